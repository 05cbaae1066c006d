"""The unwind rows (probes/elf/cfi.py, probes/elf/cfi_rows.c) against
binutils' readelf, which interprets the same call-frame information on its
own: every row readelf prints, at its address, in libc, libstdc++ and
libgcrypt (whose assembly defines its CFA by expressions) as the
distribution ships them; every ELF file of the system read without an
exception or a problem, with rows wherever its .eh_frame holds an FDE;
and damaged call-frame information, byte by byte, read without a crash."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mtrace_live.probes.elf import _cfi
from mtrace_live.probes.elf.cfi import (
    CFA_END,
    CFA_NONE,
    CFA_OTHER,
    CFA_RBP,
    CFA_RSP,
    RBP_AT,
    RBP_LOST,
    RBP_SAME,
    ROW,
    read_cfi,
    rule_at,
)

from .needs import needs

LIBGCRYPT = Path("/usr/lib/x86_64-linux-gnu/libgcrypt.so.20")
LIBRARIES = [Path("/lib/x86_64-linux-gnu/libc.so.6"),
             Path("/usr/lib/x86_64-linux-gnu/libstdc++.so.6"), LIBGCRYPT]  # fmt: skip
FDE = re.compile(r"^\S+ \S+ \S+ FDE cie=\S+ pc=([0-9a-f]+)\.\.([0-9a-f]+)$")


def readelf_rows(path: Path) -> tuple[list[tuple[int, tuple[int, int, int, int]]], set[int]]:
    """(address, (cfa kind, offset, rbp kind, offset)) of every row readelf
    interprets in .eh_frame, and the addresses no FDE covers that are an
    FDE's end."""
    # readelf exits 1 on this libc with nothing on stderr; its table is whole
    text = subprocess.run(["readelf", "--debug-dump=frames-interp", str(path)],
                          capture_output=True, text=True).stdout  # fmt: skip
    rows, ranges, columns, in_fde = [], [], [], False
    for line in text.splitlines():
        if match := FDE.match(line):
            ranges.append((int(match.group(1), 16), int(match.group(2), 16)))
            in_fde = True
        elif " CIE " in line:
            columns, in_fde = [], False  # a CIE's initial rules are no address's
        elif line.startswith("   LOC") and in_fde:
            columns = line.split()
        elif re.match(r"^[0-9a-f]{16} ", line) and columns:
            line = re.sub(r"(r\d+) \((\w+)\)", r"\1(\2)", line)  # a rule "in register"
            cells = dict(zip(columns, line.split(), strict=True))
            rows.append((int(cells["LOC"], 16), expected(cells)))
    ranges.sort()
    covered_ends = {end for (_, end), (start, _) in itertools.pairwise(ranges) if start <= end}
    return rows, {end for _, end in ranges} - covered_ends - {start for start, _ in ranges}


def expected(cells: dict[str, str]) -> tuple[int, int, int, int]:
    if cells["ra"] == "u":
        return CFA_END, 0, RBP_SAME, 0
    cfa, rbp = cells["CFA"], cells.get("rbp", "u")
    match = re.fullmatch(r"(rsp|rbp)\+(-?\d+)", cfa)
    if match is None or cells["ra"] != "c-8":
        return CFA_OTHER, 0, RBP_LOST, 0
    kind = CFA_RSP if match.group(1) == "rsp" else CFA_RBP
    if rbp in ("u", "s"):
        return kind, int(match.group(2)), RBP_SAME, 0
    if saved := re.fullmatch(r"c(-?\d+)", rbp):
        return kind, int(match.group(2)), RBP_AT, int(saved.group(1))
    return kind, int(match.group(2)), RBP_LOST, 0


def got(rows, pc: int) -> tuple[int, int, int, int] | None:  # type: ignore[no-untyped-def]
    row = rule_at(rows, pc)
    if row is None:
        return None
    return int(row["cfa"]), int(row["cfa_off"]), int(row["rbp"]), int(row["rbp_off"])


@pytest.mark.parametrize("library", LIBRARIES, ids=lambda p: p.name)
def test_every_row_readelf_interprets_is_the_row_the_unwinder_finds(library: Path) -> None:
    # GIVEN a library's call-frame information, as readelf interprets it
    # (binutils is part of make setup: its absence fails here and says so)
    needs(shutil.which("readelf") is not None, "binutils' readelf is missing")
    want, ends = readelf_rows(library)
    assert len(want) > 10_000
    # WHEN it is read into unwind rows
    table = read_cfi(library)
    assert table.problem == "" and table.skipped == 0 and table.build_id
    # THEN at every address readelf has a row for, the row in force says the same
    wrong = [(hex(pc), rule, got(table.rows, pc)) for pc, rule in want
             if got(table.rows, pc) != rule]  # fmt: skip
    assert not wrong, wrong[:5]
    # AND where no function's entry covers an address, none is claimed
    assert ends and all(got(table.rows, end)[0] == CFA_NONE for end in ends)  # type: ignore[index]


FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "elf" / "no_notes.so"


def section_span(path: Path, name: str) -> tuple[int, int]:
    from mtrace_live.probes.elf.file import open_elf

    with open_elf(path) as elf:
        section = elf.get_section_by_name(name)
        assert section is not None
        return section["sh_offset"], section["sh_size"]


@pytest.mark.parametrize("fill", [b"\xff", b"\x00", bytes(range(7, 256, 13))])
@pytest.mark.parametrize("kept", [0.0, 0.5, 0.66])
def test_damaged_call_frame_information_gives_no_rows_and_says_so(tmp_path: Path, fill: bytes,
                                                                  kept: float) -> None:  # fmt: skip
    # GIVEN a library whose .eh_frame is overwritten from a point on (all but
    # its first entry's length, or its second half, or its last third)
    assert len(read_cfi(FIXTURE).rows) > 0
    offset, size = section_span(FIXTURE, ".eh_frame")
    start = max(4, int(size * kept))
    data = bytearray(FIXTURE.read_bytes())
    data[offset + start : offset + size] = (fill * size)[: size - start]
    damaged = tmp_path / "damaged.so"
    damaged.write_bytes(bytes(data))
    # WHEN it is read
    table = read_cfi(damaged)
    # THEN no wrong row comes out: each row is a row of the undamaged file, or
    # claims nothing the unwinder would follow: no CFI at its address (where an
    # entry cut short now ends), or instructions it cannot interpret (malformed)
    undamaged = read_cfi(FIXTURE).rows
    claims = set(undamaged.tolist())
    wrong = [row for row in table.rows.tolist()
             if row not in claims and row[3] not in (CFA_NONE, CFA_OTHER)]  # fmt: skip
    assert not wrong, wrong[:5]
    # AND rows were lost only where the damage was said, or where zeros end
    # the section (a zero length is its terminator)
    if len(table.rows) < len(undamaged) and fill != b"\x00":
        assert table.problem or table.skipped or table.malformed, table


def section_header_at(path: Path, name: str) -> int:
    """The file offset of section ``name``'s header (ELF64)."""
    from mtrace_live.probes.elf.file import open_elf

    with open_elf(path) as elf:
        index = next(n for n, s in enumerate(elf.iter_sections()) if s.name == name)
        return int(elf["e_shoff"]) + index * int(elf["e_shentsize"])


def test_a_section_larger_than_any_file_gives_no_rows_and_says_so(tmp_path: Path) -> None:
    # GIVEN a library whose .eh_frame header claims 2**63 bytes (make fuzz's
    # cfi target found it: pyelftools raised OverflowError reading it)
    data = bytearray(FIXTURE.read_bytes())
    size_at = section_header_at(FIXTURE, ".eh_frame") + 32  # sh_size in Elf64_Shdr
    data[size_at : size_at + 8] = (2**63 + 16).to_bytes(8, "little")
    huge = tmp_path / "huge.so"
    huge.write_bytes(bytes(data))
    # WHEN it is read, THEN no row, and why; no exception
    table = read_cfi(huge)
    assert len(table.rows) == 0 and "damaged" in table.problem, table.problem


def test_a_file_that_is_not_elf_gives_no_rows_and_says_why(tmp_path: Path) -> None:
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"\x7fELF" + b"\x01" * 100)
    table = read_cfi(junk)
    assert len(table.rows) == 0 and table.problem
    assert read_cfi(tmp_path / "missing.so").problem


def test_a_cfa_by_expression_is_a_row_not_followed() -> None:
    # GIVEN libgcrypt, whose hand-written assembly defines its CFA by
    # DW_CFA_def_cfa_expression (and then moves it with def_cfa_register)
    want, _ = readelf_rows(LIBGCRYPT)
    by_expression = {pc for pc, rule in want if rule[0] == CFA_OTHER}
    assert by_expression
    # WHEN its rows are read, THEN they are there, those addresses marked not
    # followed, and nothing was skipped
    table = read_cfi(LIBGCRYPT)
    assert table.problem == "" and table.skipped == table.malformed == 0
    assert all(got(table.rows, pc)[0] == CFA_OTHER for pc in by_expression)  # type: ignore[index]


SYSTEM_DIRECTORIES = ("/usr/lib/x86_64-linux-gnu", "/usr/bin", "/usr/sbin")
SHT_NOBITS = 8  # a section with no bytes in the file


def system_elf_files() -> list[Path]:
    found = []
    for directory in SYSTEM_DIRECTORIES:
        for root, _, names in os.walk(directory):
            for name in names:
                path = Path(root) / name
                if path.is_symlink() or not path.is_file():
                    continue
                with contextlib.suppress(OSError), open(path, "rb") as file:
                    if file.read(4) == b"\x7fELF":
                        found.append(path)
    return found


def eh_frame_holds_an_fde(path: Path) -> bool:
    """Whether the file's .eh_frame section holds an FDE: an entry whose CIE
    pointer is not 0, before the 0 length that ends the section (the LSB's
    .eh_frame layout). Read here with struct, apart from the product and
    pyelftools, from the section headers of a 64-bit little-endian file
    (all this machine has; another kind is said to hold none)."""
    with open(path, "rb") as file:
        head = file.read(64)
        if len(head) < 64 or head[4:6] != b"\x02\x01":
            return False
        (shoff,) = struct.unpack_from("<Q", head, 0x28)
        size, count, names_index = struct.unpack_from("<HHH", head, 0x3A)
        if shoff == 0 or count == 0 or names_index >= count:
            return False
        file.seek(shoff)
        table = file.read(size * count)
        headers = [struct.unpack_from("<IIQQQQ", table, i * size) for i in range(count)]
        file.seek(headers[names_index][4])
        names = file.read(headers[names_index][5])
        data = b""
        for name, kind, _, _, offset, length in headers:
            if names[name : names.index(b"\0", name)] == b".eh_frame" and kind != SHT_NOBITS:
                file.seek(offset)
                data = file.read(length)
                break
    at = 0
    while at + 8 <= len(data):
        (length,) = struct.unpack_from("<I", data, at)
        header = 4
        if length == 0xFFFFFFFF:  # the 64-bit format: the length follows
            (length,) = struct.unpack_from("<Q", data, at + 4)
            header = 12
        if length == 0:
            return False
        (cie_pointer,) = struct.unpack_from("<I", data, at + header)
        if cie_pointer != 0:
            return True
        at += header + length
    return False


def test_every_elf_file_of_the_system_reads_without_an_exception() -> None:
    # GIVEN every ELF file under the system's library and program directories
    files = system_elf_files()
    assert len(files) > 500
    # WHEN each one's call-frame information is read, THEN none raises, none
    # says a problem but that it has none, every file whose .eh_frame holds
    # an FDE has rows, and every row table is sorted, one row per address
    with_fdes, wrong = 0, []
    for path in files:
        table = read_cfi(path)
        pcs = table.rows["pc"]
        assert (pcs[1:] > pcs[:-1]).all(), path
        if eh_frame_holds_an_fde(path):
            with_fdes += 1
            if table.problem or len(table.rows) == 0:
                wrong.append((path, table.problem, len(table.rows)))
        elif table.problem not in ("", "no call-frame information"):
            wrong.append((path, table.problem, len(table.rows)))
    assert not wrong, wrong[:10]
    assert with_fdes > 500


def eh_frame_of(path: Path) -> tuple[bytes, int]:
    from mtrace_live.probes.elf.file import open_elf

    with open_elf(path) as elf:
        section = elf.get_section_by_name(".eh_frame")
        assert section is not None
        return bytes(section.data()), int(section["sh_addr"])


EH_FRAME, EH_ADDRESS = eh_frame_of(Path("/lib/x86_64-linux-gnu/libm.so.6"))


@settings(deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(EH_FRAME) - 1), st.integers(0, 255)),
                min_size=1, max_size=40),
       st.integers(0, len(EH_FRAME)))  # fmt: skip
def test_damaged_entries_are_read_without_a_crash(flips: list[tuple[int, int]], cut: int) -> None:
    # GIVEN a real .eh_frame with bytes changed and its end cut off
    data = bytearray(EH_FRAME)
    for at, value in flips:
        data[at] = value
    data = data[:cut]
    # WHEN it is read (as .eh_frame and as .debug_frame), THEN it returns,
    # and what it returns is a sorted table of whole rows
    for eh, debug in ((bytes(data), b""), (b"", bytes(data))):
        packed, functions, skipped, malformed = _cfi.rows(eh, EH_ADDRESS, debug)
        assert len(packed) % 12 == 0 and skipped <= functions + 1 and malformed <= functions
        pcs = np.frombuffer(packed, dtype=ROW)["pc"]
        assert (pcs[1:] > pcs[:-1]).all()


def test_a_library_with_only_debug_frame_is_read_as_readelf_interprets_it(tmp_path: Path) -> None:
    # GIVEN a library built without unwind tables (no .eh_frame) but with -g:
    # its call-frame information is in .debug_frame alone
    needs(shutil.which("readelf") is not None, "binutils' readelf is missing")
    library = tmp_path / "libdebugframe.so"
    source = Path(__file__).resolve().parents[1] / "workloads" / "cfi" / "deep.c"
    subprocess.run(["gcc", "-O2", "-g", "-fomit-frame-pointer", "-fno-asynchronous-unwind-tables",
                    "-fno-unwind-tables", "-fPIC", "-shared", "-o", str(library), str(source)],
                   check=True)  # fmt: skip
    sections = subprocess.run(["readelf", "-S", "-W", str(library)], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    eh_frame = re.search(r" \.eh_frame +PROGBITS +\S+ \S+ (\S+) ", sections)
    assert " .debug_frame " in sections and eh_frame is not None, sections
    assert int(eh_frame.group(1), 16) <= 4, sections  # a terminator, no entry
    want, _ = readelf_rows(library)
    assert len(want) > 2
    # WHEN it is read into unwind rows
    table = read_cfi(library)
    # THEN at every address readelf has a row for, the row in force says the same
    assert table.problem == "" and table.skipped == 0
    wrong = [(hex(pc), rule, got(table.rows, pc)) for pc, rule in want
             if got(table.rows, pc) != rule]  # fmt: skip
    assert not wrong, wrong[:5]
