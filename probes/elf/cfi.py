"""An ELF file's call-frame information (``.eh_frame``, and ``.debug_frame``
where it has one) as the rows the BPF unwinder searches (probes/bpf/unwind.bpf.c).

The entries are read and their instructions interpreted by ``_cfi``
(probes/elf/cfi_rows.c, compiled at install): in Python (pyelftools) a
database server's binary took 6.4 s, in C it takes a few milliseconds.
pyelftools finds the sections; nothing a file holds makes the reading
raise.

Each row keeps what an x86-64 unwinder needs at an address, and only that:

- the CFA: %rsp or %rbp plus an offset (``CFA_RSP``, ``CFA_RBP``); the return
  address is then at CFA - 8, as every x86-64 CIE says (checked per row);
- where the caller's %rbp is: unchanged (``RBP_SAME``), saved at CFA plus
  an offset (``RBP_AT``), or lost to a rule the unwinder does not follow
  (``RBP_LOST``);
- ``CFA_END``: the return address is undefined, the outermost frame
  (glibc's ``_start`` and its threads' start say so);
- ``CFA_OTHER``: a rule the unwinder does not follow (a CFA by expression,
  as in PLT stubs, signal trampolines and libgcrypt's assembly, a CFA in
  another register, a return address elsewhere), or an entry whose
  instructions cannot be interpreted (counted as malformed): the unwinder
  takes one step by frame pointers there, and says so;
- ``CFA_NONE``: no entry covers the address (between functions).

Rows are sorted by address, one per address, with a row whose rules equal
the previous one's left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import NotElfError, TargetError
from . import _cfi
from .file import build_id, elf_failures, not_elf, open_elf
from .lazy import lazy_dtype, lazy_module

if TYPE_CHECKING:
    import numpy as np
    from elftools.elf.elffile import ELFFile
else:
    np = lazy_module("numpy")  # (at the first use: probes/elf/lazy.py)

# The rows, as struct unwind_row in probes/bpf/unwind.bpf.c.
ROW = lazy_dtype([("pc", "<u4"), ("cfa_off", "<i4"), ("rbp_off", "<i2"), ("cfa", "u1"),
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
PC_LIMIT = 1 << 32  # rows hold 32-bit link-time addresses


@dataclass(frozen=True)
class CfiTable:
    """A file's unwind rows, and what could not be made of its CFI."""

    rows: np.ndarray  # of ROW, by pc
    build_id: str | None
    functions: int  # FDEs read
    skipped: int  # FDEs left out: damaged beyond reading their range, or beyond 4 GiB
    problem: str = ""  # why none could be read ("" when fine)
    malformed: int = 0  # FDEs whose instructions could not be interpreted: CFA_OTHER rows


def _no_rows(ident: str | None, why: str) -> CfiTable:
    return CfiTable(np.zeros(0, dtype=ROW), ident, 0, 0, why)


def read_cfi(path: Path) -> CfiTable:
    """The unwind rows of the ELF file at ``path``. A file that cannot be
    read, or whose CFI cannot, gives no rows and says why: this never
    raises for what a file holds."""
    try:
        with open_elf(path) as elf:
            return cfi_of(elf, path)
    except (TargetError, NotElfError) as exc:
        return _no_rows(None, str(exc))
    except OSError as exc:
        return _no_rows(None, str(not_elf(path, exc)))


def cfi_of(elf: ELFFile, path: str | Path) -> CfiTable:
    """``read_cfi`` of a file already open (``path`` names it). Raises
    OSError where the file could not be read: a failure of the moment, not
    of what the file holds."""
    try:
        return _read(elf)
    except (*elf_failures(), MemoryError) as exc:
        return _no_rows(None, str(not_elf(path, exc)))


def _section(elf: ELFFile, name: str) -> tuple[bytes, int]:
    """A section's bytes (decompressed) and its address; empty if absent
    or of no bytes in the file (SHT_NOBITS, as in a separate debug file)."""
    section = elf.get_section_by_name(name)
    if section is None or section["sh_type"] == "SHT_NOBITS":
        return b"", 0
    return bytes(section.data()), int(section["sh_addr"])


def _read(elf: ELFFile) -> CfiTable:
    ident = build_id(elf)
    try:
        eh_frame, eh_address = _section(elf, ".eh_frame")
        debug_frame, _ = _section(elf, ".debug_frame")
    except elf_failures() as exc:
        return _no_rows(ident, f"call-frame information damaged: {exc}")
    packed, functions, skipped, malformed = _cfi.rows(eh_frame, eh_address, debug_frame)
    rows = np.frombuffer(packed, dtype=ROW).copy()
    problem = "" if len(rows) else "no call-frame information"
    return CfiTable(rows, ident, functions, skipped, problem, malformed)


def rule_at(rows: np.ndarray, pc: int) -> np.void | None:
    """The row in force at link-time address ``pc``, as the BPF unwinder
    finds it (the last row at or below it); None below the first."""
    index = int(np.searchsorted(rows["pc"], pc, side="right")) - 1
    return rows[index] if index >= 0 else None
