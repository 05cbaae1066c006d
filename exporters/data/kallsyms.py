"""Kernel addresses to ``function+0xoffset [module]``, from a kallsyms text.

``record`` saves /proc/kallsyms beside the records, so that ``report`` names
call sites on any machine, or where /proc/kallsyms is unreadable.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from mtrace_live.probes.elf.lazy import lazy_module

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # (at the first use: probes/elf/lazy.py)


KALLSYMS = Path("/proc/kallsyms")
_TEXT_TYPES = frozenset("tTwW")
_ADDRESS = re.compile(r"[0-9a-fA-F]{1,16}")


class KernelSymbols:
    def __init__(self, text: str) -> None:
        addresses = []
        names = []
        for line in text.splitlines():
            parts = line.split()
            if len(parts) < 3 or parts[1] not in _TEXT_TYPES:
                continue
            if not _ADDRESS.fullmatch(parts[0]):
                continue  # not a 64-bit hex address (signs, overlong numbers)
            address = int(parts[0], 16)
            if address == 0:
                continue  # kptr_restrict hid the addresses
            module = f" {parts[3]}" if len(parts) > 3 else ""
            addresses.append(address)
            names.append(parts[2] + module)
        order = np.argsort(np.array(addresses, dtype=np.uint64), kind="stable")
        self._addresses = np.array(addresses, dtype=np.uint64)[order]
        self._names = [names[i] for i in order]

    def __len__(self) -> int:
        return len(self._names)

    @classmethod
    def load(cls, path: Path = KALLSYMS) -> KernelSymbols:
        try:
            return cls(path.read_text(encoding="ascii", errors="replace"))
        except OSError:
            return cls("")

    def function(self, address: int) -> tuple[str, int, str] | None:
        """(function, offset, "[module]" or "") for a text address, or None."""
        if not self._names or not 0 < address < 1 << 64:
            return None
        index = int(np.searchsorted(self._addresses, np.uint64(address), side="right")) - 1
        if index < 0:
            return None
        name, _, module = self._names[index].partition(" ")
        return name, address - int(self._addresses[index]), module

    def module_range(self, module: str) -> tuple[int, int] | None:
        """The lowest and highest text symbol address of a module ("" for
        the kernel itself), or None."""
        wanted = [i for i, name in enumerate(self._names) if name.partition(" ")[2] == module]
        if not wanted:
            return None
        return int(self._addresses[wanted[0]]), int(self._addresses[wanted[-1]])

    def describe(self, address: int) -> str:
        found = self.function(address)
        if found is None:
            return f"{address:#x}"
        name, offset, module = found
        return f"{name}+{offset:#x}" + (f" {module}" if module else "")


def saved_text() -> str:
    """The live kallsyms, for saving beside records ("" if unreadable)."""
    try:
        return KALLSYMS.read_text(encoding="ascii", errors="replace")
    except OSError:
        return ""
