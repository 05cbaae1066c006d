"""Finding a separate debug file, the way gdb does: by build-id under each
debug directory (``.build-id/ab/cdef....debug``), then by the
``.gnu_debuglink`` name beside the file, in its ``.debug`` directory and
under each debug directory."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..errors import DebugInfoError, NotElfError, TargetError
from .facts import file_fact
from .file import build_id_of, elf_failures, open_elf

DEBUG_ROOT = Path("/usr/lib/debug")
DEBUG_DIRECTORIES = (DEBUG_ROOT,)


def build_id_path(build: str, directory: Path | None = None) -> Path:
    """Where a build-id's debug file is installed under ``directory``
    (/usr/lib/debug by default)."""
    return (directory or DEBUG_ROOT) / ".build-id" / build[:2] / f"{build[2:]}.debug"


def debug_files(path: Path, build_id: str | None, debuglink: str | None,
                directories: Sequence[Path] = DEBUG_DIRECTORIES) -> list[Path]:  # fmt: skip
    """The separate debug files of ``path`` that exist, in gdb's order."""
    candidates = []
    for directory in directories:
        if build_id and len(build_id) > 2:
            candidates.append(build_id_path(build_id, directory))
    if debuglink:
        candidates.append(path.parent / debuglink)
        candidates.append(path.parent / ".debug" / debuglink)
        candidates += [
            directory / str(path.parent).lstrip("/") / debuglink for directory in directories
        ]
    return [candidate for candidate in candidates if candidate.is_file()]


@file_fact
def has_debug_info(path: Path) -> bool:
    try:
        with open_elf(path) as elf:
            return elf.get_section_by_name(".debug_info") is not None
    except (NotElfError, TargetError, *elf_failures()):
        return False


def find_debug_file(file: Path, given: Path | None = None) -> Path | None:
    """The debug file for ``file``: ``given`` if any (checked against its
    build-id), the file itself when it has DWARF, else the one its build-id
    names under /usr/lib/debug, if installed."""
    wanted = build_id_of(file)
    if given is not None:
        if not given.is_file():
            raise DebugInfoError(f"debug file {given}: no such file")
        found = build_id_of(given)
        if wanted is None or found != wanted:
            raise DebugInfoError(
                f"debug file {given} has build-id {found or 'none'}, but {file} has "
                f"{wanted or 'none'}: it describes another build, refused"
            )
        return given
    if has_debug_info(file):
        return file
    if wanted is None:
        return None
    candidate = build_id_path(wanted)
    if not candidate.is_file():
        return None
    if build_id_of(candidate) != wanted:
        raise DebugInfoError(f"{candidate} does not carry the build-id {wanted} it is filed under")
    return candidate
