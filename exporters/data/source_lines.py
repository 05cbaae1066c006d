"""file:line of link-time addresses in one ELF file's DWARF, read only as
far as the addresses asked for need, and kept on disk by build-id.

``LineIndex`` finds an address's unit by its ranges (.debug_aranges), then
reads that unit's line table, once (probes/elf/line_table.py, with libdw).
A libc's debug file has some 2,000 units; naming a stack's frames reads a
handful. pyelftools took 0.2 s for one of libpython's units, libdw a
millisecond or two.

The cache: each file's ranges and the units read so far, by build-id
(``MTRACE_LIVE_LINE_CACHE``, default /var/cache/mtrace-live/lines; ``off``
disables it), so that the next trace of the same program opens no DWARF at
all for the units it has read before. It is only ever a saving: a
directory that cannot be written, or a file that cannot be read back,
leaves the lines to be read from the DWARF, without a word.
"""

from __future__ import annotations

import bisect
import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from mtrace_live.probes.elf.facts import private_file
from mtrace_live.probes.elf.lazy import lazy_module
from mtrace_live.probes.elf.line_table import RANGES, LineTables, UnitRows, no_rows

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # (at the first use: probes/elf/lazy.py)

DEFAULT_CACHE = Path("/var/cache/mtrace-live/lines")
CACHE_FORMAT = 1
KEEP_FILES = 256  # the files whose lines are kept, the least recently written dropped


def line_cache_dir() -> Path | None:
    value = os.environ.get("MTRACE_LIVE_LINE_CACHE", "")
    if value == "off":
        return None
    return Path(value) if value else DEFAULT_CACHE


def line_key(build_id: str | None, info_size: int, line_size: int, aranges: bool) -> str | None:
    """The cache's key for a file's lines: its build-id, and the layout of
    its DWARF (a unit is kept by its offset, and the same build's DWARF may
    be laid out anew, by dwz or objcopy, in another file); None without a
    build-id."""
    if not build_id:
        return None
    return f"{build_id}-{info_size:x}-{line_size:x}-{'a' if aranges else 'u'}"


class LineCache:
    """Files' line tables on disk, by build-id: a directory per file
    (``<key>.v1``, the key ``line_key``'s) holding its ranges
    (``ranges.npz``) and each unit read so far (``<unit offset>.npz``). The
    archives' checksums tell a damaged file from a good one."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory

    def _folder(self, ident: str | None) -> Path | None:
        if self.directory is None or not ident or not ident.replace("-", "").isalnum():
            return None
        return self.directory / f"{ident}.v{CACHE_FORMAT}"

    def _read(self, ident: str | None, name: str) -> dict[str, np.ndarray]:
        """The arrays kept as ``name``; none where there is no such file,
        or one that is damaged or that another user could have written."""
        folder = self._folder(ident)
        if folder is None:
            return {}
        path = folder / name
        try:
            if not (path.is_file() and private_file(path) and private_file(folder)):
                return {}
            with open(path, "rb") as stream, np.load(stream, allow_pickle=False) as kept:
                return {key: kept[key] for key in kept.files}
        except Exception:  # whatever a damaged file makes numpy raise: the cache is only a saving
            return {}

    def ranges(self, ident: str | None) -> np.ndarray | None:
        ranges = self._read(ident, "ranges.npz").get("ranges")
        if ranges is None or ranges.dtype != RANGES or ranges.ndim != 2 or ranges.shape[1] != 3:
            return None
        return ranges

    def unit(self, ident: str | None, unit: int) -> UnitRows | None:
        kept = self._read(ident, f"{unit:x}.npz")
        if set(kept) != {"addresses", "places", "names"} or kept["names"].dtype != np.uint8:
            return None
        try:
            names = kept["names"].tobytes().decode().split("\0")[:-1]
        except UnicodeDecodeError:
            return None
        rows = UnitRows(kept["addresses"], kept["places"], tuple(names))
        return rows if rows.valid() else None

    def store_ranges(self, ident: str | None, ranges: np.ndarray) -> None:
        self._keep(ident, "ranges.npz", {"ranges": ranges})

    def store_unit(self, ident: str | None, unit: int, rows: UnitRows) -> None:
        names = "".join(f"{name}\0" for name in rows.names).encode()
        self._keep(ident, f"{unit:x}.npz", {"addresses": rows.addresses, "places": rows.places,
                                            "names": np.frombuffer(names, np.uint8)})  # fmt: skip

    def _keep(self, ident: str | None, name: str, arrays: dict[str, np.ndarray]) -> None:
        """Write ``name`` in the file's folder atomically, only in a folder
        no other user may write; where that fails (a read-only or full
        disk), the cache goes without it. A new folder makes room: the
        KEEP_FILES most recently written are kept."""
        import tempfile  # (only where lines are written: naming, after the trace)

        folder = self._folder(ident)
        if folder is None or self.directory is None:
            return
        scratch = None
        try:
            new = not folder.exists()
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            folder.mkdir(mode=0o700, exist_ok=True)
            if not (private_file(self.directory) and private_file(folder)):
                return
            with tempfile.NamedTemporaryFile(dir=folder, suffix=".tmp", delete=False) as out:
                scratch = Path(out.name)
                np.savez(out, allow_pickle=False, **arrays)
            os.replace(scratch, folder / name)
            scratch = None
            if new:
                self._prune()
        except OSError:
            if scratch is not None:
                with contextlib.suppress(OSError):
                    scratch.unlink()

    def _prune(self) -> None:
        """The folders past the KEEP_FILES most recently written removed."""
        import shutil  # (at a trace's end: it imports bz2 and lzma)

        assert self.directory is not None
        folders = [(entry.stat().st_mtime, entry) for entry in self.directory.iterdir()
                   if entry.is_dir() and entry.name.endswith(f".v{CACHE_FORMAT}")]  # fmt: skip
        for _, stale in sorted(folders, key=lambda item: -item[0])[KEEP_FILES:]:
            with contextlib.suppress(OSError):
                shutil.rmtree(stale)


class LineIndex:
    """file:line of link-time addresses in one ELF file's DWARF. libdw
    opens the file at the first unit the cache does not hold, and keeps
    it open; each unit is read the first time an address in it is asked
    for. Without .debug_aranges (``aranges`` False) every unit is read, once,
    at the first question, unless the cache holds the ranges."""

    def __init__(self, path: Path, key: str | None = None, aranges: bool = True,
                 cache: LineCache | None = None) -> None:  # fmt: skip
        self.path = path
        self.key = key  # in the cache (line_key); None: not kept
        self._aranges = aranges
        self._cache = cache if cache is not None else LineCache(line_cache_dir())
        self._tables: LineTables | None = None
        self._ranges: list[tuple[int, int, int]] | None = None  # (start, end, unit), by start
        self._starts: list[int] = []
        self._units: dict[int, UnitRows] = {}
        self._unkept: set[int] = set()  # units read with the ranges, not in the cache yet
        self._failed = False

    def _open(self) -> LineTables | None:
        if self._tables is None and not self._failed:
            try:
                self._tables = LineTables(self.path)
            except (OSError, ValueError):
                self._failed = True
        return self._tables

    def _load_ranges(self) -> list[tuple[int, int, int]]:
        if self._ranges is None:
            ranges = self._cache.ranges(self.key)
            if ranges is None:
                tables = self._open()
                if tables is None:
                    self._ranges = []  # no lines: the file cannot be read
                    return self._ranges
                ranges, read = tables.ranges(self._aranges)
                self._units.update(read)
                self._unkept.update(read)
                self._cache.store_ranges(self.key, ranges)
            found = [(start, end, unit) for start, end, unit in ranges.tolist()]
            self._starts = [start for start, _, _ in found]
            self._ranges = found
        return self._ranges

    def _unit_rows(self, unit: int) -> UnitRows:
        found = self._units.get(unit)
        if found is None:
            found = self._cache.unit(self.key, unit)
            if found is None:
                tables = self._open()
                found = tables.unit(unit) if tables is not None else no_rows()
                if tables is not None:
                    self._cache.store_unit(self.key, unit, found)
            self._units[unit] = found
        elif unit in self._unkept:
            self._unkept.discard(unit)
            self._cache.store_unit(self.key, unit, found)
        return found

    def location(self, vaddr: int) -> str | None:
        ranges = self._load_ranges()
        index = bisect.bisect_right(self._starts, vaddr) - 1
        if index < 0 or vaddr >= ranges[index][1]:
            return None
        return self._unit_rows(ranges[index][2]).location(vaddr)
