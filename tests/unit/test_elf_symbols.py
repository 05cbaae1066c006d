"""The bulk symbol-table reader against pyelftools' one-at-a-time parse."""

from __future__ import annotations

from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection
from mtrace_live.probes.elf.symbols import SHN_UNDEF, symbol_table

FIXTURES = Path(__file__).parent.parent / "fixtures" / "elf"
FILES = [*sorted(FIXTURES.glob("*.so")), Path("/lib/x86_64-linux-gnu/libc.so.6"),
         Path("/usr/bin/python3")]  # fmt: skip


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
@pytest.mark.parametrize("section_name", [".symtab", ".dynsym"])
def test_every_symbol_reads_as_pyelftools_reads_it(path: Path, section_name: str) -> None:
    # GIVEN an ELF file's symbol table, as pyelftools parses it symbol by symbol
    with path.open("rb") as stream:
        elf = ELFFile(stream)
        section = elf.get_section_by_name(section_name)
        expected = None
        if isinstance(section, SymbolTableSection):
            expected = [
                (s.name, s["st_value"], s["st_size"], s["st_info"]["type"], s["st_shndx"])
                for s in section.iter_symbols()
            ]
        # WHEN the table is read in bulk
        table = symbol_table(elf, section_name)
    # THEN it holds the same symbols, in the same order, with the same fields
    if expected is None:
        assert table is None
        return
    assert table is not None and len(table) == len(expected) > 0
    types = {"STT_NOTYPE": 0, "STT_OBJECT": 1, "STT_FUNC": 2, "STT_SECTION": 3, "STT_FILE": 4,
             "STT_TLS": 6, "STT_GNU_IFUNC": 10, "STT_LOOS": 10}  # fmt: skip
    for symbol, (name, value, size, kind, shndx) in zip(table, expected, strict=True):
        assert (symbol.name, symbol.value, symbol.size) == (name, value, size)
        assert symbol.type == types.get(kind, kind)
        assert symbol.defined == (shndx not in ("SHN_UNDEF", SHN_UNDEF))
