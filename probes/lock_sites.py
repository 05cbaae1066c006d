"""Where to probe the libc's lock-wait slow path, ``__lll_lock_wait_private``.

glibc takes its internal locks with ``lll_lock``: an atomic exchange and,
when the lock was held, a call of ``__lll_lock_wait_private(futex)``, which
sleeps on the futex until the lock is free and returns holding it. The time
from its entry to its return is a wait (tracer/lock_waits.py times it).

Its first instruction loads the lock (``mov (%rdi),%eax``), which the kernel
would single-step for a uprobe: about 15 us a wait here, measured. The
entry and the return probes both stand instead at the first instruction the
kernel emulates on the straight path from the entry, before any write to
%rdi or %rsp (probes/alloc_sites.py: ``choose``), so that the futex and the
return address are still where the entry had them; and only where no jump
in the function comes back to it or before it, so that every call passes it
exactly once. The function is exported (GLIBC_PRIVATE) by every glibc that
has it, with SDT notes or without.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import capstone

from .alloc_sites import choose
from .elf.file import code_at, open_elf
from .elf.symbols import STT_FUNC, symbols_by_name

WAIT_FUNCTION = "__lll_lock_wait_private"
SCAN_BYTES = 512  # the function's bytes looked at for jumps back (its size, if smaller)


@dataclass(frozen=True)
class LockWaitSite:
    entry: int  # the function's address
    address: int  # the probes' address
    file_offset: int
    instruction: str
    emulated: bool  # False: the entry, single-stepped


def _jumps_back_to(code: bytes, entry: int, site: int) -> bool:
    """A jump in ``code`` (the function from ``entry``) lands at or before ``site``."""
    disassembler = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    disassembler.detail = True
    for insn in disassembler.disasm(code, entry):
        if capstone.CS_GRP_JUMP not in insn.groups or insn.address == site:
            continue
        if not insn.operands or insn.operands[0].type != capstone.x86.X86_OP_IMM:
            continue  # through a register or memory: not a jump back within reach
        if entry <= insn.operands[0].imm <= site:
            return True
    return False


def lock_wait_site(path: Path) -> LockWaitSite | None:
    """The site in ``path``, or None when it exports no such function."""
    with open_elf(path) as elf:
        found = symbols_by_name(elf, (".dynsym", ".symtab"), frozenset({STT_FUNC}))
        entry, size = found.get(WAIT_FUNCTION, (0, 0))
        if not entry:
            return None
        code, bias = code_at(elf, entry, entry + min(size or SCAN_BYTES, SCAN_BYTES), clamp=True)
    address, text, fast = choose(code, entry, ("rdi",))
    if fast and _jumps_back_to(code, entry, address):
        address, fast = entry, False
        text = "the entry"
    return LockWaitSite(entry, address, address - bias, text, fast)
