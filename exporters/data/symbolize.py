"""User-space addresses to module, function and source line, with pyelftools.

``ModuleSymbols`` reads one ELF file once: its function symbols (.symtab,
else .dynsym) and, where DWARF line tables exist, the address-to-line rows.
When the file itself is stripped, its separate debug file is looked for the
way gdb does: by build-id under each debug directory
(``.build-id/ab/cdef....debug``), then by ``.gnu_debuglink`` name beside the
file and under the debug directory. A module's tables are cached by path,
inode and modification time, so every process mapping a library shares them.

``ProcessSymbols`` maps a process's addresses to modules through
/proc/PID/maps, reaching the files through /proc/PID/root, so processes in
other mount namespaces (containers) resolve too. An address no symbol
covers gives the module only; a module that cannot be read gives nothing.
Neither is an error.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from elftools.common.exceptions import DWARFError, ELFError
from elftools.elf.elffile import ELFFile
from mtrace_live.probes.elf.debug import DEBUG_DIRECTORIES, debug_files
from mtrace_live.probes.elf.file import LoadSegment, build_id, debuglink, load_segments, vaddr_at
from mtrace_live.probes.elf.symbols import STT_FUNC, STT_GNU_IFUNC, symbol_table

PAGE = 4096
_FUNCTION_TYPES = frozenset({STT_FUNC, STT_GNU_IFUNC})


@dataclass(frozen=True)
class Symbol:
    module: str  # the file as the process maps it
    function: str | None = None
    offset: int = 0  # from the function's start
    location: str | None = None  # file:line
    # The module's load base and the end of its last mapping: what
    # sp-rtrace's map lines hold (its resolver takes START as the base that
    # an address of a shared object is made relative to).
    span: tuple[int, int] | None = None


class ModuleSymbols:
    """The symbols and line table of one ELF file (addresses are its link-time ones)."""

    def __init__(self, path: Path, debug_directories: Sequence[Path] = DEBUG_DIRECTORIES) -> None:
        self.path = path
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._names: list[str] = []
        self._rows: list[int] = []  # line-table addresses, sorted
        self._places: list[str | None] = []
        self.loads: list[LoadSegment] = []
        self.build_id: str | None = None
        self.debug_file: Path | None = None  # where the names or lines came from, if not path
        self._full_symbols = False  # from a .symtab (static functions too), not .dynsym only
        try:
            with open(path, "rb") as file:
                elf = ELFFile(file)
                self.loads = load_segments(elf)
                self.build_id = build_id(elf)
                self._read_symbols(elf)
                self._read_lines(elf)
                link = debuglink(elf)
        except (OSError, ELFError, DWARFError, ValueError):
            return
        if not self._full_symbols or not self._rows:
            for candidate in debug_files(path, self.build_id, link, debug_directories):
                if self._read_debug_file(candidate):
                    self.debug_file = candidate
                    break

    @property
    def has_lines(self) -> bool:
        return bool(self._rows)

    @property
    def source(self) -> str:
        """Where the names come from, for reading."""
        return f"debug file {self.debug_file}" if self.debug_file else f"{self.path} itself"

    def _read_debug_file(self, candidate: Path) -> bool:
        try:
            with open(candidate, "rb") as file:
                elf = ELFFile(file)
                if self.build_id and build_id(elf) not in (None, self.build_id):
                    return False
                if not self._full_symbols:
                    before = (self._starts, self._ends, self._names)
                    self._starts, self._ends, self._names = [], [], []
                    self._read_symbols(elf)
                    if not self._names:  # nothing better there: keep the exported ones
                        self._starts, self._ends, self._names = before
                if not self._rows:
                    self._read_lines(elf)
        except (OSError, ELFError, DWARFError, ValueError):
            return False
        return bool(self._names or self._rows)

    def _read_symbols(self, elf: ELFFile) -> None:
        found: dict[int, tuple[int, str]] = {}
        for name in (".symtab", ".dynsym"):
            table = symbol_table(elf, name)
            if table is None:
                continue
            for sym in table:
                if sym.type in _FUNCTION_TYPES and sym.value and sym.name:
                    found.setdefault(sym.value, (sym.size, sym.name))
            if found:
                self._full_symbols = name == ".symtab"
                break
        starts = sorted(found)
        for index, start in enumerate(starts):
            size, name = found[start]
            following = starts[index + 1] if index + 1 < len(starts) else start + 1
            self._starts.append(start)
            self._ends.append(start + size if size else following)  # no size: up to the next
            self._names.append(name)

    def _read_lines(self, elf: ELFFile) -> None:
        if not elf.has_dwarf_info():
            return
        dwarf = elf.get_dwarf_info()
        if not dwarf.has_debug_info:
            return
        rows: dict[int, str | None] = {}  # None: a sequence ended here, no line until the next
        for unit in dwarf.iter_CUs():
            program = dwarf.line_program_for_CU(unit)
            if program is None:
                continue
            files = program["file_entry"]
            base = 1 if program["version"] < 5 else 0
            for entry in program.get_entries():
                state = entry.state
                if state is None:
                    continue
                if state.end_sequence:
                    rows.setdefault(state.address, None)
                    continue
                index = state.file - base
                name = (
                    files[index].name.decode(errors="replace") if 0 <= index < len(files) else "?"
                )
                rows[state.address] = f"{os.path.basename(name)}:{state.line}"  # the last row wins
        self._rows = sorted(rows)
        self._places = [rows[address] for address in self._rows]

    def lookup(self, vaddr: int) -> tuple[str | None, int, str | None]:
        """(function, offset into it, file:line) for a link-time address."""
        function, offset = None, 0
        index = bisect.bisect_right(self._starts, vaddr) - 1
        if index >= 0 and vaddr < self._ends[index]:
            function, offset = self._names[index], vaddr - self._starts[index]
        location = None
        row = bisect.bisect_right(self._rows, vaddr) - 1
        if row >= 0 and function is not None:
            location = self._places[row]
        return function, offset, location

    def span(self, bias: int) -> tuple[int, int] | None:
        """Loaded at ``bias``: (base, end). The base is where the first
        loadable page lies, which for a shared object or a PIE (first
        segment at address 0) is the bias itself, as sp-rtrace's resolver
        expects; for a fixed-address executable, its first segment's page."""
        if not self.loads:
            return None
        first = min(load.vaddr for load in self.loads) & ~(PAGE - 1)
        last = max(load.vaddr + load.memsz for load in self.loads)
        return bias + first, bias + ((last + PAGE - 1) & ~(PAGE - 1))

    def vaddr(self, file_offset: int) -> int | None:
        """The link-time address of a byte at this file offset."""
        return vaddr_at(self.loads, file_offset)


_CACHE: dict[tuple[str, int, int], ModuleSymbols] = {}


def module_symbols(
    path: Path, debug_directories: Sequence[Path] = DEBUG_DIRECTORIES
) -> ModuleSymbols:
    """One ModuleSymbols per file (by inode and mtime), read once."""
    try:
        stat = os.stat(path)
        key = (str(path), stat.st_ino, stat.st_mtime_ns)
    except OSError:
        key = (str(path), 0, 0)
    found = _CACHE.get(key)
    if found is None:
        found = _CACHE[key] = ModuleSymbols(path, debug_directories)
    return found


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    offset: int
    path: str  # as the process sees it
    executable: bool = True


class ProcessSymbols:
    """Symbolizes addresses of one process (a snapshot of its maps)."""

    def __init__(self, pid: int, debug_directories: Sequence[Path] = DEBUG_DIRECTORIES,
                 saved: Sequence[Mapping] | None = None) -> None:  # fmt: skip
        """``saved``: the file mappings as recorded (a record set's
        user_maps), instead of reading /proc/PID/maps."""
        self.pid = pid
        self.debug_directories = debug_directories
        self.root = Path(f"/proc/{pid}/root")
        self.mappings: list[Mapping] = []
        self._file_maps: list[Mapping] = []  # every mapping of a file, executable or not
        if saved is not None:
            self._file_maps = list(saved)
            self.mappings = sorted((m for m in saved if m.executable), key=lambda m: m.start)
            self._starts = [m.start for m in self.mappings]
            return
        try:
            text = Path(f"/proc/{pid}/maps").read_text(encoding="utf-8", errors="replace")
        except OSError:
            text = ""
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or not fields[5].startswith("/"):
                continue
            start, end = (int(part, 16) for part in fields[0].split("-"))
            mapping = Mapping(start, end, int(fields[2], 16), fields[5], "x" in fields[1])
            self._file_maps.append(mapping)
            if "x" in fields[1]:
                self.mappings.append(mapping)
        self._starts = [m.start for m in self.mappings]

    def modules(self) -> list[Mapping]:
        return list(self.mappings)

    @property
    def file_mappings(self) -> list[Mapping]:
        """Every mapping of a file, executable or not (a module's load base
        is its lowest)."""
        return list(self._file_maps)

    def resolve(self, address: int) -> Symbol | None:
        index = bisect.bisect_right(self._starts, address) - 1
        if index < 0 or address >= self.mappings[index].end:
            return None
        mapping = self.mappings[index]
        span = self._span(mapping.path)
        path = self.root / mapping.path.lstrip("/")
        try:
            reachable = path.exists()
        except OSError:  # /proc/PID/root of another user's process, after serve gave up root
            reachable = False
        if not reachable:
            path = Path(mapping.path)
        symbols = module_symbols(path, self.debug_directories)
        vaddr = symbols.vaddr(address - mapping.start + mapping.offset)
        if vaddr is None:
            return Symbol(mapping.path, span=span)
        function, offset, location = symbols.lookup(vaddr)
        return Symbol(mapping.path, function, offset, location, span)

    def _span(self, path: str) -> tuple[int, int]:
        """All of a module's mappings, from its load base (its lowest
        mapping, which holds file offset 0) to the end of its highest."""
        mine = [m for m in self._file_maps if m.path == path]
        return min(m.start for m in mine), max(m.end for m in mine)
