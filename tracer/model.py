"""A model of each traced process's allocator, built from the event stream.

Counting is done on whole batches with numpy; only the rows of probes that
change the model's state (arenas, heaps, sbrk, retries, mallopt and
tunables, double-free checks, lock waits, exec and exit) are decoded one by
one, and those fire rarely.

Arena contention has two sources. ``memory_arena_reuse_wait`` fires when a
thread must wait for a busy arena at the arena limit. Threads that block on
an arena they already use wait in ``lll_lock_wait_private`` on the arena's
mutex, which is the first member of struct malloc_state, so its futex address
is the arena's address; those waits are attributed to the arena.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .events import MALLOPT_PARAMS, Event, EventDecoder, EventKind
from .target import process_name

RETRY_PROBES = {
    "memory_malloc_retry": "malloc",
    "memory_realloc_retry": "realloc",
    "memory_memalign_retry": "memalign",
    "memory_calloc_retry": "calloc",
    "memory_arena_retry": "arena",
}
SETTING_PROBES = {
    "memory_mallopt_mxfast": "M_MXFAST",
    "memory_mallopt_trim_threshold": "M_TRIM_THRESHOLD",
    "memory_mallopt_top_pad": "M_TOP_PAD",
    "memory_mallopt_mmap_threshold": "M_MMAP_THRESHOLD",
    "memory_mallopt_mmap_max": "M_MMAP_MAX",
    "memory_mallopt_perturb": "M_PERTURB",
    "memory_mallopt_arena_test": "M_ARENA_TEST",
    "memory_mallopt_arena_max": "M_ARENA_MAX",
    "memory_tunable_tcache_max_bytes": "glibc.malloc.tcache_max",
    "memory_tunable_tcache_count": "glibc.malloc.tcache_count",
    "memory_tunable_tcache_unsorted_limit": "glibc.malloc.tcache_unsorted_limit",
}
STATEFUL_PROBES = frozenset(
    {
        "memory_sbrk_more", "memory_sbrk_less", "memory_heap_new", "memory_heap_more",
        "memory_heap_less", "memory_heap_free", "memory_arena_new", "memory_arena_reuse",
        "memory_arena_reuse_wait", "memory_arena_reuse_free_list", "memory_mallopt",
        "memory_mallopt_free_dyn_thresholds", "memory_tcache_double_free",
        *RETRY_PROBES, *SETTING_PROBES,
    }
)  # fmt: skip
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
        return self.counts.get("memory_tcache_double_free", 0)

    @property
    def jumps(self) -> tuple[int, int]:
        return self.counts.get("setjmp", 0), self.counts.get("longjmp", 0)


def _log(entries: list[Any], entry: object) -> None:
    if len(entries) < LOG_LIMIT:
        entries.append(entry)


class AllocatorModel:
    """Per-process allocator state; feed it batches with ``consume``."""

    def __init__(
        self,
        decoder: EventDecoder,
        probe_names: Sequence[str],
        main_arena: Callable[[Event, int], int | None] | None = None,
    ) -> None:
        """``probe_names[slot]`` names each probe slot; ``main_arena(event,
        site)`` returns the main arena's address in the event's process."""
        self.decoder = decoder
        self.probe_names = list(probe_names)
        self.processes: dict[int, ProcessState] = {}
        self.events = 0
        # Held while a batch is applied; readers on other threads (the
        # metrics exporter) take it to see a consistent model.
        self.lock = threading.Lock()
        self._main_arena = main_arena
        # Lock waits can come by the hundred thousand a second under
        # contention: they are counted per (process, futex) in bulk.
        self._lock_wait_slot = (
            self.probe_names.index("lll_lock_wait_private")
            if "lll_lock_wait_private" in self.probe_names
            else None
        )
        self._stateful_slots = np.array(
            [slot for slot, name in enumerate(self.probe_names) if name in STATEFUL_PROBES],
            dtype=np.uint16,
        )
        self._handlers: dict[str, Callable[[ProcessState, Event], None]] = {
            "memory_sbrk_more": _sbrk_more,
            "memory_sbrk_less": _sbrk_less,
            "memory_heap_new": _heap_new,
            "memory_heap_more": _heap_resize,
            "memory_heap_less": _heap_resize,
            "memory_heap_free": _heap_free,
            "memory_arena_new": _arena_new,
            "memory_arena_reuse": _arena_reuse,
            "memory_arena_reuse_wait": _arena_reuse_wait,
            "memory_arena_reuse_free_list": _arena_free_list,
            "memory_arena_retry": _arena_retry,
            "memory_mallopt": _mallopt,
            "memory_mallopt_free_dyn_thresholds": _dyn_thresholds,
            "memory_tcache_double_free": _double_free,
        }

    def process(self, pid: int) -> ProcessState:
        state = self.processes.get(pid)
        if state is None:
            state = self.processes[pid] = ProcessState(pid, comm=process_name(pid))
        return state

    def consume(self, batch: np.ndarray) -> None:
        if len(batch) == 0:
            return
        with self.lock:
            self._consume(batch)

    def _consume(self, batch: np.ndarray) -> None:
        self.events += len(batch)
        probe_rows = batch["kind"] == EventKind.PROBE
        self._count(batch[probe_rows])
        if self._lock_wait_slot is not None:
            self._count_lock_waits(batch[probe_rows & (batch["probe"] == self._lock_wait_slot)])
        special = ~probe_rows | np.isin(batch["probe"], self._stateful_slots)
        if special.any():
            rows = batch[special]
            for event, site in zip(self.decoder.decode(rows), self._sites(rows), strict=True):
                self._apply(event, site)

    @staticmethod
    def _sites(rows: np.ndarray) -> list[int]:
        """Site index of each row, in the order ``decode`` returns events."""
        return [int(site) for site in rows["site"]]

    def _count(self, batch: np.ndarray) -> None:
        if len(batch) == 0:
            return
        keys = (batch["tgid"].astype(np.uint64) << np.uint64(16)) | batch["probe"]
        unique, counts = np.unique(keys, return_counts=True)
        first = {}
        last = {}
        tgids = batch["tgid"]
        for pid in np.unique(tgids).tolist():
            mask = tgids == pid
            stamps = batch["ts"][mask]
            first[pid], last[pid] = int(stamps.min()), int(stamps.max())
        for key, count in zip(unique.tolist(), counts.tolist(), strict=True):
            pid, slot = key >> 16, key & 0xFFFF
            state = self.process(pid)
            name = self.probe_names[slot] if slot < len(self.probe_names) else f"probe{slot}"
            state.counts[name] += count
        for pid, stamp in first.items():
            state = self.process(pid)
            state.first_ns = stamp if not state.first_ns else min(state.first_ns, stamp)
            state.last_ns = max(state.last_ns, last[pid])

    def _count_lock_waits(self, rows: np.ndarray) -> None:
        if len(rows) == 0:
            return
        pairs = np.stack([rows["tgid"].astype(np.uint64), rows["args"][:, 0]], axis=1)
        unique, counts = np.unique(pairs, axis=0, return_counts=True)
        for (pid, futex), count in zip(unique.tolist(), counts.tolist(), strict=True):
            self.process(pid).lock_waits[futex] += count

    def _apply(self, event: Event, site: int) -> None:
        state = self.process(event.pid)
        if event.probe == "exec":
            state.execs += 1
            state.comm = process_name(event.pid) or state.comm
            return
        if event.probe == "exit":
            state.exited = True
            return
        if self._main_arena is not None and not state.main_arena_known:
            address = self._main_arena(event, site)
            if address:
                state.arena(address).main = True
                state.main_arena_known = True
        handler = self._handlers.get(event.probe)
        if handler is not None:
            handler(state, event)
        elif event.probe in RETRY_PROBES:
            state.retries[RETRY_PROBES[event.probe]] += 1
        elif event.probe in SETTING_PROBES:
            _log(
                state.settings,
                SettingChange(
                    event.ts_ns, event.pid, SETTING_PROBES[event.probe],
                    event.args.get("old"), event.args.get("value"),
                ),
            )  # fmt: skip


def _arg(event: Event, index: int) -> int:
    values = list(event.args.values())
    value = values[index] if index < len(values) else None
    return value if value is not None else 0


def _sbrk_more(state: ProcessState, event: Event) -> None:
    if _arg(event, 0) == 0:  # sbrk failed: the probe fires anyway
        state.sbrk_failed += 1
    else:
        state.sbrk_grown += _arg(event, 1)


def _sbrk_less(state: ProcessState, event: Event) -> None:
    state.sbrk_shrunk += _arg(event, 1)


def _heap_new(state: ProcessState, event: Event) -> None:
    state.heaps[_arg(event, 0)] = _arg(event, 1)
    state.heap_bytes_grown += _arg(event, 1)


def _heap_resize(state: ProcessState, event: Event) -> None:
    heap, size = _arg(event, 0), _arg(event, 1)
    before = state.heaps.get(heap)
    state.heaps[heap] = size
    if before is not None:
        if size > before:
            state.heap_bytes_grown += size - before
        else:
            state.heap_bytes_released += before - size


def _heap_free(state: ProcessState, event: Event) -> None:
    heap = _arg(event, 0)
    size = state.heaps.pop(heap, _arg(event, 1))
    state.heap_bytes_released += size


def _arena_new(state: ProcessState, event: Event) -> None:
    arena = state.arena(_arg(event, 0))
    arena.created_ns = event.ts_ns
    arena.created_for = _arg(event, 1)


def _arena_reuse(state: ProcessState, event: Event) -> None:
    state.arena(_arg(event, 0)).reused += 1


def _arena_reuse_wait(state: ProcessState, event: Event) -> None:
    state.arena(_arg(event, 1)).reuse_waits += 1


def _arena_free_list(state: ProcessState, event: Event) -> None:
    state.arena(_arg(event, 0)).free_list += 1


def _arena_retry(state: ProcessState, event: Event) -> None:
    state.retries["arena"] += 1
    state.arena(_arg(event, 1)).retries += 1


def _mallopt(state: ProcessState, event: Event) -> None:
    param = _arg(event, 0)
    name = MALLOPT_PARAMS.get(param, str(param))
    _log(
        state.settings,
        SettingChange(event.ts_ns, event.pid, f"mallopt({name})", None, _arg(event, 1)),
    )


def _dyn_thresholds(state: ProcessState, event: Event) -> None:
    for index, setting in enumerate(("M_MMAP_THRESHOLD (dynamic)", "M_TRIM_THRESHOLD (dynamic)")):
        _log(
            state.settings, SettingChange(event.ts_ns, event.pid, setting, None, _arg(event, index))
        )


def _double_free(state: ProcessState, event: Event) -> None:
    _log(
        state.double_frees, DoubleFreeCheck(event.ts_ns, event.tid, _arg(event, 0), _arg(event, 1))
    )
