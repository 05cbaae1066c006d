"""Where an SDT argument lives at the probe site, in a form BPF can read.

An SDT note gives each argument as ``[-]SIZE@OPERAND``, where OPERAND is the
assembler operand the compiler chose (x86_64, AT&T syntax)::

    %rdi  %ebp  %r8         a register (its low SIZE bytes)
    $42                     a constant
    -8(%rbp)  1592(%rbx)    memory at register + displacement
    32+mp_(%rip)            memory at a symbol (+ offset): a global variable

The rip-relative form names a symbol of the same object. Its run-time address
is the site's run-time address plus a constant (the symbol's link-time address
+ offset - the site's link-time address), so BPF reads it relative to the
instruction pointer, in any process, whatever the load address.

Anything else (indexed operands, high-byte registers) is described as
``UNREADABLE``: the probe is still counted and traced, that argument is not
recorded, and the listing says why.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

from .elf.lazy import lazy_module
from .elf.symbols import symbol_tables
from .sdt_notes import SdtSite

elffile = lazy_module("elftools.elf.elffile")  # (pyelftools: at a file's first parse)


class ArgKind(IntEnum):
    """enum arg_kind in bpf/records.h (tests/unit/test_record_layout.py compares them)."""

    UNREADABLE = 0
    CONST = 1
    REG = 2
    DEREF_REG = 3
    DEREF_IP = 4


# Slot of each 64-bit register in x86_64's struct pt_regs.
_PT_REGS_SLOT = {
    "r15": 0, "r14": 1, "r13": 2, "r12": 3, "rbp": 4, "rbx": 5, "r11": 6,
    "r10": 7, "r9": 8, "r8": 9, "rax": 10, "rcx": 11, "rdx": 12, "rsi": 13,
    "rdi": 14, "rip": 16, "rsp": 19,
}  # fmt: skip

_LEGACY = {"ax": "rax", "bx": "rbx", "cx": "rcx", "dx": "rdx", "si": "rsi", "di": "rdi",
           "bp": "rbp", "sp": "rsp"}  # fmt: skip


def _register_table() -> dict[str, tuple[int, int]]:
    """Every register name the assembler may print -> (pt_regs slot, width)."""
    table: dict[str, tuple[int, int]] = {}
    for name, slot in _PT_REGS_SLOT.items():
        table[name] = (slot, 8)
        if name[1:].isdigit():  # r8 ... r15: r8d, r8w, r8b (and r8l)
            for suffix, width in (("d", 4), ("w", 2), ("b", 1), ("l", 1)):
                table[name + suffix] = (slot, width)
    for short, full in _LEGACY.items():
        slot = _PT_REGS_SLOT[full]
        table["e" + short] = (slot, 4)
        table[short] = (slot, 2)
        low = short[0] + "l" if short[1] == "x" else short + "l"  # al, sil, bpl ...
        table[low] = (slot, 1)
    return table


REGISTERS = _register_table()

_REG = r"%([a-z0-9]+)"
_INT = r"[-+]?(?:0x[0-9a-fA-F]+|\d+)"
_CONST = re.compile(rf"^\$({_INT})$")
_REGISTER = re.compile(rf"^{_REG}$")
_DEREF = re.compile(rf"^({_INT})?\({_REG}\)$")
# 32+mp_(%rip), mp_(%rip), mp_+32(%rip), mp_-8(%rip)
_RIP_SYMBOL = re.compile(
    rf"^(?:({_INT})\+)?([A-Za-z_.$][\w.$@]*)((?:[-+](?:0x[0-9a-fA-F]+|\d+))?)\(%rip\)$"
)
_SIZED = re.compile(r"^(-?)(\d+)@(.+)$")


@dataclass(frozen=True)
class ArgLocation:
    """One argument as BPF reads it: see struct arg_desc in bpf/sdt.bpf.c."""

    kind: ArgKind
    size: int  # 1, 2, 4 or 8
    signed: bool
    reg: int = 0  # pt_regs slot, for REG and DEREF_REG
    value: int = 0  # constant, displacement, or distance from the site's ip
    why: str = ""  # for UNREADABLE: what was not understood

    @property
    def readable(self) -> bool:
        return self.kind is not ArgKind.UNREADABLE


@dataclass(frozen=True)
class SiteLayout:
    """A site and where each of its arguments lives."""

    site: SdtSite
    args: tuple[ArgLocation, ...]


SymbolLookup = Callable[[str], int | None]


def _int(text: str | None) -> int:
    return int(text, 0) if text else 0


def parse_location(text: str, site_address: int, symbol: SymbolLookup) -> ArgLocation:
    """Decode one note argument such as ``-4@%esi`` or ``8@32+mp_(%rip)``."""
    sized = _SIZED.match(text)
    signed, size_text, operand = sized.groups() if sized else ("", "", text)
    size = int(size_text) if size_text else 0
    if size not in (0, 1, 2, 4, 8):
        return _unreadable(text, f"unsupported size {size}")
    is_signed = signed == "-"

    def sized_as(width: int) -> int:
        return size or width

    if match := _CONST.match(operand):
        return ArgLocation(ArgKind.CONST, sized_as(8), is_signed, value=_int(match[1]))
    if match := _REGISTER.match(operand):
        reg = REGISTERS.get(match[1])
        if reg is None:
            return _unreadable(text, f"register %{match[1]} is not readable")
        return ArgLocation(ArgKind.REG, sized_as(reg[1]), is_signed, reg=reg[0])
    if match := _RIP_SYMBOL.match(operand):
        address = symbol(match[2])
        if address is None:
            return _unreadable(text, f"symbol {match[2]} is not in the file's symbol tables")
        target = address + _int(match[1]) + _int(match[3])
        return ArgLocation(ArgKind.DEREF_IP, sized_as(8), is_signed, value=target - site_address)
    if match := _DEREF.match(operand):
        reg = REGISTERS.get(match[2])
        if reg is None or match[2] == "rip":
            return _unreadable(text, f"base %{match[2]} is not supported")
        return ArgLocation(
            ArgKind.DEREF_REG, sized_as(8), is_signed, reg=reg[0], value=_int(match[1])
        )
    return _unreadable(text, "operand form not supported")


def _unreadable(text: str, why: str) -> ArgLocation:
    return ArgLocation(ArgKind.UNREADABLE, 8, False, why=f"{text}: {why}")


def symbol_addresses(path: str | Path, names: Iterable[str]) -> dict[str, int]:
    """Link-time addresses of ``names`` from .symtab, else .dynsym."""
    wanted = set(names)
    found: dict[str, int] = {}
    if not wanted:
        return found
    with open(path, "rb") as stream:
        for table in symbol_tables(elffile.ELFFile(stream)):
            for sym in table:
                if sym.name in wanted and sym.name not in found and sym.defined:
                    found[sym.name] = sym.value
            if wanted <= set(found):
                break
    return found


def rip_symbols(sites: Iterable[SdtSite]) -> set[str]:
    """The symbols the sites' rip-relative operands name."""
    names = set()
    for site in sites:
        for text in site.arguments:
            match = _RIP_SYMBOL.match(text.split("@", 1)[-1])
            if match:
                names.add(match[2])
    return names


def layout_sites(
    path: str | Path, sites: Iterable[SdtSite], symbols: Mapping[str, int] | None = None
) -> list[SiteLayout]:
    """Where every argument of every site lives; ``symbols`` (link-time
    addresses) are read from ``path`` when not given."""
    sites = list(sites)
    if symbols is None:
        symbols = symbol_addresses(path, rip_symbols(sites))
    return [
        SiteLayout(
            site,
            tuple(parse_location(text, site.address, symbols.get) for text in site.arguments),
        )
        for site in sites
    ]
