"""An ELF file's symbol tables, read whole with numpy.

pyelftools parses one symbol at a time through its construct library, about
10 µs each: a libc's 16,000 symbols took 0.18 s of every trace's start-up.
Here pyelftools finds the sections, and the fixed-size entries and their
names are read in bulk, in the file's own class and byte order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from .facts import file_fact
from .file import file_offset, load_segments, open_elf
from .lazy import lazy_module

if TYPE_CHECKING:
    import numpy as np
    from elftools.elf import sections
    from elftools.elf.elffile import ELFFile
else:  # (pyelftools: at a file's first parse)
    sections = lazy_module("elftools.elf.sections")
    np = lazy_module("numpy")  # (at the first use: probes/elf/lazy.py)

STT_FUNC = 2
STT_GNU_IFUNC = 10
SHN_UNDEF = 0


def _entry(elf: ELFFile) -> np.dtype:
    order = "<" if elf.little_endian else ">"
    if elf.elfclass == 64:
        fields = [("name", "u4"), ("info", "u1"), ("other", "u1"), ("shndx", "u2"),
                  ("value", "u8"), ("size", "u8")]  # fmt: skip
    else:
        fields = [("name", "u4"), ("value", "u4"), ("size", "u4"), ("info", "u1"),
                  ("other", "u1"), ("shndx", "u2")]  # fmt: skip
    return np.dtype([(name, order + kind) for name, kind in fields])


class Symbol(NamedTuple):
    name: str
    value: int
    size: int
    type: int  # STT_*
    defined: bool  # not SHN_UNDEF


@dataclass
class SymbolTable:
    """One symbol table (.symtab or .dynsym), in file order."""

    names: list[str]
    value: np.ndarray
    size: np.ndarray
    type: np.ndarray
    shndx: np.ndarray

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[Symbol]:
        for name, value, size, kind, shndx in zip(
            self.names, self.value.tolist(), self.size.tolist(), self.type.tolist(),
            self.shndx.tolist(), strict=True,
        ):  # fmt: skip
            yield Symbol(name, value, size, kind, shndx != SHN_UNDEF)


def symbol_table(elf: ELFFile, section_name: str) -> SymbolTable | None:
    """The table ``section_name`` of ``elf``, or None when it has none."""
    section = elf.get_section_by_name(section_name)
    if not isinstance(section, sections.SymbolTableSection):
        return None
    dtype = _entry(elf)
    data = section.data()
    entries = np.frombuffer(data, dtype=dtype, count=len(data) // dtype.itemsize)
    strtab = section.stringtable.data()
    text = np.frombuffer(strtab, dtype=np.uint8)
    ends = np.flatnonzero(text == 0)
    starts = entries["name"].astype(np.int64)
    # Each name runs to the first NUL at or after its start; a start past the
    # table (a damaged file) gives an empty name.
    at = np.searchsorted(ends, starts)
    inside = (at < len(ends)) & (starts < len(strtab))
    stops = np.where(inside, ends[np.minimum(at, max(len(ends) - 1, 0))] if len(ends) else 0,
                     starts)  # fmt: skip
    names = [
        strtab[start:stop].decode("utf-8", "replace") if ok else ""
        for start, stop, ok in zip(starts.tolist(), stops.tolist(), inside.tolist(), strict=True)
    ]
    return SymbolTable(names, entries["value"], entries["size"], entries["info"] & 0xF,
                       entries["shndx"])  # fmt: skip


def symbol_tables(
    elf: ELFFile, order: tuple[str, ...] = (".symtab", ".dynsym")
) -> Iterator[SymbolTable]:
    """The file's symbol tables that exist, in ``order``."""
    for name in order:
        table = symbol_table(elf, name)
        if table is not None:
            yield table


def symbols_by_name(
    elf: ELFFile,
    order: tuple[str, ...] = (".symtab", ".dynsym"),
    types: frozenset[int] | None = None,
) -> dict[str, tuple[int, int]]:
    """name -> (value, size) of the defined, named symbols of the tables in
    ``order`` (of the STT_* ``types`` only, if given); the first table
    naming a symbol wins."""
    found: dict[str, tuple[int, int]] = {}
    for table in symbol_tables(elf, order):
        for symbol in table:
            if symbol.defined and symbol.name and (types is None or symbol.type in types):
                found.setdefault(symbol.name, (symbol.value, symbol.size))
    return found


def defined_functions(elf: ELFFile, tables: tuple[str, ...] = (".dynsym",)) -> set[str]:
    """The names of the functions the file defines in ``tables``."""
    names: set[str] = set()
    for table in tables:
        symbols = symbol_table(elf, table)
        if symbols is None:
            continue
        for name, kind, shndx in zip(symbols.names, symbols.type.tolist(),
                                     symbols.shndx.tolist(), strict=True):  # fmt: skip
            if shndx != SHN_UNDEF and kind in (STT_FUNC, STT_GNU_IFUNC):
                names.add(name)
    return names


@file_fact
def exported_offset(path: Path, name: str) -> int | None:
    """Where the exported function ``name`` is in the file at ``path``."""
    with open_elf(path) as elf:
        dynsym = symbol_table(elf, ".dynsym")
        if dynsym is None:
            return None
        address = next((s.value for s in dynsym if s.name == name and s.value), None)
        return None if address is None else file_offset(load_segments(elf), address)
