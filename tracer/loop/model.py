"""A model of each traced process's allocator, built from the event stream:
the first sink every batch reaches.

Counting is done on whole batches with numpy; only the rows of probes that
change the model's state (arenas, heaps, sbrk, retries, mallopt and
tunables, double-free checks, exec and exit) are decoded one by one, and
those fire rarely. Which probes those are, and what each changes (its
``effect``), comes from the catalog (probes/meanings.py); each effect has one
handler here, which reads the event's arguments by their catalog names.

Arena contention has two sources. ``memory_arena_reuse_wait`` fires when a
thread must wait for a busy arena at the arena limit. Threads that block on
an arena they already use wait in ``lll_lock_wait_private`` (effect
``lock_wait``) on the arena's mutex, which is the first member of struct
malloc_state, so its futex address is the arena's address; those waits are
counted in bulk per futex and attributed to the arena.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from mtrace_live.exporters.data.allocator_state import (
    LOG_LIMIT,
    Allocators,
    DoubleFreeCheck,
    ProcessState,
    SettingChange,
)
from mtrace_live.exporters.data.events import MALLOPT_PARAMS, Event, EventDecoder
from mtrace_live.exporters.data.processes import namespace_pid, process_name
from mtrace_live.exporters.data.sink import EventBatch, Sink
from mtrace_live.probes.elf.lazy import lazy_module
from mtrace_live.probes.meanings import Meanings, meanings
from mtrace_live.probes.records import EventKind
from mtrace_live.tracer.processes.arena_walk import ArenaScan, arena_limit

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # (at the first use: probes/elf/lazy.py)


def _log(entries: list[Any], entry: object) -> None:
    if len(entries) < LOG_LIMIT:
        entries.append(entry)


class AllocatorModel(Sink):
    """Per-process allocator state in ``state``; fed batches by ``consume``."""

    def __init__(
        self,
        decoder: EventDecoder,
        probe_names: Sequence[str],
        main_arena: Callable[[Event, int], int | None] | None = None,
        probe_meanings: Meanings | None = None,
    ) -> None:
        """``probe_names[slot]`` names each probe slot; ``main_arena(event,
        site)`` returns the main arena's address in the event's process."""
        self.decoder = decoder
        self.probe_names = list(probe_names)
        self.meanings = probe_meanings or meanings()
        self.state = Allocators()
        self._main_arena = main_arena
        self._effects = [self.meanings.effects.get(name, "") for name in self.probe_names]
        lock_waits = [slot for slot, e in enumerate(self._effects) if e == "lock_wait"]
        self._lock_wait_slots = lock_waits  # (lists: numpy is not needed yet)
        self._stateful_slots = [
            slot for slot, name in enumerate(self.probe_names) if name in self.meanings.stateful
        ]

    # The state's parts, as the outputs name them.
    @property
    def processes(self) -> dict[int, ProcessState]:
        return self.state.processes

    @property
    def events(self) -> int:
        return self.state.events

    def process(self, pid: int) -> ProcessState:
        state = self.state.processes.get(pid)
        if state is None:
            state = ProcessState(pid, comm=process_name(pid), ns_pid=namespace_pid(pid))
            self.state.processes[pid] = state
        return state

    def consume(self, batch: EventBatch | np.ndarray) -> None:
        rows = batch.libc if isinstance(batch, EventBatch) else batch
        if len(rows) == 0:
            return
        with self.state.lock:
            self._consume(rows)

    def _consume(self, batch: np.ndarray) -> None:
        self.state.events += len(batch)
        probe_rows = batch["kind"] == EventKind.PROBE
        self._count(batch[probe_rows])
        if len(self._lock_wait_slots) == 1:  # the usual case: one compare, not isin
            self._count_lock_waits(batch[probe_rows & (batch["probe"] == self._lock_wait_slots[0])])
        elif len(self._lock_wait_slots):
            waits = probe_rows & np.isin(batch["probe"], self._lock_wait_slots)
            self._count_lock_waits(batch[waits])
        lifecycle = (batch["kind"] == EventKind.EXEC) | (batch["kind"] == EventKind.EXIT)
        special = lifecycle | (probe_rows & np.isin(batch["probe"], self._stateful_slots))
        if special.any():
            rows = batch[special]
            sites = [int(site) for site in rows["site"]]  # in the order decode returns events
            for event, site in zip(self.decoder.decode(rows), sites, strict=True):
                self._apply(event, site)

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

    def named_arenas(self, pid: int) -> dict[int, bool]:
        """The arenas of ``pid`` the model knows, address -> main."""
        with self.state.lock:
            state = self.state.processes.get(pid)
            return {} if state is None else {a.address: a.main for a in state.arenas.values()}

    def seed_arenas(self, pid: int, scan: ArenaScan, at_attach: bool = False) -> None:
        """The arenas ``pid`` has, read from its memory (tracer/processes/arena_walk.py)
        when the trace attached and again while it runs, with their heaps
        and its arena limit."""
        # the limit's source is read from /proc before the lock is taken
        limit = arena_limit(pid, scan.arena_max) if not scan.problem else None
        with self.state.lock:
            state = self.process(pid)
            if limit is None:  # what an earlier read found stays
                if state.arena_limit is None:
                    state.arena_problem = scan.problem
                return
            state.arena_problem = ""
            state.arena_limit, state.arena_limit_source = limit
            for found in scan.arenas:
                arena = state.arena(found.address)
                arena.main = arena.main or found.main
                arena.found_at_attach = arena.found_at_attach or at_attach
                arena.attached_threads = found.attached_threads
                arena.system_mem = found.system_mem
                arena.heaps = found.heaps
                for heap, size in found.heaps:
                    state.heaps.setdefault(heap, size)
                if found.main:
                    state.main_arena_known = True
            # threads that exited since an earlier reading left their arenas
            attached = sum(found.attached_threads or 0 for found in scan.arenas)
            state.most_attached = max(state.most_attached, attached)

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
        effect = self.meanings.effects.get(event.probe, "")
        handler = _HANDLERS.get(effect)
        if handler is not None:
            handler(state, event, self.meanings)


def _arg(event: Event, name: str) -> int:
    value = event.args.get(name)
    return value if value is not None else 0


def _sbrk_more(state: ProcessState, event: Event, _: Meanings) -> None:
    if _arg(event, "brk") == 0:  # sbrk failed: the probe fires anyway
        state.sbrk_failed += 1
    else:
        state.sbrk_grown += _arg(event, "size")


def _sbrk_less(state: ProcessState, event: Event, _: Meanings) -> None:
    state.sbrk_shrunk += _arg(event, "extra")


def _heap_new(state: ProcessState, event: Event, _: Meanings) -> None:
    size = _arg(event, "size")
    state.heaps[_arg(event, "h")] = size
    state.heap_bytes_grown += size


def _heap_resize(state: ProcessState, event: Event, _: Meanings) -> None:
    heap, size = _arg(event, "h"), _arg(event, "size")
    before = state.heaps.get(heap)
    state.heaps[heap] = size
    if before is not None:
        if size > before:
            state.heap_bytes_grown += size - before
        else:
            state.heap_bytes_released += before - size


def _heap_free(state: ProcessState, event: Event, _: Meanings) -> None:
    size = state.heaps.pop(_arg(event, "heap"), _arg(event, "size"))
    state.heap_bytes_released += size


def _arena_new(state: ProcessState, event: Event, _: Meanings) -> None:
    arena = state.arena(_arg(event, "a"))
    arena.created_ns = event.ts_ns
    arena.created_for = _arg(event, "size")


def _arena_reuse(state: ProcessState, event: Event, _: Meanings) -> None:
    state.arena(_arg(event, "result")).reused += 1


def _arena_reuse_wait(state: ProcessState, event: Event, _: Meanings) -> None:
    state.arena(_arg(event, "result")).reuse_waits += 1


def _arena_free_list(state: ProcessState, event: Event, _: Meanings) -> None:
    state.arena(_arg(event, "result")).free_list += 1


def _retry(state: ProcessState, event: Event, meaning: Meanings) -> None:
    state.retries[meaning.retries[event.probe]] += 1


def _arena_retry(state: ProcessState, event: Event, meaning: Meanings) -> None:
    _retry(state, event, meaning)
    state.arena(_arg(event, "ar_ptr")).retries += 1


def _setting(state: ProcessState, event: Event, meaning: Meanings) -> None:
    change = SettingChange(
        event.ts_ns, event.pid, meaning.settings[event.probe],
        event.args.get("old"), event.args.get("value"),
    )  # fmt: skip
    _log(state.settings, change)


def _apply_mallopt(state: ProcessState, event: Event, _: Meanings) -> None:
    param = _arg(event, "param_number")
    name = MALLOPT_PARAMS.get(param, str(param))
    value = _arg(event, "value")
    change = SettingChange(event.ts_ns, event.pid, f"mallopt({name})", None, value)
    _log(state.settings, change)
    # glibc sets arena_max only for a positive value; a read of the memory, later, has the last word
    if name == "M_ARENA_MAX" and value > 0:
        state.arena_limit, state.arena_limit_source = value, "mallopt M_ARENA_MAX"


def _dynamic_thresholds(state: ProcessState, event: Event, _: Meanings) -> None:
    for arg, setting in (("mmap_threshold", "M_MMAP_THRESHOLD (dynamic)"),
                         ("trim_threshold", "M_TRIM_THRESHOLD (dynamic)")):  # fmt: skip
        _log(state.settings, SettingChange(event.ts_ns, event.pid, setting, None, _arg(event, arg)))


def _double_free(state: ProcessState, event: Event, _: Meanings) -> None:
    check = DoubleFreeCheck(event.ts_ns, event.tid, _arg(event, "e"), _arg(event, "tc_idx"))
    _log(state.double_frees, check)


# One handler per effect (probes/catalog.py: EFFECTS; "lock_wait" is counted in bulk).
_HANDLERS: dict[str, Callable[[ProcessState, Event, Meanings], None]] = {
    "sbrk_more": _sbrk_more,
    "sbrk_less": _sbrk_less,
    "heap_new": _heap_new,
    "heap_resize": _heap_resize,
    "heap_free": _heap_free,
    "arena_new": _arena_new,
    "arena_reuse": _arena_reuse,
    "arena_reuse_wait": _arena_reuse_wait,
    "arena_free_list": _arena_free_list,
    "retry": _retry,
    "arena_retry": _arena_retry,
    "setting": _setting,
    "mallopt": _apply_mallopt,
    "dynamic_thresholds": _dynamic_thresholds,
    "double_free_check": _double_free,
}
