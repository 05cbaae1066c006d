"""One process's uprobes, moved to another of its threads when the thread
they are attached for ends first.

``--pid`` without ``--follow-forks`` attaches the uprobes for the process
alone: the kernel places its breakpoints in that process only, and takes a
call to be the process's while the memory of the thread the perf events
target is the caller's. That thread is the process's first (main). When main
calls ``pthread_exit`` and the other threads go on, its memory is gone at its
exit, and no call of the process would be seen again.

So allocs.bpf.c's ``alloc_thread_exit`` says so when that thread calls
``pthread_exit``, and here the uprobes are attached for a thread that stays
(the oldest that lives), and the old entry probes closed; the new events carry the
next generation as their BPF cookie, and the program's generation turns to
it once they are all attached, so each call is counted once while both
fire. A call entered under the old probes returns after the turn: recent
kernels (6.18 here) give a return only to the return probes that saw the
call enter, so the old return probes stay open until no thread of the
process is inside a call they saw enter (``KeptReturns``, each tick),
and each return is taken by its call's entry generation alone (older
kernels give it to every return probe attached). A process mtrace-live started is
stopped (SIGSTOP) meanwhile and continued after (tracer/processes/holds.py). Any
other process is never stopped: it goes on while the probes move, and what
it calls after the old thread is gone and before the new events are
attached is not seen.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from mtrace_live.tracer.bpf.bpf_backend import BpfProgram
from mtrace_live.tracer.bpf.uprobe_attach import AttachFailure

STOPPED_STATES = frozenset(b"tTZX")  # stopped, traced, or exiting: none will call again
STOP_WAIT_S = 1.0  # a thread in an uninterruptible sleep may take this long to stop


@dataclass(frozen=True)
class Moved:
    """The uprobes of process ``tgid`` moved from thread ``old`` to ``new``."""

    tgid: int
    old: int
    new: int
    probes: int  # perf events moved
    held: bool  # the process was stopped while they moved: no call was missed

    def __str__(self) -> str:
        missed = "" if self.held else (
            "; the calls made after it was gone and before the move were not seen")  # fmt: skip
        return (f"thread {self.old} of process {self.tgid}, which its probes were attached for, "
                f"called pthread_exit: they follow thread {self.new} now ({self.probes} "
                f"moved{missed})")  # fmt: skip


def move_uprobes(program: BpfProgram, tgid: int, old: int,
                 release: Callable[[int], None] | None = None,
                 ended: Collection[int] = ()) -> Moved | str | None:  # fmt: skip
    """Move process ``tgid``'s uprobes off thread ``old``, which is ending,
    to its oldest thread that lives and has not called pthread_exit (not
    in ``ended``, the threads the probes moved off before): what was moved,
    a line saying why nothing could be, or None when the process has no
    such thread (it ends with it). ``release``: the process is held (one
    mtrace-live started): it is moved once every thread has stopped, and
    continued by ``release`` after. Any other process goes on meanwhile:
    what it calls after ``old`` is gone and before the move is done is not
    seen."""
    threads = [tid for tid in _threads(tgid) if tid != old and tid not in ended
               and _lives(tgid, tid)]  # fmt: skip
    try:
        if not threads:
            return None
        if release is not None:
            _wait_stopped(tgid, threads)
        # named first: the new thread's own pthread_exit may come as soon as
        # the generation turns
        program.fill_array("alloc_target", [threads[0]])
        try:
            probes = program.retarget(old, threads[0])
        except AttachFailure as failure:
            return (f"thread {old} of process {tgid} called pthread_exit, and its probes could "
                    f"not be attached for thread {threads[0]}: {failure}; the process's "
                    "other threads are no longer traced")  # fmt: skip
        return Moved(tgid, old, threads[0], probes, release is not None)
    finally:
        if release is not None:
            release(tgid)


class KeptReturns:
    """The return probes of the generations turned from, kept until no
    thread of process ``tgid`` is inside a call they saw enter."""

    def __init__(self, tgid: int) -> None:
        self.tgid = tgid
        self._empty: set[int] = set()  # generations no call was found in at the last look

    def look(self, program: BpfProgram) -> None:
        """Close those of each generation no call was found in at this look
        and the one before (an entry handler that took the old generation
        just before the turn may not have written its call yet at the
        first); all of them once the process is gone."""
        if not program.kept_returns:
            return
        threads = _threads(self.tgid)
        busy = program.tables.generations_in_flight(threads)
        empty = set()
        for generation in program.kept_returns:
            if threads and generation in busy:
                continue
            if not threads or generation in self._empty:
                program.close_returns(generation)
            else:
                empty.add(generation)
        self._empty = empty


def _threads(tgid: int) -> list[int]:
    try:
        return sorted(int(name) for name in os.listdir(f"/proc/{tgid}/task"))
    except OSError:
        return []  # gone already


def _wait_stopped(tgid: int, threads: list[int]) -> None:
    """Until every one of ``threads`` is stopped (SIGSTOP reaches each as it
    next runs), or STOP_WAIT_S passed."""
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        if all(_state(tgid, tid) in STOPPED_STATES for tid in threads):
            return
        time.sleep(0.001)


PF_EXITING = 0x4  # the kernel's task flag: in do_exit


def _lives(tgid: int, tid: int) -> bool:
    """Thread ``tid`` is not exiting: neither a zombie (an ended leader
    stays listed so till the process ends) nor in the kernel's exit."""
    try:
        fields = Path(f"/proc/{tgid}/task/{tid}/stat").read_bytes().rpartition(b") ")[2].split()
    except OSError:
        return False
    return fields[0] not in (b"Z", b"X") and not int(fields[6]) & PF_EXITING


def _state(tgid: int, tid: int) -> int:
    try:
        stat = Path(f"/proc/{tgid}/task/{tid}/stat").read_bytes()
    except OSError:
        return ord("X")  # gone
    return stat.rpartition(b") ")[2][0]
