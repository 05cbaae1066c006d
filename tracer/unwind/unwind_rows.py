"""A mapped file's unwind rows, as the CFI unwinder's tables hold them
(probes/bpf/unwind.bpf.c): read from its call-frame information
(probes/elf/cfi.py) or from the cache kept by build-id, indexed by page,
and the kernel's entry of unwind_files that names them. Shared by the
trace's tables (tracer/unwind/unwind_tables.py) and the file server
(tracer/unwind/file_server.py), a process of its own that imports nothing of bcc.

The cache: a file's rows on disk by build-id (``MTRACE_LIVE_CFI_CACHE``,
default /var/cache/mtrace-live/cfi; ``off`` disables it), with their page
index, as the kernel's arrays hold them (``PackedRows``): reading libc's CFI
takes about 0.5 s; loading the kept rows, a millisecond, and writing them
is a copy of memory, with no numpy (a warm start imports none before its
line, docs/performance.md, section 12).
"""

from __future__ import annotations

import contextlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from mtrace_live.probes.elf.cfi import CfiTable, cfi_of
from mtrace_live.probes.elf.facts import private_file
from mtrace_live.probes.elf.file import LoadSegment
from mtrace_live.probes.elf.lazy import lazy_module
from mtrace_live.probes.program import part_constants
from mtrace_live.tracer.bpf.map_table import slot_size, slots

if TYPE_CHECKING:
    import numpy as np
    from elftools.elf.elffile import ELFFile
else:
    np = lazy_module("numpy")  # (at the first use: probes/elf/lazy.py)

DEFAULT_CACHE = Path("/var/cache/mtrace-live/cfi")
# 3: the rows as unwind_rows holds them and their page index, raw (read
# without numpy before the trace is on); 2: rows read by probes/elf/cfi_rows.c
CACHE_FORMAT = 3
UNWIND_PAGE_SHIFT = part_constants("unwind.bpf.c")["UNWIND_PAGE_SHIFT"]
ROW_SIZE, PAGE_SIZE = 12, 4  # unwind_rows' value (ROW), unwind_pages' (a u32)
# a value's place in an array map: its size in whole 8-byte units
ROW_SLOT, PAGE_SLOT = slot_size(ROW_SIZE), slot_size(PAGE_SIZE)
# the cache file's header: magic, rows, page entries, the first page's address
_HEADER = struct.Struct("<8sIIQ")
_MAGIC = b"mtl-cfi\0"


@dataclass(frozen=True)
class PackedRows:
    """A file's rows as the kernel's arrays hold them: ``rows``, each in a
    slot of ROW_SLOT bytes (unwind_rows), ``pages`` the index of the row in
    force at each page's start (a u32 in a slot of PAGE_SLOT, unwind_pages), from the page at
    ``page_base`` on. Written as they are, with no numpy."""

    rows: bytes | memoryview
    pages: bytes | memoryview
    page_base: int

    @property
    def count(self) -> int:
        return len(self.rows) // ROW_SLOT

    @property
    def page_count(self) -> int:
        return len(self.pages) // PAGE_SLOT


NO_ROWS = PackedRows(b"", b"", 0)


def packed(rows: np.ndarray) -> PackedRows:
    """``rows`` (``ROW`` records, by address) and their page index, laid out
    as the kernel's arrays hold them."""
    if not len(rows):
        return NO_ROWS
    base, pages = page_index(rows)
    return PackedRows(slots(rows), slots(pages), base)


def rows_cache_dir() -> Path | None:
    value = os.environ.get("MTRACE_LIVE_CFI_CACHE", "")
    if value == "off":
        return None
    return Path(value) if value else DEFAULT_CACHE


class RowCache:
    """Files' rows on disk, by build-id: a header, the rows, the page index."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory

    def _path(self, ident: str) -> Path | None:
        if self.directory is None or not ident.isalnum():
            return None
        return self.directory / f"{ident}.v{CACHE_FORMAT}.rows"

    def load(self, ident: str | None) -> PackedRows | None:
        path = self._path(ident) if ident else None
        if path is None:
            return None
        with contextlib.suppress(OSError):
            if private_file(path) and private_file(path.parent):
                data = memoryview(path.read_bytes())
                if len(data) < _HEADER.size:
                    return None
                magic, count, page_count, base = _HEADER.unpack_from(data)
                end = _HEADER.size + count * ROW_SLOT
                if magic != _MAGIC or not count or len(data) != end + page_count * PAGE_SLOT:
                    return None  # (damaged, cut or another layout)
                return PackedRows(data[_HEADER.size : end], data[end:], base)
        return None

    def store(self, ident: str | None, rows: PackedRows) -> None:
        path = self._path(ident) if ident else None
        if path is None or not rows.count:
            return
        with contextlib.suppress(OSError):
            path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            scratch = path.with_suffix(f".{os.getpid()}.tmp")
            with open(scratch, "wb") as out:
                out.write(_HEADER.pack(_MAGIC, rows.count, rows.page_count, rows.page_base))
                out.write(rows.rows)
                out.write(rows.pages)
            os.replace(scratch, path)


def rows_of(elf: ELFFile, path: Path, ident: str | None,
            cache: RowCache) -> tuple[PackedRows, str]:  # fmt: skip
    """The rows of the file open as ``elf`` (from the cache, else read and
    kept there), and what was wrong with its CFI ("" if nothing). Raises
    OSError where the file could not be read."""
    rows = cache.load(ident)
    if rows is not None:
        return rows, ""
    table: CfiTable = cfi_of(elf, path)
    if table.problem:
        return NO_ROWS, table.problem
    rows = packed(table.rows)
    cache.store(ident, rows)
    return rows, ""


def page_index(rows: np.ndarray) -> tuple[int, np.ndarray]:
    """(the first page's address, for each page from it to the last row's,
    the index of the row in force at the page's start): a search for an
    address then starts within its page's rows."""
    base = int(rows["pc"][0]) >> UNWIND_PAGE_SHIFT << UNWIND_PAGE_SHIFT
    count = ((int(rows["pc"][-1]) - base) >> UNWIND_PAGE_SHIFT) + 1
    starts = base + (np.arange(count, dtype=np.uint64) << UNWIND_PAGE_SHIFT)
    index = np.searchsorted(rows["pc"].astype(np.uint64), starts, side="right") - 1
    return base, np.clip(index, 0, None).astype(np.uint32)


def kernel_file_key(inode: tuple[int, int]) -> tuple[int, int]:
    """A file's (device, inode) as unwind_files keys it: the device in the
    kernel's own encoding (major << 20 | minor)."""
    device, number = inode
    return (os.major(device) << 20) | os.minor(device), number


def user_inode(key: tuple[int, int]) -> tuple[int, int]:
    """unwind_files' key as stat(2) and /proc/PID/maps give it."""
    device, number = key
    return os.makedev(device >> 20, device & 0xFFFFF), number


# A file larger than this, asked for by a walk, is loaded by the bulk thread:
# its rows take long to read (libLLVM's: a second), and asks for small files
# (a short program's own) do not wait for it.
BIG_FILE = 16 << 20


_FILE_KEY = struct.Struct("<QQ")  # UNWIND_FILE_KEY_DTYPE
# UNWIND_FILE_DTYPE: first, count, pages, page_count, page_base, written,
# seg_start, seg_end, seg_delta, number, pad
_FILE = struct.Struct("<6I3Q2I")
FILE_ENTRY_SIZE = _FILE.size


class FileEntry(NamedTuple):
    """An entry of unwind_files (UNWIND_FILE_DTYPE)."""

    first: int
    rows: int  # (the kernel's ``count``)
    pages: int
    page_count: int
    page_base: int
    written: int
    seg_start: int
    seg_end: int
    seg_delta: int
    number: int
    pad: int = 0

    @classmethod
    def of(cls, raw: bytes) -> FileEntry:
        return cls(*_FILE.unpack_from(raw))

    def raw(self) -> bytes:
        return _FILE.pack(*self)


def file_key(key: tuple[int, int]) -> bytes:
    """unwind_files' key, as the kernel's bytes."""
    return _FILE_KEY.pack(*key)


def file_entry(first: int, count: int, pages: int, page_count: int, page_base: int,
               segments: tuple[LoadSegment, ...], number: int = 0) -> bytes:  # fmt: skip
    """unwind_files' entry of a file written: its rows (count 0: none, the
    frames there by frame pointers), its executable segment, its number
    (0: none yet; the trace gives them, exporters/data/file_frames.py)."""
    segment = next((s for s in segments if s.executable), None)
    if segment is None or not count:
        return FileEntry(0, 0, 0, 0, 0, 1, 0, 0, 0, number).raw()
    delta = (segment.vaddr - segment.offset) % (1 << 64)
    return FileEntry(first, count, pages, page_count, page_base, 1, segment.offset,
                     segment.offset + segment.filesz, delta, number).raw()  # fmt: skip


def with_number(entry: bytes, number: int) -> bytes:
    """unwind_files' ``entry`` with the file's ``number``."""
    return FileEntry.of(entry)._replace(number=number).raw()


def entry_segment(entry: FileEntry) -> tuple[LoadSegment, ...]:
    """The executable segment an entry of unwind_files names."""
    start, end = entry.seg_start, entry.seg_end
    if end <= start:
        return ()
    vaddr = (start + entry.seg_delta) % (1 << 64)
    return (LoadSegment(start, vaddr, end - start, end - start, 0x1),)  # PF_X


EXEC_PATH = 256  # unwind_exec_paths' values: the parent's pid, and the path execve was given


def exec_path(raw: bytes | None) -> Path | None:
    """The program a process exec'd, from its entry of unwind_exec_paths: as
    execve was given it, and a relative one from its parent's working
    directory (the shell's, most often; None if the entry names none)."""
    if not raw:
        return None
    parent = int.from_bytes(raw[:4], "little")
    path = raw[8:].split(b"\0", 1)[0].decode(errors="replace")
    if not path:
        return None
    return Path(path) if path.startswith("/") else Path(f"/proc/{parent}/cwd") / path


def same_file(path: Path, key: tuple[int, int]) -> bool:
    """``path`` is the file of unwind_files' ``key`` (its device and inode)."""
    try:
        status = path.stat()
    except OSError:
        return False
    return status_key(status) == key


def status_key(status: os.stat_result) -> tuple[int, int]:
    """unwind_files' key of the file ``status`` is of."""
    return kernel_file_key((status.st_dev, status.st_ino))
