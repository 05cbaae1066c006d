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
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from mtrace_live.exporters.data.processes import proc_dir
from mtrace_live.probes.elf.cfi import ROW, CfiTable, read_cfi
from mtrace_live.probes.elf.file import ELF_FAILURES, LoadSegment, build_id, load_segments, open_elf
from mtrace_live.probes.elf.maps import Mapping, read_maps
from mtrace_live.probes.errors import NotElfError, TargetError
from mtrace_live.probes.program import part_constants
from mtrace_live.probes.records import FRAME_DEPTH, UNWIND_MAP_DTYPE, UNWIND_PROC_DTYPE

from .alloc_probes import exported_offset
from .bpf_backend import BpfProgram
from .bpf_cache import private_file
from .holds import Holds

# The unwinder's constants, as unwind.bpf.c defines them (read from it):
# its tables' default sizes (unwind_rows 1 M rows, 12 MiB: the libc takes
# 28,000; unwind_maps 64 Ki, 3 MiB; unwind_pages 1 M entries, 4 MiB: an
# entry per 4 KiB of code), its page index's shift, unwind_progs' slots.
_UNWIND = part_constants("unwind.bpf.c")
DEFAULT_ROWS, DEFAULT_MAPS, DEFAULT_PAGES = (
    _UNWIND["UNWIND_ROWS"], _UNWIND["UNWIND_MAPS"], _UNWIND["UNWIND_PAGES"])  # fmt: skip
DEFAULT_CACHE = Path("/var/cache/mtrace-live/cfi")
CACHE_FORMAT = 2  # 2: rows read by probes/elf/cfi_rows.c (malformed entries as CFA_OTHER)
STEP, RESUME_ALLOC, RESUME_LOCK = (
    _UNWIND[f"UNWIND_{slot}"] for slot in ("STEP", "RESUME_ALLOC", "RESUME_LOCK"))  # fmt: skip


def unwind_defines(rows: int = DEFAULT_ROWS, maps: int = DEFAULT_MAPS,
                   pages: int = DEFAULT_PAGES) -> dict[str, int]:  # fmt: skip
    """The program's switches for unwinding by CFI."""
    return {"WITH_UNWIND": 1, "UNWIND_ROWS": rows, "UNWIND_MAPS": maps, "UNWIND_PAGES": pages,
            "FRAME_DEPTH": FRAME_DEPTH}  # fmt: skip


DLOPEN_FUNCTIONS = ("dlopen", "dlmopen")  # in the libc since glibc 2.34


def attach_dlopen(program: BpfProgram, libc: Path, pid: int = -1) -> list[str]:
    """The return probe of the libc's dlopen and dlmopen (a library loaded
    while a process is traced gets its rows before its code calls): the
    functions probed (none in a libc older than 2.34, where libdl has them;
    there the mappings are read again each second)."""
    probed: list[str] = []
    offsets = {name: exported_offset(libc, name) for name in DLOPEN_FUNCTIONS}
    for name, offset in offsets.items():
        if offset is not None and offset not in [offsets[p] for p in probed]:
            program.attach_uprobe(libc, offset, "unwind_dlopen_entry", pid)
            program.attach_uretprobe(libc, offset, "unwind_dlopen_return", pid)
            probed.append(name)
    return probed


def rows_cache_dir() -> Path | None:
    value = os.environ.get("MTRACE_LIVE_CFI_CACHE", "")
    if value == "off":
        return None
    return Path(value) if value else DEFAULT_CACHE


class RowCache:
    """Files' rows on disk, by build-id."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory

    def _path(self, ident: str) -> Path | None:
        if self.directory is None or not ident.isalnum():
            return None
        return self.directory / f"{ident}.v{CACHE_FORMAT}.npy"

    def load(self, ident: str | None) -> np.ndarray | None:
        path = self._path(ident) if ident else None
        if path is None:
            return None
        with contextlib.suppress(OSError, ValueError):
            if private_file(path) and private_file(path.parent):
                rows = np.load(path, allow_pickle=False)
                if rows.dtype == ROW and rows.ndim == 1:
                    return np.asarray(rows, dtype=ROW)
        return None

    def store(self, ident: str | None, rows: np.ndarray) -> None:
        path = self._path(ident) if ident else None
        if path is None:
            return
        with contextlib.suppress(OSError):
            path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            scratch = path.with_suffix(f".{os.getpid()}.tmp")
            with open(scratch, "wb") as out:
                np.save(out, rows, allow_pickle=False)
            os.replace(scratch, path)


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


PAGE_SHIFT = _UNWIND["UNWIND_PAGE_SHIFT"]


def page_index(rows: np.ndarray) -> tuple[int, np.ndarray]:
    """(the first page's address, for each page from it to the last row's,
    the index of the row in force at the page's start): a search for an
    address then starts within its page's rows."""
    base = int(rows["pc"][0]) >> PAGE_SHIFT << PAGE_SHIFT
    count = ((int(rows["pc"][-1]) - base) >> PAGE_SHIFT) + 1
    starts = base + (np.arange(count, dtype=np.uint64) << PAGE_SHIFT)
    index = np.searchsorted(rows["pc"].astype(np.uint64), starts, side="right") - 1
    return base, np.clip(index, 0, None).astype(np.uint32)


def exec_mappings(pid: int) -> list[Mapping]:
    """``pid``'s executable mappings of files; [] when it is gone."""
    try:
        mappings = read_maps(proc_dir(pid))
    except OSError:
        return []
    return [m for m in mappings if m.executable and m.inode[1] != 0 and m.path]


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


def _segment_of(segments: tuple[LoadSegment, ...], offset: int) -> LoadSegment | None:
    """The executable segment holding file ``offset``."""
    for segment in segments:
        if segment.executable and segment.offset <= offset < segment.offset + segment.filesz:
            return segment
    return None


class UnwindTables:
    """The tables of one trace program; ``counts`` says what did not fit."""

    def __init__(self, program: BpfProgram, rows: int = DEFAULT_ROWS, maps: int = DEFAULT_MAPS,
                 pages: int = DEFAULT_PAGES, cache: RowCache | None = None,
                 holds: Holds | None = None,
                 written: Callable[[int], None] | None = None) -> None:  # fmt: skip
        """``holds``: continues a process the kernel stopped until its
        tables were written (one mtrace-live started: tracer/holds.py);
        ``written``: told each process whose mappings were written."""
        self.program = program
        self.holds = holds
        self.written_hook = written
        self.capacity = rows
        self.cache = cache if cache is not None else RowCache(rows_cache_dir())
        self.files: dict[object, MappedFile] = {}  # by build-id, else (device, inode)
        self.by_inode: dict[tuple[int, int], MappedFile] = {}
        self.next_row = 0
        self.page_capacity, self.next_page = pages, 0
        self.free: list[tuple[int, int]] = [(0, maps)]  # blocks of unwind_maps: (first, size)
        # blocks no process of ours names, which a forked one's entry may,
        # each with how many sweeps in a row found no entry naming it
        self.retired: dict[tuple[int, int], int] = {}
        self.blocks: dict[int, tuple[int, int]] = {}  # pid -> its block
        self.written: dict[int, tuple[Mapping, ...]] = {}  # pid -> the mappings written
        self.counts: Counter[str] = Counter()
        self.load_s = 0.0  # time spent writing tables

    def _file(self, pid: int, mapping: Mapping) -> MappedFile:
        known = self.by_inode.get(mapping.inode)
        if known is not None:
            return known
        path = mapped_file(pid, mapping)
        if path is None:
            return self._no_rows(mapping, "the mapped file cannot be opened")
        try:
            with open_elf(path) as elf:
                ident, segments = build_id(elf), tuple(load_segments(elf))
        except (TargetError, NotElfError, *ELF_FAILURES) as exc:
            return self._no_rows(mapping, str(exc))
        key: object = ident or mapping.inode
        known = self.files.get(key)
        if known is None:
            try:
                known = self._load(path, ident, segments)
            except Exception as exc:  # one file's failure is that file's alone
                self.counts["files_failed"] += 1
                print(f"mtrace-live: warning: {mapping.path}: its unwind tables could not be "
                      f"built ({type(exc).__name__}: {exc}); its frames are walked by frame "
                      "pointers", file=sys.stderr, flush=True)  # fmt: skip
                known = MappedFile(0, 0, segments, f"its tables could not be built ({exc})")
            self.files[key] = known
        self.by_inode[mapping.inode] = known
        return known

    def _no_rows(self, mapping: Mapping, why: str) -> MappedFile:
        found = self.by_inode[mapping.inode] = MappedFile(0, 0, (), why)
        return found

    def _load(self, path: Path, ident: str | None, segments: tuple[LoadSegment, ...]) -> MappedFile:
        rows = self.cache.load(ident)
        problem = ""
        if rows is None:
            table: CfiTable = read_cfi(path)
            rows, problem = table.rows, table.problem
            if not problem:
                self.cache.store(ident, rows)
        if problem or len(rows) == 0:
            self.counts["files_without_cfi"] += 1
            return MappedFile(0, 0, segments, problem or "no call-frame information")
        base, pages = page_index(rows)
        if (self.next_row + len(rows) > self.capacity or
                self.next_page + len(pages) > self.page_capacity):  # fmt: skip
            self.counts["files_not_fitting"] += 1
            self.counts["rows_not_fitting"] += len(rows)
            return MappedFile(0, 0, segments, "no room left in the unwind rows")
        first, first_page = self.next_row, self.next_page
        self.program.write_array("unwind_rows", first, rows)
        self.program.write_array("unwind_pages", first_page, pages)
        self.next_row += len(rows)
        self.next_page += len(pages)
        self.counts["files"] += 1
        return MappedFile(first, len(rows), segments, "", first_page, len(pages), base)

    def _entries(self, pid: int, mappings: list[Mapping]) -> np.ndarray:
        entries = np.zeros(len(mappings), dtype=UNWIND_MAP_DTYPE)
        for i, mapping in enumerate(sorted(mappings, key=lambda m: m.start)):
            file = self._file(pid, mapping)
            entries[i]["start"], entries[i]["end"] = mapping.start, mapping.end
            segment = _segment_of(file.segments, mapping.offset)
            if segment is None or not file.count:
                continue  # frame pointers there
            bias = mapping.start - mapping.offset + segment.offset - segment.vaddr
            entries[i]["bias"] = bias % (1 << 64)
            entries[i]["first"], entries[i]["count"] = file.first, file.count
            entries[i]["pages"], entries[i]["page_count"] = file.pages, file.page_count
            entries[i]["page_base"] = file.page_base
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
            self.load_s += time.monotonic() - begun

    def _write(self, pid: int, new: bool) -> bool:
        mappings = exec_mappings(pid)
        if not mappings:
            return False
        if self.written.get(pid) == tuple(mappings):
            return True
        entries = self._entries(pid, mappings)
        block = self._take(len(entries))
        if block is None:
            self.counts["processes_not_fitting"] += 1
            return False
        self.program.write_array("unwind_maps", block[0], entries)
        if not self.program.set_row("unwind_procs", pid, (block[0], len(entries), 0, 0),
                                    only_existing=not new):  # fmt: skip
            # its entry is gone (an exit or exec after its maps were read): the
            # block, never named, is free; its old one retired; a new program asks
            self.free.append(block)
            self.forget(pid)
            return False
        old = self.blocks.pop(pid, None)
        if old is not None:
            self.retired[old] = 0
        self.blocks[pid], self.written[pid] = block, tuple(mappings)
        if self.written_hook is not None:
            self.written_hook(pid)
        return True

    def _take(self, size: int) -> tuple[int, int] | None:
        for i, (first, room) in enumerate(self.free):
            if room >= size:
                if room == size:
                    del self.free[i]
                else:
                    self.free[i] = (first + size, room - size)
                return first, size
        return None

    def table_counts(self) -> dict[str, int]:
        """The files whose rows are written, the rows, and what had none or
        no room: files without CFI, files and processes that did not fit."""
        keys = ("files", "files_without_cfi", "files_failed", "files_not_fitting",
                "rows_not_fitting", "processes_not_fitting", "processes_failed")  # fmt: skip
        return {"rows": self.next_row, **{key: self.counts[key] for key in keys}}

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
        block = self.blocks.pop(pid, None)
        if block is not None:
            self.retired[block] = 0
        self.written.pop(pid, None)

    def sweep(self) -> None:
        """Free the retired blocks that two sweeps in a row (a second apart)
        found no entry of unwind_procs naming: a process forked from one
        that had the block holds it until its own are written, or it ends,
        and a fork that read an entry just as it was replaced or deleted has
        written its own by the next sweep."""
        if not self.retired:
            return
        _, entries = self.program.read_table("unwind_procs", "<u4", UNWIND_PROC_DTYPE)
        named = set(entries["first"][entries["count"] > 0].tolist())  # not the empty asks
        for block in list(self.retired):
            unnamed = 0 if block[0] in named else self.retired[block] + 1
            if unnamed == 2:
                del self.retired[block]
                self.free.append(block)
            else:
                self.retired[block] = unnamed

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
