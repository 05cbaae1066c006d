"""The unwind rows (probes/elf/cfi.py) against binutils' readelf, which
interprets the same call-frame information on its own: every row readelf
prints, at its address, in libc and libstdc++ as the distribution ships them."""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from mtrace_live.probes.elf.cfi import (
    CFA_END,
    CFA_NONE,
    CFA_OTHER,
    CFA_RBP,
    CFA_RSP,
    RBP_AT,
    RBP_LOST,
    RBP_SAME,
    read_cfi,
    rule_at,
)

LIBRARIES = [Path("/lib/x86_64-linux-gnu/libc.so.6"),
             Path("/usr/lib/x86_64-linux-gnu/libstdc++.so.6")]  # fmt: skip
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


@pytest.mark.skipif(shutil.which("readelf") is None, reason="binutils' readelf is not installed")
@pytest.mark.parametrize("library", LIBRARIES, ids=lambda p: p.name)
def test_every_row_readelf_interprets_is_the_row_the_unwinder_finds(library: Path) -> None:
    # GIVEN a library's call-frame information, as readelf interprets it
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
def test_damaged_call_frame_information_gives_no_rows_and_says_so(tmp_path: Path,
                                                                  fill: bytes) -> None:  # fmt: skip
    # GIVEN a library whose .eh_frame is overwritten (all but its first entry's length)
    assert len(read_cfi(FIXTURE).rows) > 0
    offset, size = section_span(FIXTURE, ".eh_frame")
    data = bytearray(FIXTURE.read_bytes())
    data[offset + 4 : offset + size] = (fill * size)[: size - 4]
    damaged = tmp_path / "damaged.so"
    damaged.write_bytes(bytes(data))
    # WHEN it is read, THEN no wrong row comes out: none at all, with why, or
    # only whole entries, the damaged ones counted as skipped
    table = read_cfi(damaged)
    assert table.problem or table.skipped or len(table.rows) == 0


def test_a_file_that_is_not_elf_gives_no_rows_and_says_why(tmp_path: Path) -> None:
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"\x7fELF" + b"\x01" * 100)
    table = read_cfi(junk)
    assert len(table.rows) == 0 and table.problem
    assert read_cfi(tmp_path / "missing.so").problem
