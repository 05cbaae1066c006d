"""The allocator model's state, as plain data: what every traced process's
allocator did, per arena, heap and setting. tracer/loop/model.py builds it from
the event stream; the outputs read it (under ``Allocators.lock``)."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from mtrace_live.probes.meanings import meanings

LOG_LIMIT = 1000  # settings changes and double-free checks kept per process


@dataclass
class ArenaState:
    address: int
    main: bool = False
    created_ns: int | None = None
    created_for: int | None = None  # the allocation size that made the arena
    reused: int = 0
    free_list: int = 0
    reuse_waits: int = 0
    retries: int = 0
    found_at_attach: bool = False  # read from the process's memory when the trace attached
    attached_threads: int | None = None  # threads using it, as its struct said when read
    system_mem: int | None = None  # bytes it had from the system, when read
    heaps: tuple[tuple[int, int], ...] = ()  # a non-main arena's heaps (address, size), when read


@dataclass(frozen=True)
class SettingChange:
    ts_ns: int
    pid: int
    setting: str
    old: int | None
    new: int | None


@dataclass(frozen=True)
class DoubleFreeCheck:
    ts_ns: int
    tid: int
    pointer: int | None
    tcache_bin: int | None


@dataclass
class ProcessState:
    pid: int
    comm: str = ""
    ns_pid: int | None = None  # its pid in its own pid namespace, where that differs
    first_ns: int = 0
    last_ns: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    arenas: dict[int, ArenaState] = field(default_factory=dict)
    lock_waits: Counter[int] = field(default_factory=Counter)  # futex address -> waits
    heaps: dict[int, int] = field(default_factory=dict)  # live mmapped heap -> size
    heap_bytes_grown: int = 0
    heap_bytes_released: int = 0
    sbrk_grown: int = 0
    sbrk_shrunk: int = 0
    sbrk_failed: int = 0
    retries: Counter[str] = field(default_factory=Counter)
    settings: list[SettingChange] = field(default_factory=list)
    double_frees: list[DoubleFreeCheck] = field(default_factory=list)
    execs: int = 0
    exited: bool = False
    main_arena_known: bool = False
    arena_limit: int | None = None  # the arena limit in force, when known
    arena_limit_source: str = ""  # tunable, environment, mallopt or default (8 x cores)
    arena_problem: str = ""  # why the arenas could not be read from memory
    most_attached: int = 0  # the most threads its arenas' structs counted at one reading

    def arena(self, address: int) -> ArenaState:
        state = self.arenas.get(address)
        if state is None:
            state = self.arenas[address] = ArenaState(address)
        return state

    def arena_lock_waits(self, arena: ArenaState) -> int:
        return self.lock_waits.get(arena.address, 0)

    @property
    def contention_waits(self) -> int:
        arenas = sum(a.reuse_waits + self.arena_lock_waits(a) for a in self.arenas.values())
        return arenas

    @property
    def heap_bytes(self) -> int:
        return sum(self.heaps.values())

    @property
    def double_free_checks(self) -> int:
        return sum(
            self.counts.get(probe, 0) for probe in meanings().with_effect("double_free_check")
        )

    @property
    def jumps(self) -> tuple[int, int]:
        return self.counts.get("setjmp", 0), self.counts.get("longjmp", 0)


@dataclass
class Allocators:
    """Every traced process's state. The model holds ``lock`` while it
    applies a batch; a reader on another thread (the metrics endpoint)
    takes it to see a consistent state."""

    processes: dict[int, ProcessState] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    events: int = 0  # events applied


def arena_lock_waits(state: ProcessState) -> int:
    """Lock waits on any of the process's arenas."""
    return sum(state.arena_lock_waits(arena) for arena in state.arenas.values())
