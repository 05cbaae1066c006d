"""User-space addresses to module, function and source line.

``ModuleSymbols`` reads one ELF file once: its function symbols (.symtab,
else .dynsym, read in bulk with pyelftools). Source lines come from DWARF,
reading only what the addresses asked for need (``LineIndex``,
exporters/data/source_lines.py: each unit's line table read with libdw,
kept on disk by build-id).
When the file itself is stripped, its separate debug file is looked for the
way gdb does: by build-id under each debug directory
(``.build-id/ab/cdef....debug``), then by ``.gnu_debuglink`` name beside the
file and under the debug directory. A module's tables are cached by path,
inode and modification time, so every process mapping a library shares them.

``ProcessSymbols`` maps a process's addresses to modules through
/proc/PID/maps, reaching the files through /proc/PID/root, so processes in
other mount namespaces (containers) resolve too. An address no symbol
covers gives the module only; a module that cannot be read gives nothing.
Neither is an error. An address in anonymous executable memory (JIT code)
is named by the process's perf map (``PerfMap``), if it writes one; else it
is a frame of JIT code unnamed.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elftools.common.exceptions import DWARFError, ELFError
from mtrace_live.exporters.data.perf_map import PerfMap
from mtrace_live.exporters.data.processes import proc_dir
from mtrace_live.exporters.data.source_lines import LineIndex, line_key
from mtrace_live.probes.elf.debug import DEBUG_DIRECTORIES, debug_files
from mtrace_live.probes.elf.file import LoadSegment, build_id, debuglink, load_segments, vaddr_at
from mtrace_live.probes.elf.lazy import lazy_module
from mtrace_live.probes.elf.maps import Mapping, read_maps
from mtrace_live.probes.elf.symbols import STT_FUNC, STT_GNU_IFUNC, symbol_table
from mtrace_live.probes.frame_kinds import (
    FILE_SHIFT,
    KIND_FILE,
    KIND_PYTHON,
    KIND_SHIFT,
    frame_kind,
)

if TYPE_CHECKING:
    import pyderust
    from elftools.elf import elffile
    from elftools.elf.elffile import ELFFile
else:  # (imported at the first Rust name: mtrace_live.probes.elf.lazy)
    pyderust = lazy_module("pyderust")
    elffile = lazy_module("elftools.elf.elffile")  # (pyelftools: at a file's first parse)

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
    system_name: str | None = None  # the function's symbol as the file has it (mangled)
    build_id: str | None = None  # the module's GNU build-id, in hex


# The mapping every Python function's frame is placed in (probes/frame_kinds.py:
# its frames' values are the addresses in it), in every output.
PYTHON_MODULE = "[python]"
PYTHON_SPAN = (KIND_PYTHON << KIND_SHIFT, (KIND_PYTHON + 1) << KIND_SHIFT)


def python_symbol(qualname: str, filename: str, line: int) -> Symbol:
    """A Python function's frame: its qualified name, file and line."""
    return Symbol(PYTHON_MODULE, qualname, 0, f"{filename}:{line}", span=PYTHON_SPAN)


def is_python(symbol: Symbol | None) -> bool:
    return symbol is not None and symbol.module == PYTHON_MODULE and symbol.span == PYTHON_SPAN


# The mapping every frame in JIT code (anonymous executable memory) is placed
# in, in every output; its span is the anonymous mapping's.
JIT_MODULE = "[jit]"


def jit_symbol(name: str | None, offset: int, span: tuple[int, int]) -> Symbol:
    """A frame in JIT code: its name from the process's perf map, and the
    offset from where the code named starts; unnamed: ``name`` None."""
    return Symbol(JIT_MODULE, name, offset if name is not None else 0, span=span)


def is_jit(symbol: Symbol | None) -> bool:
    return symbol is not None and symbol.module == JIT_MODULE


def is_anonymous(mapping: Mapping) -> bool:
    """Memory of no file: where JIT code lies when it is executable. Private
    anonymous memory has no path, or the name a process gave it
    (``[anon:NAME]``, Linux 5.17); shared anonymous memory is the kernel's
    ``/dev/zero (deleted)``, and a mapping of /dev/zero is anonymous too."""
    return not mapping.path or mapping.path.startswith("[anon:") or mapping.path in _ZERO


_ZERO = ("/dev/zero", "/dev/zero (deleted)")


# Rust's legacy mangling is Itanium's with a last element "h" and 16 hex
# digits (its hash), before any ".llvm.N"-style suffix the compiler adds.
_RUST_LEGACY = re.compile(r"^_ZN.*17h[0-9a-f]{16}E(\.[\w.$]+)?$")


@functools.cache
def _demangler() -> Any:  # cxxfilt.BaseDemangler
    """cxxfilt's demangler, freeing what __cxa_demangle returns with the
    ``free`` this process's ``malloc`` pairs with. cxxfilt takes libc's own
    ``free`` (dlopen of libc.so.6): under a preloaded allocator (mtrace-live
    run with LD_PRELOAD=libtcmalloc...) that frees tcmalloc's block with
    glibc's, and the process aborts. dlsym in the global scope finds the
    interposed one. (cxxfilt is imported on the first C++ name: a trace's
    start does not wait for it.)"""
    import cxxfilt

    try:
        demangler = cxxfilt.Demangler(cxxfilt.find_any_library("c"),
                                      cxxfilt.find_any_library("stdc++", "c++"))  # fmt: skip
    except cxxfilt.Error:
        return cxxfilt.default_demangler
    free = ctypes.CDLL(None).free
    free.argtypes = [ctypes.c_void_p]
    demangler._free = free
    return demangler


@functools.lru_cache(maxsize=1 << 16)
def demangled(name: str) -> str:
    """A C++ or Rust function's name as heaptrack and perf show it: a Rust
    symbol (v0 ``_R...`` or legacy) by rustc's own demangler (the
    rustc-demangle crate, through pyderust), without its hash and crate
    disambiguators; a C++ one by the C++ runtime's (abi::__cxa_demangle,
    through cxxfilt); any other name, or one that does not demangle, as it is."""
    if name.startswith("_R") or _RUST_LEGACY.match(name):
        try:
            return str(pyderust.demangle(name))
        except pyderust.DemangleError:
            return name
    if not name.startswith("_Z"):
        return name
    import cxxfilt

    try:
        return str(_demangler().demangle(name))
    except cxxfilt.Error:
        return name


def _has_lines(elf: ELFFile) -> bool:
    return elf.get_section_by_name(".debug_line") is not None and elf.has_dwarf_info()


def _line_index(path: Path, elf: ELFFile, ident: str | None) -> LineIndex:
    """The lines of ``path`` (open as ``elf``, of build-id ``ident``):
    units found by .debug_aranges where it has them."""
    aranges = elf.get_section_by_name(".debug_aranges") is not None
    info, line = (elf.get_section_by_name(name) for name in (".debug_info", ".debug_line"))
    sizes = [int(section.header.sh_size) if section is not None else 0 for section in (info, line)]
    return LineIndex(path, line_key(ident, sizes[0], sizes[1], aranges), aranges)


class ModuleSymbols:
    """The symbols and line table of one ELF file (addresses are its link-time ones)."""

    def __init__(self, path: Path, debug_directories: Sequence[Path] = DEBUG_DIRECTORIES) -> None:
        self.path = path
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._names: list[str] = []
        self._lines: LineIndex | None = None  # of the file with DWARF, itself or its debug file
        self.loads: list[LoadSegment] = []
        self.build_id: str | None = None
        self.debug_file: Path | None = None  # where the names or lines came from, if not path
        self._full_symbols = False  # from a .symtab (static functions too), not .dynsym only
        try:
            with open(path, "rb") as file:
                elf = elffile.ELFFile(file)
                self.loads = load_segments(elf)
                self.build_id = build_id(elf)
                self._read_symbols(elf)
                if _has_lines(elf):
                    self._lines = _line_index(path, elf, self.build_id)
                link = debuglink(elf)
        except (OSError, ELFError, DWARFError, ValueError):
            return
        if not self._full_symbols or self._lines is None:
            for candidate in debug_files(path, self.build_id, link, debug_directories):
                if self._read_debug_file(candidate):
                    self.debug_file = candidate
                    break

    @property
    def has_lines(self) -> bool:
        return self._lines is not None

    @property
    def source(self) -> str:
        """Where the names come from, for reading."""
        return f"debug file {self.debug_file}" if self.debug_file else f"{self.path} itself"

    def _read_debug_file(self, candidate: Path) -> bool:
        try:
            with open(candidate, "rb") as file:
                elf = elffile.ELFFile(file)
                own = build_id(elf)
                if self.build_id and own not in (None, self.build_id):
                    return False
                if not self._full_symbols:
                    before = (self._starts, self._ends, self._names)
                    self._starts, self._ends, self._names = [], [], []
                    self._read_symbols(elf)
                    if not self._names:  # nothing better there: keep the exported ones
                        self._starts, self._ends, self._names = before
                if self._lines is None and _has_lines(elf):
                    self._lines = _line_index(candidate, elf, own)
        except (OSError, ELFError, DWARFError, ValueError):
            return False
        return bool(self._names or self._lines)

    def _read_symbols(self, elf: ELFFile) -> None:
        found: dict[int, tuple[int, str]] = {}
        for name in (".symtab", ".dynsym"):
            table = symbol_table(elf, name)
            if table is None:
                continue
            for sym in table:
                if sym.type in _FUNCTION_TYPES and sym.value and sym.name:
                    held = found.get(sym.value)
                    # a compiler's alias (f.localalias, f.isra.0) gives way to the name itself
                    if held is None or ("." in held[1] and "." not in sym.name):
                        found[sym.value] = (sym.size, sym.name)
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

    def lookup(self, vaddr: int) -> tuple[str | None, int, str | None]:
        """(function, offset into it, file:line) for a link-time address."""
        function, offset = None, 0
        index = bisect.bisect_right(self._starts, vaddr) - 1
        if index >= 0 and vaddr < self._ends[index]:
            function, offset = self._names[index], vaddr - self._starts[index]
        location = None
        if function is not None and self._lines is not None:
            location = self._lines.location(vaddr)
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


_CACHE: dict[tuple[str | int, int, int], ModuleSymbols] = {}


def module_symbols(
    path: Path, debug_directories: Sequence[Path] = DEBUG_DIRECTORIES
) -> ModuleSymbols:
    """One ModuleSymbols per file (by device, inode and mtime, whatever path
    reaches it: each process's /proc/PID/root/... is the same file), read once."""
    try:
        stat = os.stat(path)
        key: tuple[str | int, int, int] = (stat.st_dev, stat.st_ino, stat.st_mtime_ns)
    except OSError:
        key = (str(path), 0, 0)
    found = _CACHE.get(key)
    if found is None:
        found = _CACHE[key] = ModuleSymbols(path, debug_directories)
    return found


def _place_of(start: int) -> int:
    """0 for a process's own mapping, else the numbered file's place (its
    kind and number: probes/frame_kinds.py)."""
    return start >> FILE_SHIFT if frame_kind(start) == KIND_FILE else 0


class ProcessSymbols:
    """Symbolizes addresses of one process (a snapshot of its maps), and
    of the numbered files placed beside them (``add``)."""

    def __init__(self, pid: int, debug_directories: Sequence[Path] = DEBUG_DIRECTORIES,
                 saved: Sequence[Mapping] | None = None) -> None:  # fmt: skip
        """``saved``: the file mappings as recorded (a record set's
        user_maps), instead of reading /proc/PID/maps."""
        self.pid = pid
        self.debug_directories = debug_directories
        where = proc_dir(pid)
        self.root = where / "root"
        self.mappings: list[Mapping] = []  # the process's own executable ones
        self.jit: list[Mapping] = []  # its anonymous executable ones (JIT code), by start
        self.perf_map: PerfMap | None = None  # the names of its JIT code, if it writes them
        self.numbers: set[int] = set()  # the numbered files placed beside (``add``)
        self._file_maps: list[Mapping] = []  # every mapping of a file, executable or not
        self._placed: list[Mapping] = []  # the numbered files' (``add``)
        if saved is not None:
            self._file_maps = [m for m in saved if not is_anonymous(m)]
            self.mappings = sorted((m for m in self._file_maps if m.executable),
                                   key=lambda m: m.start)  # fmt: skip
            found = sorted(saved, key=lambda m: m.start)
        else:
            try:
                found = read_maps(where)
            except OSError:
                found = []
            self._file_maps = [m for m in found if m.is_file and not is_anonymous(m)]
            self.mappings = [m for m in self._file_maps if m.executable]
        self.jit = [m for m in found if m.executable and is_anonymous(m)]
        # (starts, mappings) searched by resolve, replaced whole by add
        self._index = ([m.start for m in self.mappings], list(self.mappings))

    def modules(self) -> list[Mapping]:
        return list(self.mappings)

    def add(self, mappings: Sequence[Mapping]) -> None:
        """Mappings placed beside the process's own: the numbered files its
        frames are in (exporters/data/file_frames.py), above all of its
        addresses. (A scrape's thread may resolve meanwhile: the search's
        lists are replaced in one assignment.)"""
        fresh = [m for m in mappings if m not in self._placed]
        if not fresh:
            return
        self._placed = self._placed + fresh
        searched = sorted(self._index[1] + [m for m in fresh if m.executable],
                          key=lambda m: m.start)  # fmt: skip
        self._index = ([m.start for m in searched], searched)

    @property
    def file_mappings(self) -> list[Mapping]:
        """Every mapping of a file, executable or not (a module's load base
        is its lowest), and the numbered files placed beside them."""
        return self._file_maps + self._placed

    def resolve(self, address: int) -> Symbol | None:
        starts, searched = self._index
        index = bisect.bisect_right(starts, address) - 1
        if index < 0 or address >= searched[index].end:
            return self._in_jit(address)
        mapping = searched[index]
        span = self._span(mapping)
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
            return Symbol(mapping.path, span=span, build_id=symbols.build_id)
        function, offset, location = symbols.lookup(vaddr)
        shown = demangled(function) if function is not None else None
        return Symbol(mapping.path, shown, offset, location, span, function, symbols.build_id)

    def _in_jit(self, address: int) -> Symbol | None:
        """A frame in the process's JIT code, named by its perf map (read
        again for lines written since, when it names nothing there); None
        outside that code."""
        jit = self.jit
        index = bisect.bisect_right([m.start for m in jit], address) - 1
        if index < 0 or address >= jit[index].end:
            return None
        span = (jit[index].start, jit[index].end)
        perf_map = self.perf_map
        if perf_map is None:
            return jit_symbol(None, 0, span)
        found = perf_map.name(address)
        if found is None and perf_map.read():
            found = perf_map.name(address)
        if found is None:
            return jit_symbol(None, 0, span)
        return jit_symbol(found[0], address - found[1], span)

    def _span(self, mapping: Mapping) -> tuple[int, int]:
        """All of a module's mappings, from its load base (its lowest
        mapping, which holds file offset 0) to the end of its highest: those
        of the same place as ``mapping`` (the process's own, or one numbered
        file's, by its number)."""
        place = _place_of(mapping.start)
        mine = [m for m in self.file_mappings
                if m.path == mapping.path and _place_of(m.start) == place]  # fmt: skip
        return min(m.start for m in mine), max(m.end for m in mine)
