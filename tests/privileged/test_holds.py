"""Holds (tracer/processes/holds.py): only a process the trace started is ever
stopped, and every stop ends, whatever becomes of the tracer.

- The tracer is killed with SIGKILL, 10 times (100 in ``make soak``), while
  its command (the churn: forks, execs, dlopens, exits) is held again and
  again: afterwards none of the churn's processes is stopped. bpftrace, in
  the same run, sees the stops: a real share of the kills landed while a
  process was held, forked ones among them (they inherit holdability), and
  each of those was continued while the killed tracer was still exiting
  (the guardian reads its main thread in do_exit, ``holds.exiting``),
  before the hold's bound would have let it go.
- The tracer itself is stopped (SIGSTOP) while its command is held: the
  guardian lets the command go past the bound, and the trace says so.

Every check is of this test's own processes: the churn runs as a copy of
its own name (no other process on the machine shares it), its tree is read
from /proc/PID/task/*/children, and the guardian is the tracer's child.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from mtrace_live.tracer.processes.holds import GUARDIAN_NAME, exiting

from .conftest import MTRACE, built
from .tracing import Reaper, interrupt_bpftrace, wait_for_line, wait_until

READY = "Ctrl-C to stop"
PEER_READY = "holds-peer-ready"
CHURN_NAME = f"churn{os.getpid()}"[:15]  # the churn's comm, this run's own
# At least this share of the kills aimed at a hold landed while a process of
# the churn was held (bpftrace's stops not yet continued at the kill; 6 of 6
# here), and this share of all kills while a forked one was (5 of 10 here).
HELD_SHARE = 0.5
FORKED_SHARE = 0.2
# The guardian's bound on a hold while tracers are killed: none is let go by
# it within a test, so that each continue seen is the guardian's at a death.
NO_BOUND_S = 3600


def state(pid: int | str) -> bytes:
    """``pid``'s state (R, S, T, Z, ...), or b"" if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rpartition(b") ")[2][:1]
    except OSError:
        return b""


def stopped(tasks: set[int]) -> set[int]:
    """Those of ``tasks`` (threads, by id) in state T."""
    return {task for task in tasks if state(task) == b"T"}


def churn_tree(root: int) -> set[int]:
    """``root`` and its descendants' threads, to any depth (each thread's
    children, from /proc/PID/task/TID/children)."""
    tree: set[int] = set()
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue  # gone meanwhile
        for task in tasks:
            tree.add(int(task.name))
            with contextlib.suppress(OSError):
                todo += [int(child) for child in (task / "children").read_text().split()]
    return tree


def guardian_of(tracer: int) -> int:
    """The guardian: the tracer's child of that name."""
    children: set[int] = set()
    for task in Path(f"/proc/{tracer}/task").iterdir():
        with contextlib.suppress(OSError):
            children.update(int(child) for child in (task / "children").read_text().split())
    found = [pid for pid in children if comm(pid) == GUARDIAN_NAME]
    assert len(found) == 1, (tracer, children)
    return found[0]


def comm(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/comm").read_bytes().strip()
    except OSError:
        return b""


def guardian_alive(pid: int) -> bool:
    """The guardian runs (not gone, not a zombie, its pid not reused)."""
    return comm(pid) == GUARDIAN_NAME and state(pid) not in (b"", b"Z")


def command_pid(err: Path) -> int:
    found = re.search(r"for command pid (\d+)", err.read_text(errors="replace"))
    assert found, err.read_text(errors="replace")
    return int(found.group(1))


def own_churn(tmp: Path) -> Path:
    """The churn, copied under this run's own name (it execs itself by its
    real path, so every process of it has that name)."""
    program = tmp / CHURN_NAME
    if not program.exists():
        shutil.copy2(built("churn"), program)
    return program


def start_churn_trace(
    tmp: Path, reaper: Reaper, seconds: int, name: str = "trace.err", bound_s: float = 0
) -> tuple[subprocess.Popen[bytes], Path]:
    """The churn traced by run for ``seconds``; ``bound_s``: the guardian's
    bound on a hold (holds.BOUND_S) where not 0, the default."""
    churn = [str(own_churn(tmp)), str(built("libcfi_plugin.so")), str(seconds)]
    err = tmp / name
    env = {**os.environ, **({"MTRACE_LIVE_HOLD_BOUND_S": str(bound_s)} if bound_s else {})}
    with open(err, "wb") as errors:
        tracer = reaper.add(subprocess.Popen(
            [*MTRACE, "run", "--follow-forks", "-o", "summary", "--", *churn],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=errors, env=env,
        ))  # fmt: skip
    assert tracer.stdin is not None
    wait_for_line(err, READY, tracer, timeout=120)
    tracer.stdin.write(b"g")  # the churn's go
    tracer.stdin.close()
    return tracer, err


def poll(ready: Callable[[], bool], what: str) -> None:
    """Until ``ready()``, looking every 2 ms (a hold lasts milliseconds; a
    guard against a hang, not a measure)."""
    deadline = time.monotonic() + 120
    while not ready():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.002)


def kill_points(rng: random.Random, kills: int) -> list[str]:
    """Where each kill lands, in an order drawn at random: three in five at a
    hold, one in five at the go, one in five between holds (a fixed share,
    so that ten kills aim at holds as often as a hundred do)."""
    points = ["held"] * (kills * 3 // 5) + ["go"] * (kills // 5)
    points += ["between"] * (kills - len(points))
    rng.shuffle(points)
    return points


def kill_point(rng: random.Random, churn: int, at: str) -> str:
    """Wait for the point ``at`` of the churn, by what the churn's processes
    do (never a clock): the go; the 1st to 3rd hold seen (a new set of its
    processes stopped); or once 1 to 3 were seen and none is held. Its name."""
    if at == "go":
        return at
    wanted = rng.randint(1, 3)
    holds = 0
    last: set[int] = set()

    def held_enough() -> bool:
        nonlocal holds, last
        now = stopped(churn_tree(churn))
        holds += bool(now) and now != last
        last = now
        return holds >= wanted

    poll(held_enough, f"{wanted} holds of the churn's processes")
    if at == "between":
        poll(lambda: not stopped(churn_tree(churn)), "none of the churn's processes held")
    return f"{at} {wanted}"


def start_peer(tmp: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """bpftrace printing, with its clock: each SIGSTOP delivered to a churn
    process (a hold, in the receiving process: whichever thread allocated),
    each SIGCONT sent to one, each SIGKILL this test sends, and each exit of
    a child of this test (its SIGCHLD: the tracer's exit complete, its perf
    events closed)."""
    script = tmp / "holds.bt"
    script.write_text(
        f'BEGIN {{ printf("{PEER_READY}\\n"); }}\n'
        f'tracepoint:signal:signal_deliver /args->sig == 19 && comm == "{CHURN_NAME}"/\n'
        '{ printf("stop %d %lld\\n", pid, nsecs); }\n'
        f'tracepoint:signal:signal_generate /args->sig == 18 && args->comm == "{CHURN_NAME}"/\n'
        '{ printf("cont %d %lld\\n", args->pid, nsecs); }\n'
        "tracepoint:signal:signal_generate /args->sig == 9 && pid == $1/\n"
        '{ printf("kill %d %lld\\n", args->pid, nsecs); }\n'
        "tracepoint:signal:signal_generate /args->sig == 17 && args->pid == $1/\n"
        '{ printf("exit %d %lld\\n", pid, nsecs); }\n'
    )
    out = tmp / "holds.out"
    with open(out, "wb") as sink:
        peer = subprocess.Popen(["bpftrace", str(script), str(os.getpid())], stdout=sink,
                                stderr=subprocess.STDOUT)  # fmt: skip
    wait_for_line(out, PEER_READY, peer, timeout=120)
    return peer, out


@dataclass
class Kill:
    at: str  # the kill point
    tracer: int
    command: int
    stopped_after: set[int]  # the churn's threads stopped once the guardian was gone


@dataclass
class Seen:
    """What bpftrace saw of one kill: the holds in flight when it landed
    (pid -> the stop's time), and when each was continued after it."""

    kill: Kill
    killed: int  # ns
    exited: int  # ns: the tracer's exit complete
    in_flight: dict[int, int]
    continued: dict[int, int | None]


def peer_events(out: Path) -> list[tuple[str, int, int]]:
    events = []
    for line in out.read_text(errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] in ("stop", "cont", "kill", "exit"):
            events.append((parts[0], int(parts[1]), int(parts[2])))
    return sorted(events, key=lambda event: event[2])


def seen_by_peer(kill: Kill, events: list[tuple[str, int, int]]) -> Seen:
    (killed,) = [ns for what, pid, ns in events if what == "kill" and pid == kill.tracer]
    exits = [ns for what, pid, ns in events if what == "exit" and pid == kill.tracer]
    assert exits, f"bpftrace saw no exit of tracer {kill.tracer}"
    last_stop: dict[int, int] = {}
    for what, pid, ns in events:
        if ns >= killed:
            break
        if what == "stop":
            last_stop[pid] = ns
        elif what == "cont":
            last_stop.pop(pid, None)
    continued = {pid: next((ns for what, p, ns in events
                            if what == "cont" and p == pid and ns > killed), None)
                 for pid in last_stop}  # fmt: skip
    return Seen(kill, killed, exits[0], last_stop, continued)


@dataclass
class Dying:
    """A tracer just killed, its perf events closing (seconds), and its churn."""

    at: str
    tracer: subprocess.Popen[bytes]
    guardian: int
    churn: int

    def settled(self, peer: subprocess.Popen[bytes], out: Path) -> Kill:
        """Once the tracer has exited and its guardian is gone: the churn's
        processes stopped then. The churn is killed after."""
        self.tracer.wait()
        wait_until(lambda: not guardian_alive(self.guardian), "the guardian ends")
        wait_for_line(out, f"exit {self.tracer.pid} ", peer, timeout=120)  # the peer is in step
        kill = Kill(self.at, self.tracer.pid, self.churn, stopped(churn_tree(self.churn)))
        # (a kill that came before the tracer let the churn exec leaves it
        # never started: at its door it reads the tracer gone and exits)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.churn, signal.SIGKILL)
        return kill


def kill_at_random_points(kills: int, tmp: Path) -> list[Seen]:
    """Each tracer killed while the next one loads its programs (a killed
    tracer takes seconds to close its perf events)."""
    rng = random.Random(46)
    points = kill_points(rng, kills)
    peer, out = start_peer(tmp)
    done: list[Kill] = []
    dying: Dying | None = None
    try:
        with Reaper() as reaper:
            for index in range(kills):
                # GIVEN the churn run by the tracer, held at each new process's
                # first allocation, each dlopen and each exit
                tracer, err = start_churn_trace(tmp, reaper, 30, f"trace{index}.err",
                                                bound_s=NO_BOUND_S)  # fmt: skip
                if dying is not None:
                    done.append(dying.settled(peer, out))
                churn = command_pid(err)
                guardian = guardian_of(tracer.pid)
                # WHEN the tracer is killed with SIGKILL at a point of the churn
                at = kill_point(rng, churn, points[index])
                tracer.kill()
                dying = Dying(at, tracer, guardian, churn)
            if dying is not None:
                done.append(dying.settled(peer, out))
    finally:
        interrupt_bpftrace(peer)
    events = peer_events(out)
    return [seen_by_peer(kill, events) for kill in done]


@pytest.mark.parametrize("kills", [10, pytest.param(100, marks=pytest.mark.soak)])
def test_a_tracer_killed_at_any_point_leaves_no_process_stopped(tmp_path: Path,
                                                                kills: int) -> None:  # fmt: skip
    seen = kill_at_random_points(kills, tmp_path)
    # THEN no kill left a process of the churn stopped
    left = [(s.kill.at, sorted(s.kill.stopped_after)) for s in seen if s.kill.stopped_after]
    assert not left, left
    # AND a real share of the kills landed while the churn was held, forked
    # processes among them (holdability is inherited at the fork)
    held = [s for s in seen if s.in_flight]
    aimed = [s for s in seen if s.kill.at.startswith("held")]
    hit = [s for s in aimed if s.in_flight]
    forked = [s for s in held if set(s.in_flight) - {s.kill.command}]
    shares = (f"{len(held)} of {kills} kills during a hold ({len(hit)} of {len(aimed)}"
              f" aimed at one), {len(forked)} in a forked process")  # fmt: skip
    print(shares)
    assert len(hit) >= HELD_SHARE * len(aimed), shares
    assert len(forked) >= FORKED_SHARE * kills, shares
    # AND each hold in flight was continued while the killed tracer was still
    # exiting (the guardian saw its main thread in do_exit), not once the
    # tracer was gone (the bound, NO_BOUND_S, let none go meanwhile)
    for s in held:
        for pid in s.in_flight:
            cont = s.continued[pid]
            assert cont is not None, (s.kill, pid)
            assert cont < s.exited, f"{s.kill}: pid {pid} continued after the tracer's exit"


def test_a_process_whose_main_thread_is_in_do_exit_is_seen_exiting() -> None:
    # GIVEN leader_exit, running, then with its main thread gone through
    # pthread_exit (left in do_exit's end while another thread runs: the
    # kernel keeps PF_EXITING on it, as on a killed tracer's main thread
    # while it closes its perf events), then ended
    with Reaper() as reaper:
        pipe = subprocess.PIPE
        workload = reaper.add(subprocess.Popen([str(built("leader_exit")), "10", "wait"],
                                               stdin=pipe, stdout=pipe))  # fmt: skip
        assert workload.stdin is not None and workload.stdout is not None
        assert workload.stdout.readline() == b"ready\n"
        running = exiting(workload.pid)
        workload.stdin.write(b"g")
        workload.stdin.flush()
        assert workload.stdout.readline() == b"main gone\n"
        in_exit = exiting(workload.pid)
        workload.stdin.write(b"p")
        workload.stdin.close()
        assert workload.wait(timeout=60) == 0
        workload.stdout.close()
    # THEN the guardian's test of its tracer (holds.exiting) says so only
    # once main is in do_exit, and of a process gone
    assert (running, in_exit, exiting(workload.pid)) == (False, True, True)


def test_a_hold_the_tracer_cannot_end_is_let_go_past_the_bound(tmp_path: Path) -> None:
    with Reaper() as reaper:
        # GIVEN the churn under a tracer that is itself stopped
        tracer, err = start_churn_trace(tmp_path, reaper, 5)
        churn = command_pid(err)
        tracer.send_signal(signal.SIGSTOP)
        # WHEN the churn is held meanwhile (its next new process's first call)
        wait_until(lambda: bool(stopped(churn_tree(churn))), "a churn process is held")
        # THEN the guardian lets it go
        wait_until(lambda: not stopped(churn_tree(churn)), "the guardian lets it go")
        tracer.send_signal(signal.SIGCONT)
        # AND the trace ends with the churn, saying so
        assert tracer.wait(timeout=120) == 0, err.read_text()
    said = [line for line in err.read_text().splitlines() if "let go after 2 s" in line]
    assert len(said) == 1, err.read_text()
