"""Where the kernel spends an attach and a detach, by kind, for section 12:
a program that returns 0 attached to the libc's allocation functions and
to tracepoints, each kind timed around its own system calls.

- uprobes, one perf event each (perf_event_open, PERF_EVENT_IOC_SET_BPF,
  ENABLE), as tracer/bpf/uprobe_attach.py makes them, then closed;
- the same uprobes in one uprobe_multi link (tracer/bpf/uprobe_multi.py);
- tracepoints, one perf event each (as bcc attaches a tracepoint program);
- the raw tracepoints beneath them as links (BPF_RAW_TRACEPOINT_OPEN): the
  system calls' are the two of sys_enter and sys_exit.

Each close is timed alone: the kernel's waits for RCU grace periods are in
the close of the last user of a probe.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from mtrace_live.tracer.bpf import bpf_syscalls, uprobe_attach, uprobe_multi
from mtrace_live.tracer.bpf.tracefs import tracefs_root
from mtrace_live.tracer.processes.target import default_libc

PROG_TYPE_TRACEPOINT, PROG_TYPE_RAW_TRACEPOINT = 5, 17
PERF_TYPE_TRACEPOINT = 2
TRACEPOINTS = ("sched:sched_process_exec", "sched:sched_process_exit", "task:task_newtask",
               "syscalls:sys_enter_mmap", "syscalls:sys_exit_mmap", "syscalls:sys_enter_munmap",
               "syscalls:sys_enter_brk", "syscalls:sys_exit_brk")  # fmt: skip
# The raw tracepoints beneath them: the system calls' are sys_enter and sys_exit.
RAW = ("sched_process_exec", "sched_process_exit", "task_newtask", "sys_enter", "sys_exit")
FUNCTIONS = ("malloc", "free", "calloc", "realloc", "posix_memalign", "aligned_alloc", "valloc",
             "pvalloc")  # fmt: skip
_LIBC = ctypes.CDLL(None, use_errno=True)


def _offsets(libc: Path) -> list[int]:
    """The functions' offsets in the libc (its text is loaded at its file
    offset), as nm gives them."""
    listed = subprocess.run(["nm", "-D", str(libc)], capture_output=True, text=True,
                            check=True).stdout  # fmt: skip
    found = {}
    for line in listed.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2].split("@", 1)[0] in FUNCTIONS:
            found[parts[2].split("@", 1)[0]] = int(parts[0], 16)
    return sorted(set(found.values()))


def _timed_closes(fds: list[int]) -> float:
    began = time.monotonic()
    for fd in fds:
        os.close(fd)
    return time.monotonic() - began


def _tracepoint_event(name: str, prog_fd: int) -> int:
    category, event = name.split(":")
    number = int((tracefs_root() / "events" / category / event / "id").read_text())
    attr = ctypes.create_string_buffer(128)
    struct.pack_into("=IIQQQQQ", attr, 0, PERF_TYPE_TRACEPOINT, 128, number, 1, 0, 0, 0)
    fd = int(_LIBC.syscall(uprobe_attach.SYS_PERF_EVENT_OPEN["x86_64"], attr, -1, 0, -1,
                           uprobe_attach.PERF_FLAG_FD_CLOEXEC))  # fmt: skip
    if fd < 0:
        raise OSError(ctypes.get_errno(), f"perf_event_open {name}")
    uprobe_attach._ioctl(fd, uprobe_attach.PERF_EVENT_IOC_SET_BPF, prog_fd)
    uprobe_attach._ioctl(fd, uprobe_attach.PERF_EVENT_IOC_ENABLE, 0)
    return fd


def _raw_tracepoint(name: str, prog_fd: int) -> int:
    event = ctypes.create_string_buffer(name.encode())
    attr = ctypes.create_string_buffer(16)
    struct.pack_into("=QI", attr, 0, ctypes.addressof(event), prog_fd)
    fd = bpf_syscalls._bpf(bpf_syscalls.BPF_RAW_TRACEPOINT_OPEN, attr)
    if fd < 0:
        raise OSError(ctypes.get_errno(), f"raw tracepoint {name}")
    return fd


def _while_closing(attach: Callable[[], list[int]], closing: list[int]) -> dict[str, float]:
    """``attach`` timed while another thread closes ``closing``."""
    detacher = threading.Thread(target=_timed_closes, args=(closing,))
    detacher.start()
    time.sleep(0.01)  # the closes under way
    began = time.monotonic()
    fds = attach()
    attached = time.monotonic() - began
    detacher.join()
    return {"attach_s": attached, "close_s": _timed_closes(fds), "count": len(fds)}


def measure() -> dict[str, dict[str, float]]:
    """Seconds to attach and to close each kind, all its probes; and the
    perf events' attach while a detacher (another thread here) closes as
    many of the same kind, of another program: both want the kernel's locks."""
    libc = default_libc()
    offsets = _offsets(libc)
    load = bpf_syscalls.load_program
    programs = {
        "plain": [load(uprobe_multi.RETURN_ZERO, "GPL", "empty", bpf_syscalls.PROG_TYPE_KPROBE, 0)
                  for _ in range(2)],
        "multi": [uprobe_multi.load_for_links(uprobe_multi.RETURN_ZERO, "GPL", "empty", 0)],
        "classic": [load(uprobe_multi.RETURN_ZERO, "GPL", "empty", PROG_TYPE_TRACEPOINT, 0)
                    for _ in range(2)],
        "raw": [load(uprobe_multi.RETURN_ZERO, "GPL", "empty", PROG_TYPE_RAW_TRACEPOINT, 0)],
    }  # fmt: skip
    kinds: dict[str, tuple[str, Callable[[int], list[int]]]] = {
        f"{len(offsets)} uprobes, a perf event each": ("plain", lambda prog: [
            uprobe_attach.attach(libc, offset, prog) for offset in offsets]),
        f"the same {len(offsets)} uprobes in one uprobe_multi link": ("multi", lambda prog: [
            uprobe_multi.attach_link(prog, libc, offsets, [0] * len(offsets), -1, False)]),
        f"{len(TRACEPOINTS)} tracepoints, a perf event each": ("classic", lambda prog: [
            _tracepoint_event(name, prog) for name in TRACEPOINTS]),
        f"the {len(RAW)} raw tracepoints beneath them, as links": ("raw", lambda prog: [
            _raw_tracepoint(name, prog) for name in RAW]),
    }  # fmt: skip
    rows: dict[str, dict[str, float]] = {}
    try:
        for name, (kind, attach) in kinds.items():
            first = programs[kind][0]
            began = time.monotonic()
            fds = attach(first)
            attached = time.monotonic() - began
            rows[name] = {"attach_s": attached, "close_s": _timed_closes(fds), "count": len(fds)}
            if len(programs[kind]) > 1:
                other = programs[kind][1]
                rows[f"{name}, while as many close"] = _while_closing(
                    functools.partial(attach, first), attach(other))  # fmt: skip
    finally:
        for fd in (fd for fds in programs.values() for fd in fds):
            os.close(fd)
    return rows
