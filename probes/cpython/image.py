"""An ELF file's contents at link-time addresses, as the dynamic loader
leaves them: the words a dynamic relocation fills read as what it puts
there, and the functions a call's target stands for (a PLT stub or a
symbol).

In an executable linked at a fixed address the stored words are final. In
a position-independent file the loader writes pointers: an
``R_X86_64_RELATIVE`` word becomes its addend (the file may store the addend
in place too, or 0), an ``R_X86_64_64`` or ``GLOB_DAT`` word the address of
its symbol. Both read here as link-time addresses, with the file's own
definition of each symbol (what the loader binds unless another object
interposes one).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING

from ..elf.file import LoadSegment, file_offset, load_segments
from ..elf.lazy import lazy_dtype, lazy_module
from ..elf.symbols import STT_FUNC, STT_GNU_IFUNC, SymbolTable, symbol_table
from ..uprobe_sites import disassemble

if TYPE_CHECKING:
    import numpy as np
    from capstone import x86
    from elftools.elf.elffile import ELFFile
    from elftools.elf.sections import Section
else:  # (imported at the first disassembly: mtrace_live.probes.elf.lazy)
    x86 = lazy_module("capstone.x86")
    np = lazy_module("numpy")  # (at the first use: probes/elf/lazy.py)

R_X86_64_64 = 1
R_X86_64_GLOB_DAT = 6
R_X86_64_JUMP_SLOT = 7
R_X86_64_RELATIVE = 8
_RELA = lazy_dtype([("offset", "<u8"), ("info", "<u8"), ("addend", "<i8")])
SHF_ALLOC = 2


class Image:
    """The loadable contents of an open ELF file (x86-64, little-endian),
    read by link-time address. The file stays open as long as ``elf``."""

    def __init__(self, elf: ELFFile) -> None:
        self.elf = elf
        self.segments: list[LoadSegment] = load_segments(elf)
        self.dynsym: SymbolTable | None = symbol_table(elf, ".dynsym")
        self.symtab: SymbolTable | None = symbol_table(elf, ".symtab")
        offsets, infos, addends = [], [], []
        for section in _dynamic_relocations(elf):
            data = section.data()
            table = np.frombuffer(data, dtype=_RELA, count=len(data) // _RELA.itemsize)
            offsets.append(table["offset"])
            infos.append(table["info"])
            addends.append(table["addend"])
        merged = np.concatenate(offsets) if offsets else np.zeros(0, "<u8")
        order = np.argsort(merged, kind="stable")
        self._reloc_at = merged[order]
        self._reloc_info = (np.concatenate(infos) if infos else np.zeros(0, "<u8"))[order]
        self._reloc_addend = (np.concatenate(addends) if addends else np.zeros(0, "<i8"))[order]
        self._functions: dict[int, str] | None = None

    # ---- data ----------------------------------------------------------

    def read(self, address: int, size: int) -> bytes:
        """The ``size`` bytes at ``address`` as the file initialises them
        (zeros past a segment's file size); ValueError outside every segment."""
        out = bytearray()
        while size > 0:
            segment = next((s for s in self.segments
                            if s.vaddr <= address < s.vaddr + s.memsz), None)  # fmt: skip
            if segment is None:
                raise ValueError(f"{address:#x} is in no loadable segment")
            take = min(size, segment.vaddr + segment.memsz - address)
            in_file = max(0, min(take, segment.vaddr + segment.filesz - address))
            if in_file:
                offset = file_offset([segment], address)
                assert offset is not None
                stream: IO[bytes] = self.elf.stream
                stream.seek(offset)
                chunk = stream.read(in_file)
                if len(chunk) != in_file:
                    raise ValueError(f"{address:#x}: the file is truncated")
                out += chunk
            out += bytes(take - in_file)
            address += take
            size -= take
        return bytes(out)

    def relocated(self, address: int) -> int | None:
        """What the loader writes in the word at ``address`` (a link-time
        address), or None when no dynamic relocation covers it."""
        at = int(np.searchsorted(self._reloc_at, address))
        if at >= len(self._reloc_at) or int(self._reloc_at[at]) != address:
            return None
        info = int(self._reloc_info[at])
        kind, index, addend = info & 0xFFFFFFFF, info >> 32, int(self._reloc_addend[at])
        if kind == R_X86_64_RELATIVE:
            return addend
        if kind in (R_X86_64_64, R_X86_64_GLOB_DAT, R_X86_64_JUMP_SLOT):
            symbol = self._dynamic_symbol(index)
            if symbol is None or not symbol[1]:
                return None  # a symbol of another object: bound at load time
            return symbol[1] + (addend if kind == R_X86_64_64 else 0)
        return None

    def word(self, address: int) -> int:
        """The 64-bit word at ``address``, relocated."""
        relocated = self.relocated(address)
        if relocated is not None:
            return relocated
        value: int = struct.unpack("<Q", self.read(address, 8))[0]
        return value

    def u32(self, address: int) -> int:
        value: int = struct.unpack("<I", self.read(address, 4))[0]
        return value

    def cstring(self, address: int, limit: int = 256) -> str:
        """The NUL-terminated string at ``address`` (at most ``limit`` bytes)."""
        data = self.read(address, limit) if address else b""
        return data.split(b"\0", 1)[0].decode("ascii", "replace")

    # ---- code ----------------------------------------------------------

    def code(self, address: int, size: int) -> bytes:
        """Up to ``size`` bytes of code at ``address`` (cut at its segment's end)."""
        segment = next((s for s in self.segments if s.executable
                        and s.vaddr <= address < s.vaddr + s.filesz), None)  # fmt: skip
        if segment is None:
            raise ValueError(f"{address:#x} is in no executable segment")
        return self.read(address, min(size, segment.vaddr + segment.filesz - address))

    def function_at(self, address: int) -> str | None:
        """The function a call to ``address`` reaches: the symbol a PLT stub
        there jumps through, else a function symbol of the file that starts
        there."""
        stub = self._plt_target(address)
        if stub is not None:
            return stub
        if self._functions is None:
            self._functions = {}
            for table in (self.dynsym, self.symtab):
                for symbol in table or ():
                    if symbol.defined and symbol.type in (STT_FUNC, STT_GNU_IFUNC):
                        self._functions.setdefault(symbol.value, symbol.name)
        return self._functions.get(address)

    def _plt_target(self, address: int) -> str | None:
        # A stub is `[endbr64;] [bnd] jmp *slot(%rip)`; the slot's relocation names it.
        try:
            insns = disassemble(self.code(address, 16), address)
        except ValueError:
            return None
        insns = [insn for insn in insns[:2] if insn.mnemonic != "endbr64"][:1]
        if not insns or not insns[0].mnemonic.endswith("jmp") or not insns[0].operands:
            return None
        jump = insns[0]
        operand = jump.operands[0]
        if operand.type != x86.X86_OP_MEM or operand.mem.base != x86.X86_REG_RIP:
            return None
        slot = jump.address + jump.size + operand.mem.disp
        at = int(np.searchsorted(self._reloc_at, slot))
        if at >= len(self._reloc_at) or int(self._reloc_at[at]) != slot:
            return None
        symbol = self._dynamic_symbol(int(self._reloc_info[at]) >> 32)
        return None if symbol is None else symbol[0]

    def _dynamic_symbol(self, index: int) -> tuple[str, int] | None:
        """(name, value) of the .dynsym entry ``index``; value 0 when undefined."""
        if self.dynsym is None or not 0 < index < len(self.dynsym):
            return None
        return self.dynsym.names[index], int(self.dynsym.value[index])


def _dynamic_relocations(elf: ELFFile) -> Iterator[Section]:
    """The SHT_RELA sections the loader applies (allocated ones)."""
    for section in elf.iter_sections():
        if section["sh_type"] == "SHT_RELA" and section["sh_flags"] & SHF_ALLOC:
            yield section
