"""Where a uprobe costs least: the one answer, for every probe mtrace-live
places by disassembly, to "the first instruction at or after X that the
kernel emulates, on the straight path, with no jump back to it, before
register R or the stack is written".

The kernel single-steps the instruction under a uprobe out of line (a
second trap, about 15 us here) unless it can emulate it: a push of a
register, a one-byte nop, a relative jump or call, a conditional jump
(arch/x86/kernel/uprobes.c: branch_setup_xol_ops, push_setup_xol_ops). A
probe moved from X to such an instruction sees what X would have seen as
long as, on the way there:

- no jump lands, so every pass through X passes it exactly once (a jump to
  X itself is a pass through X, and passes it too);
- nothing writes the registers the probe reads (R) or the stack pointer
  (an entry probe reads the return address at the top of the stack);
- the code neither returns nor leaves for the kernel, nor jumps away by a
  jump the kernel does not emulate (through a register or memory): what
  follows such a jump is not on the straight path.

Its callers: the allocation functions' entries (probes/alloc_sites.py),
the libc's lock-wait slow path (probes/lock_sites.py) and the memory_*
probes derived for a libc without SDT notes (probes/derived.py).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .elf.lazy import lazy_module

if TYPE_CHECKING:
    import capstone
    from capstone import x86
else:  # (imported at the first disassembly: mtrace_live.probes.elf.lazy)
    capstone, x86 = lazy_module("capstone"), lazy_module("capstone.x86")


# The 64-bit register each narrower name is part of.
WIDE = {
    **{f"{r}{s}": f"r{r}" for r in ("8", "9", "10", "11", "12", "13", "14", "15")
       for s in ("", "d", "w", "b")},
    **{n: "rdi" for n in ("rdi", "edi", "di", "dil")},
    **{n: "rsi" for n in ("rsi", "esi", "si", "sil")},
    **{n: "rdx" for n in ("rdx", "edx", "dx", "dl", "dh")},
    **{n: "rcx" for n in ("rcx", "ecx", "cx", "cl", "ch")},
    **{n: "rax" for n in ("rax", "eax", "ax", "al", "ah")},
    **{n: "rbx" for n in ("rbx", "ebx", "bx", "bl", "bh")},
    **{n: "rbp" for n in ("rbp", "ebp", "bp", "bpl")},
    **{n: "rsp" for n in ("rsp", "esp", "sp", "spl")},
}  # fmt: skip
# The registers an argument may be read from at a site (records.h's enum
# site_reg), in the order one is preferred when it is in several.
SITE_REGISTERS = ("rdi", "rsi", "rdx", "rcx", "r8", "r9", "rax", "r10", "r11", "rbx", "rbp",
                  "r12", "r13", "r14", "r15")  # fmt: skip
_ENDS = ("ret", "hlt", "ud2", "syscall")  # the straight path ends there


@dataclass(frozen=True)
class Site:
    address: int
    instruction: str  # as capstone prints it, e.g. "push r12"
    emulated: bool  # False: X itself, single-stepped
    registers: tuple[str, ...]  # where each register asked for is at the site


def disassemble(code: bytes, address: int) -> list[capstone.CsInsn]:
    """The instructions of ``code`` (the bytes at ``address``), in detail."""
    disassembler = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    disassembler.detail = True
    return list(disassembler.disasm(code, address))


def text(insn: capstone.CsInsn) -> str:
    return f"{insn.mnemonic} {insn.op_str}".strip()


def emulated(insn: capstone.CsInsn) -> bool:
    """The kernel emulates this instruction for a uprobe (arch/x86/kernel/uprobes.c:
    branch_setup_xol_ops and push_setup_xol_ops)."""
    if insn.mnemonic == "push" and len(insn.operands) == 1:
        return bool(insn.operands[0].type == x86.X86_OP_REG)
    if insn.mnemonic == "nop" and insn.size == 1:
        return True
    if insn.mnemonic in ("jmp", "call"):
        return bool(insn.operands[0].type == x86.X86_OP_IMM)  # relative, not through memory
    return capstone.CS_GRP_JUMP in set(insn.groups) and insn.mnemonic.startswith("j")


def jump_targets(insns: Iterable[capstone.CsInsn]) -> set[int]:
    """Where the direct jumps and calls among ``insns`` land."""
    found = set()
    for insn in insns:
        if insn.mnemonic.startswith("j") or insn.mnemonic == "call":
            operand = insn.operands[0] if insn.operands else None
            if operand is not None and operand.type == x86.X86_OP_IMM:
                found.add(int(operand.imm))
    return found


def written(insn: capstone.CsInsn) -> set[str]:
    """The registers ``insn`` writes, by their 64-bit names."""
    _, registers = insn.regs_access()
    return {WIDE.get(insn.reg_name(reg), insn.reg_name(reg)) for reg in registers}


def first_emulated(insns: Sequence[capstone.CsInsn], start: int, registers: Sequence[str],
                   targets: Collection[int] = (), limit: int | None = None,
                   follow_moves: bool = False) -> Site:  # fmt: skip
    """The site for a probe at ``start`` (the address of one of ``insns``,
    which run on from it): the first instruction at or after it that the
    kernel emulates, before any of ``registers`` or the stack pointer is
    written, the code returns or traps, or an instruction one of
    ``targets`` names (where jumps land) is passed; looked for in ``limit``
    instructions at most. Else ``start`` itself.

    With ``follow_moves`` a register copied whole to another (``mov rsi,
    rdi``) is followed there, and the site may lie past writes to the
    first so long as each register asked for is still in one (mimalloc's
    mi_malloc moves the size to rsi, then loads its heap into rdi): the
    site then says where each went (``Site.registers``)."""
    first = next((i for i, insn in enumerate(insns) if insn.address == start), None)
    if first is None:
        raise ValueError(f"no instruction at {start:#x}")
    held = [{register} for register in registers]  # the registers holding each one asked for
    end = len(insns) if limit is None else min(len(insns), first + limit)
    for insn in insns[first:end]:
        if insn.address != start and insn.address in targets:
            break
        if emulated(insn):
            where = tuple(asked if asked in now else min(now, key=SITE_REGISTERS.index)
                          for asked, now in zip(registers, held, strict=True))  # fmt: skip
            return Site(insn.address, text(insn), True, where)
        wide = written(insn)
        if "rsp" in wide or insn.mnemonic in _ENDS or capstone.CS_GRP_JUMP in set(insn.groups):
            break  # (a jump here is one not emulated: jmp rax, jmp [rip + x], notrack jmp)
        copy = _register_copy(insn) if follow_moves else None
        for now in held:
            copied = copy is not None and copy[1] in now
            now -= wide
            if copied and copy is not None:
                now.add(copy[0])
        if not all(held):
            break
    return Site(start, text(insns[first]), False, tuple(registers))


def _register_copy(insn: capstone.CsInsn) -> tuple[str, str] | None:
    """(destination, source) of a whole 64-bit register copied to another
    (``mov rsi, rdi``), or None."""
    if insn.mnemonic != "mov" or len(insn.operands) != 2:
        return None
    target, source = insn.operands
    if target.type != x86.X86_OP_REG or source.type != x86.X86_OP_REG:
        return None
    names = insn.reg_name(target.reg), insn.reg_name(source.reg)
    return names if all(name in SITE_REGISTERS for name in names) else None
