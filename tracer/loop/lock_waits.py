"""Lock waits in time: the entry and return probes on the libc's lock-wait
slow path (locks.bpf.c), and their tables read as ``LockWaits``.

glibc takes its internal locks (the arenas' mutexes, stdio's, ...) with
``lll_lock``: an atomic exchange, and, when the lock is held, a call of
``__lll_lock_wait_private(futex)``, which sleeps on the futex until the
lock is free and returns holding it. The time from its entry to its return
is the wait. The function is exported (GLIBC_PRIVATE) by every glibc that
has it, with SDT notes or not, so both builds are timed the same way; the
SDT probe ``lll_lock_wait_private`` fires inside it, once per sleep.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mtrace_live.exporters.data.lock_waits import (
    LockRow,
    LockStackRow,
    LockWaits,
    ThreadTime,
    WaitTimes,
)
from mtrace_live.probes.elf.file import elf_failures
from mtrace_live.probes.errors import MtraceError
from mtrace_live.probes.lock_sites import WAIT_FUNCTION, LockWaitSite, lock_wait_site
from mtrace_live.probes.program import part_constants
from mtrace_live.probes.records import (
    LOCK_KEY_DTYPE,
    LOCK_STACK_TIME_DTYPE,
    LOCK_TIME_DTYPE,
    THREAD_START_DTYPE,
    THREAD_TIME_DTYPE,
    LockMisc,
)
from mtrace_live.tracer.processes.arena_walk import ArenaFinder, arena_symbols

if TYPE_CHECKING:
    from mtrace_live.tracer.bpf.bpf_backend import BpfProgram

_LOCKS = part_constants("locks.bpf.c")  # the tables' sizes, read from the C
LOCK_ROWS = _LOCKS["LOCK_ROWS"]  # (process, lock) rows
LOCK_STACK_ROWS = _LOCKS["LOCK_STACK_ROWS"]  # (process, lock, stack) rows


@dataclass(frozen=True)
class LockWaitPlan:
    """Where the slow path is probed in the libc, or why it cannot be timed."""

    libc: Path
    site: LockWaitSite | None
    problem: str = ""

    @property
    def timed(self) -> bool:
        return self.site is not None


def plan_lock_waits(libc: Path) -> LockWaitPlan:
    """The slow path's site in ``libc`` (probes/lock_sites.py)."""
    try:
        site = lock_wait_site(libc)
    except (MtraceError, *elf_failures()) as exc:
        return LockWaitPlan(libc, None, f"{libc} cannot be read: {exc}")
    if site is None:
        return LockWaitPlan(libc, None, f"{libc} has no {WAIT_FUNCTION}: lock waits are counted, "
                            "not timed")  # fmt: skip
    return LockWaitPlan(libc, site)


@dataclass(frozen=True)
class TimingReport:
    """What ``probes`` and ``doctor`` say of the lock waits' timing in a libc."""

    timed: bool  # the slow path can be timed
    arenas_told: bool  # its waits can be told to be on arenas or not
    text: str

    def as_json(self) -> dict[str, object]:
        return {"timed": self.timed, "arenas_told_apart": self.arenas_told, "why": self.text}


def timing_report(libc: Path, debug_file: Path | None = None) -> TimingReport:
    plan = plan_lock_waits(libc)
    if plan.site is None:
        return TimingReport(False, False, plan.problem)
    site = plan.site
    how = "emulated" if site.emulated else "single-stepped: slow"
    where = (f"{WAIT_FUNCTION}+{site.address - site.entry:#x} ({site.instruction}, {how}; file "
             f"offset {site.file_offset:#x}): each wait is timed")  # fmt: skip
    symbols = arena_symbols(libc, debug_file)
    if symbols.main_arena is None:
        return TimingReport(True, False, f"{where}; but its arenas cannot be read: "
                            f"{symbols.source}, so no wait is told to be an arena's")  # fmt: skip
    return TimingReport(True, True, f"{where}, and told to be an arena's or not by main_arena "
                        f"from {symbols.source}")  # fmt: skip


def lock_defines(stacks: bool, events: bool, one_process: bool) -> dict[str, int]:
    return {
        "WITH_LOCK_TIMES": 1,
        "LOCK_STACKS": int(stacks),
        "LOCK_EVENTS": int(events),
        "LOCK_ONE_PROCESS": int(one_process),
        "UPROBE_MOVES": int(one_process),
        "LOCK_ROWS": LOCK_ROWS,
        "LOCK_STACK_ROWS": LOCK_STACK_ROWS,
    }


def attach_lock_waits(program: BpfProgram, plan: LockWaitPlan, pid: int) -> None:
    """The entry and return probes, in process ``pid`` alone (or every
    process, -1)."""
    if plan.site is None:
        return
    program.attach_uprobe(plan.libc, plan.site.file_offset, "lock_wait_enter", pid)
    program.attach_uretprobe(plan.libc, plan.site.file_offset, "lock_wait_return", pid)


class ThreadClock:
    """Each traced process's threads' time (locks.bpf.c: thread_starts,
    thread_times): the threads a process has when it is followed are added
    here, the ones made later by the kernel."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}  # pid -> when it was followed (CLOCK_MONOTONIC ns)

    def seed(self, program: BpfProgram, pid: int) -> None:
        now = time.monotonic_ns()
        try:
            tids = [int(name) for name in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            return  # gone: nothing to time
        self.seen.setdefault(pid, now)
        program.add_absent("thread_starts", ((tid, (now, pid, 0)) for tid in tids))

    def read(self, program: BpfProgram) -> dict[int, ThreadTime]:
        now = time.monotonic_ns()
        _, starts = program.read_table("thread_starts", "<u4", THREAD_START_DTYPE)
        live_ns: Counter[int] = Counter()
        live: Counter[int] = Counter()
        for start, tgid, _ in starts.tolist():
            live_ns[tgid] += max(0, now - start)
            live[tgid] += 1
        keys, rows = program.read_table("thread_times", "<u4", THREAD_TIME_DTYPE)
        done = {int(k): row for k, row in zip(keys.tolist(), rows.tolist(), strict=True)}
        times = {}
        for pid in set(live) | set(done):
            done_ns, exited, first_ns, last_exit = done.get(pid, (0, 0, 0, 0))
            first = first_ns or self.seen.get(pid, 0)
            if not first:
                continue  # there before the trace, never followed (--all): its time is unknown
            end = now if live[pid] else last_exit
            wall = max(0, end - first)
            threads = exited + live[pid]
            times[pid] = ThreadTime(pid, wall, done_ns + live_ns[pid], threads, live[pid])
        return times


def read_lock_waits(program: BpfProgram, finder: ArenaFinder | None, stacks: bool,
                    clock: ThreadClock | None = None) -> LockWaits:  # fmt: skip
    """The tables now, each lock told apart by ``finder``."""

    def kind(pid: int, futex: int) -> str:
        return finder.kind(pid, futex) if finder is not None else "unknown"

    keys, values = program.read_table("lock_times", LOCK_KEY_DTYPE, LOCK_TIME_DTYPE)
    rows = []
    for (futex, pid, _), (count, total, longest, hist) in zip(keys.tolist(), values.tolist(),
                                                              strict=True):  # fmt: skip
        times = WaitTimes(count, total, longest, tuple(int(n) for n in hist))
        rows.append(LockRow(pid, futex, kind(pid, futex), times))
    stack_rows = []
    if stacks:
        keys, values = program.read_table("lock_stack_times", LOCK_KEY_DTYPE,
                                          LOCK_STACK_TIME_DTYPE)  # fmt: skip
        cache: dict[int, tuple[int, ...]] = {}
        for (futex, pid, stack), (count, total, longest) in zip(keys.tolist(), values.tolist(),
                                                                strict=True):  # fmt: skip
            if stack >= 0 and stack not in cache:
                cache[stack] = tuple(program.tables.stack(stack))
            stack_rows.append(LockStackRow(pid, futex, kind(pid, futex), cache.get(stack, ()),
                                           WaitTimes(count, total, longest)))  # fmt: skip
    misc = program.percpu_array_totals("lock_misc")
    threads = clock.read(program) if clock is not None else {}
    return LockWaits(tuple(rows), tuple(stack_rows), {m.name.lower(): misc[m] for m in LockMisc},
                     threads)  # fmt: skip
