"""Lock waits in time, against the workloads' own knowledge, bpftrace and perf.

``arena_waits`` makes its arenas before the tracer attaches and prints each
thread's arena (read from its chunks' headers, as glibc lays them out); then
its threads contend for them. In the same run, perf's probes on the same
instruction of the same function, entry and return, time the same waits,
and bpftrace counts the calls (bpftrace 0.17 cannot probe an offset in a
function: its entry probe is on the first instruction, which the kernel
single-steps, and which mtrace-live's site is after; docs/contention.md).
The threads' time is bounded by bpftrace's stamps of each thread's start,
its process's exec and each thread's exit, in the same run.
``stdio_wait`` makes one wait on stdout's lock, which is no arena's, and can
end its process (or exec) while that wait goes on.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from mtrace_live.probes.lock_sites import lock_wait_site
from mtrace_live.tracer.loop.plan import RECORD_BUFFER_PAGES
from mtrace_live.tracer.processes import sdt_glibc, target

from .conftest import MTRACE, built
from .tracing import BPFTRACE_READY, Reaper, interrupt_bpftrace, start_bpftrace, wait_for_line

STOCK_LIBC = target.mapped_libc(os.getpid())  # Debian's, which this Python maps


@dataclass
class Workload:
    proc: subprocess.Popen[str]
    pid: int
    lines: list[str] = field(default_factory=list)

    def arenas(self) -> dict[int, str]:
        """tid -> its arena, as the workload found it ("main" or an address)."""
        found = {}
        for line in self.lines:
            if line.startswith("arena "):
                _, tid, arena = line.split()
                found[int(tid)] = arena
        return found

    def release(self, until: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("x")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            self.lines.append(line.strip())
            if line.startswith(until):
                return
        raise AssertionError(f"the workload ended before {until!r}: {self.lines}")

    def value(self, name: str) -> float:
        return float(next(line.split()[1] for line in self.lines if line.startswith(name + " ")))

    def end(self) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("y")
        self.proc.stdin.close()
        self.proc.stdout.read()
        self.proc.stdout.close()
        return self.proc.wait(timeout=60)


def start_workload(argv: list[str], reaper: Reaper) -> Workload:
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    reaper.add(proc)  # type: ignore[arg-type]
    workload = Workload(proc, 0)
    assert proc.stdout is not None
    for line in proc.stdout:
        workload.lines.append(line.strip())
        if line.startswith("pid "):
            workload.pid = int(line.split()[1])
        if line.strip() == "ready":
            return workload
    raise AssertionError(f"the workload never got ready: {workload.lines}")


def start_mtrace(
    args: list[str], tmp: Path, reaper: Reaper
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    out, err = tmp / "mtrace.out", tmp / "mtrace.err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        proc = reaper.add(subprocess.Popen([*MTRACE, *args], stdout=stdout, stderr=stderr))
    wait_for_line(err, "Ctrl-C to stop", proc, timeout=120)
    return proc, out, err


def stop_mtrace(proc: subprocess.Popen[bytes], out: Path, err: Path) -> list[dict[str, Any]]:
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0, err.read_text(errors="replace")
    return [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]


def start_bpftrace_waits(libc: Path, pid: int, tmp: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """bpftrace timing each call of the slow path in ``pid``, entry to return."""
    function = f"{libc}:__lll_lock_wait_private"
    body = (
        f"uprobe:{function} /pid == $1/ {{ @start[tid] = nsecs; }}\n"
        f"uretprobe:{function} /pid == $1 && @start[tid]/ {{ @waits = count(); "
        "@total = sum(nsecs - @start[tid]); delete(@start[tid]); }\n"
    )
    proc, out = start_bpftrace(body, pid, tmp, "waits")
    wait_for_line(out, "mtrace-live-test-ready", proc, timeout=120)
    return proc, out


def stop_bpftrace_waits(proc: subprocess.Popen[bytes], out: Path) -> tuple[int, int]:
    interrupt_bpftrace(proc)
    found: dict[str, int] = {}
    for line in out.read_text(errors="replace").splitlines():
        if line.startswith('{"type": "map"'):
            found.update({k: int(v) for k, v in json.loads(line)["data"].items()})
    return found["@waits"], found["@total"]


# This run's perf probe group: another run's probes are never touched.
GROUP = f"mtrace_test_{os.getpid()}"


def forget_dead_runs_probes() -> None:
    """Delete the probes of runs that were killed before deleting theirs
    (their group names a pid no longer running)."""
    listed = subprocess.run(["perf", "probe", "-l"], capture_output=True, text=True,
                            check=False).stdout  # fmt: skip
    for group in set(re.findall(r"(?m)^\s*(mtrace_test_(\d+)):", listed)):
        if not Path(f"/proc/{group[1]}").exists():
            subprocess.run(["perf", "probe", "-q", "-d", f"{group[0]}:*"], check=False,
                           capture_output=True)  # fmt: skip


def objdump_site(libc: Path) -> int:
    """Where the wait is timed, found here from binutils' disassembly, apart
    from the tracer's own choice (capstone's, probes/lock_sites.py): the
    function's first instruction loads the lock, which the kernel would
    single-step; the first jump or call after it is the first instruction
    the kernel emulates (x86's uprobes emulate relative jumps, conditional
    jumps and calls), and the function is in the same state there as at its
    entry (no register written but the one the load fills)."""
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn",
                           "--disassemble=__lll_lock_wait_private", str(libc)],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    insns = re.findall(r"(?m)^\s+([0-9a-f]+):\s+(\S+)\s*(.*)$", text)
    assert insns and "(%rdi)" in insns[0][2], insns[:3]  # the load of the lock
    for address, mnemonic, _ in insns[1:]:
        if mnemonic.startswith("j") or mnemonic.startswith("call"):
            return int(address, 16)
        assert mnemonic in ("cmp", "test"), insns[:5]  # nothing written on the way
    raise AssertionError(f"no jump in {libc}'s __lll_lock_wait_private")


@contextlib.contextmanager
def perf_probes(libc: Path, tmp: Path, pid: int) -> Iterator[Path]:
    """perf recording, in ``pid``, the entry and the return of the slow
    path, at the instruction the disassembly says (objdump_site); started
    disabled, and enabled through its control FIFO, whose acknowledgement
    says the events are on."""
    site = objdump_site(libc)
    forget_dead_runs_probes()
    for probe in (f"{GROUP}:lw_enter={site:#x}",
                  f"{GROUP}:lw_return=__lll_lock_wait_private%return"):  # fmt: skip
        subprocess.run(["perf", "probe", "-q", "-x", str(libc), "-a", probe], check=True)
    data, ctl, ack = tmp / "perf.data", tmp / "perf.ctl", tmp / "perf.ack"
    os.mkfifo(ctl)
    os.mkfifo(ack)
    try:
        record = subprocess.Popen(["perf", "record", "-q", "-D", "-1", "--control",
                                   f"fifo:{ctl},{ack}", "-e", f"{GROUP}:lw_enter",
                                   "-e", f"{GROUP}:lw_return__return", "-p", str(pid),
                                   "-o", str(data)])  # fmt: skip
        try:
            with open(ctl, "w") as control, open(ack) as reply:
                control.write("enable\n")
                control.flush()
                assert reply.readline() == "ack\n"
            yield data
        finally:
            record.send_signal(signal.SIGINT)
            record.wait(timeout=120)
    finally:
        subprocess.run(["perf", "probe", "-q", "-d", f"{GROUP}:*"], check=False)


def perf_waits(data: Path) -> tuple[int, int]:
    """The calls perf saw, and their time (entry to return, per thread)."""
    script = subprocess.run(["perf", "script", "-i", str(data), "--ns", "-F", "tid,time,event"],
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    started: dict[int, int] = {}
    count = total = 0
    for found in re.finditer(rf"(?m)^\s*(\d+)\s+(\d+)\.(\d{{9}}):\s+{GROUP}:(\w+)", script):
        tid, at = int(found.group(1)), int(found.group(2)) * 10**9 + int(found.group(3))
        if found.group(4) == "lw_enter":
            started[tid] = at
        elif tid in started:
            count, total = count + 1, total + at - started.pop(tid)
    return count, total


def tables(docs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc.get("table") == name]


def bucket_of(ns: int) -> int:
    """The histogram bucket of a wait (records.h): at most 2^k ns, more than 2^(k-1)."""
    return 0 if ns <= 1 else min((ns - 1).bit_length(), 39)


def test_arenas_made_before_the_attach_are_found_with_their_threads(tmp_path: Path) -> None:
    with Reaper() as reaper:
        # GIVEN 6 threads over 2 arenas, every arena made before the trace, the threads kept
        # until the trace has ended: mtrace-live reads each arena's attached_threads at the
        # attach and again while it runs (docs/contention.md), and glibc takes a thread off
        # its arena's count at the thread's exit, so a thread that ended while the trace ran
        # would make the last reading the count of some moment after the attach
        argv = [str(built("arena_waits")), "6", "2", "2000", "keep"]
        workload = start_workload(argv, reaper)
        # WHEN mtrace-live attaches to it, and the threads contend
        proc, out, err = start_mtrace(["--pid", str(workload.pid), "--no-allocs", "-o", "json"],
                                      tmp_path, reaper)  # fmt: skip
        workload.release("worked")
        docs = stop_mtrace(proc, out, err)
        assert workload.end() == 0
    # THEN it found both arenas in memory, each with the threads on it
    arenas = {doc["address"]: doc for doc in tables(docs, "arenas")}
    mine = workload.arenas()
    others = {arena for arena in mine.values() if arena != "main"}
    assert len(others) == 1 and set(arenas) - others == {
        next(a for a, doc in arenas.items() if doc["main"])
    }
    main = next(doc for doc in arenas.values() if doc["main"])
    other = arenas[others.pop()]
    assert main["found_at_attach"] and other["found_at_attach"]
    # AND the other arena's heap is the 64 MiB-aligned one it lies in
    heap = int(other["address"], 16) & ~((64 << 20) - 1)
    assert [int(address, 16) for address, _ in other["heaps"]] == [heap] and not main["heaps"]
    # main's threads: the workers on it and the main thread
    assert main["attached_threads"] == sum(1 for a in mine.values() if a == "main") + 1
    assert other["attached_threads"] == sum(1 for a in mine.values() if a != "main")
    assert (main["arena_limit"], main["arena_limit_source"]) == (2, "mallopt M_ARENA_MAX")
    # AND every wait on them is told to be an arena's: none is left unattributed
    waits = tables(docs, "lock_waits")
    assert waits and {doc["lock"] for doc in waits} <= {"main", "arena"}
    assert {int(doc["futex"], 16) for doc in waits} <= {int(a, 16) for a in arenas}


@pytest.mark.parametrize("libc", ["stock", "sdt"])
def test_wait_times_equal_perf_s_and_the_calls_bpftrace_s(
    tmp_path: Path, libc: str, sdt: sdt_glibc.SdtGlibc
) -> None:
    argv = [str(built("arena_waits")), "8", "2", "20000"]
    path = STOCK_LIBC if libc == "stock" else sdt.libc
    with Reaper() as reaper:
        # GIVEN 8 threads over 2 arenas, timed by perf and mtrace-live, counted
        # by bpftrace, all at once. Every event is compared with the counts, so
        # the trace has room for all of them (RECORD_BUFFER_PAGES): the SDT
        # libc's lll_lock_wait_private probe fires at every try, and its events
        # with the waits' (about 100,000 in a second, 10 MB) fill the default
        # room (2 MiB in the kernel, 8 MiB copied out) whenever the reader, on
        # two CPUs the eight threads share, falls a second behind; the waits
        # then lost are counted (lock_misc's lost_events), not seen.
        workload = start_workload(sdt.wrap(argv) if libc == "sdt" else argv, reaper)
        bpftrace, bpftrace_out = start_bpftrace_waits(path, workload.pid, tmp_path)
        with perf_probes(path, tmp_path, workload.pid) as perf_data:
            proc, out, err = start_mtrace(["--pid", str(workload.pid), "--no-allocs", "-o", "json",
                                           "--buffer-pages", str(RECORD_BUFFER_PAGES)],
                                          tmp_path, reaper)  # fmt: skip
            workload.release("lifetimes")
            calls, bpftrace_total = stop_bpftrace_waits(bpftrace, bpftrace_out)
            docs = stop_mtrace(proc, out, err)
        assert workload.end() == 0
    perf_calls, perf_total = perf_waits(perf_data)
    rows = tables(docs, "lock_waits")
    events = [doc for doc in docs if doc.get("probe") == "lock_wait"]
    # THEN mtrace-live probes where the disassembly says, and the waits are
    # bpftrace's calls and perf's, one for one
    chosen = lock_wait_site(path)
    assert chosen is not None and chosen.address == objdump_site(path), chosen
    assert calls > 100
    misc = tables(docs, "lock_misc")[0]
    assert sum(row["waits"] for row in rows) == calls == perf_calls == len(events), misc
    # AND their time is perf's within 1%, from above and below (perf times
    # from the instruction the disassembly gives); bpftrace's, which starts at
    # the function's first instruction, holds it
    measured = sum(row["total_ns"] for row in rows)
    assert abs(measured - perf_total) <= 0.01 * perf_total, (measured, perf_total)
    assert bpftrace_total >= measured
    # AND each wait's event adds up to the tables: total, maximum, histogram
    assert sum(event["args"]["wait_ns"] for event in events) == measured
    assert max(row["max_ns"] for row in rows) == max(e["args"]["wait_ns"] for e in events)
    buckets: dict[str, int] = {}
    for event in events:
        bound = str(1 << bucket_of(event["args"]["wait_ns"]))
        buckets[bound] = buckets.get(bound, 0) + 1
    summed: dict[str, int] = {}
    for row in rows:
        for bound, n in row["histogram_le_ns"].items():
            summed[bound] = summed.get(bound, 0) + n
    assert summed == buckets
    # AND nothing was left unattributed, lost or abandoned
    assert {row["lock"] for row in rows} <= {"main", "arena"}
    assert misc["no_row"] == misc["pending_full"] == misc["lost_events"] == misc["abandoned"] == 0


# Each thread's life as the kernel tells it, in the workload that this test's tracer ($1 is
# this test's pid, the tracer's parent) starts: the tracer forks it (task_newtask, in the
# tracer), it execs arena_waits, makes its threads and each thread exits.
LIVES = """
tracepoint:task:task_newtask /curtask->real_parent->tgid == $1/ { @forked[args->pid] = nsecs; }
tracepoint:sched:sched_process_exec /@forked[pid] && comm == "arena_waits"/ {
  @workload = pid; printf("main %d %lld %lld\\n", pid, @forked[pid], nsecs);
}
tracepoint:task:task_newtask /pid == @workload/ { printf("thread %d %lld\\n", args->pid, nsecs); }
tracepoint:sched:sched_process_exit /pid == @workload/ { printf("exit %d %lld\\n", tid, nsecs); }
END { clear(@forked); }
"""
# Between two handlers of one tracepoint's hit, the product's and bpftrace's: microseconds
STAMP_SLACK_NS = 1_000_000


@dataclass
class Lives:
    """The workload's threads' lives as bpftrace saw them (nsecs, CLOCK_MONOTONIC)."""

    pid: int = 0
    forked: int = 0
    exec: int = 0
    started: dict[int, int] = field(default_factory=dict)  # each other thread's task_newtask
    ended: dict[int, int] = field(default_factory=dict)  # each thread's sched_process_exit


def stop_bpftrace_lives(proc: subprocess.Popen[bytes], out: Path) -> Lives:
    interrupt_bpftrace(proc)
    lives = Lives()
    for line in out.read_text(errors="replace").splitlines():
        record = json.loads(line) if line.startswith('{"type": "printf"') else {}
        words = record.get("data", "").split()
        if words[:1] == ["main"]:
            lives.pid, lives.forked, lives.exec = (int(w) for w in words[1:])
        elif words[:1] == ["thread"]:
            lives.started[int(words[1])] = int(words[2])
        elif words[:1] == ["exit"]:
            lives.ended[int(words[1])] = int(words[2])
    return lives


def test_the_share_of_thread_time_is_the_workloads_own(tmp_path: Path) -> None:
    # GIVEN 8 threads over 2 arenas, run by mtrace-live from their start, and bpftrace
    # stamping each thread's start and end
    argv = [*MTRACE, "run", "--no-allocs", "-o", "json", "--",
            str(built("arena_waits")), "8", "2", "20000"]  # fmt: skip
    with Reaper() as reaper:
        bpftrace, bpftrace_out = start_bpftrace(LIVES, os.getpid(), tmp_path, "lives")
        reaper.add(bpftrace)
        wait_for_line(bpftrace_out, BPFTRACE_READY, bpftrace, timeout=120)
        run = subprocess.run(argv, input="xy", capture_output=True, text=True, timeout=300)
        lives = stop_bpftrace_lives(bpftrace, bpftrace_out)
    assert run.returncode == 0, run.stderr
    assert lives.pid and lives.ended, f"bpftrace saw no arena_waits exec'd by the tracer: {lives}"
    lines = run.stdout.splitlines()
    said = {
        line.split()[0]: float(line.split()[1])
        for line in lines
        if line.split()[0] in ("lifetimes", "main")
    }
    lifetimes = said["lifetimes"]
    docs = [json.loads(line) for line in lines if line.startswith("{")]
    time = next(doc for doc in tables(docs, "thread_time") if doc["pid"] == lives.pid)
    # THEN it saw the threads bpftrace saw, all ended
    assert time["threads"] == 1 + len(lives.started) == 9 and time["live"] == 0, (time, lives)
    assert set(lives.ended) == {lives.pid, *lives.started}, lives
    # AND its threads' time is the sum of their lives as bpftrace stamped them: each worker's
    # from its task_newtask to its exit; main's from when the tracer followed it, which is
    # after its fork and before its exec (the tracer holds it between the two), to its exit
    workers = sum(lives.ended[tid] - born for tid, born in lives.started.items())
    main_end = lives.ended[lives.pid]
    slack = 2 * STAMP_SLACK_NS * time["threads"]
    low, high = workers + main_end - lives.exec, workers + main_end - lives.forked
    assert low - slack <= time["thread_ns"] <= high + slack, (time, lives)
    # AND its wall time is main's life, which spans the process's: the thread time beyond it
    # is the workers' lives
    assert main_end - lives.exec - slack <= time["wall_ns"] <= main_end - lives.forked + slack
    assert abs(time["thread_ns"] - time["wall_ns"] - workers) <= slack, (time, workers)
    # AND those lives enclose the workload's own timings of them, on the same clock
    assert lifetimes <= time["thread_ns"] / 1e9, (time, said)
    assert time["wall_ns"] / 1e9 >= said["main"], (time, said)
    # AND the share of it spent waiting is the waits over those lives
    share = time["arena_wait_ns"] / 1e9 / lifetimes
    assert time["arena_wait_share"] > 0.01
    assert abs(time["arena_wait_share"] - share) <= 0.02


def test_a_wait_on_stdout_s_lock_is_another_libc_lock_timed_at_least_as_held(
    tmp_path: Path,
) -> None:
    with Reaper() as reaper:
        # GIVEN one thread waiting for stdout's lock, which main holds
        workload = start_workload([str(built("stdio_wait")), "release"], reaper)
        proc, out, err = start_mtrace(["--pid", str(workload.pid), "--no-allocs", "-o", "json"],
                                      tmp_path, reaper)  # fmt: skip
        workload.release("done")
        docs = stop_mtrace(proc, out, err)
        assert workload.end() == 0
    # THEN it is one wait, on a lock that is no arena's, as long as main held it or longer
    rows = tables(docs, "lock_waits")
    assert [(row["lock"], row["waits"]) for row in rows] == [("other", 1)]
    held = int(workload.value("held"))
    assert held <= rows[0]["total_ns"] < held + 50_000_000
    # AND the summary shows it apart from the arenas
    assert "other libc locks: 1 waits" in err.read_text()


@pytest.mark.parametrize("how", ["exit", "exec"])
def test_a_wait_its_process_ends_in_is_counted_and_leaves_no_entry(
    tmp_path: Path, how: str
) -> None:
    with Reaper() as reaper:
        # GIVEN a thread waiting for stdout's lock when its process ends (or execs)
        workload = start_workload([str(built("stdio_wait")), how], reaper)
        proc, out, err = start_mtrace(["--pid", str(workload.pid), "--no-allocs", "-o", "json"],
                                      tmp_path, reaper)  # fmt: skip
        assert workload.proc.stdin is not None
        workload.proc.stdin.write("x")
        workload.proc.stdin.close()
        assert workload.proc.stdout is not None
        workload.proc.stdout.read()
        workload.proc.stdout.close()
        assert workload.proc.wait(timeout=60) == 0
        code = proc.wait(timeout=120)
    docs = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    # THEN the trace ends as it does for that ending, and the abandoned wait is counted
    assert code == (0 if how == "exit" else 11), err.read_text()
    misc = tables(docs, "lock_misc")
    assert misc and misc[0]["abandoned"] == 1
    assert not tables(docs, "lock_waits")


@pytest.mark.parametrize(("arenas", "advised"), [("2", True), ("16", False)])
def test_advice_to_raise_the_arena_limit_only_where_threads_share_arenas(
    tmp_path: Path, arenas: str, advised: bool
) -> None:
    with Reaper() as reaper:
        # GIVEN 8 threads over 2 arenas (they wait), or over 16 (each has its own)
        workload = start_workload([str(built("arena_waits")), "8", arenas, "8000"], reaper)
        # WHEN mtrace-live attaches to it, the threads contend, and the trace ends in a summary
        proc, out, err = start_mtrace(["--pid", str(workload.pid), "--no-allocs", "-o", "summary"],
                                      tmp_path, reaper)  # fmt: skip
        workload.release("lifetimes")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, err.read_text(errors="replace")
        assert workload.end() == 0
    summary = out.read_text()
    # THEN the summary advises raising the limit where, and only where, they share
    found = re.search(r"advice \(arena-limit\): (\d+) threads share 2 arenas \(arena_max 2, "
                      r"set by mallopt M_ARENA_MAX\)", summary)  # fmt: skip
    assert (found is not None) is advised, summary
    if found is not None:
        assert 2 < int(found.group(1)) <= 9  # the workers and main, as many as were seen at once
    else:
        assert "advice" not in summary
