"""Where to put a uprobe on each of a libc's allocation functions.

A uprobe costs what the kernel does with the instruction under it. On
x86-64 it emulates a few (``push`` of a register, ``jmp``, ``call``, the
conditional jumps, ``nop``) and single-steps every other one out of line:
about 0.65-0.7 us a hit against 9.4 us on this machine's Linux 6.18
(``free``'s first instruction is ``test %rdi,%rdi``). So each site is the
one probes/uprobe_sites.py chooses from the function's entry: the first
instruction on the straight path that the kernel emulates, before which
nothing has written an argument register or the stack: every call passes
through it, with its arguments intact. Where there is none in the first
bytes, the entry is used, and marked single-stepped.

The functions are found in the libc's dynamic symbol table, so this works on
any glibc, with or without SDT notes or debug info; the instructions are
decoded with capstone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .elf.facts import file_fact, kept_type
from .elf.file import code_at, open_elf
from .elf.lazy import lazy_module
from .elf.symbols import STT_FUNC, STT_GNU_IFUNC, symbol_table
from .records import SITE_REG_BITS, SITE_REG_SHIFT, SiteReg
from .uprobe_sites import disassemble, first_emulated, jump_targets

if TYPE_CHECKING:
    import capstone
    from capstone import x86
    from elftools.elf import relocation, sections
    from elftools.elf.elffile import ELFFile
else:  # (imported at the first disassembly: mtrace_live.probes.elf.lazy)
    capstone, x86 = lazy_module("capstone"), lazy_module("capstone.x86")
    relocation = lazy_module("elftools.elf.relocation")  # (pyelftools: at a first read)
    sections = lazy_module("elftools.elf.sections")

# The allocation functions and the registers holding their arguments (SysV
# x86-64 calling convention), in order.
ALLOC_FUNCTIONS: Mapping[str, tuple[str, ...]] = {
    "malloc": ("rdi",),
    "calloc": ("rdi", "rsi"),
    "realloc": ("rdi", "rsi"),
    "reallocarray": ("rdi", "rsi", "rdx"),
    "free": ("rdi",),
    "memalign": ("rdi", "rsi"),
    "posix_memalign": ("rdi", "rsi", "rdx"),
    "aligned_alloc": ("rdi", "rsi"),
    "valloc": ("rdi",),
    "pvalloc": ("rdi",),
}
# Every kind of call a handler reads (allocs.bpf.c's alloc_<kind>): glibc's
# functions, and jemalloc's xallocx(ptr, size, extra, flags), which resizes in place.
KIND_ARGUMENTS: Mapping[str, tuple[str, ...]] = {**ALLOC_FUNCTIONS, "xallocx": ("rdi", "rsi")}
SCAN_BYTES = 64  # how far from the entry a site is looked for


@kept_type
@dataclass(frozen=True)
class AllocSite:
    function: str
    entry: int  # the function's address (st_value)
    address: int  # the site's address; file offset = address - load bias of its segment
    file_offset: int
    instruction: str  # as capstone prints it, e.g. "push r12"
    emulated: bool  # False: the entry, single-stepped
    aliases: tuple[str, ...] = ()  # other functions at the same address
    tail_calls: str | None = None  # the allocation function it jumps to (directly or by PLT)
    kind: str = ""  # the handler that reads its arguments (probes/allocators.py); "": function
    registers: tuple[str, ...] = ()  # where its arguments are at the site (): the usual ones

    @property
    def cookie(self) -> int:
        """The site's BPF cookie: where the handler reads the arguments that
        the instructions before the site moved (``site_cookie``)."""
        usual = KIND_ARGUMENTS[self.handler]
        return site_cookie(self.registers, usual) if self.registers else 0

    @property
    def handler(self) -> str:
        """The kind of call it is: allocs.bpf.c's ``alloc_<handler>`` reads it."""
        return self.kind or self.function

    @property
    def offset(self) -> int:
        return self.address - self.entry


def choose_site(code: bytes, entry: int, arguments: tuple[str, ...],
                follow_moves: bool = False) -> tuple[int, str, bool, tuple[str, ...]]:  # fmt: skip
    """(address, instruction, emulated, where each argument is) of the site
    in ``code`` (the bytes from ``entry``): probes/uprobe_sites.py's
    ``first_emulated`` from the entry, before a write to an argument
    register or the stack, where no jump in ``code`` lands; else the entry."""
    insns = disassemble(code, entry)
    site = first_emulated(insns, entry, arguments, jump_targets(insns), follow_moves=follow_moves)
    return site.address, site.instruction, site.emulated, site.registers


def site_cookie(registers: tuple[str, ...], standard: tuple[str, ...]) -> int:
    """The BPF cookie that tells allocs.bpf.c's ``site_arg`` where each
    argument is (records.h's enum site_reg, SITE_REG_BITS each from bit
    SITE_REG_SHIFT); 0 when every one is where the calling convention puts it."""
    cookie = 0
    for slot, (register, usual) in enumerate(zip(registers, standard, strict=True)):
        if register != usual:
            cookie |= SiteReg[register.upper()] << (SITE_REG_BITS * slot)
    return cookie << SITE_REG_SHIFT if cookie else 0


@file_fact
def alloc_sites(path: Path, entries: Mapping[str, str] | None = None,
                tables: tuple[str, ...] = (".dynsym",), follow_moves: bool = False,
                registers: Mapping[str, tuple[str, ...]] | None = None,
                ) -> dict[str, AllocSite]:  # fmt: skip
    """The site of each allocation function the file defines in ``tables``
    (by its default version), keyed by function name; functions it does not
    define are absent. ``entries``: function -> its kind (probes/allocators.py),
    glibc's ten names by default. ``follow_moves``: a site may lie where the
    arguments are in other registers (``choose_site``; its handler is then
    attached with the site's cookie). ``registers``: function -> where its
    arguments are at its entry, where not its kind's registers (mimalloc's
    mi_heap_malloc); such a function is left out without ``follow_moves``
    (its handler could not read them)."""
    kinds = entries if entries is not None else {name: name for name in ALLOC_FUNCTIONS}
    elsewhere = registers or {}
    if not follow_moves:
        kinds = {name: kind for name, kind in kinds.items() if name not in elsewhere}
    with open_elf(path) as elf:
        found: dict[str, int] = {}
        for table in tables:
            symbols = symbol_table(elf, table)
            for symbol in symbols if symbols is not None else ():
                if (
                    symbol.name in kinds
                    and symbol.value
                    and symbol.type in (STT_FUNC, STT_GNU_IFUNC)
                ):
                    found.setdefault(symbol.name, symbol.value)
        entry_of = {name: found[name] for name in kinds if name in found}  # in kinds' order
        by_address: dict[int, list[str]] = {}
        for name, address in entry_of.items():
            by_address.setdefault(address, []).append(name)
        targets = {**{address: names[0] for address, names in by_address.items()},
                   **_plt_targets(elf, kinds)}  # fmt: skip
        sites = {}
        for name, entry in entry_of.items():
            code, bias = code_at(elf, entry, entry + SCAN_BYTES, clamp=True)
            usual = KIND_ARGUMENTS[kinds[name]]
            at_entry = elsewhere.get(name, usual)
            address, text, fast, held = choose_site(code, entry, at_entry, follow_moves)
            aliases = tuple(other for other in by_address[entry] if other != name)
            jumps_to = tail_call(code, entry, targets)
            sites[name] = AllocSite(name, entry, address, address - bias, text, fast, aliases,
                                    jumps_to if jumps_to != name else None,
                                    "" if kinds[name] == name else kinds[name],
                                    held if held != usual else ())  # fmt: skip
        return sites


def tail_call(code: bytes, entry: int, targets: Mapping[int, str]) -> str | None:
    """The allocation function that the code from ``entry`` ends in a jump
    to, on its straight path (glibc's reallocarray multiplies, then jumps to
    realloc through the PLT), or None. Every conditional branch on the way
    must lead to a return that calls nothing (reallocarray's overflow returns
    NULL) or to the same jump: one that leads elsewhere (mimalloc's
    mi_heap_malloc_aligned jumps to mi_heap_malloc_small for small sizes
    only) makes it no tail call."""
    ends: set[int | None] = set()  # where each branch taken leads (_branch_end)
    for insn in disassemble(code, entry):
        if insn.mnemonic in ("ret", "hlt", "ud2", "call"):
            return None
        operand = insn.operands[0] if insn.operands else None
        if operand is None or operand.type != x86.X86_OP_IMM:
            if insn.mnemonic == "jmp":
                return None
            continue
        if insn.mnemonic == "jmp":
            jump = int(operand.imm)
            return targets.get(jump) if ends <= {RETURNS, jump} else None
        if capstone.CS_GRP_JUMP in insn.groups:
            ends.add(_branch_end(code, entry, int(operand.imm)))
    return None


RETURNS = -1  # _branch_end: the path returns, calling nothing


def _branch_end(code: bytes, entry: int, address: int) -> int | None:
    """Where the straight code at ``address`` (within ``code``) leads:
    RETURNS, the target of the jump it ends in, or None (it calls, branches
    again, or runs out of ``code``)."""
    if not entry <= address < entry + len(code):
        return None
    for insn in disassemble(code[address - entry :], address):
        if insn.mnemonic == "ret":
            return RETURNS
        if insn.mnemonic == "jmp" and insn.operands[0].type == x86.X86_OP_IMM:
            return int(insn.operands[0].imm)
        if insn.mnemonic in ("call", "hlt", "ud2") or capstone.CS_GRP_JUMP in insn.groups:
            return None
    return None


def _plt_targets(elf: ELFFile, kinds: Mapping[str, str]) -> dict[int, str]:
    """PLT stub address -> the allocation function its GOT slot is relocated to."""
    slots: dict[int, str] = {}
    for section in elf.iter_sections():
        if not isinstance(section, relocation.RelocationSection):
            continue
        symbols = elf.get_section(section.header["sh_link"])
        if not isinstance(symbols, sections.SymbolTableSection):
            continue
        for entry in section.iter_relocations():
            symbol = symbols.get_symbol(entry["r_info_sym"])
            if symbol is not None and symbol.name in kinds:
                slots[entry["r_offset"]] = symbol.name
    stubs: dict[int, str] = {}
    for name in (".plt", ".plt.sec"):
        plt = elf.get_section_by_name(name)
        if plt is None:
            continue
        for insn in disassemble(plt.data(), plt.header["sh_addr"]):
            if insn.mnemonic != "jmp" or not insn.operands:
                continue
            operand = insn.operands[0]
            if operand.type == x86.X86_OP_MEM and operand.mem.base == x86.X86_REG_RIP:
                slot = insn.address + insn.size + operand.mem.disp
                if slot in slots:
                    stub = insn.address - (insn.address - plt.header["sh_addr"]) % 16
                    stubs[stub] = slots[slot]
    return stubs
