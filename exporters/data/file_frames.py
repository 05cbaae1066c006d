"""The files a trace numbered, for its frames in files (probes/frame_kinds.py).

The tracer numbers each file whose unwind rows it wrote (never a number
twice in a trace: a file evicted and read again gets a new one), and the
walks store each frame in such a file as (number, link-time address).
Those frames are named here, without any process's maps: each numbered
file is placed, for the tools that read mappings (pprof's, kmemtrace's
saved maps, sp-rtrace's modules), as if mapped with its link-time address
0 at ``file_base(number)``, far above any process's addresses.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from mtrace_live.probes.elf.file import LoadSegment, elf_failures, load_segments, open_elf
from mtrace_live.probes.elf.maps import Mapping
from mtrace_live.probes.errors import NotElfError, TargetError
from mtrace_live.probes.frame_kinds import FILE_NUMBERS, KERNEL_NUMBERS, file_base


@dataclass(frozen=True)
class NumberedFile:
    path: str  # as a process mapped it (absolute), or "" when none is known
    inode: tuple[int, int]  # (device, inode) as /proc/PID/maps gives them
    segments: tuple[LoadSegment, ...]  # its loadable segments (the executable ones at least)

    def mappings(self, number: int) -> list[Mapping]:
        """The file as if mapped at its number's base: each executable
        segment, and below the first the part from file offset 0 (where a
        loader maps it: its load base, which sp-rtrace and pprof count
        from)."""
        base = file_base(number)
        found = []
        code = [s for s in self.segments if s.executable]
        if code:  # from the lowest segment's file offset 0 (the code's, if it is all known)
            low = min(self.segments, key=lambda s: s.vaddr)
            start = base + low.vaddr - low.offset
            if start < base + code[0].vaddr:
                found.append(Mapping(start, base + code[0].vaddr, 0, self.path, False,
                                     self.inode, "r--p"))  # fmt: skip
        found += [Mapping(base + s.vaddr, base + s.vaddr + s.filesz, s.offset, self.path, True,
                          self.inode, "r-xp") for s in code]  # fmt: skip
        return found


class FileFrames:
    """Numbers given to files, and each numbered file: the trace's own from
    KERNEL_NUMBERS on (under a lock: the trace's threads share them), and
    below those the numbers the walks' asks gave in the kernel, each named
    once the trace heard the ask (``name``)."""

    def __init__(self) -> None:
        self.files: dict[int, NumberedFile] = {}
        self._lock = threading.Lock()
        self._next = KERNEL_NUMBERS
        # segments read from the file itself, by number, with the entry read for
        # (a failed read is tried again only once the number is named anew)
        self._segments: dict[int, tuple[NumberedFile, tuple[LoadSegment, ...]]] = {}
        # numbers heard by a thread that could not find their file's path,
        # with how to look again (from the thread that names the frames)
        self._later: dict[int, tuple[tuple[int, int], Callable[[], str]]] = {}

    def name(self, number: int, file: NumberedFile) -> None:
        """A number the kernel gave: its file (segments () while unknown;
        known ones are kept)."""
        with self._lock:
            known = self.files.get(number)
            if known is None or (file.segments and not known.segments):
                self.files[number] = file

    def number(self, file: NumberedFile) -> int:
        """A new number for ``file``; 0 once the numbers ran out (its frames
        are then addresses in their processes)."""
        with self._lock:
            if self._next >= FILE_NUMBERS:
                return 0
            number = self._next
            self._next += 1
            self.files[number] = file
            return number

    def name_later(self, number: int, inode: tuple[int, int], path_of: Callable[[], str]) -> None:
        """A number whose path the thread that heard it could not read (the
        unwinder's threads have no capabilities once serve gave up root:
        they are a thread's own): ``path_of`` is asked again by the first
        frame of that number named, from the thread that names it."""
        with self._lock:
            if number not in self.files:
                self._later[number] = (inode, path_of)

    def mappings(self, number: int) -> list[Mapping]:
        """The numbered file's place ([] while its number is not named):
        its segments as the trace had them, else read from its path."""
        file = self.files.get(number)
        if file is None or not file.path:
            with self._lock:  # (two threads may name frames at once)
                later = self._later.pop(number, None)
            if later is not None:
                path = later[1]()
                if path.startswith("/"):
                    self.name(number, NumberedFile(path, later[0], ()))
                file = self.files.get(number)
        if file is None or not file.path:
            return []
        if not file.segments:
            read = self._segments.get(number)
            if read is None or read[0] is not file:
                read = self._segments[number] = (file, _segments_of(file.path))
            file = replace(file, segments=read[1])
        return file.mappings(number)


def _segments_of(path: str) -> tuple[LoadSegment, ...]:
    """The loadable segments of the file at ``path``; () if it cannot be read."""
    try:
        with open_elf(Path(path)) as elf:
            return tuple(load_segments(elf))
    except (NotElfError, TargetError, OSError, *elf_failures()):
        return ()
