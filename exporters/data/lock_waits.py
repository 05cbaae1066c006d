"""Lock waits in time, as plain data: what locks.bpf.c measured in the libc's
lock-wait slow path (``__lll_lock_wait_private``), per process and lock, and
per process, lock and stack of the waiting thread.

Each lock is a futex address, told apart by the tracer (tracer/processes/arena_walk.py)
as the main arena's mutex (``main``), another arena's (``arena``), another
libc-internal lock (``other``: stdio's, the dynamic loader's, ...) checked in
the process's memory, or ``unknown`` when that memory could not be read.
A histogram's bucket 0 counts waits of at most 1 ns, bucket k > 0 those of
more than 2^(k-1) and at most 2^k ns, the last one every longer wait
(``bucket_bound_ns``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

MAIN, ARENA, OTHER, UNKNOWN = "main", "arena", "other", "unknown"
ARENA_KINDS = (MAIN, ARENA)


def bucket_bound_ns(bucket: int) -> int:
    """The largest wait bucket ``bucket`` counts (the last one counts more)."""
    return 1 << bucket


@dataclass(frozen=True)
class WaitTimes:
    count: int = 0
    total_ns: int = 0
    max_ns: int = 0
    hist: tuple[int, ...] = ()  # per bucket; () where none is kept (per stack)

    def __add__(self, other: WaitTimes) -> WaitTimes:
        width = max(len(self.hist), len(other.hist))
        mine = self.hist + (0,) * (width - len(self.hist))
        theirs = other.hist + (0,) * (width - len(other.hist))
        hist = tuple(a + b for a, b in zip(mine, theirs, strict=True))
        return WaitTimes(self.count + other.count, self.total_ns + other.total_ns,
                         max(self.max_ns, other.max_ns), hist)  # fmt: skip

    @property
    def mean_ns(self) -> float:
        return self.total_ns / self.count if self.count else 0.0

    def quantile_bound_ns(self, q: float) -> int:
        """The bound of the bucket that holds quantile ``q``: at most that long."""
        if not self.hist or not self.count:
            return 0
        wanted, seen = q * sum(self.hist), 0
        for bucket, n in enumerate(self.hist):
            seen += n
            if n and seen >= wanted:
                return min(bucket_bound_ns(bucket), self.max_ns) if bucket else 1
        return self.max_ns


def total(times: Iterable[WaitTimes]) -> WaitTimes:
    summed = WaitTimes()
    for t in times:
        summed = summed + t
    return summed


@dataclass(frozen=True)
class LockRow:
    """The waits of one process on one lock."""

    pid: int
    futex: int
    kind: str  # MAIN, ARENA, OTHER or UNKNOWN
    times: WaitTimes


@dataclass(frozen=True)
class LockStackRow:
    """The waits of one process on one lock from one stack."""

    pid: int
    futex: int
    kind: str
    frames: tuple[int, ...]  # the waiting code's return address, then its callers
    times: WaitTimes


@dataclass(frozen=True)
class ThreadTime:
    """One process's time while traced: its wall time, and the sum of its
    threads' (each thread from its start, or the attach, to its end, or now)."""

    pid: int
    wall_ns: int
    thread_ns: int
    threads: int  # threads seen
    live: int  # of them, still there


@dataclass(frozen=True)
class LockWaits:
    """The lock-wait tables at one moment."""

    rows: tuple[LockRow, ...] = ()
    stacks: tuple[LockStackRow, ...] = ()
    misc: Mapping[str, int] = field(default_factory=dict)  # the kernel's lock_misc counters
    threads: Mapping[int, ThreadTime] = field(default_factory=dict)  # by pid
    function: str = "__lll_lock_wait_private"

    def share(self, pid: int, kinds: Iterable[str] = ARENA_KINDS) -> float | None:
        """The part of ``pid``'s thread time spent waiting on locks of ``kinds``."""
        time = self.threads.get(pid)
        if time is None or time.thread_ns <= 0:
            return None
        return self.of(pid, kinds).total_ns / time.thread_ns

    def processes(self) -> list[int]:
        return sorted({row.pid for row in self.rows})

    def of(self, pid: int | None = None, kinds: Iterable[str] = ARENA_KINDS) -> WaitTimes:
        """The waits of ``pid`` (or all processes) on locks of ``kinds``."""
        wanted = set(kinds)
        return total(r.times for r in self.rows if r.kind in wanted and pid in (None, r.pid))

    def arenas(self, pid: int) -> dict[int, WaitTimes]:
        """Each arena's waits in ``pid``, by the arena's address."""
        found: dict[int, WaitTimes] = {}
        for row in self.rows:
            if row.pid == pid and row.kind in ARENA_KINDS:
                found[row.futex] = found.get(row.futex, WaitTimes()) + row.times
        return found

    def top_stacks(self, limit: int = 10, kinds: Iterable[str] = ARENA_KINDS) -> list[LockStackRow]:
        wanted = set(kinds)
        rows = [row for row in self.stacks if row.kind in wanted]
        return sorted(rows, key=lambda r: (-r.times.total_ns, -r.times.count))[:limit]
