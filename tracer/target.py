"""Which libc a trace attaches to: the one a process maps, or a named file."""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import TargetError

# glibc's soname, and the versioned file name older glibcs installed.
_LIBC_NAME = re.compile(r"^libc(\.so\.6|-\d+\.\d+\.so)$")


def mapped_libc(pid: int) -> Path:
    """The libc that process ``pid`` really maps, as a path readable from here.

    A process in another mount namespace is reached through /proc/PID/root.
    """
    maps = Path(f"/proc/{pid}/maps")
    try:
        lines = maps.read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        raise TargetError(f"no process with pid {pid}") from None
    except PermissionError:
        raise TargetError(f"cannot read {maps}: permission denied") from None
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and _LIBC_NAME.match(os.path.basename(fields[5])):
            return _reachable(pid, Path(fields[5]))
    raise TargetError(f"process {pid} maps no glibc libc (statically linked, or not glibc)")


def _reachable(pid: int, path: Path) -> Path:
    root = Path(f"/proc/{pid}/root")
    try:
        same_root = (
            os.stat(root).st_ino == os.stat("/").st_ino
            and os.stat(root).st_dev == os.stat("/").st_dev
        )
    except OSError:
        same_root = True
    return path if same_root else root / path.relative_to("/")


def library_file(path: str | os.PathLike[str]) -> Path:
    lib = Path(path)
    if not lib.is_file():
        raise TargetError(f"no such library file: {lib}")
    return lib.resolve()


def default_libc() -> Path:
    """The system's default libc: the one this very process maps."""
    return mapped_libc(os.getpid())
