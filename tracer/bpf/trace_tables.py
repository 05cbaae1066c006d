"""The trace program's own tables, by their names in probes/bpf/: what the
tracer writes to them (the gate, the process asked for, the processes
followed) and reads or clears in them (stacks, hits per process, the calls
a thread is in), on BpfProgram's generic map interface
(tracer/bpf/bpf_backend.py), which knows no table by name."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from mtrace_live.exporters.data.sink import ProcessHits
from mtrace_live.probes.elf.lazy import lazy_module
from mtrace_live.probes.program import part_constants
from mtrace_live.probes.records import ALLOC_FRAMES_BASE

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # (at the first use: probes/elf/lazy.py)

SELF_SLOTS = part_constants("common.bpf.h")["SELF_SLOTS"]


class Maps(Protocol):
    """A loaded program's maps (BpfProgram)."""

    def table(self, name: str) -> Any: ...

    def has_table(self, name: str) -> bool: ...

    def read_all(
        self, table: str, limit: int | None = None
    ) -> tuple[Any, np.ndarray, np.ndarray] | None: ...


class TraceTables:
    """The trace program's tables, by name, through ``maps``."""

    def __init__(self, maps: Maps) -> None:
        self._maps = maps
        # alloc_frames rows read: (frames, read the same twice). The frame store
        # never gives a row to another stack, so a row read whole is kept;
        # twice the same, it is whole (a row is written once, when claimed).
        self._frame_rows: dict[int, tuple[tuple[int, ...], bool]] = {}

    def generations_in_flight(self, tids: Iterable[int]) -> set[int]:
        """The uprobe generations whose entry probes saw the calls threads
        ``tids`` are inside (tracer/processes/retarget.py): the allocation functions'
        pending slots and the lock waits'."""
        found: set[int] = set()
        if self._maps.has_table("pending"):
            pending = self._maps.table("pending")
            slots = len(pending)
            for tid in tids:
                call = pending[pending.Key(tid & (slots - 1))]
                if call.depth and call.tid == tid:
                    found.add(int(call.uprobe_gen))
        if self._maps.has_table("lock_pending"):
            waits = self._maps.table("lock_pending")
            for tid in tids:
                with contextlib.suppress(KeyError):
                    found.add(int(waits[waits.Key(tid)].uprobe_gen))
        return found

    def stack(self, stack_id: int) -> list[int]:
        """The addresses of one stored stack, innermost first: from
        ``alloc_frames`` for an allocation's stack (kept once read whole),
        else from ``stacks``."""
        if stack_id < ALLOC_FRAMES_BASE:
            return self._stack_row(self._maps.table("stacks"), stack_id)
        known = self._frame_rows.get(stack_id)
        if known is not None and known[1]:
            return list(known[0])
        frames = tuple(
            self._stack_row(self._maps.table("alloc_frames"), stack_id - ALLOC_FRAMES_BASE)
        )
        self._frame_rows[stack_id] = (frames, known is not None and known[0] == frames)
        return list(frames)

    @staticmethod
    def _stack_row(table: Any, key: int) -> list[int]:
        try:
            frames = list(table[table.Key(key)].ip)
        except (KeyError, IndexError):
            return []
        return frames[: frames.index(0)] if 0 in frames else frames

    def process_hits(self, tgids: set[int] | None = None, take: bool = False) -> list[ProcessHits]:
        """The ``proc_hits`` table: hits by (tgid, probe slot), with the name of
        the thread that hit first. ``tgids`` limits it to those processes;
        ``take`` also deletes what it returns (for processes that are gone)."""
        got = self._maps.read_all("proc_hits")
        if got is None:
            table = self._maps.table("proc_hits")
            entries = [
                (bytes(key), int(value.count), bytes(value.comm)) for key, value in table.items()
            ]
        else:
            table, keys, values = got
            entries = [(key.tobytes(), int(value[0, 0]), value[0, 1:].tobytes())
                       for key, value in zip(keys, values, strict=True)]  # fmt: skip
        rows = []
        for raw_key, count, raw_comm in entries:
            key = table.Key.from_buffer_copy(raw_key)
            tgid = int(key.tgid)
            if tgids is not None and tgid not in tgids:
                continue
            comm = raw_comm.split(b"\0", 1)[0].decode(errors="replace")
            rows.append(ProcessHits(tgid, int(key.probe), count, comm))
            if take:
                del table[key]
        return rows

    def set_gate(self, open_: bool) -> None:
        """Open or close the trace program's ``control`` gate for the site handlers."""
        control = self._maps.table("control")
        control[control.Key(0)] = control.Leaf(int(open_))

    def exclude_self(self, ours: Sequence[int]) -> None:
        """Name mtrace-live's own processes (processes.target.own_processes)
        to the program, which never traces them whatever its filter
        (common.bpf.h's self_set): written before its gate opens and its
        uprobes attach."""
        table = self._maps.table("self_set")
        leaf = table.Leaf()
        for slot, pid in enumerate(ours[:SELF_SLOTS]):
            leaf.tgid[slot] = pid
        table[table.Key(0)] = leaf

    def set_first_target(self, pid: int) -> None:
        """Name the process asked for to the trace program (FIRST_TGID)."""
        table = self._maps.table("first_target")
        table[table.Key(0)] = table.Leaf(pid, 1)

    def follow(self, pids: Iterable[int]) -> None:
        followed = self._maps.table("followed")
        for pid in pids:
            followed[followed.Key(pid)] = followed.Leaf(1)
