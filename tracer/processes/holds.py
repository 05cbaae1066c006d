"""Processes held (stopped) until user space has done its part, and the
guardian that lets every one go whatever becomes of the tracer.

Only a process mtrace-live started is ever stopped: run's command and the
children it forks (``TraceRequest.holds``; ``holdable`` in common.bpf.h).
Its first allocation waits for its unwind tables, its ``_exit`` for its
maps to be read, main's ``pthread_exit`` for the uprobes to move (each a
handler's SIGSTOP, delivered before the process runs on). A process the
trace did not start (``--pid``, its children, ``--comm``, ``--all``,
``--cgroup``, ``serve``) is never stopped: it is walked by frame pointers
until its tables exist, and named from the maps read while it ran.

The kernel writes each stop in ``holds`` (how many, the last one's time);
whoever continues a process writes in ``hold_continued`` how many of its
stops it has continued, so a process is held while its stops outnumber
those. ``Holds.release`` reads the count before it sends SIGCONT and writes
it after, so a stop that comes in between stays held.

The guardian is a process of its own, forked when the program is loaded
(before any thread or uprobe; it closes every descriptor it inherits but
the maps it reads), in a session of its own, ignoring the terminal's
signals, and the last the OOM killer would pick. It holds the
three maps and a pidfd of the tracer, and every ``POLL_S``:

- continues a process held longer than ``BOUND_S`` (the tracer is slow or
  stuck: the process is let go, counted as ``past_bound``, and its stacks
  are walked by frame pointers until its tables exist);
- when the tracer is dying (SIGKILL, the OOM killer, a crash: its main
  thread in do_exit, seen in /proc/PID/stat within ``POLL_S``) or has
  closed the trace, closes the handlers' gate (no one is held from then
  on) and continues every process still held (counted as ``tracer_gone``),
  again every 10 ms until the tracer has exited (its pidfd), which takes a
  killed tracer seconds (the kernel closes its perf events one by one);
  then it exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import struct
import sys
import time
from pathlib import Path

from mtrace_live.probes.records import HoldCount
from mtrace_live.tracer.bpf import bpf_syscalls
from mtrace_live.tracer.bpf.bpf_backend import BpfProgram


def _bound_s() -> float:
    """No process is held longer (tables, maps, a move of the uprobes): 2 s,
    or a positive number of seconds in MTRACE_LIVE_HOLD_BOUND_S (a test
    that tells the guardian's continue at a tracer's death from a let-go at
    the bound)."""
    given = os.environ.get("MTRACE_LIVE_HOLD_BOUND_S", "")
    try:
        bound = float(given) if given else 2.0
    except ValueError:
        bound = -1.0
    if 0 < bound < float("inf"):
        return bound
    print(f"mtrace-live: warning: MTRACE_LIVE_HOLD_BOUND_S={given!r} is not a positive number "
          "of seconds; holds are bounded at 2 s", file=sys.stderr)  # fmt: skip
    return 2.0


BOUND_S = _bound_s()
POLL_S = 0.1
GUARDIAN_NAME = b"mtrace-guard"
_PR_SET_NAME = 15
_HOLD = struct.Struct("=QQ")  # struct hold: stops, since (ns)
_U64 = struct.Struct("=Q")


class Holds:
    """The tracer's side: continue a held process, and read the counts."""

    def __init__(self, program: BpfProgram) -> None:
        self.program = program
        self.fds = (program.map_fd("holds"), program.map_fd("hold_continued"))

    def allow(self, pid: int) -> None:
        """``pid`` was started by mtrace-live: it may be held."""
        self.program.set_row("holdable", pid, (1,))

    def stops(self, pid: int) -> int:
        """How many times ``pid`` was held so far."""
        return _stops(self.fds[0], pid)

    def release(self, pid: int, covered: int | None = None) -> None:
        """Continue ``pid`` if it is held, and write down the stops that
        covers. ``covered``: its stops when the work it was held for began
        (its maps read for its tables): a stop made since (a dlopen while a
        process that was not held had its tables written) is left to its own
        ask, as a SIGCONT now would end it before its work is done. A
        process not held is sent nothing: a SIGCONT could end a stop of
        someone else's."""
        stops = _stops(self.fds[0], pid)
        if stops <= _u64_at(self.fds[1], pid) or (covered is not None and stops > covered):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        bpf_syscalls.update_u32(self.fds[1], pid, _U64.pack(stops))

    def is_held(self, pid: int) -> bool:
        return _is_held(self.fds, pid)

    def held(self) -> list[int]:
        """The processes held now."""
        return [pid for pid in bpf_syscalls.u32_keys(self.fds[0]) if _is_held(self.fds, pid)]

    def release_all(self) -> None:
        for pid in self.held():
            self.release(pid)

    def counts(self) -> dict[str, int]:
        """What the guardian let go: past the bound, and at the tracer's end."""
        fd = self.program.map_fd("hold_counts")
        found = {}
        for kind in HoldCount:
            raw = bpf_syscalls.lookup_u32(fd, int(kind), _U64.size)
            found[kind.name.lower()] = _U64.unpack(raw)[0] if raw else 0
        return found


def _stops(holds_fd: int, pid: int) -> int:
    raw = bpf_syscalls.lookup_u32(holds_fd, pid, _HOLD.size)
    return _HOLD.unpack(raw)[0] if raw is not None else 0


def _u64_at(fd: int, key: int) -> int:
    """The u64 at u32 ``key`` of a map (hold_continued, hold_counts), 0 where none."""
    raw = bpf_syscalls.lookup_u32(fd, key, _U64.size)
    return _U64.unpack(raw)[0] if raw is not None else 0


def _is_held(fds: tuple[int, int], pid: int) -> bool:
    return _stops(fds[0], pid) > _u64_at(fds[1], pid)


class Guardian:
    """The guardian process; ``close`` ends it (it continues whatever is
    still held as it goes)."""

    def __init__(self, program: BpfProgram) -> None:
        names = ("holds", "hold_continued", "hold_counts", "control")
        fds = tuple(program.map_fd(name) for name in names)
        self.pid = -1
        self._write = -1
        try:
            tracer = os.pidfd_open(os.getpid())
        except OSError:
            return  # no pidfd (before Linux 5.3): the tracer's own paths release
        try:
            read, self._write = os.pipe2(os.O_CLOEXEC)
        except OSError:
            os.close(tracer)
            return
        libc = ctypes.CDLL(None)  # looked up here: nothing is loaded in the child
        try:
            pid = os.fork()
        except OSError:
            for fd in (tracer, read, self._write):
                os.close(fd)
            self._write = -1
            return
        if pid == 0:
            _guard(libc, tracer, read, fds)  # never returns
        os.close(tracer)
        os.close(read)
        self.pid = pid

    def close(self) -> None:
        """End the guardian: it continues what is still held, and exits."""
        if self._write >= 0:
            os.close(self._write)
            self._write = -1
        if self.pid > 0:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            self.pid = -1


PF_EXITING = 0x4  # include/linux/sched.h: the task is in do_exit


def exiting(pid: int) -> bool:
    """Process ``pid`` is dying (its main thread is in do_exit, where a
    killed tracer spends seconds closing its perf events before its pidfd
    says it has exited), or gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes().rpartition(b") ")[2].split()
        return bool(int(fields[6]) & PF_EXITING)  # field 9, flags
    except (OSError, IndexError, ValueError):
        return True


def _guard(libc: ctypes.CDLL, tracer: int, closed: int, fds: tuple[int, ...]) -> None:
    """The guardian's life, in the forked child: only system calls and
    Python of its own from here on (no lock another thread held)."""
    try:
        tracer_pid = os.getppid()
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(GUARDIAN_NAME), 0, 0, 0)
        os.setsid()
        for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGPIPE", "SIGTSTP", "SIGTTOU",
                     "SIGTTIN"):  # fmt: skip
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        with contextlib.suppress(OSError):
            Path("/proc/self/oom_score_adj").write_text("-1000")
        keep = {tracer, closed, *fds}
        for entry in os.listdir("/proc/self/fd"):
            if int(entry) not in keep:
                with contextlib.suppress(OSError):
                    os.close(int(entry))
        watch = select.poll()
        watch.register(tracer, select.POLLIN)
        watch.register(closed, select.POLLIN)
        ending = gone = False
        while not gone:
            gone = bool(watch.poll(int(POLL_S * 1000) if not ending else 10))
            if not ending and (gone or exiting(tracer_pid)):
                # The tracer is ending: its handlers hold no one from now
                # on (the gate closed), and every process held is let go
                # until its probes are gone with it.
                ending = True
                bpf_syscalls.update_u32(fds[3], 0, struct.pack("=I", 0))
            _let_go(fds[:3], ending)
    finally:
        os._exit(0)


def _let_go(fds: tuple[int, ...], gone: bool) -> None:
    """Continue each process held past the bound, or every one if ``gone``."""
    holds_fd, continued_fd, counts_fd = fds
    now = time.monotonic_ns()
    for pid in bpf_syscalls.u32_keys(holds_fd):
        raw = bpf_syscalls.lookup_u32(holds_fd, pid, _HOLD.size)
        if raw is None:
            continue
        stops, since = _HOLD.unpack(raw)
        if stops <= _u64_at(continued_fd, pid):
            continue
        if not gone and now - since < BOUND_S * 1e9:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        bpf_syscalls.update_u32(continued_fd, pid, _U64.pack(stops))
        slot = int(HoldCount.TRACER_GONE if gone else HoldCount.PAST_BOUND)
        bpf_syscalls.update_u32(counts_fd, slot, _U64.pack(_u64_at(counts_fd, slot) + 1))
