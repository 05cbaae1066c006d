"""The CFI unwinder's tables (probes/bpf/unwind.bpf.c): each mapped file's
rows, written once per file however many processes map it, and each traced
process's executable mappings.

A file's rows come from its call-frame information (probes/elf/cfi.py),
kept on disk by build-id between runs (``MTRACE_LIVE_CFI_CACHE``, default
/var/cache/mtrace-live/cfi; ``off`` disables it): reading libc's takes about
0.5 s, loading the kept rows a millisecond. A file is opened through
/proc/PID/map_files/, which names the mapped file in any mount namespace.

A process's mappings are written when it is followed, when it first calls
a function that wants a stack (it is stopped until they are, see
``unwind_wanted``, if mtrace-live started it), and again at each ``refresh``
(once a second) when they changed: a library ``dlopen``ed meanwhile is
unwound from then on. Each process's mappings take a block of unwind_maps,
a new one each time they change (the walk in flight reads the old block).
A process forked by a followed one gets its parent's entry in the kernel,
the same block (``unwind_fork``), and asks for its own at its first call,
without a hold: so a block no process of ours names any more is retired,
not freed, and freed at a later ``refresh`` once no entry of unwind_procs
names it. What did not fit (rows of a file, a process's mappings) is
counted: those frames are walked by frame pointers.

Each file with rows has a number, which its frames carry (probes/
frame_kinds.py): the one a walk's ask gave it in the kernel, else one of
the trace's; ``file_frames`` names each (exporters/data/file_frames.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import select
import struct
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from mtrace_live.exporters.data.file_frames import FileFrames, NumberedFile
from mtrace_live.exporters.data.processes import proc_dir
from mtrace_live.probes.elf import facts
from mtrace_live.probes.elf.facts import file_fact
from mtrace_live.probes.elf.file import (
    LoadSegment,
    elf_failures,
    elf_layout,
    file_offset,
    layout_of,
    load_segments,
    open_elf,
)
from mtrace_live.probes.elf.lazy import lazy_module
from mtrace_live.probes.elf.maps import Mapping, read_maps
from mtrace_live.probes.elf.symbols import exported_offset, symbol_table
from mtrace_live.probes.errors import NotElfError, TargetError
from mtrace_live.probes.program import PAGE_SHIFT, part_constants  # vm_pgoff counts pages
from mtrace_live.probes.records import (
    FRAME_DEPTH,
    UNWIND_PROC_DTYPE,
)
from mtrace_live.tracer.bpf.bpf_backend import BpfProgram
from mtrace_live.tracer.bpf.kernel_btf import BtfUnavailable, kernel_facts
from mtrace_live.tracer.processes.holds import Holds
from mtrace_live.tracer.unwind.unwind_room import Extents
from mtrace_live.tracer.unwind.unwind_rows import (
    BIG_FILE,
    PAGE_SIZE,
    ROW_SIZE,
    FileEntry,
    PackedRows,
    RowCache,
    entry_segment,
    exec_path,
    file_entry,
    file_key,
    kernel_file_key,
    rows_cache_dir,
    rows_of,
    same_file,
    user_inode,
)

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # (at the first use: probes/elf/lazy.py)

# unwind_maps' value (UNWIND_MAP_DTYPE): start, end, bias, first, count,
# pages, page_count, page_base, pad, file, spare
_MAP_ENTRY = struct.Struct("<3Q8I")

# The unwinder's constants, as unwind.bpf.c defines them (read from it):
# its tables' default sizes (unwind_rows 2 Mi rows, 24 MiB: the libc takes
# 28,000; unwind_maps 64 Ki, 3 MiB; unwind_pages 2 Mi entries, 8 MiB: an
# entry per 4 KiB of code), its page index's shift, unwind_progs' slots.
_UNWIND = part_constants("unwind.bpf.c")
DEFAULT_ROWS, DEFAULT_MAPS, DEFAULT_PAGES = (
    _UNWIND["UNWIND_ROWS"], _UNWIND["UNWIND_MAPS"], _UNWIND["UNWIND_PAGES"])  # fmt: skip
STEP, RESUME_ALLOC, RESUME_LOCK, VMA_LOOKUP, PYTHON = (
    _UNWIND[f"UNWIND_{slot}"] for slot in ("STEP", "RESUME_ALLOC", "RESUME_LOCK",
                                            "VMA_LOOKUP", "PYTHON"))  # fmt: skip


def unwind_defines(rows: int = DEFAULT_ROWS, maps: int = DEFAULT_MAPS,
                   pages: int = DEFAULT_PAGES) -> dict[str, int]:  # fmt: skip
    """The program's switches for unwinding by CFI."""
    return {"WITH_UNWIND": 1, "UNWIND_ROWS": rows, "UNWIND_MAPS": maps, "UNWIND_PAGES": pages,
            "FRAME_DEPTH": FRAME_DEPTH, **vma_defines()}  # fmt: skip


# What unwind_vma__callback reads of the kernel's VMA, its file, inode and
# super block: each member's offset and size, from the running kernel's BTF.
_VMA_MEMBERS = {
    "VMA_START_OFF": ("vm_area_struct", "vm_start", 8),
    "VMA_END_OFF": ("vm_area_struct", "vm_end", 8),
    "VMA_PGOFF_OFF": ("vm_area_struct", "vm_pgoff", 8),
    "VMA_FILE_OFF": ("vm_area_struct", "vm_file", 8),
    "FILE_INODE_OFF": ("file", "f_inode", 8),
    "INODE_INO_OFF": ("inode", "i_ino", 8),
    "INODE_SB_OFF": ("inode", "i_sb", 8),
    "SB_DEV_OFF": ("super_block", "s_dev", 4),
    "TASK_REAL_PARENT_OFF": ("task_struct", "real_parent", 8),
    "TASK_TGID_OFF": ("task_struct", "tgid", 4),
}


def vma_defines() -> dict[str, int]:
    """UNWIND_VMA and the offsets its lookup reads, where the kernel has
    ``bpf_find_vma`` (Linux 5.17) and its BTF says where the members are
    (else a PC outside a process's tables is walked by frame pointers);
    UNWIND_LOOP where it has ``bpf_loop`` (5.17 too: the walks' frames
    through it, which the verifier checks once, not once per frame). {}
    where the BTF cannot say."""
    try:
        members, (has_find_vma, has_loop) = kernel_facts(
            [(struct, member) for struct, member, _ in _VMA_MEMBERS.values()],
            ["bpf_find_vma", "bpf_loop"],
        )
    except BtfUnavailable:
        return {}
    loop = {"UNWIND_LOOP": 1} if has_loop else {}
    found = dict(zip(_VMA_MEMBERS, members, strict=True))
    if not has_find_vma or any(found[name] is None or found[name][1] != size  # type: ignore[index]
                               for name, (_, _, size) in _VMA_MEMBERS.items()):  # fmt: skip
        return loop
    return {"UNWIND_VMA": 1, **loop,
            **{name: at[0] for name, at in found.items() if at is not None}}  # fmt: skip


DLOPEN_FUNCTIONS = ("dlopen", "dlmopen")  # in the libc since glibc 2.34


def attach_dlopen(program: BpfProgram, libc: Path, pid: int = -1) -> list[str]:
    """The return probe of the libc's dlopen and dlmopen, and the dynamic
    loader's _dl_debug_state (a library loaded while a process is traced
    gets its rows before its constructors run): the functions probed
    (no dlopen in a libc older than 2.34, where libdl has them; there the
    mappings are read again each second)."""
    probed: list[str] = []
    offsets = {name: exported_offset(libc, name) for name in DLOPEN_FUNCTIONS}
    for name, offset in offsets.items():
        if offset is not None and offset not in [offsets[p] for p in probed]:
            program.attach_uprobe(libc, offset, "unwind_dlopen_entry", pid)
            program.attach_uretprobe(libc, offset, "unwind_dlopen_return", pid)
            probed.append(name)
    loader = loader_beside(libc)
    state = rtld_state(loader) if loader is not None else None
    if loader is not None and state is not None:
        program.write_array("unwind_rtld", 0, struct.pack("<q", state[1]))
        program.attach_uprobe(loader, state[0], "unwind_dl_state", pid)
        probed.append(DEBUG_STATE)
    return probed


DEBUG_STATE = "_dl_debug_state"  # the dynamic loader's breakpoint for debuggers
R_STATE = 24  # struct r_debug's r_state (after r_version, r_map and r_brk)


def loader_beside(libc: Path) -> Path | None:
    """The dynamic loader installed with ``libc`` (in its directory)."""
    return next(iter(sorted(libc.parent.glob("ld-linux*.so*"))), None)


@file_fact
def rtld_state(loader: Path) -> tuple[int, int] | None:
    """_dl_debug_state's file offset in the dynamic loader, and the distance
    from it to _r_debug.r_state (None where either is not exported)."""
    try:
        with open_elf(loader) as elf:
            dynsym = symbol_table(elf, ".dynsym")
            values = {s.name: s.value for s in dynsym or () if s.value}
            if DEBUG_STATE not in values or "_r_debug" not in values:
                return None
            offset = file_offset(load_segments(elf), values[DEBUG_STATE])
    except (OSError, NotElfError, *elf_failures()):
        return None
    if offset is None:
        return None
    return offset, values["_r_debug"] + R_STATE - values[DEBUG_STATE]


@dataclass(frozen=True)
class MappedFile:
    """A file's rows in unwind_rows, its page index in unwind_pages, and its
    loadable segments."""

    first: int
    count: int  # 0: none (no CFI, or no room)
    segments: tuple[LoadSegment, ...]
    problem: str
    pages: int = 0
    page_count: int = 0
    page_base: int = 0
    number: int = 0  # its frames' file number (file_frames; 0: none, they are addresses)


def exec_mappings(pid: int) -> list[Mapping]:
    """``pid``'s executable mappings of files; [] when it is gone."""
    try:
        mappings = read_maps(proc_dir(pid))
    except OSError:
        return []
    return [m for m in mappings if m.executable and m.inode[1] != 0 and m.path]


def machine_mapped() -> set[tuple[int, int]]:
    """The files any process on the machine maps executable, as
    (device, inode) (as /proc/PID/maps gives them)."""
    mapped: set[tuple[int, int]] = set()
    with os.scandir("/proc") as entries:
        for entry in entries:
            if entry.name.isdigit():
                mapped.update(mapping.inode for mapping in exec_mappings(int(entry.name)))
    return mapped


def own_loader() -> list[Path]:
    """The dynamic loader mtrace-live's own process maps (the machine's)."""
    try:
        mappings = read_maps(Path("/proc/self"))
    except OSError:
        return []
    return sorted({Path(m.path) for m in mappings
                   if m.executable and Path(m.path).name.startswith("ld-linux")})  # fmt: skip


def mapped_file(pid: int, mapping: Mapping) -> Path | None:
    """A path that opens the file ``pid`` maps: /proc/PID/map_files/ (any
    mount namespace; it needs CAP_SYS_ADMIN), else the path in the process's
    root, if the file there is the mapped one (its device and inode)."""
    for path in (Path(f"/proc/{pid}/map_files/{mapping.map_files}"),
                 Path(f"{proc_dir(pid)}/root{mapping.path}")):  # fmt: skip
        try:
            with open(path, "rb"):
                pass
            status = path.stat()
        except OSError:
            continue
        if (status.st_dev, status.st_ino) == mapping.inode:
            return path
    return None


@dataclass(frozen=True)
class FoundMapping:
    """A mapping a walk found in the kernel's VMA of its process
    (EV_UNWIND_VMA): where, the file (by unwind_files' key), and whether
    the file's rows were never asked for."""

    pid: int
    start: int
    end: int
    offset: int
    file: tuple[int, int]
    ask: bool
    number: int = 0  # an ask's: the number it gave the file (its frames', file_frames)

    def mapping(self, path: str) -> Mapping:
        return Mapping(self.start, self.end, self.offset, path, True, user_inode(self.file),
                       "r-xp")  # fmt: skip


def found_mappings(records: np.ndarray) -> list[FoundMapping]:
    """The EV_UNWIND_VMA records' mappings."""
    args = records["args"].tolist()
    return [FoundMapping(pid, a[0], a[1], a[2] << PAGE_SHIFT, (a[3], a[4]), bool(a[5] & 1),
                         a[5] >> 1)
            for pid, a in zip(records["tgid"].tolist(), args, strict=True)]  # fmt: skip


def _code_size(mapping: Mapping) -> tuple[int, int]:
    """A mapping's bytes (a file's code mapping: its size follows its
    rows'), then its start."""
    return mapping.end - mapping.start, mapping.start


def _segment_of(segments: tuple[LoadSegment, ...], offset: int) -> LoadSegment | None:
    """The executable segment holding file ``offset``."""
    for segment in segments:
        if segment.executable and segment.offset <= offset < segment.offset + segment.filesz:
            return segment
    return None


NO_ROOM = "no room left in the unwind rows"

# MTRACE_LIVE_PROCESS_TABLES=off: no process's own tables are written, and
# every walk finds its mappings in the kernel (make bench's comparison of
# the two; docs/allocations.md).
PROCESS_TABLES = os.environ.get("MTRACE_LIVE_PROCESS_TABLES", "") != "off"

# An ask for a small file is the file server's; the trace serves it itself if
# it is still unwritten this long after it came.
DEFER_S = 0.05


class UnwindTables:
    """The tables of one trace program; ``counts`` says what did not fit."""

    def __init__(self, program: BpfProgram, rows: int = DEFAULT_ROWS, maps: int = DEFAULT_MAPS,
                 pages: int = DEFAULT_PAGES, cache: RowCache | None = None,
                 holds: Holds | None = None,
                 written: Callable[[int], None] | None = None,
                 found: Callable[[], np.ndarray] | None = None,
                 server_rows: int = 0, server_pages: int = 0) -> None:  # fmt: skip
        """``holds``: continues a process the kernel stopped until its
        tables were written (one mtrace-live started: tracer/processes/holds.py);
        ``written``: told each process whose mappings were written;
        ``found``: reads the mappings the walks found in the kernel (the
        unwind_found ring's records): each is put in ``learned`` with its
        file's path ("" if unknown), for the trace's own thread to take;
        ``server_rows``, ``server_pages``: the rows and page entries at the
        end of the tables that the file server writes (tracer/unwind/file_server.py),
        not these tables."""
        self.program = program
        self.holds = holds
        self.written_hook = written
        # the trace's share of unwind_rows and unwind_pages (the server's after it)
        self.rows_room, self.pages_room = (
            Extents(0, rows - server_rows),
            Extents(0, pages - server_pages),
        )
        # the tables' room (the file server's share too), and their kernel memory
        self.rows_total = rows
        self.memory_bytes = rows * ROW_SIZE + pages * PAGE_SIZE + maps * _MAP_ENTRY.size
        self.cache = cache if cache is not None else RowCache(rows_cache_dir())
        self.files: dict[object, MappedFile] = {}  # by build-id, else (device, inode)
        self.by_inode: dict[tuple[int, int], MappedFile] = {}
        self.maps_room = Extents(0, maps)  # blocks of unwind_maps
        self.block_rows: dict[tuple[int, int], frozenset[int]] = {}  # the files a block names
        self.no_room: dict[tuple[int, int], object] = {}  # files that found none: their keys
        # processes forgotten, and as many when an eviction last freed nothing
        self._forgotten, self._evict_idle = 0, -1
        # blocks no process of ours names, which a forked one's entry may,
        # each with how many sweeps in a row found no entry naming it
        self.retired: dict[tuple[int, int], int] = {}
        self.blocks: dict[int, tuple[int, int]] = {}  # pid -> its block
        self.written: dict[int, tuple[Mapping, ...]] = {}  # pid -> the mappings written
        self.counts: Counter[str] = Counter()
        self.load_s = 0.0  # time spent writing tables
        # The files' rows for the kernel's VMA lookups (UNWIND_VMA): those
        # written to unwind_files, by its key, and a path for each file
        # seen in a process's maps or exec'd (to open it by, once it is gone).
        self.vma = program.has_table("unwind_files")
        self.published: set[tuple[int, int]] = set()
        self.paths: dict[tuple[int, int], str] = {}
        self.files_gen = self._told_gen = 0  # files written, and as the kernel was told
        # the files numbered, whose frames the walks store as (number, address)
        self.file_frames = FileFrames()
        self._serving_state(found)

    def _serving_state(self, found: Callable[[], np.ndarray] | None) -> None:
        """What serves the walks' asks (``serve_in_background``) works with."""
        self.found_reader = found
        self.learned: deque[tuple[FoundMapping, str]] = deque()
        self._serving = self._nested = False
        # The files' state is shared with the threads that serve the asks,
        # and so are the blocks of unwind_maps (an eviction, in any thread,
        # frees those of processes gone): both are changed under the lock.
        self._lock = threading.RLock()
        self._loaded = threading.Condition(self._lock)  # a file's load ended
        self._loading: set[tuple[int, int]] = set()  # files being loaded, by inode
        self._thread: threading.Thread | None = None
        self._bulk_thread: threading.Thread | None = None
        self._bulk: queue.Queue[Callable[[], None]] = queue.Queue()  # its jobs
        # The file server, while it runs: it serves the asks for small
        # files; those still unwritten DEFER_S after the ask are served here.
        self.server: Callable[[], bool] | None = None  # alive?
        self._deferred: dict[tuple[int, int], tuple[float, FoundMapping]] = {}
        # what ended a serving thread (a fault of mtrace-live's own: one
        # file's failure is that file's alone), for the trace's loop to raise
        self.failure: Exception | None = None
        self._stop = threading.Event()
        self._wake: tuple[int, int] | None = None  # a pipe: the serving thread woken to stop

    def _file(self, pid: int, mapping: Mapping) -> MappedFile:
        """The file's rows, written once. Two threads load two files at once
        (the serving thread's ask is not kept waiting by a large file of the
        trace's); one waits only for the file the other is loading."""
        known = self._file_unless_loading(pid, mapping, wait=True)
        assert known is not None
        return known

    def _file_unless_loading(self, pid: int, mapping: Mapping, wait: bool) -> MappedFile | None:
        """``_file``, or (not ``wait``) None where another thread is loading it."""
        with self._lock:
            known = self.by_inode.get(mapping.inode)
            while known is None and mapping.inode in self._loading:
                if not wait:
                    return None
                self._loaded.wait()
                known = self.by_inode.get(mapping.inode)
            if known is not None:
                return known
            self._loading.add(mapping.inode)
        try:
            return self._open_file(pid, mapping)
        finally:
            with self._lock:
                self._loading.discard(mapping.inode)
                self._loaded.notify_all()

    def _open_file(self, pid: int, mapping: Mapping) -> MappedFile:
        file = kernel_file_key(mapping.inode)
        served = self._kernel_file(file) if file not in self.published else None
        if served is not None:  # the file server wrote it
            served = self._numbered(mapping, served)
            with self._lock:
                self.by_inode[mapping.inode] = served
                self.published.add(file)
            return served
        path = mapped_file(pid, mapping)
        if path is None:
            # not kept: another process mapping it may open it
            return MappedFile(0, 0, (), "the mapped file cannot be opened")
        if mapping.path.startswith("/"):
            self.paths.setdefault(kernel_file_key(mapping.inode), mapping.path)
        self._asks_first()
        known = rows = None
        problem = ""
        # a file met before (its layout a kept fact) whose rows are here or
        # in the rows' cache is not opened at all
        layout = facts.peek(elf_layout, path)
        if layout is not None:
            ident, segments = layout
            key: object = ident or mapping.inode
            known = self.files.get(key)
            if known is None:
                rows = self.cache.load(ident)
        if known is None and rows is None:
            try:
                with open_elf(path, in_memory=BIG_FILE) as elf:  # read once: it may be gone next
                    ident, segments = layout_of(elf)
                    if layout is None:
                        facts.keep(elf_layout, (ident, segments), path)
                    key = ident or mapping.inode
                    known = self.files.get(key)
                    if known is None:
                        self._asks_first()
                        rows, problem = rows_of(elf, path, ident, self.cache)
            except (TargetError, OSError) as exc:  # not kept: it may open later, or elsewhere
                return MappedFile(0, 0, (), str(exc))
            except (NotElfError, *elf_failures()) as exc:
                return self._no_rows(mapping, str(exc))
        if known is None:
            try:
                assert rows is not None
                known = self._load(rows, problem, segments)
            except Exception as exc:  # one file's failure is that file's alone
                self._file_failed(mapping.path, exc)
                known = MappedFile(0, 0, segments, f"its tables could not be built ({exc})")
            known = self._numbered(mapping, known)
        with self._lock:
            known = self.files.setdefault(key, known)
            self.by_inode[mapping.inode] = known
            self._publish(mapping.inode, known)
            if known.problem == NO_ROOM:  # tried again once an eviction makes room
                self.no_room[mapping.inode] = key
        return known

    def _numbered(self, mapping: Mapping, file: MappedFile) -> MappedFile:
        """``file`` with its number, for its frames: the one its ask gave
        it (the file server's, written with it), else a new one of the
        trace's (not given twice in a trace), where it has rows and a path."""
        key = kernel_file_key(mapping.inode)
        path = mapping.path if mapping.path.startswith("/") else self.paths.get(key, "")
        if file.number:
            self._name_number(file.number, path, mapping.inode, file.segments)
            return file
        if not file.count or not path:
            return file
        number = self.file_frames.number(NumberedFile(path, mapping.inode, file.segments))
        return replace(file, number=number)

    def _name_number(self, number: int, path: str, inode: tuple[int, int],
                     segments: tuple[LoadSegment, ...]) -> None:  # fmt: skip
        """A number the kernel gave (at a walk's ask): its file's path, and
        its segments once known."""
        if path.startswith("/"):
            self.file_frames.name(number, NumberedFile(path, inode, segments))

    def _file_failed(self, what: str, exc: Exception) -> None:
        """A file whose tables could not be built: counted, and named."""
        with self._lock:
            self.counts["files_failed"] += 1
        print(f"mtrace-live: warning: {what}: its unwind tables could not be built "
              f"({type(exc).__name__}: {exc}); its frames are walked by frame pointers",
              file=sys.stderr, flush=True)  # fmt: skip

    def _no_rows(self, mapping: Mapping, why: str) -> MappedFile:
        with self._lock:
            found = self.by_inode[mapping.inode] = MappedFile(0, 0, (), why)
            self._publish(mapping.inode, found)
        return found

    def _publish(self, inode: tuple[int, int], file: MappedFile) -> None:
        """The file's rows written to unwind_files too, for a walk that
        finds its mapping in the kernel (made known by ``publish_done``)."""
        key = kernel_file_key(inode)
        if not self.vma or key in self.published or file.problem == NO_ROOM:
            return  # (no room: an entry asked for stays so, until an eviction makes room)
        entry = file_entry(file.first, file.count, file.pages, file.page_count, file.page_base,
                           file.segments, file.number)  # fmt: skip
        if self.program.set_entry("unwind_files", file_key(key), entry):
            self.published.add(key)
            self.files_gen += 1
        else:  # unwind_files is full (UNWIND_FILES): found mappings step by frame pointers
            self.counts["files_not_fitting"] += 1

    def publish_done(self) -> None:
        """Say to the kernel that files were written since it last heard
        (unwind_files_gen): the mappings it found of files whose rows it
        did not have are looked up again."""
        with self._lock:
            if self.vma and self.files_gen != self._told_gen:
                self.program.write_array("unwind_files_gen", 0, struct.pack("<I4x", self.files_gen))
                self._told_gen = self.files_gen

    def serve_found(self, asks: bool = True) -> None:
        """The mappings the walks found since the last read: the files asked
        for written first (not ``asks``: none, as no walk follows), then
        each put in ``learned``; between two files of the processes that
        asked, new asks come first."""
        if self.found_reader is None or self._serving:
            return
        self._serving = True
        try:
            while True:
                records = self.found_reader()
                if not len(records):
                    break
                self._serve_records(records, asks)
        finally:
            self._serving = False

    def _serve_records(self, records: np.ndarray, asks: bool = True) -> None:
        found = found_mappings(records)
        paths = [self.path_of(one) for one in found]
        for one, path in zip(found, paths, strict=True):
            if one.number:  # the number an ask gave, named from now on (its rows come next)
                self._name_number(one.number, path, user_inode(one.file), ())
                if not path.startswith("/"):  # (this thread could not read it: the namer's may)
                    self.file_frames.name_later(one.number, user_inode(one.file),
                                                functools.partial(self.path_of, one))  # fmt: skip
        if asks:
            self.files_found(found)
        self.learned.extend(zip(found, paths, strict=True))

    def _asks_first(self) -> None:
        """In the serving thread, between the steps of a file's load: the
        asks that came meanwhile served first (one level deep), so that a
        large file keeps a small one waiting for one step of its load."""
        if self.found_reader is None or self._nested:
            return
        if threading.current_thread() is not self._thread:
            return
        self._nested = True
        try:
            records = self.found_reader()
            if len(records):
                self._serve_records(records)
        finally:
            self._nested = False

    def serve_in_background(self, fd: int) -> None:
        """Serve the mappings found (``serve_found``) in a thread of its own,
        woken by the ring's ``fd``: a file asked for is written within
        milliseconds of the ask, whatever the trace's loop is doing (a batch
        of events, another process's tables). Files larger than BIG_FILE,
        and the other files of the processes that asked, are loaded by a
        second thread (the rows are read in C, without the interpreter
        lock), so that no ask waits for them."""
        self._wake = os.pipe()
        self._thread = threading.Thread(target=self._serve_until_stopped, args=(fd,),
                                        name="mtrace-live-unwind", daemon=True)  # fmt: skip
        self._bulk_thread = threading.Thread(target=self._bulk_until_stopped,
                                             name="mtrace-live-bulk", daemon=True)  # fmt: skip
        self._thread.start()
        self._bulk_thread.start()

    def _bulk_until_stopped(self) -> None:
        try:
            while not self._stop.is_set():
                with contextlib.suppress(queue.Empty):
                    self._bulk.get(timeout=0.1)()
        except Exception as exc:  # a fault of mtrace-live's own: the trace ends on it
            self.failure = exc

    def _serve_until_stopped(self, fd: int) -> None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if self._wake is not None:
            poller.register(self._wake[0], select.POLLIN)
        try:
            while not self._stop.is_set():
                poller.poll(int(DEFER_S * 1000) if self._deferred else 100)
                self.serve_found()
                self._serve_deferred()
        except Exception as exc:  # a fault of mtrace-live's own: the trace ends on it
            self.failure = exc

    def _serve_deferred(self) -> None:
        """The asks the file server has not served DEFER_S after they came
        (it could not open the file, or had no room)."""
        now = time.monotonic()
        for key, (when, one) in list(self._deferred.items()):
            if now - when < DEFER_S and self.server is not None and self.server():
                continue
            del self._deferred[key]
            if self._kernel_file(key) is None:
                self._file_found_safely(one)

    def _kernel_file(self, key: tuple[int, int]) -> MappedFile | None:
        """The file as unwind_files holds it, if written (by either writer)."""
        raw = self.program.entry_bytes("unwind_files", file_key(key)) if self.vma else None
        if raw is None:
            return None
        entry = FileEntry.of(raw)
        if not entry.written:
            return None
        return MappedFile(entry.first, entry.rows, entry_segment(entry), "", entry.pages,
                          entry.page_count, entry.page_base, entry.number)  # fmt: skip

    def stop_serving(self, rest: bool = True) -> None:
        """End the serving thread, and (``rest``) take the mappings left in
        the ring in this one, for their names."""
        self._stop.set()
        # (both woken now: a trace's end does not wait for their timeouts)
        self._bulk.put(lambda: None)
        if self._wake is not None:
            os.write(self._wake[1], b"x")
        for thread in (self._thread, self._bulk_thread):
            if thread is not None:
                thread.join()
        self._thread = self._bulk_thread = None
        if self._wake is not None:
            for end in self._wake:
                os.close(end)
            self._wake = None
        if rest:
            try:
                self.serve_found(asks=False)
            except Exception as exc:  # the trace is ending: only the last names are lost
                self.failure = self.failure or exc

    def files_found(self, found: list[FoundMapping]) -> None:
        """Files whose rows a walk asked for (a mapping it found in the
        kernel): each opened through the process, else by the path it was
        mapped or exec'd from, if that is still the same file; one that
        cannot be opened is asked for again by the next process to meet it."""
        served = self.server is not None and any(one.ask for one in found) and self.server()
        for one in found:
            if one.file in self.published or not one.ask:
                continue
            big = self._size(one) > BIG_FILE
            if not big and served:
                self._deferred.setdefault(one.file, (time.monotonic(), one))
            elif big and self._bulk_thread is not None:
                self._bulk.put(functools.partial(self._file_found_safely, one))
            else:
                self._file_found_safely(one)
        self.publish_done()
        # then the other files of their processes (a walk asks for one file
        # at a time, as it meets it), in the bulk thread
        if self._bulk_thread is not None:
            for pid in sorted({one.pid for one in found if one.ask}):
                for mapping in exec_mappings(pid):
                    key = kernel_file_key(mapping.inode)
                    if key not in self.published and key not in self._deferred:  # (the server's)
                        self._bulk.put(functools.partial(self._publish_mapping, pid, mapping))

    def _file_found_safely(self, one: FoundMapping) -> None:
        begun = time.monotonic()
        try:
            self._file_found(one)
        except Exception as exc:  # one file's failure is that file's alone
            self._file_failed(f"a file of pid {one.pid}", exc)
        finally:
            self.publish_done()
            self._took(begun)

    def _took(self, begun: float) -> None:
        """Time spent writing tables, from ``begun`` (any thread's)."""
        with self._lock:
            self.load_s += time.monotonic() - begun

    def _publish_mapping(self, pid: int, mapping: Mapping) -> None:
        if kernel_file_key(mapping.inode) not in self.published:
            self._file(pid, mapping)
            self.publish_done()

    def _size(self, one: FoundMapping) -> int:
        """The size of the file a walk found (0 where it cannot be told)."""
        with contextlib.suppress(OSError):
            return os.stat(f"/proc/{one.pid}/map_files/{one.start:x}-{one.end:x}").st_size
        path = self.paths.get(one.file)
        with contextlib.suppress(OSError):
            return os.stat(path).st_size if path else 0
        return 0

    def publish_path(self, path: Path) -> None:
        """A file written for the walks before any asks (the libc, the
        dynamic loader: in most processes' stacks)."""
        try:
            status = path.stat()
        except OSError:
            return
        mapping = Mapping(0, 0, 0, str(path), True, (status.st_dev, status.st_ino))
        if self.vma and kernel_file_key(mapping.inode) not in self.published:
            begun = time.monotonic()
            self._file(os.getpid(), mapping)
            self.publish_done()
            self._took(begun)

    def _file_found(self, one: FoundMapping) -> None:
        path = self.path_of(one)
        mapping = one.mapping(path)
        file = self._file_unless_loading(one.pid, mapping, wait=False)
        if file is None:  # another thread is loading it: looked at again if that fails
            with self._lock:
                self._deferred.setdefault(one.file, (time.monotonic(), one))
            return
        if file.problem == NO_ROOM:
            return  # asked again once an eviction makes room (_retry_no_room)
        gone = not file.segments and path and Path(path).is_absolute()
        if gone and same_file(Path(path), one.file):
            # the process is gone: opened by the path, still the file
            file = self._file(os.getpid(), replace(mapping, path=path))
        with self._lock:
            if one.file not in self.published and self._kernel_file(one.file) is None:
                # asked again by the next walk to meet it (the file server's
                # write between the look and the delete is asked again too)
                self.program.delete_entry("unwind_files", file_key(one.file))
                self.counts["files_unopened"] += 1

    def path_of(self, one: FoundMapping) -> str:
        """The path of the file a walk found: its process's link to it while
        it lives (without root: the path its maps give), else where it was
        seen mapped, else the program the
        process exec'd ("" if none is known). The first path found for a
        file is kept for it."""
        known = self.paths.get(one.file)
        if known is not None:
            return known
        with contextlib.suppress(OSError):
            path = os.readlink(f"/proc/{one.pid}/map_files/{one.start:x}-{one.end:x}")
            self.paths[one.file] = path
            return path
        # (map_files' links are root's: serve, having given it up, reads the maps)
        with contextlib.suppress(OSError, ValueError):
            inode = user_inode(one.file)
            for mapping in read_maps(proc_dir(one.pid)):
                if mapping.inode == inode and mapping.path.startswith("/"):
                    self.paths[one.file] = mapping.path
                    return mapping.path
        raw = self.program.row_bytes("unwind_exec_paths", one.pid) if self.vma else None
        executed = exec_path(raw)
        if executed is None or not same_file(executed, one.file):
            return ""
        self.paths[one.file] = os.path.realpath(executed)  # (not through the parent's cwd link)
        return self.paths[one.file]

    def _load(self, rows: PackedRows, problem: str,
              segments: tuple[LoadSegment, ...]) -> MappedFile:  # fmt: skip
        self._asks_first()
        with self._lock:  # room taken in one step; written after, outside the lock
            if problem or rows.count == 0:
                self.counts["files_without_cfi"] += 1
                return MappedFile(0, 0, segments, problem or "no call-frame information")
            room = self._room(rows.count, rows.page_count)
            if room is None and self._evict():
                room = self._room(rows.count, rows.page_count)
            if room is None:
                self.counts["files_not_fitting"] += 1
                self.counts["rows_not_fitting"] += rows.count
                return MappedFile(0, 0, segments, NO_ROOM)
            first, first_page = room
            self.counts["files"] += 1
        self.program.write_array("unwind_rows", first, rows.rows)
        self.program.write_array("unwind_pages", first_page, rows.pages)
        return MappedFile(first, rows.count, segments, "", first_page, rows.page_count,
                          rows.page_base)  # fmt: skip

    def _room(self, rows: int, pages: int) -> tuple[int, int] | None:
        """Runs of ``rows`` rows and ``pages`` page entries taken, or None."""
        first = self.rows_room.take(rows)
        if first is None:
            return None
        first_page = self.pages_room.take(pages)
        if first_page is None:
            self.rows_room.give(first, rows)
            return None
        return first, first_page

    def _evict(self) -> int:
        """Give back the rows of the files no process maps any more (a
        program that ran and ended; a library unloaded) and no block of
        unwind_maps names: the number of files evicted. Their unwind_files
        entries go first, so that no walk takes them up while the machine's
        maps are read again; a file a process maps by then gets its entry
        back. One that freed nothing is not tried again until a process of
        ours is gone (the machine's maps are read each time)."""
        if self._evict_idle == self._forgotten:
            return 0
        self._free_unnamed()
        named = set().union(*self.block_rows.values())
        by_first: dict[int, list[tuple[int, int]]] = {}
        for inode, file in self.by_inode.items():
            if file.count and file.first < self.rows_room.end:  # (the server's are its own)
                by_first.setdefault(file.first, []).append(inode)
        unnamed = {first: inodes for first, inodes in by_first.items() if first not in named}
        mapped = machine_mapped()
        unnamed = {first: inodes for first, inodes in unnamed.items() if mapped.isdisjoint(inodes)}
        for inodes in unnamed.values():
            for inode in inodes:
                self._unpublish(inode)
        mapped = machine_mapped()  # (again: a process that met one before its entry went)
        evicted = 0
        for inodes in unnamed.values():
            file = self.by_inode[inodes[0]]
            if mapped.isdisjoint(inodes):
                self._forget_file(file, inodes)
                evicted += 1
            else:
                for inode in inodes:
                    self._publish(inode, file)
        self.counts["files_evicted"] += evicted
        if evicted:
            self._retry_no_room()
        else:
            self._evict_idle = self._forgotten
        return evicted

    def _retry_no_room(self) -> None:
        """The files that found no room before are read again when next met:
        by a process's tables, or (their entry gone) a walk's ask."""
        for inode, key in self.no_room.items():
            self.by_inode.pop(inode, None)
            self.files.pop(key, None)
            if self.vma:
                self.program.delete_entry("unwind_files", file_key(kernel_file_key(inode)))
        self.no_room.clear()

    def _unpublish(self, inode: tuple[int, int]) -> None:
        """The file's unwind_files entry gone: a walk that meets it asks again."""
        key = kernel_file_key(inode)
        if self.vma and key in self.published:
            self.program.delete_entry("unwind_files", file_key(key))
            self.published.discard(key)

    def _forget_file(self, file: MappedFile, inodes: list[tuple[int, int]]) -> None:
        """An evicted file: its rows and page entries free, and no trace of
        it left (a process that maps it again has it read anew)."""
        self.rows_room.give(file.first, file.count)
        self.pages_room.give(file.pages, file.page_count)
        for inode in inodes:
            del self.by_inode[inode]
        for key in [key for key, known in self.files.items() if known is file]:
            del self.files[key]

    def _entries(self, pid: int, mappings: list[Mapping]) -> list[tuple[int, ...]]:
        """The process's mappings as unwind_maps' rows (UNWIND_MAP_DTYPE's
        fields), by start. A mapping
        whose file has no rows here (none, or it could not be opened) is
        left out where the kernel looks mappings up itself (UNWIND_VMA): it
        may know the file's rows (the file server's), else it steps by frame
        pointers there, as it does at a mapping without rows."""
        entries: list[tuple[int, ...]] = []
        # the files read smallest code first: where the rows cannot all fit,
        # the many small files (a program's own, an interpreter's extensions)
        # are written, and the few largest step by frame pointers
        files = {id(m): self._file(pid, m) for m in sorted(mappings, key=_code_size)}
        for mapping in sorted(mappings, key=lambda m: m.start):
            file = files[id(mapping)]
            segment = _segment_of(file.segments, mapping.offset)
            if segment is None or not file.count:
                if not self.vma:  # frame pointers there
                    entries.append((mapping.start, mapping.end, 0, 0, 0, 0, 0, 0, 0, 0, 0))
                continue
            bias = mapping.start - mapping.offset + segment.offset - segment.vaddr
            entries.append((mapping.start, mapping.end, bias % (1 << 64), file.first,
                            file.count, file.pages, file.page_count, file.page_base, 0,
                            file.number, 0))  # fmt: skip
        return entries

    def load(self, pid: int, new: bool = True) -> bool:
        """Write ``pid``'s mappings (and any file's rows not yet written),
        if they changed: False when the process is gone or its mappings did
        not fit. ``new``: a process the trace starts to follow (it has no
        entry yet); else one that asked or was written before, whose entry
        is written only over the one there is: an exit or exec between the
        read of its maps and the write deleted it in the kernel, and the
        maps read are then no process's (a new program asks anew)."""
        begun = time.monotonic()
        try:
            return self._write(pid, new)
        finally:
            if self.files_gen != self._told_gen:
                self.publish_done()
            self._took(begun)

    def _write(self, pid: int, new: bool) -> bool:
        if self.vma and not PROCESS_TABLES:
            return False  # every walk finds its mappings in the kernel (the bench's switch)
        mappings = exec_mappings(pid)
        if not mappings:
            return False
        if self.written.get(pid) == tuple(mappings):
            return True
        entries = self._entries(pid, mappings)
        with self._lock:  # (blocks and the files they name: an eviction reads them)
            block = self._take(len(entries))
            if block is None:
                self.counts["processes_not_fitting"] += 1
                return False
            rows = b"".join(_MAP_ENTRY.pack(*entry) for entry in entries)
            self.program.write_array("unwind_maps", block[0], rows)
            self.block_rows[block] = frozenset(entry[3] for entry in entries if entry[4])
            if not self.program.set_row("unwind_procs", pid, (block[0], len(entries), 0, 0),
                                        only_existing=not new):  # fmt: skip
                # its entry is gone (an exit or exec after its maps were read): the
                # block, never named, is free; its old one retired; a new program asks
                self._retire(block, at_once=True)
                self.forget(pid)
                return False
            old = self.blocks.pop(pid, None)
            if old is not None:
                self._retire(old)
            self.blocks[pid], self.written[pid] = block, tuple(mappings)
        if self.written_hook is not None:
            self.written_hook(pid)
        return True

    def _take(self, size: int) -> tuple[int, int] | None:
        first = self.maps_room.take(size)  # (0 rows: never freed, nor retired)
        return None if first is None else (first, size)

    def table_counts(self) -> dict[str, int]:
        """The files whose rows are written, the rows, and what had none or
        no room: files without CFI, files and processes that did not fit."""
        keys = ("files", "files_without_cfi", "files_failed", "files_not_fitting",
                "rows_not_fitting", "processes_not_fitting", "processes_failed",
                "files_unopened", "files_evicted")  # fmt: skip
        return {"rows": self.rows_room.used, "rows_room": self.rows_total,
                "memory_bytes": self.memory_bytes,
                **{key: self.counts[key] for key in keys}}  # fmt: skip

    def refresh(self) -> None:
        """Write again the mappings of each process whose mappings changed
        (a library loaded or unloaded); forget those that are gone; free
        the retired blocks no entry names."""
        for pid in list(self.blocks):
            if not self.load(pid, new=False) and not Path(f"/proc/{pid}").exists():
                self.forget(pid)
        self.sweep()

    def forget(self, pid: int) -> None:
        """``pid`` is gone (or exec'd: the kernel deleted its entry)."""
        with self._lock:
            block = self.blocks.pop(pid, None)
            if block is not None:
                self._retire(block)
                self._forgotten += 1
            self.written.pop(pid, None)

    def _retire(self, block: tuple[int, int], at_once: bool = False) -> None:
        """A block no process of ours names now: free (``at_once``: no entry
        ever named it), or retired until no entry does."""
        if not block[1]:
            return
        if at_once:
            self._free_block(block)
        else:
            self.retired[block] = 0

    def _free_block(self, block: tuple[int, int]) -> None:
        self.maps_room.give(*block)
        self.block_rows.pop(block, None)

    def sweep(self, at_once: bool = False) -> None:
        """Free the retired blocks that two sweeps in a row (a second apart)
        found no entry of unwind_procs naming: a process forked from one
        that had the block holds it until its own are written, or it ends,
        and a fork that read an entry just as it was replaced or deleted has
        written its own by the next sweep. ``at_once`` (an eviction, which
        needs their files' rows now): those one read finds unnamed, at the
        risk the two sweeps guard against: a fork in that read's moment may
        keep a freed block (its walks then read another process's rows,
        within the tables' bounds, until its own are written)."""
        with self._lock:
            if not self.retired:
                return
            _, entries = self.program.read_table("unwind_procs", "<u4", UNWIND_PROC_DTYPE)
            named = set(entries["first"][entries["count"] > 0].tolist())  # not the empty asks
            for block in list(self.retired):
                unnamed = 0 if block[0] in named else self.retired[block] + 1
                if unnamed == 2 or (at_once and unnamed):
                    del self.retired[block]
                    self._free_block(block)
                else:
                    self.retired[block] = unnamed

    def _free_unnamed(self) -> None:
        """(an eviction) The blocks of the processes gone, and the retired
        ones no entry names now, free."""
        for pid in list(self.blocks):
            if not exec_mappings(pid):  # gone, or a zombie (no maps)
                self.forget(pid)
        self.sweep(at_once=True)

    def tables_wanted(self, pids: list[int]) -> None:
        """Processes whose tables the kernel asked for (their first call
        wanting a stack, or a dlopen): written, and each continued if the
        kernel stopped it."""
        for pid in pids:
            covered = self.holds.stops(pid) if self.holds is not None else 0
            if not self._in_force(pid):
                self.forget(pid)  # a new image: written anew
            try:
                self.load(pid, new=False)  # over the entry it asked with
            except Exception as exc:  # one process's failure is that process's alone
                self._failed_process(pid, exc)
            finally:
                if self.holds is not None:  # the stops made before its maps were read
                    self.holds.release(pid, covered)

    def _in_force(self, pid: int) -> bool:
        """The kernel holds ``pid``'s tables as written (it asks again after a
        dlopen, and they stay in force until the new ones replace them); not
        after an exec, or at its first call, when it has none or an empty
        entry."""
        block = self.blocks.get(pid)
        row = self.program.row("unwind_procs", pid)
        return block is not None and row is not None and tuple(row[:2]) == block and not row[2]

    def _failed_process(self, pid: int, exc: Exception) -> None:
        """Tables that could not be written for ``pid``: counted, said once
        a trace, and its stacks walked by frame pointers."""
        self.counts["processes_failed"] += 1
        if self.counts["processes_failed"] == 1:
            print(f"mtrace-live: warning: the unwind tables of pid {pid} could not be written "
                  f"({type(exc).__name__}: {exc}); its stacks, and those of any other process "
                  "this befalls (counted in the summary), are walked by frame pointers",
                  file=sys.stderr, flush=True)  # fmt: skip
