"""A process's perf map: the names of its JIT code, as the JIT writes them.

A JIT that wants its code named by profilers writes ``/tmp/perf-PID.map``,
a line per piece of code it made: ``START SIZE NAME``, START and SIZE in
hex (Node.js with ``--perf-basic-prof``, the JVM with perf-map-agent,
CPython 3.12+ with ``-X perf``), appended as it compiles. perf, bcc and
bpftrace read it so, and so does this module: a line with no name or no
size names nothing, and where two lines' ranges overlap (code freed and its
memory used again) the later line wins.

A process in a mount namespace of its own (a container, a private /tmp)
writes the file in its own /tmp, under the pid it has in its pid
namespace: it is read through /proc/PID/root, and from our /tmp only when
the process shares our pid namespace (or is gone). The file is read
incrementally: from where the last read ended, while it is the same file
(device and inode) and has only grown; a line not ended yet waits for the
next read.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import os
import stat
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from .processes import namespace_pid, proc_dir

PerfMapEntry = tuple[int, int, str]  # (start, end, name)


def parse_perf_map(text: str) -> list[PerfMapEntry]:
    """The entries of a perf map's ``text``, in its order; a line that is
    not ``START SIZE NAME`` (hex numbers, a size above 0) is left out."""
    found = []
    for line in text.splitlines():
        fields = line.split(maxsplit=2)
        if len(fields) < 3:
            continue
        try:
            start, size = int(fields[0], 16), int(fields[1], 16)
        except ValueError:
            continue
        name = fields[2].strip()
        if size > 0 and start >= 0 and name:
            found.append((start, start + size, name))
    return found


class PerfMap:
    """The names one perf map gives, as ranges that do not overlap: each
    part of an address range named by the last line that covers it, and
    kept with that line's start (where its code begins)."""

    def __init__(self, paths: Sequence[Path]) -> None:
        self.paths = tuple(paths)  # where the file is looked for, in order
        # the ranges by start: (starts, ends, names, each one's line's start),
        # replaced whole (a name resolved meanwhile sees the old or the new)
        self._index: _Ranges = ([], [], [], [])
        self._file: tuple[int, int] | None = None  # (device, inode) of the file read
        self._offset = 0  # where the next read begins: after the last whole line
        self.entries = 0  # lines taken in
        self.reading = 0  # the reads that took lines in (or started over)
        self._lock = threading.Lock()  # one read at a time (a scrape's thread names frames too)

    @classmethod
    def of_process(cls, pid: int) -> PerfMap:
        """Process ``pid``'s perf map: in its own /tmp under its own pid,
        and in ours when that pid is the same (or it is gone)."""
        inner = namespace_pid(pid)
        paths = [proc_dir(pid) / "root" / "tmp" / f"perf-{inner or pid}.map"]
        if inner is None:
            paths.append(Path(f"/tmp/perf-{pid}.map"))
        return cls(paths)

    def __len__(self) -> int:
        return len(self._index[0])

    def name(self, address: int) -> tuple[str, int] | None:
        """(name, start of its code) of ``address``, or None."""
        starts, ends, names, origins = self._index
        index = bisect.bisect_right(starts, address) - 1
        if index < 0 or address >= ends[index]:
            return None
        return names[index], origins[index]

    def read(self) -> bool:
        """Take in the lines written since the last read (the whole file
        again if it is another file, or shorter than what was read); False
        when there was nothing new or no file to read."""
        with self._lock:
            return self._read()

    def _read(self) -> bool:
        for path in self.paths:
            try:
                with _open_map(path) as file:
                    status = os.fstat(file.fileno())
                    identity = (status.st_dev, status.st_ino)
                    if identity != self._file or status.st_size < self._offset:
                        self._file, self._offset, self.entries = identity, 0, 0
                        self._index = ([], [], [], [])
                        self.reading += 1
                    if status.st_size == self._offset:
                        return False
                    file.seek(self._offset)
                    data = file.read(status.st_size - self._offset)
            except OSError:
                continue
            whole = data[: data.rfind(b"\n") + 1]
            self._offset += len(whole)
            self.add(parse_perf_map(whole.decode("utf-8", errors="replace")))
            self.reading += bool(whole)
            return bool(whole)
        return False

    def add(self, entries: Sequence[PerfMapEntry]) -> None:
        """Entries in the file's order, each over what came before: a few
        laid one by one (into copies of the ranges held), many in one sweep."""
        self.entries += len(entries)
        starts, ends, names, origins = self._index
        if len(entries) > _FEW:
            held = list(zip(starts, ends, names, origins, strict=True))
            self._index = _swept(held + [(start, end, name, start) for start, end, name in entries])
            return
        laid = (starts.copy(), ends.copy(), names.copy(), origins.copy())
        for start, end, name in entries:
            _lay(laid, start, end, name)
        self._index = laid


def _open_map(path: Path) -> BinaryIO:
    """The perf map at ``path``, opened as perf reads one: not through a
    symbolic link, never blocking (a FIFO planted there), a regular file
    owned by root or by the owner of the directory's process. OSError
    otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        status = os.fstat(fd)
        owner = _owner(path)
        if not stat.S_ISREG(status.st_mode) or status.st_uid not in (0, owner):
            raise OSError(f"{path}: not a regular file of root's or the process's owner's")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _owner(path: Path) -> int | None:
    """The uid of the process whose perf map ``path`` is (by its name)."""
    pid = path.name.removeprefix("perf-").removesuffix(".map")
    proc = path.parents[2] if path.parts[:2] == ("/", "proc") else Path(f"/proc/{pid}")
    try:
        return proc.stat().st_uid
    except OSError:
        return None


_FEW = 1024  # entries laid one by one (each moves the ranges after it); more: a sweep
_Ranges = tuple[list[int], list[int], list[str], list[int]]


def _lay(ranges: _Ranges, start: int, end: int, name: str) -> None:
    """[start, end) named ``name`` laid over ``ranges`` (by start, not
    overlapping): what it covers of them is cut away, what sticks out of it
    kept."""
    starts, ends, names, origins = ranges
    first = bisect.bisect_right(starts, start) - 1
    if first < 0 or ends[first] <= start:
        first += 1
    last = bisect.bisect_left(starts, end)  # the ranges [first, last) meet it
    pieces = [(start, end, name, start)]
    if first < last and starts[first] < start:
        pieces.insert(0, (starts[first], start, names[first], origins[first]))
    if first < last and ends[last - 1] > end:
        pieces.append((end, ends[last - 1], names[last - 1], origins[last - 1]))
    starts[first:last] = [piece[0] for piece in pieces]
    ends[first:last] = [piece[1] for piece in pieces]
    names[first:last] = [piece[2] for piece in pieces]
    origins[first:last] = [piece[3] for piece in pieces]


def _swept(ranges: Sequence[tuple[int, int, str, int]]) -> _Ranges:
    """``ranges`` (start, end, name, its line's start), each over those
    before it, as ranges that do not overlap, by start."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    points = sorted({r[0] for r in ranges} | {r[1] for r in ranges})
    starts: list[int] = []
    ends: list[int] = []
    names: list[str] = []
    origins: list[int] = []
    covering: list[tuple[int, int]] = []  # (-its place in ranges, its end): the last on top
    taken = 0
    for point, following in itertools.pairwise(points):
        while taken < len(order) and ranges[order[taken]][0] <= point:
            heapq.heappush(covering, (-order[taken], ranges[order[taken]][1]))
            taken += 1
        while covering and covering[0][1] <= point:
            heapq.heappop(covering)  # ended (those below it go when they come on top)
        if not covering:
            continue
        _, _, name, origin = ranges[-covering[0][0]]
        if ends and ends[-1] == point and origins[-1] == origin and names[-1] == name:
            ends[-1] = following  # the same line's range goes on
            continue
        starts.append(point)
        ends.append(following)
        names.append(name)
        origins.append(origin)
    return starts, ends, names, origins
