"""Reading SystemTap SDT probe notes (``.note.stapsdt``) from ELF files.

Each probe site is one ELF note of type NT_STAPSDT (3), owner "stapsdt". Its
descriptor holds three addresses (the site, the link-time address of the
``.stapsdt.base`` section, the semaphore) followed by three NUL-terminated
strings: provider, probe name, argument specification such as
``-4@%esi 8@32+mp_(%rip)``. When a file was prelinked or otherwise moved
after linking, the difference between the recorded base and the actual
address of ``.stapsdt.base`` must be added to the site and semaphore.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.segments import Segment

NT_STAPSDT = 3
_OWNER = b"stapsdt\0"


class SdtNoteError(Exception):
    """The file is not a readable ELF file, or its SDT notes are malformed."""


@dataclass(frozen=True)
class SdtSite:
    """One probe site: where in the file it is and how its arguments are found."""

    provider: str
    name: str
    address: int  # link-time virtual address of the site, base-adjusted
    file_offset: int  # what a uprobe attaches to
    semaphore: int  # 0 when the probe has none
    arguments: tuple[str, ...]  # e.g. ("8@%rcx", "-8@%r15")

    @property
    def qualified_name(self) -> str:
        return f"{self.provider}:{self.name}"


def read_sites(path: str | Path) -> list[SdtSite]:
    """All SDT probe sites of an ELF file, in note order."""
    try:
        with open(path, "rb") as stream:
            elf = ELFFile(stream)
            return list(_sites(elf))
    except (ELFError, struct.error) as exc:
        raise SdtNoteError(f"{path}: not a readable ELF file ({exc})") from None
    except OSError as exc:
        raise SdtNoteError(f"{path}: {exc.strerror}") from None


def _sites(elf: ELFFile) -> Iterator[SdtSite]:
    notes = elf.get_section_by_name(".note.stapsdt")
    if notes is None:
        return
    base_section = elf.get_section_by_name(".stapsdt.base")
    actual_base = base_section["sh_addr"] if base_section is not None else None
    address_size = 8 if elf.elfclass == 64 else 4
    byte_order = "<" if elf.little_endian else ">"
    address_format = byte_order + ("QQQ" if address_size == 8 else "III")
    header_format = byte_order + "III"
    loads = [seg for seg in elf.iter_segments() if seg["p_type"] == "PT_LOAD"]
    data = notes.data()
    offset = 0
    while offset + 12 <= len(data):
        namesz, descsz, note_type = struct.unpack_from(header_format, data, offset)
        offset += 12
        owner = data[offset : offset + namesz]
        offset += _align4(namesz)
        desc = data[offset : offset + descsz]
        offset += _align4(descsz)
        if note_type != NT_STAPSDT or owner != _OWNER:
            continue
        pc, link_base, semaphore = struct.unpack_from(address_format, desc, 0)
        strings = desc[3 * address_size :].split(b"\0")
        if len(strings) < 3:
            raise SdtNoteError("truncated stapsdt note")
        if actual_base is not None and link_base:
            pc += actual_base - link_base
            if semaphore:
                semaphore += actual_base - link_base
        provider, name, args = (s.decode("ascii", errors="replace") for s in strings[:3])
        yield SdtSite(
            provider=provider,
            name=name,
            address=pc,
            file_offset=_file_offset(loads, pc),
            semaphore=semaphore,
            arguments=tuple(args.split()),
        )


def _align4(size: int) -> int:
    return (size + 3) & ~3


def _file_offset(loads: Sequence[Segment], vaddr: int) -> int:
    for seg in loads:
        start = seg["p_vaddr"]
        if start <= vaddr < start + seg["p_filesz"]:
            return int(vaddr - start + seg["p_offset"])
    raise SdtNoteError(f"probe address {vaddr:#x} lies in no loadable segment")
