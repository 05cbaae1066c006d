"""Where to probe the libc's lock-wait slow path, ``__lll_lock_wait_private``.

glibc takes its internal locks with ``lll_lock``: an atomic exchange and,
when the lock was held, a call of ``__lll_lock_wait_private(futex)``, which
sleeps on the futex until the lock is free and returns holding it. The time
from its entry to its return is a wait (tracer/loop/lock_waits.py times it).

Its first instruction loads the lock (``mov (%rdi),%eax``), which the kernel
would single-step for a uprobe: about 15 us a wait here, measured. The
entry and the return probes both stand instead at the first instruction the
kernel emulates on the straight path from the entry, before any write to
%rdi or %rsp, and where no jump in the function lands on the way
(probes/uprobe_sites.py: ``first_emulated``): the futex and the return
address are still where the entry had them, and the site is passed as often
as the entry is. The function is exported (GLIBC_PRIVATE) by every glibc that
has it, with SDT notes or without.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .elf.facts import file_fact, kept_type
from .elf.file import code_at, open_elf
from .elf.symbols import STT_FUNC, symbols_by_name
from .uprobe_sites import disassemble, first_emulated, jump_targets

WAIT_FUNCTION = "__lll_lock_wait_private"
SCAN_BYTES = 512  # the function's bytes looked at for jumps back (its size, if smaller)


@kept_type
@dataclass(frozen=True)
class LockWaitSite:
    entry: int  # the function's address
    address: int  # the probes' address
    file_offset: int
    instruction: str
    emulated: bool  # False: the entry, single-stepped


@file_fact
def lock_wait_site(path: Path) -> LockWaitSite | None:
    """The site in ``path``, or None when it exports no such function."""
    with open_elf(path) as elf:
        found = symbols_by_name(elf, (".dynsym", ".symtab"), frozenset({STT_FUNC}))
        entry, size = found.get(WAIT_FUNCTION, (0, 0))
        if not entry:
            return None
        code, bias = code_at(elf, entry, entry + min(size or SCAN_BYTES, SCAN_BYTES), clamp=True)
    insns = disassemble(code, entry)
    site = first_emulated(insns, entry, ("rdi",), jump_targets(insns))
    return LockWaitSite(entry, site.address, site.address - bias, site.instruction, site.emulated)
