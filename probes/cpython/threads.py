"""Where glibc keeps a thread's value of a pthread key: what a reader of a
thread's memory needs to find the PyThreadState an interpreter stored under
its thread-state key.

For a key below 32 (glibc's PTHREAD_KEY_2NDLEVEL_SIZE) the value lies in
the thread's ``struct pthread``, at ``tp + base + key * stride`` (on x86-64
the thread pointer, the %fs base, is the ``struct pthread *`` itself, and is
what ``pthread_self()`` returns). ``thread_slot`` reads base and stride
from the libc's own ``pthread_getspecific``.
"""

from __future__ import annotations

from pathlib import Path

from ..elf.facts import file_fact
from ..elf.file import elf_failures, not_elf, open_elf
from ..elf.symbols import symbols_by_name
from ..errors import UnknownLayoutError
from .image import Image
from .symbolic import Loaded, Sum, explore

FIRST_BLOCK = 32  # glibc's PTHREAD_KEY_2NDLEVEL_SIZE: keys with a slot in struct pthread


@file_fact
def thread_slot(libc: Path) -> tuple[int, int]:
    """(base, stride): where ``pthread_getspecific(key)`` of the libc at
    ``libc`` finds a key's value for a key below 32, from the thread
    pointer: at ``tp + base + key * stride``. Read from the function's code:
    the value it returns on the path where it checks the key against 31 and
    loads from the thread pointer, and kept between runs (probes/elf/facts.py).
    UnknownLayoutError (one line) when the code does not read that way."""
    with open_elf(libc) as elf:
        try:
            symbols = symbols_by_name(elf, (".dynsym", ".symtab"))
            if "pthread_getspecific" not in symbols:
                raise UnknownLayoutError(f"{libc}: no pthread_getspecific among its symbols")
            start, size = symbols["pthread_getspecific"]
            exits = explore(Image(elf), start, start + (size or 256), {"rdi": Sum(key=1)})
        except (ValueError, *elf_failures()) as exc:
            raise not_elf(libc, exc) from None
    found = set()
    for exit in exits:
        value = exit.registers.get("rax")
        if (exit.kind == "ret" and isinstance(value, Loaded) and value.size == 8
                and value.at.tp == 1 and value.at.key > 0
                and (Sum(key=1), FIRST_BLOCK - 1) in exit.compared):  # fmt: skip
            found.add((value.at.const, value.at.key))
    if len(found) != 1:
        raise UnknownLayoutError(f"{libc}: pthread_getspecific's code does not say where a "
                                 "key's value is in struct pthread")  # fmt: skip
    return found.pop()
