"""A small function's x86-64 code run on symbolic values: what it computes
from its argument, read without running it.

A register holds a ``Sum`` (a constant plus multiples of the function's
argument, ``key``, and of the thread pointer, ``tp``), a ``Loaded`` value
(the bytes at such a sum), or nothing known (None). ``explore`` follows
each path through a function, both ways at every conditional jump, within a
bound, and gives back each return and each call out of it with the
registers as they are there. The instructions that compute addresses are
understood (mov, movzx, movsxd, lea, add, sub, shl, imul by a constant, xor
of a register with itself); any other leaves what it writes unknown.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..elf.lazy import lazy_module
from ..uprobe_sites import disassemble
from .image import Image

if TYPE_CHECKING:
    import capstone
    from capstone import x86
else:  # (imported at the first disassembly: mtrace_live.probes.elf.lazy)
    capstone, x86 = lazy_module("capstone"), lazy_module("capstone.x86")

MAX_STEPS = 512  # instructions run over all paths of one function
MAX_PATH = 96  # instructions of one path (a loop ends here)
CALLER_SAVED = ("rax", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11")

# Each general register's names, by its 64-bit name.
_WIDE: dict[str, str] = {}
for _base in ("ax", "bx", "cx", "dx", "si", "di", "bp", "sp"):
    _WIDE.update({f"r{_base}": f"r{_base}", f"e{_base}": f"r{_base}", _base: f"r{_base}"})
_WIDE.update(al="rax", bl="rbx", cl="rcx", dl="rdx", sil="rsi", dil="rdi", bpl="rbp", spl="rsp")
for _number in range(8, 16):
    _WIDE.update({f"r{_number}{suffix}": f"r{_number}" for suffix in ("", "d", "w", "b")})


@dataclass(frozen=True)
class Sum:
    """``const + key * key_scale + tp * tp_scale``."""

    const: int = 0
    key: int = 0  # times the function's argument
    tp: int = 0  # times the thread pointer

    def __add__(self, other: Sum) -> Sum:
        return Sum(self.const + other.const, self.key + other.key, self.tp + other.tp)

    def scaled(self, factor: int) -> Sum:
        return Sum(self.const * factor, self.key * factor, self.tp * factor)

    @property
    def plain(self) -> bool:
        """A constant: a link-time address, or a number."""
        return self.key == 0 and self.tp == 0


@dataclass(frozen=True)
class Loaded:
    """The ``size`` bytes at the address ``at``."""

    at: Sum
    size: int


Value = Sum | Loaded | None


@dataclass
class Exit:
    """Where a path leaves the function: a ``ret``, or a call (or tail
    jump) to ``target``, with the registers then."""

    kind: str  # "ret" or "call"
    address: int  # of the instruction
    target: int | None  # the callee, for a call to a known address
    registers: dict[str, Value]
    compared: frozenset[tuple[Value, int]] = field(default_factory=frozenset)
    # (value, immediate) of each `cmp` of a register with a constant on the path


def explore(image: Image, start: int, end: int, registers: dict[str, Value]) -> list[Exit]:
    """The exits of every path through the code in [start, end) from
    ``start``, the registers set to ``registers`` there. A jump out of the
    range is a tail call; a conditional jump out of it is not followed."""
    exits: list[Exit] = []
    nothing: frozenset[tuple[Value, int]] = frozenset()
    paths = [(start, dict(registers), nothing, 0)]
    total = 0
    while paths and total < MAX_STEPS:
        address, regs, compared, steps = paths.pop()
        try:
            insns = disassemble(image.code(address, end - address), address)
        except ValueError:
            continue  # not code
        for insn in insns:
            total += 1
            steps += 1
            if steps > MAX_PATH or total > MAX_STEPS:
                break
            name = insn.mnemonic.split()[-1]  # without a prefix: bnd jmp, repz ret
            target = _immediate(insn)
            if name == "ret":
                exits.append(Exit("ret", insn.address, None, dict(regs), compared))
                break
            if name in ("hlt", "ud2", "int3"):
                break  # no way on
            if name == "jmp":
                if target is not None and start <= target < end:
                    paths.append((target, regs, compared, steps))
                elif target is not None:
                    exits.append(Exit("call", insn.address, target, dict(regs), compared))
                break
            if capstone.CS_GRP_JUMP in insn.groups:  # conditional: both ways
                if target is not None and start <= target < end:
                    paths.append((target, dict(regs), compared, steps))
                continue
            if name == "call":
                exits.append(Exit("call", insn.address, target, dict(regs), compared))
                regs.update(dict.fromkeys(CALLER_SAVED))
                continue
            if name == "cmp" and len(insn.operands) == 2:
                left, right = insn.operands
                if left.type == x86.X86_OP_REG and right.type == x86.X86_OP_IMM:
                    compared = compared | {(_held(insn, left.reg, regs), right.imm)}
                continue
            step(image, insn, regs)
    return exits


def step(image: Image, insn: capstone.CsInsn, regs: dict[str, Value]) -> None:
    """Run one instruction that is not a jump, call or return on ``regs``."""
    ops = insn.operands
    written = set()
    for reg in insn.regs_access()[1]:
        wide = _register(insn, reg)
        if wide is not None and wide not in ("rsp", "rip"):
            written.add(wide)
    dest = _register(insn, ops[0].reg) if ops and ops[0].type == x86.X86_OP_REG else None
    value: Value = None
    if dest in written and ops[0].size >= 4:  # a write to an 8- or 16-bit part: unknown
        value = _computed(image, insn, regs, _held(insn, ops[0].reg, regs))
    for wide in written:
        regs[wide] = None  # what is not computed is unknown
    if dest is not None and dest in written:
        regs[dest] = value


def _computed(image: Image, insn: capstone.CsInsn, regs: dict[str, Value], old: Value) -> Value:
    """What ``insn`` writes to its first operand, a register that held ``old``."""
    ops = insn.operands
    name = insn.mnemonic
    if len(ops) == 2 and name in ("mov", "movabs", "movzx", "movsxd"):
        return _operand(image, insn, ops[1], regs)
    if len(ops) == 2 and name == "lea":
        return _address(insn, ops[1], regs)
    if len(ops) == 2 and name in ("add", "sub"):
        other = _operand(image, insn, ops[1], regs)
        if isinstance(old, Sum) and isinstance(other, Sum):
            return old + (other if name == "add" else other.scaled(-1))
        return None
    if len(ops) == 2 and name == "shl" and ops[1].type == x86.X86_OP_IMM:
        return old.scaled(1 << ops[1].imm) if isinstance(old, Sum) else None
    if len(ops) == 3 and name == "imul" and ops[2].type == x86.X86_OP_IMM:
        source = _operand(image, insn, ops[1], regs)
        return source.scaled(ops[2].imm) if isinstance(source, Sum) else None
    if len(ops) == 2 and name == "xor" and ops[1].type == x86.X86_OP_REG:
        same = _register(insn, ops[1].reg) == _register(insn, ops[0].reg)
        return Sum(0) if same else None
    return None


def _operand(image: Image, insn: capstone.CsInsn, op: x86.X86Op, regs: dict[str, Value]) -> Value:
    """The value of a source operand."""
    if op.type == x86.X86_OP_IMM:
        return Sum(int(op.imm))
    if op.type == x86.X86_OP_REG:
        return _held(insn, op.reg, regs)
    if op.type == x86.X86_OP_MEM:
        return _loaded_value(image, _address(insn, op, regs), op.size)
    return None


def _address(insn: capstone.CsInsn, op: x86.X86Op, regs: dict[str, Value]) -> Sum | None:
    """The address a memory operand names (with %fs: from the thread pointer)."""
    mem = op.mem
    total = Sum(int(mem.disp))
    if mem.segment == x86.X86_REG_FS:
        total += Sum(tp=1)
    elif mem.segment != x86.X86_REG_INVALID:
        return None
    if mem.base == x86.X86_REG_RIP:
        total += Sum(insn.address + insn.size)
    elif mem.base != x86.X86_REG_INVALID:
        base = _held(insn, mem.base, regs)
        if not isinstance(base, Sum):
            return None
        total += base
    if mem.index != x86.X86_REG_INVALID:
        index = _held(insn, mem.index, regs)
        if not isinstance(index, Sum):
            return None
        total += index.scaled(mem.scale)
    return total


def _loaded_value(image: Image, at: Sum | None, size: int) -> Value:
    """The value read from ``at``: a word the loader fills (a GOT slot)
    is known at link time; the thread control block's first word and its
    ``self`` word (glibc x86-64's tcbhead_t, at 0 and 0x10 from %fs) are
    the thread pointer itself."""
    if at is None:
        return None
    if at.plain and size == 8:
        relocated = image.relocated(at.const)
        if relocated is not None:
            return Sum(relocated)
    if at in (Sum(0, tp=1), Sum(0x10, tp=1)) and size == 8:
        return Sum(tp=1)
    return Loaded(at, size)


def _register(insn: capstone.CsInsn, reg: int) -> str | None:
    return _WIDE.get(insn.reg_name(reg) or "")


def _held(insn: capstone.CsInsn, reg: int, regs: dict[str, Value]) -> Value:
    """What register ``reg`` (of any width) holds."""
    wide = _register(insn, reg)
    return None if wide is None else regs.get(wide)


def _immediate(insn: capstone.CsInsn) -> int | None:
    ops = insn.operands
    if len(ops) == 1 and ops[0].type == x86.X86_OP_IMM:
        return int(ops[0].imm)
    return None
