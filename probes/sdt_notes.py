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

from .elf.facts import file_fact, kept_type
from .elf.file import LoadSegment, elf_failures, file_offset, load_segments, not_elf, open_elf
from .errors import MalformedNoteError, TargetError

NT_STAPSDT = 3
_OWNER = b"stapsdt\0"


@kept_type
@dataclass(frozen=True)
class SdtSite:
    """One probe site: where in the file it is and how its arguments are found."""

    provider: str
    name: str
    address: int  # link-time virtual address of the site, base-adjusted
    file_offset: int  # what a uprobe attaches to
    semaphore: int  # 0 when the probe has none
    arguments: tuple[str, ...]  # e.g. ("8@%rcx", "-8@%r15")
    base: int = 0  # the .stapsdt.base address the note was linked against

    @property
    def qualified_name(self) -> str:
        return f"{self.provider}:{self.name}"


@file_fact
def read_sites(path: str | Path) -> list[SdtSite]:
    """All SDT probe sites of an ELF file, in note order. Raises TargetError
    (unreadable), NotElfError (exit 9) or MalformedNoteError (exit 10)."""
    with open_elf(path) as elf:
        try:
            notes = elf.get_section_by_name(".note.stapsdt")
            data = notes.data() if notes is not None else b""
            base_section = elf.get_section_by_name(".stapsdt.base")
            actual_base = base_section["sh_addr"] if base_section is not None else None
            loads = load_segments(elf)
            layout = _Layout(elf.little_endian, 8 if elf.elfclass == 64 else 4, actual_base)
        except elf_failures() as exc:
            raise not_elf(path, exc) from None
        except OSError as exc:
            raise TargetError(f"{path}: {exc.strerror}") from None
        return list(_sites(data, layout, loads, path))


@dataclass(frozen=True)
class _Layout:
    little_endian: bool
    address_size: int
    actual_base: int | None  # where .stapsdt.base really is, if present


def _sites(
    data: bytes, layout: _Layout, loads: Sequence[LoadSegment], path: str | Path
) -> Iterator[SdtSite]:
    byte_order = "<" if layout.little_endian else ">"
    address_format = byte_order + ("QQQ" if layout.address_size == 8 else "III")
    header_format = byte_order + "III"
    offset = 0
    while offset < len(data):
        if offset + 12 > len(data):
            raise MalformedNoteError(f"{path}: .note.stapsdt ends inside a note header")
        namesz, descsz, note_type = struct.unpack_from(header_format, data, offset)
        offset += 12
        if offset + _align4(namesz) + descsz > len(data):
            raise MalformedNoteError(f"{path}: a note in .note.stapsdt runs past its section")
        owner = data[offset : offset + namesz]
        offset += _align4(namesz)
        desc = data[offset : offset + descsz]
        offset += _align4(descsz)
        if note_type != NT_STAPSDT or owner != _OWNER:
            continue
        yield _site(desc, layout, address_format, loads, path)


def _site(
    desc: bytes,
    layout: _Layout,
    address_format: str,
    loads: Sequence[LoadSegment],
    path: str | Path,
) -> SdtSite:
    head = 3 * layout.address_size
    strings = desc[head:].split(b"\0")
    if len(desc) < head or len(strings) < 4:
        raise MalformedNoteError(f"{path}: a stapsdt note lacks its addresses or strings")
    pc, link_base, semaphore = struct.unpack_from(address_format, desc, 0)
    if layout.actual_base is not None and link_base:
        pc += layout.actual_base - link_base
        if semaphore:
            semaphore += layout.actual_base - link_base
    try:
        provider, name, args = (s.decode("ascii") for s in strings[:3])
    except UnicodeDecodeError:
        raise MalformedNoteError(f"{path}: a stapsdt note has non-ASCII names") from None
    if not provider or not name:
        raise MalformedNoteError(f"{path}: a stapsdt note has an empty provider or name")
    offset = file_offset(loads, pc)
    if offset is None:
        raise MalformedNoteError(f"{path}: probe {provider}:{name} at {pc:#x} is outside the file")
    return SdtSite(
        provider=provider,
        name=name,
        address=pc,
        file_offset=offset,
        semaphore=semaphore,
        arguments=tuple(args.split()),
        base=link_base,
    )


def _align4(size: int) -> int:
    return (size + 3) & ~3
