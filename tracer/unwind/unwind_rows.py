"""A mapped file's unwind rows, as the CFI unwinder's tables hold them
(probes/bpf/unwind.bpf.c): read from its call-frame information
(probes/elf/cfi.py) or from the cache kept by build-id, indexed by page,
and the kernel's entry of unwind_files that names them. Shared by the
trace's tables (tracer/unwind/unwind_tables.py) and the file server
(tracer/unwind/file_server.py), a process of its own that imports nothing of bcc.

The cache: a file's rows on disk by build-id (``MTRACE_LIVE_CFI_CACHE``,
default /var/cache/mtrace-live/cfi; ``off`` disables it): reading libc's
takes about 0.5 s, loading the kept rows a millisecond.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from mtrace_live.probes.elf.cfi import ROW, CfiTable, cfi_of
from mtrace_live.probes.elf.facts import private_file
from mtrace_live.probes.elf.file import LoadSegment
from mtrace_live.probes.program import part_constants
from mtrace_live.probes.records import UNWIND_FILE_DTYPE, UNWIND_FILE_KEY_DTYPE

if TYPE_CHECKING:
    from elftools.elf.elffile import ELFFile

DEFAULT_CACHE = Path("/var/cache/mtrace-live/cfi")
CACHE_FORMAT = 2  # 2: rows read by probes/elf/cfi_rows.c (malformed entries as CFA_OTHER)
UNWIND_PAGE_SHIFT = part_constants("unwind.bpf.c")["UNWIND_PAGE_SHIFT"]


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
        # (a damaged header: ValueError, SyntaxError from its literal; an
        # empty or cut file: EOFError)
        with contextlib.suppress(OSError, ValueError, SyntaxError, EOFError):
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


def rows_of(elf: ELFFile, path: Path, ident: str | None,
            cache: RowCache) -> tuple[np.ndarray, str]:  # fmt: skip
    """The rows of the file open as ``elf`` (from the cache, else read and
    kept there), and what was wrong with its CFI ("" if nothing). Raises
    OSError where the file could not be read."""
    rows = cache.load(ident)
    if rows is not None:
        return rows, ""
    table: CfiTable = cfi_of(elf, path)
    if not table.problem:
        cache.store(ident, table.rows)
    return table.rows, table.problem


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


def file_key(key: tuple[int, int]) -> bytes:
    """unwind_files' key, as the kernel's bytes."""
    return np.array([key], dtype=UNWIND_FILE_KEY_DTYPE).tobytes()


def file_entry(first: int, count: int, pages: int, page_count: int, page_base: int,
               segments: tuple[LoadSegment, ...], number: int = 0) -> bytes:  # fmt: skip
    """unwind_files' entry of a file written: its rows (count 0: none, the
    frames there by frame pointers), its executable segment, its number
    (0: none yet; the trace gives them, exporters/data/file_frames.py)."""
    entry = np.zeros(1, dtype=UNWIND_FILE_DTYPE)
    entry["number"] = number
    segment = next((s for s in segments if s.executable), None)
    if segment is not None and count:
        entry["first"], entry["count"] = first, count
        entry["pages"], entry["page_count"], entry["page_base"] = pages, page_count, page_base
        entry["seg_start"], entry["seg_end"] = segment.offset, segment.offset + segment.filesz
        entry["seg_delta"] = (segment.vaddr - segment.offset) % (1 << 64)
    entry["written"] = 1
    return entry.tobytes()


def with_number(entry: bytes, number: int) -> bytes:
    """unwind_files' ``entry`` with the file's ``number``."""
    fields = np.frombuffer(entry, dtype=UNWIND_FILE_DTYPE).copy()
    fields["number"] = number
    return fields.tobytes()


def entry_segment(entry: np.void) -> tuple[LoadSegment, ...]:
    """The executable segment an entry of unwind_files names."""
    start, end = int(entry["seg_start"]), int(entry["seg_end"])
    if end <= start:
        return ()
    vaddr = (start + int(entry["seg_delta"])) % (1 << 64)
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
