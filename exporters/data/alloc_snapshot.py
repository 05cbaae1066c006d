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
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, overload

from mtrace_live.probes.elf.lazy import lazy_module
from mtrace_live.probes.elf.maps import Mapping as FileMapping
from mtrace_live.probes.frame_kinds import (
    JIT_NAME,
    KIND_ADDRESS,
    KIND_FILE,
    KIND_NAMES,
    frame_kind,
    in_file,
)

from .file_frames import FileFrames
from .perf_map import PerfMap
from .processes import process_name
from .symbolize import JIT_MODULE, ProcessSymbols, Symbol, is_jit, is_python

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # (at the first use: probes/elf/lazy.py)


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
    provider: str = ""  # the allocator whose function was called (jemalloc); "": not told
    provider_lib: str = ""  # ... its file (libjemalloc.so.2)

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


# tgid, function, call_site, frames, then the provider and its file (StackRow's)
StackKey = tuple[int, str, int, tuple[int, ...], str, str]
VALUE_FIELDS = ("calls", "bytes", "sizes", "frees", "bytes_freed", "sizes_freed", "last_ts")
LAST_TS = VALUE_FIELDS.index("last_ts")
_INT64_FLOAT = (-(2.0**63), 2.0**63 - 1024)  # the int64 range's ends that a float64 holds


class StackCatalog:
    """The keys of stack rows (process, function, call site, stack, provider), each
    numbered once: a number names one key for as long as the catalog
    lives, so that what is worked out for a key (its frames, its cut, its
    encoded locations) is kept by number from one read of the tables to
    the next, and a read itself is arrays of numbers and values."""

    def __init__(self) -> None:
        self.keys: list[StackKey] = []
        self.index: dict[StackKey, int] = {}
        # (allocating function, provider, its file) -> its code
        self.functions: dict[tuple[str, ...], int] = {}
        self._tgids: list[int] = []
        self._codes: list[int] = []
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None  # (numpy: at the first read)

    def __len__(self) -> int:
        return len(self.keys)

    def number(self, key: StackKey) -> int:
        found = self.index.get(key)
        if found is None:
            found = self.index[key] = len(self.keys)
            self.keys.append(key)
            self._tgids.append(key[0])
            self._codes.append(self.functions.setdefault(key[1:2] + key[4:], len(self.functions)))
        return found

    def row(self, number: int, values: Sequence[int]) -> StackRow:
        """The StackRow of key ``number`` with ``values`` (VALUE_FIELDS)."""
        key: tuple[Any, ...] = self.keys[number]
        return StackRow(*key[:4], *values, *key[4:])

    def tgids(self) -> np.ndarray:
        """Each key's process, by number."""
        return self._columns()[0]

    def codes(self) -> np.ndarray:
        """Each key's allocating function (its code in ``functions``), by number."""
        return self._columns()[1]

    def _columns(self) -> tuple[np.ndarray, np.ndarray]:
        if self._arrays is None or len(self._arrays[0]) != len(self.keys):
            self._arrays = (np.array(self._tgids, np.int64), np.array(self._codes, np.int64))
        return self._arrays


class StackColumns(Sequence[StackRow]):
    """Stack rows as columns: row i is the key ``ids[i]`` of ``catalog``
    with the values ``values[i]`` (VALUE_FIELDS, as int64). Read as a
    sequence it gives StackRows, made once when first asked for; serve's
    profiles and metrics work on the columns and never make them."""

    def __init__(self, catalog: StackCatalog, ids: np.ndarray, values: np.ndarray) -> None:
        self.catalog = catalog
        self.ids = ids
        self.values = values
        self._rows: tuple[StackRow, ...] | None = None

    @classmethod
    def of(cls, rows: Sequence[StackRow]) -> StackColumns:
        """``rows`` as columns (numbered in a catalog of their own)."""
        if isinstance(rows, StackColumns):
            return rows
        catalog = StackCatalog()
        ids = np.array([catalog.number((r.tgid, r.function, r.call_site, r.frames, r.provider,
                                        r.provider_lib)) for r in rows], np.int64)  # fmt: skip
        values = np.array([[getattr(r, name) for name in VALUE_FIELDS] for r in rows], np.int64)
        return cls(catalog, ids, values.reshape(len(rows), len(VALUE_FIELDS)))

    def rows(self) -> tuple[StackRow, ...]:
        if self._rows is None:
            numbers, values = self.ids.tolist(), self.values.tolist()
            self._rows = tuple(self.catalog.row(k, row)
                               for k, row in zip(numbers, values, strict=True))  # fmt: skip
        return self._rows

    def __len__(self) -> int:
        return len(self.ids)

    @overload
    def __getitem__(self, index: int) -> StackRow: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[StackRow]: ...

    def __getitem__(self, index: int | slice) -> StackRow | Sequence[StackRow]:
        return self.rows()[index]

    def __iter__(self) -> Iterator[StackRow]:
        return iter(self.rows())

    def select(self, keep: np.ndarray) -> StackColumns:
        """The rows where ``keep`` (a mask or indices)."""
        return StackColumns(self.catalog, self.ids[keep], self.values[keep])

    def tgids(self) -> np.ndarray:
        found: np.ndarray = self.catalog.tgids()[self.ids]
        return found

    def heap_values(self) -> np.ndarray:
        """Each row's StackRow.heap_values, as a (rows, 4) int64 array (an
        object count past int64, which no profile can hold, at its bound)."""
        calls, nbytes, sizes, frees, freed = (self.values[:, i] for i in range(5))
        scaled = (sizes != 0) & (nbytes != sizes)
        scale = np.ones(len(calls))
        np.divide(nbytes, sizes, out=scale, where=scaled)
        out = np.empty((len(calls), 4), np.int64)
        for column, objects in ((0, calls), (2, calls - frees)):
            out[:, column] = np.clip(np.rint(objects * scale), _INT64_FLOAT[0], _INT64_FLOAT[1])
        out[:, 1] = nbytes
        out[:, 3] = nbytes - freed
        return out

    def by_process(self, columns: np.ndarray) -> dict[int, list[int]]:
        """``columns`` (one row of numbers per row) summed per process."""
        tgids, inverse = np.unique(self.tgids(), return_inverse=True)
        sums = np.zeros((len(tgids), columns.shape[1]), np.int64)
        np.add.at(sums, inverse, columns)
        return dict(zip(tgids.tolist(), sums.tolist(), strict=True))

    def by_provider(self) -> dict[int, list[tuple[str, str, int, int]]]:
        """Each process's (provider, its file, calls, bytes) by the provider
        called, most calls first; rows whose provider is not told are left out."""
        providers = {code: kind[1:] for kind, code in self.catalog.functions.items()
                     if len(kind) == 3 and kind[1]}  # fmt: skip
        codes = self.catalog.codes()[self.ids]
        # (a table of the few codes: np.isin's sort would import numpy.ma, 6 ms)
        wanted = np.fromiter(providers, dtype=np.int64, count=len(providers))
        chosen = np.flatnonzero(np.isin(codes, wanted, kind="table"))
        groups, inverse = np.unique(self.tgids()[chosen] << 16 | codes[chosen],
                                    return_inverse=True)  # fmt: skip
        sums = np.zeros((len(groups), 2), np.int64)
        np.add.at(sums, inverse, self.heap_values()[chosen][:, :2])
        merged: dict[int, dict[tuple[str, ...], list[int]]] = {}
        for group, (calls, nbytes) in zip(groups.tolist(), sums.tolist(), strict=True):
            found = merged.setdefault(group >> 16, {}).setdefault(providers[group & 0xFFFF], [0, 0])
            found[0] += calls
            found[1] += nbytes
        return {tgid: sorted(((name, lib, calls, nbytes)
                              for (name, lib), (calls, nbytes) in found.items()),
                             key=lambda row: (-row[2], row[0], row[1]))
                for tgid, found in merged.items()}  # fmt: skip

    def live_by_process(self) -> dict[int, tuple[int, int]]:
        """Each process's live objects and bytes (StackRow.live_objects, .live_bytes summed)."""
        sums = self.by_process(self.heap_values()[:, 2:])
        return {tgid: (objects, nbytes) for tgid, (objects, nbytes) in sums.items()}

    def top(self, key: str, limit: int) -> list[StackRow]:
        """AllocSnapshot.top's rows, ordered by arrays: the rows made are those returned."""
        calls = self.values[:, 0]
        if key == "live":
            live = self.values[:, 1] - self.values[:, 4]
            chosen = np.flatnonzero(live > 0)
            order = chosen[np.lexsort((-calls[chosen], -live[chosen]))]
        else:
            order = np.lexsort((-calls, -self.values[:, 1]))
        return [self.catalog.row(int(self.ids[i]), self.values[i].tolist()) for i in order[:limit]]


def summed(catalog: StackCatalog, ids: np.ndarray, values: np.ndarray) -> StackColumns:
    """One row per number in ``ids``: its rows' values summed, their last
    time the latest."""
    order = np.argsort(ids, kind="stable")
    ordered = ids[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]]) if len(ids) else ordered
    if len(starts) == len(ids):
        return StackColumns(catalog, ordered, values[order])
    out = np.add.reduceat(values[order], starts, axis=0)
    out[:, LAST_TS] = np.maximum.reduceat(values[order, LAST_TS], starts)
    return StackColumns(catalog, ordered[starts], out)


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
    allocator: str = ""  # what its malloc binds to (jemalloc); "": not known
    allocator_lib: str = ""  # ... in this file (libjemalloc.so.2)
    # allocations not tracked until freed: the table of outstanding blocks
    # (--max-outstanding) or of stacks (--alloc-stacks) was full; each one's
    # free is among unknown_frees
    untracked: int = 0

    @property
    def allocator_label(self) -> str:
        """As the outputs name it: ``jemalloc (libjemalloc.so.2)``; "" if not known."""
        return f"{self.allocator} ({self.allocator_lib})" if self.allocator else ""


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
    stacks: Sequence[StackRow]  # read from the kernel's tables: a StackColumns
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
    # every process was traced from its start (run's command and the children
    # it forks): none holds memory allocated before the trace
    traced_from_start: bool = False

    @property
    def live_bytes(self) -> int:
        return sum(row.live_bytes for row in self.stacks)

    def top(self, key: str = "live", limit: int = 10) -> list[StackRow]:
        """The rows with most live bytes, or (``key="bytes"``) most bytes
        allocated; the first of equals first."""
        return StackColumns.of(self.stacks).top(key, limit)

    def allocator_lines(self, tgids: Collection[int] | None = None, limit: int = 64) -> list[str]:
        """``pid N: allocator: jemalloc (libjemalloc.so.2)`` of each process
        (of ``tgids``) whose allocator is known, the first ``limit`` by pid."""
        known = sorted((p.tgid, p.allocator_label) for p in self.processes
                       if p.allocator and (tgids is None or p.tgid in tgids))  # fmt: skip
        lines = [f"pid {tgid}: allocator: {label}" for tgid, label in known[:limit]]
        if len(known) > limit:
            lines.append(f"and {len(known) - limit} more processes")
        return lines

    def by_provider(self) -> dict[int, list[tuple[str, str, int, int]]]:
        """StackColumns.by_provider of the stacks."""
        return StackColumns.of(self.stacks).by_provider()

    def process(self, tgid: int) -> ProcessAllocs | None:
        return next((p for p in self.processes if p.tgid == tgid), None)


def unknown_free_origins(proc: ProcessAllocs, snapshot: AllocSnapshot) -> tuple[str, ...]:
    """What a process's frees of blocks not seen allocated may be, as far
    as the trace can know: ``not_sampled`` (sampling keeps some blocks
    only), ``before_trace`` (the process ran before the trace: not run's
    command or its children), ``untracked`` (the tables had no room for
    some of its allocations). None of them: glibc's own frees of blocks no
    traced call returned (a thread's tcache at its exit, glibc 2.26+), or a
    forked child's of its parent's blocks."""
    return tuple(origin for origin, possible in (("not_sampled", snapshot.sample_bytes > 0),
                                                 ("before_trace", not snapshot.traced_from_start),
                                                 ("untracked", proc.untracked > 0))
                 if possible)  # fmt: skip


def trimmed(snapshot: AllocSnapshot, names: FrameNames) -> AllocSnapshot:
    """The snapshot with each stack cut at its first frame that lies in no
    executable mapping of its process, and the rows that then share a
    stack summed. Code built without frame pointers leaves the walk to
    follow whatever its rbp holds, so that past the call site (always
    exact: read at the return) a stack may go on with garbage that differs
    from call to call; cut there, the calls of one site come together."""

    stacks = names.trim(StackColumns.of(snapshot.stacks))
    held = tuple(replace(item, frames=names.cut(item.tgid, item.frames))
                 for item in snapshot.outstanding)  # fmt: skip
    return replace(snapshot, stacks=stacks, outstanding=held)


@dataclass
class FrameNames:
    """Names for the frames of allocation stacks, per process.

    The maps of a process are read when it is first asked about and again
    when an address falls outside them (a library loaded later); ``remember``
    reads them ahead of need (the tracer does so when a process stops in
    _exit). Once a process is gone its last maps are used; a process forked
    from another (``inherit``) and gone before its own maps were read is
    named by its parent's, which were its own at its fork; any other gone
    before its maps were read, by the mappings its walks found in the
    kernel (``learn``). A frame in a numbered file (probes/frame_kinds.py)
    needs none of that: it is named by its file (``files``), placed beside
    its process's mappings. A frame of any other kind (a Python function's)
    is named by the resolver of its kind (``resolvers``), or shows as
    itself. An address in anonymous executable memory is a frame of JIT
    code, named by the process's perf map (``perf_maps``: read with its
    maps, and again for lines written since when it names nothing there),
    or shown unnamed; only an address in no executable mapping, of a file
    or anonymous, ends a stack (``cut``)."""

    symbols: dict[int, ProcessSymbols] = field(default_factory=dict)
    comms: dict[int, str] = field(default_factory=dict)  # process names, read with the maps
    live: bool = True  # False: the maps given are all there is (a record set's), read no others
    _names: dict[tuple[int, int], Symbol | None] = field(default_factory=dict)
    # (process, stack) -> the stack cut as ``cut`` cuts it, while its names hold
    _cuts: dict[tuple[int, tuple[int, ...]], tuple[int, ...]] = field(default_factory=dict)
    parents: dict[int, int] = field(default_factory=dict)  # a forked process -> its parent
    # a process -> the mappings its walks found in the kernel, by start
    learned: dict[int, dict[int, FileMapping]] = field(default_factory=dict)
    files: FileFrames | None = None  # the trace's numbered files
    # a frame kind other than an address or a file's -> the frame's name
    resolvers: dict[int, Callable[[int, int], Symbol | None]] = field(default_factory=dict)
    # a process -> the numbered files its frames were found in
    placed: dict[int, set[int]] = field(default_factory=dict)
    # a process -> its perf map, read from where the last read ended (each
    # ProcessSymbols made for the process is given it)
    perf_maps: dict[int, PerfMap] = field(default_factory=dict)
    # a process -> its JIT frames named nothing, and its perf map's reading
    # when they were last named anew (named again once it took more lines)
    _unnamed_jit: dict[int, set[int]] = field(default_factory=dict)
    _jit_read: dict[int, int] = field(default_factory=dict)
    named: int = 0  # frames named (each once)
    naming_s: float = 0.0  # the time that took
    _trimming: _Trimming | None = field(default=None, repr=False)

    def remember(self, tgid: int) -> None:
        if not self.live:
            self.symbols.setdefault(tgid, ProcessSymbols(tgid, saved=[]))
            return
        fresh = ProcessSymbols(tgid)
        parent = self.parents.get(tgid)
        known = self.symbols.get(tgid)
        if not fresh.mappings and parent in self.symbols and (known is None or not known.mappings):
            self.symbols[tgid] = self.symbols[parent]  # gone: its maps were its parent's
            self.comms.setdefault(tgid, self.comms.get(parent, ""))
            return
        if not fresh.mappings and tgid in self.learned and (known is None or not known.mappings):
            self.symbols[tgid] = self._learned_symbols(tgid)  # gone: what its walks found
            return
        if fresh.mappings or tgid not in self.symbols:
            self.symbols[tgid] = fresh
        self._read_perf_map(tgid)
        name = process_name(tgid)
        if name:
            self.comms[tgid] = name

    def _read_perf_map(self, tgid: int) -> None:
        """The perf map of a process with JIT code, read for the lines
        written since: its JIT frames named nothing so far are named anew
        once it took more."""
        symbols = self.symbols.get(tgid)
        if symbols is None or not symbols.jit:
            return
        if symbols.perf_map is None:
            known = self.perf_maps.get(tgid)
            if known is None:
                known = self.perf_maps[tgid] = PerfMap.of_process(tgid)
            symbols.perf_map = known
        symbols.perf_map.read()
        if self._jit_read.get(tgid) != symbols.perf_map.reading:
            self._jit_read[tgid] = symbols.perf_map.reading
            for address in tuple(self._unnamed_jit.pop(tgid, ())):
                self._names.pop((tgid, address), None)

    def inherit(self, child: int, parent: int) -> None:
        """``child`` was forked from ``parent`` and unwound by its tables:
        named by the parent's maps (read now if they were not) if it is gone
        before its own are read."""
        if not self.live or child == parent:
            return
        self.parents[child] = parent
        if parent not in self.symbols:
            self.remember(parent)

    def learn(self, tgid: int, mapping: FileMapping) -> None:
        """A mapping of ``tgid``'s that a walk found in the kernel: it names
        the process's frames there if it is gone before its maps are read."""
        if not self.live or not mapping.path:
            return
        known = self.learned.setdefault(tgid, {})
        if known.get(mapping.start) == mapping:
            return
        known[mapping.start] = mapping
        symbols = self.symbols.get(tgid)
        if symbols is not None and not symbols.mappings:
            del self.symbols[tgid]  # named anew, by what was learned
            self._drop_names({tgid})

    def _learned_symbols(self, tgid: int) -> ProcessSymbols:
        """The process's symbols by the mappings its walks found: each file
        taken as mapped from its start (its load base, where file offset 0
        is), as the dynamic loader maps it."""
        found = list(self.learned[tgid].values())
        bases = {m.path: FileMapping(m.start - m.offset, m.start, 0, m.path, False, m.inode, "r--p")
                 for m in found if m.offset}  # fmt: skip
        return ProcessSymbols(tgid, saved=[*found, *bases.values()])

    def disinherit(self, tgids: Iterable[int]) -> None:
        """Processes that run another program now (an exec: its maps are
        no longer its parent's)."""
        for tgid in tgids:
            self.parents.pop(tgid, None)

    def forget(self, tgids: set[int]) -> None:
        """Processes gone whose frames will not be named again (serve's
        retired ones): their maps and names go."""
        for tgid in tgids:
            self.symbols.pop(tgid, None)
            self.comms.pop(tgid, None)
            self.parents.pop(tgid, None)
            self.learned.pop(tgid, None)
            self.placed.pop(tgid, None)
            self.perf_maps.pop(tgid, None)
            self._jit_read.pop(tgid, None)
        self._drop_names(tgids)

    def _drop_names(self, tgids: set[int]) -> None:
        """Forget the names and cuts of ``tgids``' frames. A scrape's thread
        may name frames meanwhile: each dict is copied at once (in C, under
        the interpreter lock), never iterated while it may grow."""
        self._names = {key: name for key, name in list(self._names.items())
                       if key[0] not in tgids}  # fmt: skip
        self._cuts = {key: cut for key, cut in list(self._cuts.items()) if key[0] not in tgids}
        for tgid in tgids:
            self._unnamed_jit.pop(tgid, None)
        if self._trimming is not None:
            self._trimming.drop(tgids)

    def refresh(self, tgid: int) -> None:
        """Read the process's maps again, and keep them if they changed (a
        library loaded, an exec, JIT code placed anew), and its perf map
        for the lines written since: its frames can then be named after it
        is gone, without reading its symbols anew while nothing changed."""
        if not self.live:
            return
        fresh = ProcessSymbols(tgid)
        known = self.symbols.get(tgid)
        if fresh.mappings and (known is None or fresh.mappings != known.mappings
                               or fresh.jit != known.jit):  # fmt: skip
            self.symbols[tgid] = fresh
            self._drop_names({tgid})
        self._read_perf_map(tgid)

    def preload(self, tgid: int) -> None:
        """Read the process's maps and every module's symbols now (serve
        does, before giving up the root needed to read them)."""
        self.remember(tgid)
        for mapping in self.symbols[tgid].mappings:
            self.symbols[tgid].resolve(mapping.start)

    def trim(self, columns: StackColumns) -> StackColumns:
        """``columns`` with each stack cut (``cut``) and the rows that then
        share a key summed; each key's cut kept by its number while the
        names of its process hold."""
        trimming = self._trimming
        if trimming is None or trimming.source is not columns.catalog or trimming.oversized():
            trimming = self._trimming = _Trimming(columns.catalog)
        return trimming.apply(columns, self.cut)

    def cut(self, tgid: int, frames: tuple[int, ...]) -> tuple[int, ...]:
        """``frames`` up to its first frame past the call site that lies in
        no executable mapping of the process, of a file or anonymous (JIT
        code, named or not: ``trimmed``), each stack's cut kept while its
        names are."""
        key = (tgid, frames)
        found = self._cuts.get(key)
        if found is None:
            found = frames
            for index in range(1, len(frames)):
                # (a frame of another kind is never a cut: unnamed, it shows as itself)
                frame = frames[index]
                if frame_kind(frame) == KIND_ADDRESS and self.resolve(tgid, frame) is None:
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
        kind = frame_kind(address)
        if kind not in (KIND_ADDRESS, KIND_FILE):
            resolver = self.resolvers.get(kind)
            found = resolver(tgid, address) if resolver is not None else None
            if found is not None:  # (kept while the process's names are: each read once)
                self._names[key] = found
            return found
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
        if found is None and in_file(address) is None:  # (a file's frame needs no maps)
            self.remember(tgid)
            found = self._lookup(tgid, address - 1)
        if found is not None and found.function is not None:
            found = replace(found, offset=found.offset + 1)
        if found is not None or in_file(address) is None:  # (a file's number may be named later)
            if is_jit(found) and found is not None and found.function is None:
                self._unnamed_jit.setdefault(tgid, set()).add(address)
            self._names[key] = found
        return found

    def _lookup(self, tgid: int, address: int) -> Symbol | None:
        placed = in_file(address)
        if placed is not None and self.files is not None:
            self.placed.setdefault(tgid, set()).add(placed[0])
            self.place_files(tgid)
        try:
            return self.symbols[tgid].resolve(address)
        except OSError:  # a file we may no longer read (serve runs unprivileged): unnamed
            return None

    def place_files(self, tgid: int) -> None:
        """The numbered files of ``tgid``'s frames placed beside its
        mappings (again, once its maps were read anew)."""
        symbols = self.symbols.get(tgid)
        if symbols is None or self.files is None:
            return
        for number in tuple(self.placed.get(tgid, ())):  # (a scrape's thread may add)
            if number not in symbols.numbers:
                mappings = self.files.mappings(number)
                if mappings:  # (else not named yet: placed once it is)
                    symbols.numbers.add(number)
                    symbols.add(mappings)

    def frame(self, tgid: int, address: int) -> str:
        """``function+0xoff (file:line)`` or ``0xaddr (module)``: one frame, for reading."""
        return frame_text(address, self.resolve(tgid, address))

    def stack(self, tgid: int, frames: Iterable[int]) -> list[str]:
        return [self.frame(tgid, address) for address in frames]


class _Trimming:
    """The keys of one catalog, each with its stack cut (FrameNames.cut)
    and numbered in a catalog of the cut keys."""

    def __init__(self, source: StackCatalog) -> None:
        self.source = source
        self.catalog = StackCatalog()
        self.cut_to = np.zeros(0, np.int64)  # a source number -> its cut key's; -1: not yet

    def oversized(self) -> bool:
        """Holding many more cut keys than there are keys (cuts made again)."""
        return len(self.catalog) > 2 * len(self.source) + 100_000

    def drop(self, tgids: set[int]) -> None:
        """The cuts of these processes made again when next asked for."""
        known = len(self.cut_to)
        self.cut_to[np.isin(self.source.tgids()[:known], list(tgids))] = -1

    def apply(self, columns: StackColumns,
              cut: Callable[[int, tuple[int, ...]], tuple[int, ...]]) -> StackColumns:  # fmt: skip
        grown = len(self.source) - len(self.cut_to)
        if grown > 0:
            self.cut_to = np.concatenate([self.cut_to, np.full(grown, -1, np.int64)])
        to = self.cut_to[columns.ids]
        if (to < 0).any():
            for number in np.unique(columns.ids[to < 0]).tolist():
                key = self.source.keys[number]
                cut_key = (key[0], key[1], key[2], cut(key[0], key[3]), *key[4:])
                self.cut_to[number] = self.catalog.number(cut_key)
            to = self.cut_to[columns.ids]
        return summed(self.catalog, to, columns.values)


def frame_text(address: int, symbol: Symbol | None) -> str:
    """function+offset (file:line); in no function a symbol names,
    module+offset (never the nearest name, which would be another
    function's); in JIT code, the perf map's name (which says where the
    code came from itself), or ``[jit] 0xaddr``; outside every file, the
    address."""
    if symbol is None or symbol.function is None or is_jit(symbol):
        return function_name(symbol, address)
    place = f" ({symbol.location})" if symbol.location else ""
    if is_python(symbol):  # a line, not an offset
        return f"{symbol.function}{place}"
    return f"{symbol.function}+{symbol.offset:#x}{place}"


def function_name(symbol: Symbol | None, address: int) -> str:
    """The function, or the module and the offset from its load base: a
    name for grouping. JIT code that no perf map names is ``[jit] 0xaddr``
    (its memory has no base that stays)."""
    if symbol is None:
        return f"{address:#x}"
    if symbol.function is None:
        if is_jit(symbol):
            return f"{JIT_MODULE} {address:#x}"
        base = symbol.span[0] if symbol.span else 0
        return f"{symbol.module}+{address - base:#x}"
    return symbol.function


def kind_name(address: int, symbol: Symbol | None) -> str:
    """A frame's kind as the outputs name it: its stored kind's
    (probes/frame_kinds.py), or ``jit`` for an address in JIT code."""
    if is_jit(symbol):
        return JIT_NAME
    return KIND_NAMES.get(frame_kind(address), KIND_NAMES[KIND_ADDRESS])
