"""Uprobes attached through perf_event_open(2) on the kernel's uprobe PMU,
with the kernel's errno kept.

bcc's attach_uprobe discards the errno ("Failed to attach BPF to uprobe"),
and, given a pid, looks for the file again under /proc/PID/root: a chrooted
process's libc, which /proc/PID/maps already shows as this process sees it,
is then looked for inside the chroot a second time and not found. Here the
path is opened as given, from this process's root, and the errno says why
an attach failed: ``AttachFailure`` names the cause and the fix, and a
failure that can pass (EINTR, EAGAIN, EBUSY) is tried again a few times.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import struct
from pathlib import Path

from mtrace_live.tracer.bpf import bpf_syscalls

PMU = Path("/sys/bus/event_source/devices/uprobe")
SYS_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241, "riscv64": 241, "ppc64le": 319,
                       "s390x": 331}  # fmt: skip
PERF_FLAG_FD_CLOEXEC = 8
PERF_EVENT_IOC_ENABLE = 0x2400
PERF_EVENT_IOC_SET_BPF = 0x40042408
# struct perf_event_attr up to PERF_ATTR_SIZE_VER7: type, size, config,
# sample_period, sample_type, read_format, the flag bits, wakeup_events,
# bp_type, config1 (the uprobe's path), config2 (its file offset); the rest zero.
ATTR = struct.Struct("=IIQQQQQIIQQ")
ATTR_SIZE = 128
TRANSIENT = frozenset({errno.EINTR, errno.EAGAIN, errno.EBUSY})
TRIES = 5

_LIBC = ctypes.CDLL(None, use_errno=True)

# errno -> what it means for an attach, and what to do
CAUSES = {
    errno.ENOENT: "the file is gone (deleted or replaced since it was mapped): restart the "
    "process, or trace it where its files are",
    errno.ESRCH: "the process exited",
    errno.EINVAL: "the kernel refused the offset (not in the file, or the file changed since "
    "it was read)",
    errno.EPERM: "not permitted (root, or CAP_PERFMON and CAP_BPF, is needed; kernel lockdown "
    "forbids uprobes)",
    errno.EACCES: "permission denied (root, or CAP_PERFMON and CAP_BPF, is needed)",
    errno.EMFILE: "too many open files: raise the limit (ulimit -n)",
    errno.ENFILE: "the system's open file table is full",
    errno.ENOMEM: "the kernel is out of memory",
    errno.ENOSPC: "the kernel's probe or map limits are reached",
    errno.EOPNOTSUPP: "this kernel cannot attach uprobes through perf events (CONFIG_UPROBES)",
    errno.ENODEV: "this kernel has no uprobe PMU (CONFIG_UPROBE_EVENTS)",
}


class AttachFailure(Exception):
    """The kernel's errno for an attach, and what it means."""

    def __init__(self, error: int, tries: int = 1) -> None:
        super().__init__(error, tries)
        self.errno = error
        self.tries = tries

    def __str__(self) -> str:
        name = errno.errorcode.get(self.errno, str(self.errno))
        cause = CAUSES.get(self.errno, os.strerror(self.errno))
        again = f", {self.tries} tries" if self.tries > 1 else ""
        return f"{cause} ({name}{again})"


@functools.cache
def _pmu() -> tuple[int, int]:
    """The uprobe PMU's type and the config bit of a return probe."""
    try:
        kind = int((PMU / "type").read_text())
        field = (PMU / "format" / "retprobe").read_text().strip()  # "config:0"
    except (OSError, ValueError):
        raise AttachFailure(errno.ENODEV) from None
    return kind, int(field.rpartition(":")[2])


def _open(path: bytes, offset: int, retprobe: bool, pid: int) -> int:
    kind, bit = _pmu()
    name = ctypes.create_string_buffer(path)
    # A uprobe for one process is a perf event on it, on any CPU; one for
    # every process is a CPU-wide event, which fires on every CPU all the same.
    return open_event(kind, int(retprobe) << bit, pid=pid, cpu=-1 if pid >= 0 else 0,
                      config1=ctypes.addressof(name), config2=offset)  # fmt: skip


def open_event(kind: int, config: int, sample_type: int = 0, pid: int = -1, cpu: int = 0,
               config1: int = 0, config2: int = 0) -> int:  # fmt: skip
    """A perf event of PMU type ``kind`` and ``config`` (``config1`` and
    ``config2``: a uprobe's path and offset), for process ``pid`` on ``cpu``;
    by default on CPU 0 for every process (a tracepoint's: it fires on every
    CPU once a program is set on it): its fd. Raises AttachFailure."""
    number = SYS_PERF_EVENT_OPEN.get(bpf_syscalls.MACHINE)
    if number is None:
        raise AttachFailure(errno.ENOSYS)
    attr = ctypes.create_string_buffer(ATTR_SIZE)
    ATTR.pack_into(attr, 0, kind, ATTR_SIZE, config, 1, sample_type, 0, 0, 1, 0, config1,
                   config2)  # fmt: skip
    fd = int(_LIBC.syscall(number, attr, pid, cpu, -1, PERF_FLAG_FD_CLOEXEC))
    if fd < 0:
        raise AttachFailure(ctypes.get_errno())
    return fd


def set_program(fd: int, prog_fd: int) -> None:
    """Program ``prog_fd`` set on perf event ``fd``, and the event enabled.
    Raises AttachFailure (``fd`` closed)."""
    _ioctl(fd, PERF_EVENT_IOC_SET_BPF, prog_fd)
    _ioctl(fd, PERF_EVENT_IOC_ENABLE, 0)


def _ioctl(fd: int, request: int, argument: int) -> None:
    if _LIBC.ioctl(fd, ctypes.c_ulong(request), ctypes.c_int(argument)) < 0:
        error = ctypes.get_errno()
        os.close(fd)
        raise AttachFailure(error)


def attach(path: Path, offset: int, prog_fd: int, pid: int = -1, retprobe: bool = False) -> int:
    """Attach the program ``prog_fd`` at file ``offset`` of ``path`` (entry,
    or with ``retprobe`` the function's returns), in process ``pid`` or
    (-1) every process: the perf event's fd, which detaches it when closed.
    Raises AttachFailure."""
    fd = _opened(path, offset, retprobe, pid)
    set_program(fd, prog_fd)
    return fd


def attach_with_cookie(path: Path, offset: int, prog_fd: int, pid: int, retprobe: bool,
                       cookie: int) -> tuple[int, int]:  # fmt: skip
    """``attach``, the program attached through a BPF link carrying
    ``cookie``: (the perf event's fd, the link's fd); both are closed to
    detach it."""
    fd = _opened(path, offset, retprobe, pid)
    link = bpf_syscalls.perf_event_link(prog_fd, fd, cookie)
    if link < 0:
        error = ctypes.get_errno()
        os.close(fd)
        raise AttachFailure(error)
    try:
        _ioctl(fd, PERF_EVENT_IOC_ENABLE, 0)
    except AttachFailure:
        os.close(link)
        raise
    return fd, link


def _opened(path: Path, offset: int, retprobe: bool, pid: int) -> int:
    encoded = os.fsencode(path)
    for attempt in range(1, TRIES + 1):
        try:
            return _open(encoded, offset, retprobe, pid)
        except AttachFailure as failure:
            if failure.errno in TRANSIENT and attempt < TRIES:
                continue
            raise AttachFailure(failure.errno, attempt) from None
    raise AssertionError("unreachable")
