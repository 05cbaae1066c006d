"""Allocations by call stack, as plain data: what allocs.bpf.c (WITH_ALLOCS)
aggregated for the allocation functions, and the names of their frames.

A row of ``AllocSnapshot.stacks`` is one (process, allocating function,
call stack). Without sampling every allocation is kept and the numbers are
exact counts. With ``--sample-bytes N`` only sampled allocations are kept:
``bytes`` and ``bytes_freed`` are then unbiased estimates (each sample
stands for N bytes per sample point inside it), ``sizes`` the bytes the
kept allocations asked for, and the object counts are estimated in the
ratio bytes / sizes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from .processes import process_name
from .symbolize import ProcessSymbols, Symbol


@dataclass(frozen=True)
class StackRow:
    tgid: int
    function: str  # the allocation function: malloc, calloc, ...
    call_site: int  # the return address into its caller
    frames: tuple[int, ...]  # the call site, then its callers, innermost first
    calls: int
    bytes: int
    sizes: int
    frees: int
    bytes_freed: int
    sizes_freed: int
    last_ts: int

    @property
    def live_bytes(self) -> int:
        return self.bytes - self.bytes_freed

    @property
    def scale(self) -> float:
        """Objects per kept allocation (1 without sampling)."""
        return self.bytes / self.sizes if self.sizes and self.bytes != self.sizes else 1.0

    @property
    def objects(self) -> int:
        return round(self.calls * self.scale)

    @property
    def live_objects(self) -> int:
        return round((self.calls - self.frees) * self.scale)

    @property
    def heap_values(self) -> tuple[int, int, int, int]:
        """A heap profile's four values: alloc_objects, alloc_space,
        inuse_objects, inuse_space."""
        scale = self.scale
        return (round(self.calls * scale), self.bytes, round((self.calls - self.frees) * scale),
                self.bytes - self.bytes_freed)  # fmt: skip


@dataclass(frozen=True)
class ProcessAllocs:
    """Every call of one process, sampled or not."""

    tgid: int
    calls: int  # allocations that returned a pointer
    bytes: int  # the bytes they asked for
    frees: int
    unknown_frees: int  # of pointers not seen allocated
    failed: int
    comm: str = ""  # its name when the kernel first saw it call (it may be gone now)


@dataclass(frozen=True)
class Outstanding:
    """One allocation not freed yet."""

    tgid: int
    ptr: int
    size: int
    weight: int
    ts_ns: int
    tid: int
    function: str
    call_site: int
    frames: tuple[int, ...]


@dataclass(frozen=True)
class AllocSnapshot:
    stacks: tuple[StackRow, ...]
    processes: tuple[ProcessAllocs, ...]
    calls: Mapping[str, int]  # every hit of each function's probe, nested calls included
    misc: Mapping[str, int]  # probes/records.py AllocMisc, lower-case
    sample_bytes: int  # 0: every allocation kept
    now_ns: int
    started_ns: int
    outstanding: tuple[Outstanding, ...] = ()
    outstanding_read: bool = False
    # pid -> mmap/munmap/mremap/brk figures (probes/records.py VM_PROC_FIELDS)
    vm: Mapping[int, Mapping[str, int]] = field(default_factory=dict)
    # how the stacks were walked: probes/records.py UnwindMisc, lower-case ({}: by frame pointers)
    unwind: Mapping[str, int] = field(default_factory=dict)

    @property
    def live_bytes(self) -> int:
        return sum(row.live_bytes for row in self.stacks)

    def top(self, key: str = "live", limit: int = 10) -> list[StackRow]:
        """The rows with most live bytes, or (``key="bytes"``) most bytes allocated."""
        if key == "live":
            rows = [row for row in self.stacks if row.live_bytes > 0]
            return sorted(rows, key=lambda r: (-r.live_bytes, -r.calls))[:limit]
        return sorted(self.stacks, key=lambda r: (-r.bytes, -r.calls))[:limit]

    def process(self, tgid: int) -> ProcessAllocs | None:
        return next((p for p in self.processes if p.tgid == tgid), None)


def trimmed(snapshot: AllocSnapshot, names: FrameNames) -> AllocSnapshot:
    """The snapshot with each stack cut at its first frame that lies in no
    executable mapping of its process, and the rows that then share a
    stack summed. Code built without frame pointers leaves the walk to
    follow whatever its rbp holds, so that past the call site (always
    exact: read at the return) a stack may go on with garbage that differs
    from call to call; cut there, the calls of one site come together."""

    rows: dict[tuple[int, str, int, tuple[int, ...]], list[int]] = {}
    for row in snapshot.stacks:
        key = (row.tgid, row.function, row.call_site, names.cut(row.tgid, row.frames))
        values = [row.calls, row.bytes, row.sizes, row.frees, row.bytes_freed, row.sizes_freed,
                  row.last_ts]  # fmt: skip
        known = rows.get(key)
        if known is None:
            rows[key] = values
        else:
            rows[key] = [*(a + b for a, b in zip(known[:-1], values[:-1], strict=True)),
                         max(known[-1], values[-1])]  # fmt: skip
    stacks = tuple(StackRow(tgid, function, call_site, frames, *values)
                   for (tgid, function, call_site, frames), values in rows.items())  # fmt: skip
    held = tuple(replace(item, frames=names.cut(item.tgid, item.frames))
                 for item in snapshot.outstanding)  # fmt: skip
    return replace(snapshot, stacks=stacks, outstanding=held)


@dataclass
class FrameNames:
    """Names for the frames of allocation stacks, per process.

    The maps of a process are read when it is first asked about and again
    when an address falls outside them (a library loaded later); ``remember``
    reads them ahead of need (the tracer does so when a process stops in
    _exit). Once a process is gone its last maps are used."""

    symbols: dict[int, ProcessSymbols] = field(default_factory=dict)
    comms: dict[int, str] = field(default_factory=dict)  # process names, read with the maps
    live: bool = True  # False: the maps given are all there is (a record set's), read no others
    _names: dict[tuple[int, int], Symbol | None] = field(default_factory=dict)
    # (process, stack) -> the stack cut as ``cut`` cuts it, while its names hold
    _cuts: dict[tuple[int, tuple[int, ...]], tuple[int, ...]] = field(default_factory=dict)
    named: int = 0  # frames named (each once)
    naming_s: float = 0.0  # the time that took

    def remember(self, tgid: int) -> None:
        if not self.live:
            self.symbols.setdefault(tgid, ProcessSymbols(tgid, saved=[]))
            return
        fresh = ProcessSymbols(tgid)
        if fresh.mappings or tgid not in self.symbols:
            self.symbols[tgid] = fresh
        name = process_name(tgid)
        if name:
            self.comms[tgid] = name

    def forget(self, tgids: set[int]) -> None:
        """Processes gone whose frames will not be named again (serve's
        retired ones): their maps and names go."""
        for tgid in tgids:
            self.symbols.pop(tgid, None)
            self.comms.pop(tgid, None)
        self._names = {key: name for key, name in self._names.items() if key[0] not in tgids}
        self._cuts = {key: cut for key, cut in self._cuts.items() if key[0] not in tgids}

    def refresh(self, tgid: int) -> None:
        """Read the process's maps again, and keep them if they changed (a
        library loaded, an exec): its frames can then be named after it is
        gone, without reading its symbols anew while nothing changed."""
        if not self.live:
            return
        fresh = ProcessSymbols(tgid)
        known = self.symbols.get(tgid)
        if fresh.mappings and (known is None or fresh.mappings != known.mappings):
            self.symbols[tgid] = fresh
            self._names = {key: name for key, name in self._names.items() if key[0] != tgid}
            self._cuts = {key: cut for key, cut in self._cuts.items() if key[0] != tgid}

    def preload(self, tgid: int) -> None:
        """Read the process's maps and every module's symbols now (serve
        does, before giving up the root needed to read them)."""
        self.remember(tgid)
        for mapping in self.symbols[tgid].mappings:
            self.symbols[tgid].resolve(mapping.start)

    def cut(self, tgid: int, frames: tuple[int, ...]) -> tuple[int, ...]:
        """``frames`` up to its first frame past the call site that lies in
        no executable mapping of the process (``trimmed``), each stack's
        cut kept while its names are."""
        key = (tgid, frames)
        found = self._cuts.get(key)
        if found is None:
            found = frames
            for index in range(1, len(frames)):
                if self.resolve(tgid, frames[index]) is None:
                    found = frames[:index]
                    break
            self._cuts[key] = found
        return found

    def resolve(self, tgid: int, address: int) -> Symbol | None:
        """The frame at return address ``address``: named by the call
        instruction before it (address - 1), as debuggers do, so that the
        line is the call's and a call ending a function is not named after
        the next one."""
        key = (tgid, address)
        if key in self._names:
            return self._names[key]
        begun = time.monotonic()
        try:
            return self._resolve(tgid, address)
        finally:
            self.named += 1
            self.naming_s += time.monotonic() - begun

    def _resolve(self, tgid: int, address: int) -> Symbol | None:
        key = (tgid, address)
        if tgid not in self.symbols:
            self.remember(tgid)
        found = self._lookup(tgid, address - 1)
        if found is None:
            self.remember(tgid)
            found = self._lookup(tgid, address - 1)
        if found is not None and found.function is not None:
            found = replace(found, offset=found.offset + 1)
        self._names[key] = found
        return found

    def _lookup(self, tgid: int, address: int) -> Symbol | None:
        try:
            return self.symbols[tgid].resolve(address)
        except OSError:  # a file we may no longer read (serve runs unprivileged): unnamed
            return None

    def frame(self, tgid: int, address: int) -> str:
        """``function+0xoff (file:line)`` or ``0xaddr (module)``: one frame, for reading."""
        return frame_text(address, self.resolve(tgid, address))

    def stack(self, tgid: int, frames: Iterable[int]) -> list[str]:
        return [self.frame(tgid, address) for address in frames]


def frame_text(address: int, symbol: Symbol | None) -> str:
    """function+offset (file:line); in no function a symbol names,
    module+offset (never the nearest name, which would be another
    function's); outside every file, the address."""
    if symbol is None or symbol.function is None:
        return function_name(symbol, address)
    place = f" ({symbol.location})" if symbol.location else ""
    return f"{symbol.function}+{symbol.offset:#x}{place}"


def function_name(symbol: Symbol | None, address: int) -> str:
    """The function, or the module and the offset from its load base: a
    name for grouping."""
    if symbol is None:
        return f"{address:#x}"
    if symbol.function is None:
        base = symbol.span[0] if symbol.span else 0
        return f"{symbol.module}+{address - base:#x}"
    return symbol.function
