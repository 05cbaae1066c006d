"""Uprobes attached in one batch: a BPF link of the uprobe_multi kind
(``BPF_LINK_CREATE`` with ``BPF_TRACE_UPROBE_MULTI``, Linux 6.6) holds every
uprobe of one program on one file, each with its own BPF cookie.

Why: a uprobe opened as a perf event (tracer/bpf/uprobe_attach.py) is closed
under the kernel's global ``event_mutex``, and each close waits for RCU
grace periods there, about 100 ms apiece on this machine (docs/performance.md,
section 6). A trace of 34 uprobes took over 3 s to detach, and a trace
started meanwhile waited for that mutex at each of its own attaches. A
link is made and closed with no perf event: its uprobes are registered one
after the other, and unregistered with a single wait at the end.

The kernel lets a uprobe_multi link carry only a program loaded for it
(its expected attach type), and a program array's programs must all have
the type of those that tail-call into them: so with links, every uprobe
program of a trace, and the unwinder's steps they tail-call, are loaded
that way (tracer/bpf/bpf_backend.py). A kernel without links (or
``MTRACE_LIVE_UPROBE_MULTI=0``) gets the perf events, one per uprobe.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mtrace_live.tracer.bpf import bpf_callbacks, bpf_syscalls
from mtrace_live.tracer.bpf.uprobe_attach import TRANSIENT, TRIES, AttachFailure

SINCE = (6, 6)
LOADERS = 2  # threads loading programs (UprobeLinks.prefetch)
RETURN = 1  # BPF_F_UPROBE_MULTI_RETURN
ENVIRONMENT = "MTRACE_LIVE_UPROBE_MULTI"
# A link for one process finds it by its main thread, and places its
# breakpoints in that thread's memory: none once that thread has exited.
MAIN_GONE = "the process's main thread has exited (pthread_exit)"
# union bpf_attr for BPF_LINK_CREATE: prog_fd, target_fd, attach_type, flags
# (u32 each), then uprobe_multi's path, offsets, ref_ctr_offsets, cookies
# (u64 addresses), cnt, flags, pid (u32 each).
_LINK = struct.Struct("=IIIIQQQQIII")
# r0 = 0; exit: the least program there is
RETURN_ZERO = bytes.fromhex("b7000000000000009500000000000000")


def why_not() -> str | None:
    """Why this trace attaches its uprobes one perf event each, or None
    when it attaches them in links."""
    return _why_not()


@functools.cache
def _why_not() -> str | None:
    if os.environ.get(ENVIRONMENT, "") in ("0", "off"):
        return f"{ENVIRONMENT}={os.environ[ENVIRONMENT]}"
    if bpf_syscalls.kernel_version() < SINCE:
        return f"Linux {SINCE[0]}.{SINCE[1]} or later is needed"
    try:
        fd = load_for_links(RETURN_ZERO, "GPL", "mtrace_multi", 0)
    except OSError as exc:
        return f"the kernel refuses a program for them ({exc.strerror})"
    os.close(fd)
    return None


def load_for_links(code: bytes, license_: str, name: str, kern_version: int) -> int:
    """A uprobe program's code loaded for a uprobe_multi link: its fd.
    Raises OSError."""
    return bpf_syscalls.load_program(code, license_, name, bpf_syscalls.PROG_TYPE_KPROBE,
                                     bpf_syscalls.TRACE_UPROBE_MULTI, kern_version)  # fmt: skip


def attach_link(prog_fd: int, path: Path, offsets: Sequence[int], cookies: Sequence[int],
           pid: int, retprobe: bool) -> int:  # fmt: skip
    """Program ``prog_fd`` at each file offset of ``path`` (at the
    function's returns with ``retprobe``), each with its cookie, in
    process ``pid`` or (-1) every process: the link's fd, which detaches
    them all when closed. Raises AttachFailure."""
    count = len(offsets)
    name = ctypes.create_string_buffer(os.fsencode(path))
    places = (ctypes.c_uint64 * count)(*offsets)
    marks = (ctypes.c_uint64 * count)(*cookies)
    attr = ctypes.create_string_buffer(64)
    _LINK.pack_into(attr, 0, prog_fd, 0, bpf_syscalls.TRACE_UPROBE_MULTI, 0,
                    ctypes.addressof(name), ctypes.addressof(places), 0, ctypes.addressof(marks),
                    count, RETURN if retprobe else 0, max(pid, 0))  # fmt: skip
    for attempt in range(1, TRIES + 1):
        fd = bpf_syscalls.link_create(attr)
        if fd >= 0:
            return fd
        error = ctypes.get_errno()
        if error not in TRANSIENT or attempt == TRIES:
            raise AttachFailure(error or errno.EINVAL, attempt)
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Uprobe:
    """One uprobe asked for: a program at a file offset of ``path``."""

    path: Path
    offset: int
    handler: str
    pid: int  # the thread (a process's id: its first) it is attached for; -1: every process
    retprobe: bool
    cookie: int  # a link's uprobes never move (tracer/processes/retarget.py): no generation in it


@dataclass(frozen=True)
class Link:
    """A uprobe_multi link, and the uprobes it carries."""

    fd: int
    uprobes: tuple[Uprobe, ...]


class LinkFailure(Exception):
    """The uprobe the kernel refused, and why."""

    def __init__(self, uprobe: Uprobe, failure: AttachFailure) -> None:
        super().__init__(uprobe, failure)
        self.uprobe, self.failure = uprobe, failure


class _Loading:
    """A program loading on a loader thread: its fd, or what its load raised."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._fd = -1
        self._raised: BaseException | None = None

    def settle(self, load: Callable[[], int]) -> None:
        try:
            self._fd = load()
        except BaseException as exc:  # (raised again by result)
            self._raised = exc
        finally:
            self._done.set()

    def result(self) -> int:
        self._done.wait()
        if self._raised is not None:
            raise self._raised
        return self._fd


class UprobeLinks:
    """A trace's uprobe programs, loaded for links from their code, and its
    links: one per (file, program, process, entry or return) in a batch."""

    def __init__(self, code: Mapping[str, bytes], license_: str, kern_version: int) -> None:
        self._code, self._license, self._kern_version = dict(code), license_, kern_version
        self.programs: dict[str, int] = {}  # loaded, by handler
        self.links: list[Link] = []
        self._batch: list[Uprobe] | None = None
        self._loading: dict[str, _Loading] = {}  # by prefetch, not asked for yet
        self.load_ms: dict[str, float] = {}  # how long each load took (the verifier's time)

    @property
    def code(self) -> dict[str, bytes]:
        """Each handler's code, as it is loaded (relocated to the trace's maps)."""
        return self._code

    @property
    def handlers(self) -> list[str]:
        """The handlers a uprobe can be attached to (their callbacks are not)."""
        return [h for h in self._code if not bpf_callbacks.is_callback(h)]

    def prefetch(self, later: frozenset[str] = frozenset(),
                 times: Mapping[str, float] | None = None) -> None:  # fmt: skip
        """Load every program now but those ``later`` (loaded when first
        asked for), from LOADERS threads while this one goes on: the
        verifier's milliseconds (most of a warm start's kernel work) overlap
        each other and the tracer's own start. The longest to load go first
        (``times``: each one's last load, in ms; else the largest code), so
        that the last load ends soonest. (A handler this trace never
        attaches is loaded too, where it is not ``later``: a few small ones.)"""
        took = times or {}
        handlers = sorted((h for h in self.handlers if h not in later),
                          key=lambda h: (-took.get(h, 0.0), -len(self._code[h])))  # fmt: skip
        self._loading = {h: _Loading() for h in handlers}
        queue = iter(list(self._loading.items()))  # (shared: next() on a list's iterator is atomic)

        def loader() -> None:  # each thread ends with the last load
            for handler, loading in queue:
                loading.settle(functools.partial(self._load, handler))

        started = 0
        for number in range(LOADERS):
            try:
                threading.Thread(target=loader, name=f"mtrace-load-{number}", daemon=True).start()
            except RuntimeError:  # (no thread can be started: the rest load here)
                break
            started += 1
        if not started:
            loader()  # each one settled: none is waited for in vain

    def program(self, handler: str) -> int:
        """The handler's program fd, loaded on first use. Raises OSError
        (the verifier's words), KeyError for a handler the program does not
        have."""
        if handler not in self.programs:
            loading = self._loading.pop(handler, None)
            self.programs[handler] = (loading.result() if loading is not None
                                      else self._load(handler))  # fmt: skip
        return self.programs[handler]

    def _load(self, handler: str) -> int:
        started = time.monotonic()
        fd = self._load_now(handler)
        self.load_ms[handler] = (time.monotonic() - started) * 1000
        return fd

    def _load_now(self, handler: str) -> int:
        if bpf_callbacks.has_callback(handler, self._code):
            try:
                return bpf_callbacks.load_linked(self._code, handler, self._license,
                                                 bpf_syscalls.PROG_TYPE_KPROBE,
                                                 bpf_syscalls.TRACE_UPROBE_MULTI,
                                                 self._kern_version)  # fmt: skip
            except ValueError as exc:
                raise OSError(0, str(exc)) from None
        return load_for_links(self._code[handler], self._license, handler, self._kern_version)

    def add(self, uprobe: Uprobe) -> None:
        """Attach ``uprobe``: at the end of the batch when one is open, else
        now. Raises LinkFailure."""
        if self._batch is not None:
            self._batch.append(uprobe)
        else:
            self._attach([uprobe])

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Every uprobe added inside attached at its end, a link per group
        (nested batches are one); none when the block raises."""
        if self._batch is not None:
            yield
            return
        self._batch = []
        try:
            yield
            asked = self._batch
        finally:
            self._batch = None
        groups: dict[tuple[Path, str, int, bool], list[Uprobe]] = {}
        for uprobe in asked:
            key = (uprobe.path, uprobe.handler, uprobe.pid, uprobe.retprobe)
            groups.setdefault(key, []).append(uprobe)
        for group in groups.values():
            self._attach(group)

    def _attach(self, group: Sequence[Uprobe]) -> Link:
        """One link for ``group`` (one file, program, process and kind);
        where the kernel refuses it, each uprobe alone, so that the one it
        refuses is named."""
        first = group[0]
        program = self.program(first.handler)
        try:
            fd = attach_link(program, first.path, [u.offset for u in group],
                        [u.cookie for u in group], first.pid,
                        first.retprobe)  # fmt: skip
        except AttachFailure as failure:
            if len(group) > 1:
                return self._one_by_one(group)
            raise LinkFailure(first, failure) from None
        link = Link(fd, tuple(group))
        self.links.append(link)
        return link

    def _one_by_one(self, group: Sequence[Uprobe]) -> Link:
        links = [self._attach([uprobe]) for uprobe in group]
        return links[-1]  # all attached, each in a link of its own

    def take_fds(self) -> list[int]:
        """The links' fds, to close (this object forgets them)."""
        fds = [link.fd for link in self.links]
        self.links = []
        return fds

    def close_programs(self) -> None:
        loading, self._loading = self._loading, {}
        for pending in loading.values():  # loaded and never asked for: waited for, closed
            with contextlib.suppress(Exception):
                os.close(pending.result())
        for fd in self.programs.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.programs.clear()
