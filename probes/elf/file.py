"""Opening an ELF file, and what every reader of one needs: its build-id,
its loadable segments, where a link-time address is in the file, and the
code at an address.

pyelftools reads the file; what it raises on a damaged one is
``elf_failures()``, and ``open_elf`` turns it into ``NotElfError`` (exit 9).
"""

from __future__ import annotations

import contextlib
import io
import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple

from elftools.common.exceptions import DWARFError, ELFError

from ..errors import NotElfError, TargetError
from .facts import file_fact, kept_type
from .lazy import lazy_module

if TYPE_CHECKING:
    from elftools.elf import dynamic, elffile, sections
    from elftools.elf.elffile import ELFFile
else:  # (pyelftools' parser is imported where a file is first opened)
    dynamic, elffile = lazy_module("elftools.elf.dynamic"), lazy_module("elftools.elf.elffile")
    sections = lazy_module("elftools.elf.sections")


_Failure = type[Exception]
Failures = tuple[_Failure, _Failure, _Failure, _Failure, _Failure, _Failure, _Failure, _Failure,
                 _Failure]  # fmt: skip


def elf_failures() -> Failures:
    """What pyelftools may raise on a damaged file (its parser's own error
    imported only here: an except clause asks for it when something was raised)."""
    from elftools.construct import ConstructError

    return (ELFError, DWARFError, ConstructError, struct.error, ValueError, EOFError,
            OverflowError, IndexError, KeyError)  # fmt: skip


PF_X = 1


def load_parser() -> None:
    """Import pyelftools' parser now (what ``open_elf`` and the readers here
    use): the file server's first work in its forked child
    (tracer/unwind/file_server.py), bounded there by an alarm, since a
    module's import lock may be held, at the fork, by a thread the child does
    not have."""
    for module, name in ((elffile, "ELFFile"), (sections, "NoteSection"),
                         (dynamic, "DynamicSection")):  # fmt: skip
        getattr(module, name)
    elf_failures()


def not_elf(path: str | Path, exc: BaseException) -> NotElfError:
    return NotElfError(f"{path}: not a readable ELF file ({exc or 'truncated'})")


@contextlib.contextmanager
def open_elf(path: str | Path, in_memory: int = 0) -> Iterator[ELFFile]:
    """The file, parsed: TargetError when it cannot be opened, NotElfError
    when it is not ELF (what the body raises goes through unchanged).
    ``in_memory``: a file of at most that many bytes is read whole first, in
    one read, and parsed from memory (each of pyelftools' many small reads
    would otherwise let another thread take the interpreter lock)."""
    try:
        stream: BinaryIO = open(path, "rb")  # noqa: SIM115 (closed below)
        if in_memory and os.fstat(stream.fileno()).st_size <= in_memory:
            with stream:
                stream = io.BytesIO(stream.read())
    except OSError as exc:
        raise TargetError(f"{path}: {exc.strerror}") from None
    with stream:
        try:
            elf = elffile.ELFFile(stream)
        except elf_failures() as exc:
            raise not_elf(path, exc) from None
        yield elf


def build_id(elf: ELFFile) -> str | None:
    """The GNU build-id, in hex, or None."""
    for section in elf.iter_sections():
        if isinstance(section, sections.NoteSection):
            for note in section.iter_notes():
                if note["n_type"] == "NT_GNU_BUILD_ID":
                    return str(note["n_desc"])
    return None


@file_fact
def build_id_of(path: Path) -> str | None:
    """The build-id of the file at ``path``; None when it has none or
    cannot be read."""
    try:
        with open_elf(path) as elf:
            return build_id(elf)
    except (OSError, NotElfError, TargetError, *elf_failures()):
        return None


def debuglink(elf: ELFFile) -> str | None:
    """The name in ``.gnu_debuglink``, or None."""
    section = elf.get_section_by_name(".gnu_debuglink")
    if section is None:
        return None
    return section.data().split(b"\0", 1)[0].decode(errors="replace") or None


@kept_type
class LoadSegment(NamedTuple):
    """One PT_LOAD segment."""

    offset: int
    vaddr: int
    filesz: int
    memsz: int
    flags: int

    @property
    def executable(self) -> bool:
        return bool(self.flags & PF_X)


def load_segments(elf: ELFFile) -> list[LoadSegment]:
    return [LoadSegment(s["p_offset"], s["p_vaddr"], s["p_filesz"], s["p_memsz"], s["p_flags"])
            for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]  # fmt: skip


Layout = tuple[str | None, tuple[LoadSegment, ...]]  # (build-id, PT_LOAD segments)


def layout_of(elf: ELFFile) -> Layout:
    return build_id(elf), tuple(load_segments(elf))


@file_fact
def elf_layout(path: Path) -> Layout:
    """The build-id and PT_LOAD segments of the file at ``path`` (kept:
    facts.peek finds them without opening it)."""
    with open_elf(path) as elf:
        return layout_of(elf)


def file_offset(segments: Sequence[LoadSegment], vaddr: int) -> int | None:
    """Where the byte at link-time address ``vaddr`` is in the file."""
    for segment in segments:
        if segment.vaddr <= vaddr < segment.vaddr + segment.filesz:
            return vaddr - segment.vaddr + segment.offset
    return None


def vaddr_at(segments: Sequence[LoadSegment], offset: int) -> int | None:
    """The link-time address of the byte at file ``offset`` (within a
    segment's size in memory)."""
    for segment in segments:
        if segment.offset <= offset < segment.offset + segment.memsz:
            return offset - segment.offset + segment.vaddr
    return None


def code_at(elf: ELFFile, begin: int, end: int, clamp: bool = False) -> tuple[bytes, int]:
    """The bytes [begin, end) of the executable segment holding them, and
    that segment's vaddr less its file offset. ``clamp``: up to ``end`` or
    the segment's end, whichever comes first. ValueError when no executable
    segment holds them."""
    for segment in elf.iter_segments():
        if segment["p_type"] != "PT_LOAD" or not segment["p_flags"] & PF_X:
            continue
        start = segment["p_vaddr"]
        stop = start + segment["p_filesz"]
        if clamp and start <= begin < stop:
            end = min(end, stop)
        if start <= begin and end <= stop:
            return bytes(segment.data()[begin - start : end - start]), start - segment["p_offset"]
    raise ValueError(f"{begin:#x}-{end:#x} is in no executable segment")


def needed(elf: ELFFile) -> list[str]:
    """The sonames the file names in DT_NEEDED, in order (none for a
    static executable)."""
    return [str(tag.needed) for tag in _dynamic_tags(elf, "DT_NEEDED")]


def soname(elf: ELFFile) -> str | None:
    """The file's DT_SONAME (libjemalloc.so.2), if it has one."""
    return next((str(tag.soname) for tag in _dynamic_tags(elf, "DT_SONAME")), None)


def _dynamic_tags(elf: ELFFile, kind: str) -> list[Any]:
    for section in elf.iter_sections():
        if isinstance(section, dynamic.DynamicSection):
            return list(section.iter_tags(kind))
    return []
