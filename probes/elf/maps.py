"""A process's mappings, as /proc/PID/maps gives them: the one reader of
that file, for every module that needs a process's mappings (the unwinder's
tables, the symbolizer, the libc and allocator found in a process, its
break, its arenas' base).

Each line is ``START-END PERMISSIONS OFFSET MAJOR:MINOR INODE [PATH]``. The
path is as the process sees it (its own mount namespace); ``map_files``
names the link under /proc/PID/map_files/ that opens the mapped file from
any namespace.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Mapping:
    """One mapping. (Saved mappings, a record set's, know no device, inode
    or permissions: those keep their defaults.)"""

    start: int
    end: int
    offset: int
    path: str  # as the process sees it; "" for anonymous memory; [heap], [stack] ...
    executable: bool = True
    inode: tuple[int, int] = (0, 0)  # the file's (device, inode); (0, 0): no file
    permissions: str = ""  # as maps writes them: r-xp, rw-s ...

    @property
    def is_file(self) -> bool:
        """A mapping of a file (its path absolute)."""
        return self.path.startswith("/")

    @property
    def map_files(self) -> str:
        """Its link's name under /proc/PID/map_files/."""
        return f"{self.start:x}-{self.end:x}"


def parse_maps(text: str) -> list[Mapping]:
    """The mappings of a maps file's ``text``, in its order; a line that is
    not a mapping's is left out."""
    found = []
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 5:
            continue
        try:
            start, end = (int(part, 16) for part in fields[0].split("-"))
            major, minor = (int(part, 16) for part in fields[3].split(":"))
            mapping = Mapping(start, end, int(fields[2], 16), fields[5] if len(fields) > 5 else "",
                              fields[1][2:3] == "x", (os.makedev(major, minor), int(fields[4])),
                              fields[1])  # fmt: skip
        except ValueError:
            continue
        found.append(mapping)
    return found


def read_maps(directory: Path) -> list[Mapping]:
    """The mappings of the process whose /proc directory is ``directory``.
    Raises OSError (FileNotFoundError, ProcessLookupError: gone;
    PermissionError) for the caller to say what it means."""
    return parse_maps((directory / "maps").read_text(encoding="utf-8", errors="replace"))
