"""Lock contention in time, as text: each process's waits on its arenas'
locks and on the other libc locks, the share of its threads' time they
take, their histogram, the stacks that wait longest, and what the numbers
suggest changing (docs/contention.md). The summary and the live view show
these lines."""

from __future__ import annotations

from dataclasses import dataclass

from .data.alloc_snapshot import FrameNames
from .data.allocator_state import ProcessState
from .data.lock_waits import MAIN, OTHER, UNKNOWN, LockWaits, WaitTimes, bucket_bound_ns

# Advice is given only on this much evidence (docs/contention.md).
ADVICE_MIN_SHARE = 0.05  # of the process's thread time spent waiting
ADVICE_MIN_WAITS = 100
# Probes on every allocation lengthen every lock hold, and so the waits:
# measured in docs/performance.md.
INFLATED_NOTE = ("the allocation probes are on: they lengthen every malloc and so every "
                 "lock hold, sampled or not; --contention watches contention without them "
                 "(docs/contention.md)")  # fmt: skip


def duration_text(ns: float) -> str:
    if ns >= 1e9:
        return f"{ns / 1e9:.3f} s"
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.1f} us"
    return f"{ns:.0f} ns"


def _bound_text(ns: int) -> str:
    for unit, size in (("s", 10**9), ("ms", 10**6), ("us", 10**3)):
        if ns >= size:
            return f"{ns / size:g}{unit}" if ns % size == 0 else f"{ns / size:.3g}{unit}"
    return f"{ns}ns"


def histogram_lines(times: WaitTimes, width: int = 32) -> list[str]:
    """The log2 histogram of waits, bcc's way: one row per bucket from the
    first to the last that counted a wait."""
    used = [i for i, n in enumerate(times.hist) if n]
    if not used:
        return []
    top = max(times.hist)
    lines = [f"      {'wait (at most)':>14} : {'count':>8}   distribution"]
    for bucket in range(used[0], used[-1] + 1):
        n = times.hist[bucket]
        last = bucket == len(times.hist) - 1
        bound = _bound_text(bucket_bound_ns(bucket - 1 if last else bucket))
        label = f"> {bound}" if last else f"<= {bound}"
        bar = "*" * (round(width * n / top) if n else 0)
        lines.append(f"      {label:>14} : {n:>8}   |{bar:<{width}}|")
    return lines


def times_text(times: WaitTimes) -> str:
    return (f"{times.count} waits, {duration_text(times.total_ns)} in all, "
            f"max {duration_text(times.max_ns)}, mean {duration_text(times.mean_ns)}")  # fmt: skip


@dataclass(frozen=True)
class Advice:
    rule: str  # its name in docs/contention.md
    text: str


def advice(waits: LockWaits, state: ProcessState | None) -> list[Advice]:
    """What the numbers suggest for process ``state.pid``, by the rules of
    docs/contention.md; nothing where the evidence is thin."""
    if state is None:
        return []
    pid = state.pid
    share = waits.share(pid) or 0.0
    arena = waits.of(pid)
    found: list[Advice] = []
    thread_time = waits.threads.get(pid)
    arenas = len(state.arenas)
    strong = share >= ADVICE_MIN_SHARE and arena.count >= ADVICE_MIN_WAITS
    if strong and thread_time is not None and state.arena_limit is not None:
        threads = max(thread_time.live, state.most_attached)
        if arenas >= state.arena_limit and threads > arenas:
            found.append(Advice("arena-limit", _arena_limit_text(state, threads, arenas, share)))
    other = waits.share(pid, (OTHER,)) or 0.0
    if other >= ADVICE_MIN_SHARE and waits.of(pid, (OTHER,)).count >= ADVICE_MIN_WAITS:
        found.append(Advice("other-locks", f"{other:.0%} of thread time waits on libc locks that "
                            "are not arenas (stdio's, the loader's, ...): no malloc setting "
                            "changes that; see the top stacks"))  # fmt: skip
    return found


def _arena_limit_text(state: ProcessState, threads: int, arenas: int, share: float) -> str:
    source = state.arena_limit_source
    how = f"GLIBC_TUNABLES=glibc.malloc.arena_max={threads}"
    if "mallopt" in source:
        how = f"the program's mallopt(M_ARENA_MAX, {threads})"
    return (
        f"{threads} threads share {arenas} arenas (arena_max {state.arena_limit}, set by "
        f"{source}) and wait {share:.0%} of their time: raise the limit to the thread "
        f"count ({how}), at the cost of more memory held per arena"
    )


def process_contention_lines(waits: LockWaits, state: ProcessState | None, pid: int,
                             names: FrameNames, inflated: bool = False,
                             limit: int = 5) -> list[str]:  # fmt: skip
    """One process's lock waits, for the summary."""
    arena = waits.of(pid)
    other, unknown = waits.of(pid, (OTHER,)), waits.of(pid, (UNKNOWN,))
    lines = [f"  arena lock waits ({waits.function}): {times_text(arena)}"]
    share, threads = waits.share(pid), waits.threads.get(pid)
    if share is not None and threads is not None:
        lines.append(
            f"    {share:.1%} of thread time waiting on malloc arenas "
            f"({duration_text(arena.total_ns)} of {duration_text(threads.thread_ns)} in "
            f"{threads.threads} threads; wall {duration_text(threads.wall_ns)})"
        )
    if state is not None and state.arena_limit is not None:
        lines.append(f"    arenas {len(state.arenas)} of a limit of {state.arena_limit} "
                     f"({state.arena_limit_source})")  # fmt: skip
    elif state is not None and state.arena_problem:
        lines.append(f"    arenas not read from memory: {state.arena_problem}")
    lines.append(f"    other libc locks: {times_text(other)}; not told apart (memory "
                 f"unreadable): {unknown.count} waits")  # fmt: skip
    lines += histogram_lines(arena)
    top = [row for row in waits.top_stacks(limit) if row.pid == pid]
    if top:
        lines.append("    top stacks by arena lock wait time:")
        lines.append(f"      {'TOTAL':>10} {'WAITS':>8} {'MAX':>10}  {'LOCK':<8} CALL STACK")
        for row in top:
            stack = " < ".join(names.stack(pid, row.frames[:6])) or "(not walked)"
            kind = "main" if row.kind == MAIN else "arena"
            lines.append(f"      {duration_text(row.times.total_ns):>10} {row.times.count:>8} "
                         f"{duration_text(row.times.max_ns):>10}  {kind:<8} {stack}")  # fmt: skip
    for item in advice(waits, state):
        lines.append(f"    advice ({item.rule}): {item.text}")
    if inflated and arena.count:
        lines.append(f"    note: {INFLATED_NOTE}")
    return lines


def arena_waits(waits: LockWaits | None, pid: int) -> dict[int, WaitTimes]:
    """Each arena's waits in ``pid`` (none when waits are not timed)."""
    return waits.arenas(pid) if waits is not None else {}
