"""The file server: a process of its own that writes the rows of the files
the stack walks ask for (unwind_vma.bpf.c: a walk meets a file whose rows
were never written, steps by frame pointers there, and says so through the
unwind_asks ring), so that the next call is whole.

Why a process: the trace's own threads share one interpreter lock with the
trace's loop, whose work (numpy over a batch of events, a process's tables)
holds it for milliseconds at a time. An ask served by a thread of the trace
waited 10 to 30 ms, and a short program exec'd in a loop had its first
dozen runs walked by frame pointers. Here an ask is served in a millisecond
or two: the file opened through the process (/proc/PID/map_files/, any
mount namespace) or, if it is gone, by the path it exec'd
(unwind_exec_paths, if still the same file); its rows from the cache by
build-id, else read from its CFI; written into the server's own region of
unwind_rows and unwind_pages (the last 1/SERVER_SHARE of each); its entry
of unwind_files; and its slot of unwind_files_gen bumped, so that the walks
that met the file before look it up again.

A file larger than BIG_FILE is left to the trace (its bulk thread), as is
any file the server could not open or had no room for: the trace serves
what is still unwritten a moment after the ask (tracer/unwind/unwind_tables.py).
The server imports nothing of bcc: only the maps' descriptors, passed at
its start. It ends when the trace closes its pipe, or dies
(PR_SET_PDEATHSIG), and never outlives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import os
import select
import signal
import struct
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from mtrace_live.probes.elf.file import (
    build_id,
    elf_failures,
    load_parser,
    load_segments,
    open_elf,
)
from mtrace_live.probes.errors import NotElfError, TargetError
from mtrace_live.probes.program import part_constants
from mtrace_live.probes.records import EVENT_DTYPE
from mtrace_live.tracer.bpf import bpf_syscalls
from mtrace_live.tracer.bpf.map_table import write_mapped
from mtrace_live.tracer.bpf.ringbuf import RingReader
from mtrace_live.tracer.unwind.unwind_rows import (
    BIG_FILE,
    EXEC_PATH,
    FILE_ENTRY_SIZE,
    PAGE_SIZE,
    ROW_SIZE,
    FileEntry,
    RowCache,
    exec_path,
    file_entry,
    file_key,
    rows_cache_dir,
    rows_of,
    status_key,
    with_number,
)

SERVER_SHARE = 8  # the server's region: the last 1/8 of unwind_rows and unwind_pages
# The server's own import of pyelftools' parser, after its fork, must end
# within IMPORT_S, else the server ends (SIGALRM) and the trace serves every
# ask itself: a module's import lock held at the fork by another thread of
# the trace would never be let go in the child. The server reads its asks
# and writes kept rows without numpy: it imports numpy (within IMPORT_S too)
# only to read a file's CFI that no cache keeps, where the trace had not
# imported it before the fork (run and record do, tracer/commands/trace.py).
IMPORT_S = 10
ENDING_S = 10.0  # the most the trace's close waits for the server's end
NAME = b"mtrace-live-fs"
# Its scheduling priority: an ask waits for no busy process (the trace's
# loop, the workload), and the server's work is a millisecond an ask.
NICE = -10
_PR_SET_NAME, _PR_SET_PDEATHSIG = 15, 1
# An ask, as the server reads it (struct event, EVENT_DTYPE): its tgid and its
# args (start, end, pgoff, device, inode, ask), read without numpy
_ASK = struct.Struct("<16xI12x6Q8x")
# The maps the server reads and writes, by their names in the program.
MAPS = ("unwind_asks", "unwind_files", "unwind_files_gen", "unwind_rows", "unwind_pages",
        "unwind_exec_paths")  # fmt: skip


def region(total: int) -> tuple[int, int]:
    """The server's part of a table of ``total`` entries: [first, end)."""
    return total - total // SERVER_SHARE, total


class FileServer:
    """The server process, from the trace's side."""

    def __init__(self, fds: Mapping[str, int], rows: tuple[int, int],
                 pages: tuple[int, int]) -> None:  # fmt: skip
        """Fork it, with the maps' descriptors ``fds`` (by name, MAPS) and
        its regions of unwind_rows and unwind_pages: a fork, not a new
        interpreter, so that it serves within milliseconds, with what the
        trace has imported (a new one took 0.3 s to start) and pyelftools'
        parser, which it imports itself. Raises OSError."""
        read, self._write = os.pipe2(os.O_CLOEXEC)
        ring_pages = part_constants("unwind_vma.bpf.c")["UNWIND_ASKS_PAGES"]
        ring_bytes = ring_pages * os.sysconf("SC_PAGE_SIZE")
        libc = ctypes.CDLL(None)  # looked up here, before the fork
        try:
            pid = os.fork()
        except OSError:
            for fd in (read, self._write):
                os.close(fd)
            raise
        if pid == 0:
            _serve(libc, dict(fds), read, rows, pages, ring_bytes)  # never returns
        os.close(read)
        self.pid = pid
        # this child, whatever becomes of its pid once alive() has reaped it
        self._reaped = False
        self._child = -1
        with contextlib.suppress(OSError):
            self._child = os.pidfd_open(pid)

    def alive(self) -> bool:
        if self._reaped:
            return False
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(self.pid, os.WNOHANG) == (0, 0):
                return True
        self._reaped = True  # (its pid is no longer this child's)
        return False

    def close(self) -> None:
        """End the server (it finishes the file it is writing, within
        ENDING_S; else it is killed)."""
        if self._write >= 0:
            os.close(self._write)
            self._write = -1
        if self._child >= 0:
            with contextlib.suppress(OSError):
                ended = select.poll()
                ended.register(self._child, select.POLLIN)
                if not ended.poll(int(ENDING_S * 1000)):
                    signal.pidfd_send_signal(self._child, signal.SIGKILL)
            os.close(self._child)
            self._child = -1
        if not self._reaped:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            self._reaped = True


@dataclass
class _Region:
    """Where the next file's rows and page index go, and where they end."""

    row: int
    row_end: int
    page: int
    page_end: int


class _Server:
    """The server's work: each ask served."""

    def __init__(self, fds: Mapping[str, int], rows: tuple[int, int],
                 pages: tuple[int, int]) -> None:  # fmt: skip
        self.fds = fds
        self.region = _Region(rows[0], rows[1], pages[0], pages[1])
        self.cache = RowCache(rows_cache_dir())
        self.by_build_id: dict[str, bytes] = {}  # a file served: its entry, for its copies
        self.gen = 0
        self.pending: dict[tuple[int, int], tuple[int, int]] = {}  # key -> (its fd, its size)
        self.ring: RingReader | None = None  # the asks' (read between a file's steps)
        self.nested = False

    def take(self, records: list[bytes]) -> None:
        """New asks (EV_UNWIND_VMA records: start, end, pgoff, device, inode),
        each file opened now, while its process most likely lives: the
        descriptor reads it after the process is gone."""
        for record in records:
            tgid, start, end, _, device, inode, _ = _ASK.unpack(record)
            key = (device, inode)
            if key in self.pending:
                continue
            opened = self._open(key, tgid, start, end)
            if opened is not None:
                self.pending[key] = opened

    def serve_one(self, below: int | None = None) -> bool:
        """The smallest file asked for (a short program's own before the
        large one of a process that runs on), if smaller than ``below``:
        False when there is none."""
        key = min(self.pending, key=lambda k: self.pending[k][1], default=None)
        if key is None or (below is not None and self.pending[key][1] >= below):
            return False
        fd, size = self.pending.pop(key)
        try:
            if self._serve(key, Path(f"/proc/{os.getpid()}/fd/{fd}"), size):
                self.gen += 1
                bpf_syscalls.update_u32(self.fds["unwind_files_gen"], 1,
                                        struct.pack("<I", self.gen))  # fmt: skip
        except OSError:
            pass  # a file it cannot read is left to the trace
        finally:
            os.close(fd)
        return True

    def _between(self, size: int) -> None:
        """Between two steps of a file's load: the asks that came meanwhile
        taken, and the smaller files among them served first (one level)."""
        if self.ring is None or self.nested:
            return
        self.nested = True
        try:
            self.take(self.ring.read_raw(_ASK.size))
            while self.serve_one(below=size):
                pass
        finally:
            self.nested = False

    def _serve(self, key: tuple[int, int], path: Path, size: int) -> bool:
        raw = bpf_syscalls.lookup(self.fds["unwind_files"], file_key(key), FILE_ENTRY_SIZE)
        asked = FileEntry.of(raw) if raw is not None else None
        if asked is not None and asked.written:
            return False  # written meanwhile
        # the number the walk's ask gave it, which its frames carry
        number = asked.number if asked is not None else 0
        try:
            with open_elf(path, in_memory=BIG_FILE) as elf:
                ident, segments = build_id(elf), tuple(load_segments(elf))
                if ident is not None and ident in self.by_build_id:
                    return self._publish(key, with_number(self.by_build_id[ident], number))
                self._between(size)
                rows, problem = self.cache.load(ident), ""
                if rows is None:  # its CFI read (with numpy)
                    if "numpy" not in sys.modules:
                        _bounded(lambda: importlib.import_module("numpy"))
                    rows, problem = rows_of(elf, path, ident, self.cache)
        except (TargetError, OSError):
            return False  # it cannot be read now: left to the trace
        except (NotElfError, *elf_failures()):
            return self._publish(key, file_entry(0, 0, 0, 0, 0, ()))  # no rows there
        if problem or not rows.count:
            return self._publish(key, file_entry(0, 0, 0, 0, 0, segments))
        self._between(size)
        room = self.region
        if room.row + rows.count > room.row_end or room.page + rows.page_count > room.page_end:
            return False  # left to the trace
        write_mapped(self.fds["unwind_rows"], room.row, rows.rows, ROW_SIZE)
        write_mapped(self.fds["unwind_pages"], room.page, rows.pages, PAGE_SIZE)
        entry = file_entry(room.row, rows.count, room.page, rows.page_count, rows.page_base,
                           segments, number)  # fmt: skip
        room.row += rows.count
        room.page += rows.page_count
        if ident is not None:
            self.by_build_id[ident] = entry
        return self._publish(key, entry)

    def _publish(self, key: tuple[int, int], entry: bytes) -> bool:
        return bpf_syscalls.update(self.fds["unwind_files"], file_key(key), entry)

    def _open(self, key: tuple[int, int], pid: int, start: int,
              end: int) -> tuple[int, int] | None:  # fmt: skip
        """The file asked for, opened (its descriptor and size): through its
        process while it lives, else by the program it exec'd; None where
        neither is the file, or it is larger than BIG_FILE (the trace's)."""
        candidates = [Path(f"/proc/{pid}/map_files/{start:x}-{end:x}"),
                      exec_path(bpf_syscalls.lookup_u32(self.fds["unwind_exec_paths"], pid,
                                                        EXEC_PATH))]  # fmt: skip
        for path in candidates:
            if path is None:
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            status = os.fstat(fd)
            if status_key(status) == key and status.st_size <= BIG_FILE:
                return fd, status.st_size
            os.close(fd)
        return None


def _bounded(load: Callable[[], object]) -> None:
    """An import in the forked server, which must end within IMPORT_S."""
    signal.alarm(IMPORT_S)
    load()
    signal.alarm(0)


def _serve(libc: ctypes.CDLL, fds: dict[str, int], end: int, rows: tuple[int, int],
           pages: tuple[int, int], ring_bytes: int) -> None:  # fmt: skip
    """The server's life, in the forked child, until the trace closes its
    pipe or dies: only system calls and Python of its own from here on (no
    lock another thread held), but for pyelftools' parser, imported within
    IMPORT_S; and no descriptor of the trace's but its maps' (a probe's
    stays attached while any process holds it)."""
    try:
        parent = os.getppid()
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            return  # the trace died before the line above
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(NAME), 0, 0, 0)
        with contextlib.suppress(OSError):  # before the busy processes: its work is brief
            os.setpriority(os.PRIO_PROCESS, 0, NICE)
        for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGPIPE", "SIGTSTP", "SIGTTOU",
                     "SIGTTIN"):  # fmt: skip
            signal.signal(getattr(signal, name), signal.SIG_IGN)
        keep = {end, *fds.values()}
        for entry in os.listdir("/proc/self/fd"):
            if int(entry) not in keep:
                with contextlib.suppress(OSError):
                    os.close(int(entry))
        # Imported here, not by the trace before the fork: 15-25 ms of the
        # start's main thread, under the interpreter lock, where this runs on
        # the other CPU while the trace goes on (the asks wait in their ring)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        _bounded(load_parser)
        server = _Server(fds, rows, pages)
        ring = server.ring = RingReader(fds["unwind_asks"], ring_bytes, EVENT_DTYPE)
        watch = select.poll()
        watch.register(ring.fd, select.POLLIN)
        watch.register(end, select.POLLIN)
        while True:  # one file at a time: the asks that came meanwhile are taken first
            ready = {fd for fd, _ in watch.poll(0 if server.pending else 1000)}
            if end in ready:
                return  # the trace closed its end (or ended)
            server.take(ring.read_raw(_ASK.size))
            if server.pending:
                server.serve_one()
    except BaseException:  # the trace serves the asks then (a failure here is not the trace's)
        pass
    finally:
        os._exit(0)
