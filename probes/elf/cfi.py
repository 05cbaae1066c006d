"""An ELF file's call-frame information (``.eh_frame``, and ``.debug_frame``
where it has one) as the rows the BPF unwinder searches (probes/bpf/unwind.bpf.c).

pyelftools parses the entries and interprets their instructions into a
table per function (one row per address where a rule changes). Its
interpreter does not know ``DW_CFA_GNU_args_size`` (GCC emits it in C++
code that passes arguments on the stack), which says nothing about the CFA
or any register: it is dropped before the table is interpreted.

Each row keeps what an x86-64 unwinder needs at an address, and only that:

- the CFA: %rsp or %rbp plus an offset (``CFA_RSP``, ``CFA_RBP``); the return
  address is then at CFA - 8, as every x86-64 CIE says (checked per row);
- where the caller's %rbp is: unchanged (``RBP_SAME``), saved at CFA plus
  an offset (``RBP_AT``), or lost to a rule the unwinder does not follow
  (``RBP_LOST``);
- ``CFA_END``: the return address is undefined, the outermost frame
  (glibc's ``_start`` and its threads' start say so);
- ``CFA_OTHER``: a rule the unwinder does not follow (an expression, as in
  PLT stubs and signal trampolines, another register, or a return address
  elsewhere): the unwinder falls back to frame pointers there, and says so;
- ``CFA_NONE``: no entry covers the address (between functions).

Rows are sorted by address, one per address, with a row whose rules equal
the previous one's left out.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np
from elftools.dwarf.callframe import FDE, RegisterRule
from elftools.elf.elffile import ELFFile

from .errors import NotElfError, TargetError
from .file import ELF_FAILURES, build_id, not_elf, open_elf

# The rows, as struct unwind_row in probes/bpf/unwind.bpf.c.
ROW = np.dtype([("pc", "<u4"), ("cfa_off", "<i4"), ("rbp_off", "<i2"), ("cfa", "u1"),
                ("rbp", "u1")])  # fmt: skip


class Cfa(IntEnum):
    """enum unwind_cfa (records.h): how a row finds the CFA."""

    NONE = 0
    RSP = 1
    RBP = 2
    END = 3
    OTHER = 4


class Rbp(IntEnum):
    """enum unwind_rbp (records.h): where a row finds the caller's %rbp."""

    SAME = 0
    AT = 1
    LOST = 2


CFA_NONE, CFA_RSP, CFA_RBP, CFA_END, CFA_OTHER = Cfa
RBP_SAME, RBP_AT, RBP_LOST = Rbp
REG_RBP, REG_RSP, REG_RA = 6, 7, 16
PC_LIMIT = 1 << 32  # rows hold 32-bit link-time addresses
DW_CFA_GNU_ARGS_SIZE = 0x2E  # an integer in every pyelftools: an enum's member in 0.33


@dataclass(frozen=True)
class CfiTable:
    """A file's unwind rows, and what could not be made of its CFI."""

    rows: np.ndarray  # of ROW, by pc
    build_id: str | None
    functions: int  # FDEs read
    skipped: int  # FDEs left out: damaged, or beyond 4 GiB
    problem: str = ""  # why none could be read ("" when fine)


def _rule(row: dict[Any, Any]) -> tuple[int, int, int, int]:
    """(cfa kind, cfa offset, rbp kind, rbp offset) of one decoded row."""
    ra = row.get(REG_RA)
    if isinstance(ra, RegisterRule) and ra.type == RegisterRule.UNDEFINED:
        return CFA_END, 0, RBP_SAME, 0
    cfa = row["cfa"]
    kind = {REG_RSP: CFA_RSP, REG_RBP: CFA_RBP}.get(cfa.reg) if cfa.expr is None else None
    ra_at_cfa = isinstance(ra, RegisterRule) and ra.type == RegisterRule.OFFSET and ra.arg == -8
    if kind is None or not ra_at_cfa or not -(1 << 31) <= cfa.offset < 1 << 31:
        return CFA_OTHER, 0, RBP_LOST, 0
    rbp = row.get(REG_RBP)
    if rbp is None or rbp.type == RegisterRule.SAME_VALUE:
        return kind, cfa.offset, RBP_SAME, 0
    if rbp.type == RegisterRule.OFFSET and -(1 << 15) <= rbp.arg < 1 << 15:
        return kind, cfa.offset, RBP_AT, rbp.arg
    return kind, cfa.offset, RBP_LOST, 0


def _fde_rows(fde: FDE) -> list[tuple[int, int, int, int, int]]:
    """(pc, rules...) of one FDE, then a CFA_NONE row at its end."""
    fde.instructions = [i for i in fde.instructions if i.opcode != DW_CFA_GNU_ARGS_SIZE]
    table = fde.get_decoded().table
    start = fde.header["initial_location"]
    end = start + fde.header["address_range"]
    rows = [(row["pc"], *_rule(row)) for row in table if start <= row["pc"] < end]
    rows.append((end, CFA_NONE, 0, RBP_SAME, 0))
    return rows


def _entries(elf: ELFFile) -> Iterator[FDE]:
    """The FDEs of .eh_frame, then of .debug_frame."""
    dwarf = elf.get_dwarf_info(relocate_dwarf_sections=False, follow_links=False)
    if dwarf.has_EH_CFI():
        yield from (e for e in dwarf.EH_CFI_entries() if isinstance(e, FDE))
    if dwarf.has_CFI():
        yield from (e for e in dwarf.CFI_entries() if isinstance(e, FDE))


def _merge(functions: Iterable[list[tuple[int, int, int, int, int]]]) -> np.ndarray:
    """One sorted table: a function's rows win over an earlier function's
    closing CFA_NONE row at the same address; where two functions overlap
    the first read (.eh_frame's) stands."""
    rows: dict[int, tuple[int, int, int, int, int]] = {}
    for function in sorted(functions, key=lambda f: f[0][0]):
        for row in function:
            held = rows.get(row[0])
            if held is None or (held[1] == CFA_NONE and row[1] != CFA_NONE):
                rows[row[0]] = row
    ordered = [rows[pc] for pc in sorted(rows)]
    kept = [row for i, row in enumerate(ordered) if i == 0 or row[1:] != ordered[i - 1][1:]]
    table = np.zeros(len(kept), dtype=ROW)
    if kept:
        pc, cfa, cfa_off, rbp, rbp_off = zip(*kept, strict=True)
        table["pc"], table["cfa"], table["cfa_off"] = pc, cfa, cfa_off
        table["rbp"], table["rbp_off"] = rbp, rbp_off
    return table


def read_cfi(path: Path) -> CfiTable:
    """The unwind rows of the ELF file at ``path``. A file that cannot be
    read, or whose CFI cannot, gives no rows and says why."""
    try:
        with open_elf(path) as elf:
            return _read(elf)
    except (TargetError, NotElfError) as exc:
        return CfiTable(np.zeros(0, dtype=ROW), None, 0, 0, str(exc))
    except ELF_FAILURES as exc:
        return CfiTable(np.zeros(0, dtype=ROW), None, 0, 0, str(not_elf(path, exc)))


def _read(elf: ELFFile) -> CfiTable:
    ident = build_id(elf)
    functions, skipped = [], 0
    try:
        entries = list(_entries(elf))
    except ELF_FAILURES as exc:
        why = f"call-frame information damaged: {exc}"
        return CfiTable(np.zeros(0, dtype=ROW), ident, 0, 0, why)
    for fde in entries:
        try:
            rows = _fde_rows(fde)
        except ELF_FAILURES:
            skipped += 1
            continue
        if rows[-1][0] >= PC_LIMIT or not rows[:-1]:
            skipped += 1
            continue
        functions.append(rows)
    problem = "" if functions else "no call-frame information"
    return CfiTable(_merge(functions), ident, len(entries), skipped, problem)


def rule_at(rows: np.ndarray, pc: int) -> np.void | None:
    """The row in force at link-time address ``pc``, as the BPF unwinder
    finds it (the last row at or below it); None below the first."""
    index = int(np.searchsorted(rows["pc"], pc, side="right")) - 1
    return rows[index] if index >= 0 else None
