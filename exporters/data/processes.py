"""What a process is called, read from /proc."""

from __future__ import annotations

import os
from pathlib import Path

# ld.so's options that take a value (elf/rtld.c), for naming programs run
# through the loader explicitly (as the SDT glibc's testrun.sh does).
_LDSO_VALUE_OPTIONS = frozenset(
    {"--library-path", "--inhibit-rpath", "--audit", "--preload", "--argv0",
     "--glibc-hwcaps-prefix", "--glibc-hwcaps-mask"}
)  # fmt: skip


def _task_state(directory: Path) -> bytes:
    try:
        return (directory / "stat").read_bytes().rpartition(b") ")[2][:1]
    except OSError:
        return b"X"


def live_thread(pid: int) -> int | None:
    """A thread of process ``pid`` that has not exited (main first), or None."""
    base = Path(f"/proc/{pid}")
    if _task_state(base) not in (b"Z", b"X"):
        return pid
    try:
        tids = sorted(int(name) for name in os.listdir(base / "task"))
    except OSError:
        return None
    alive = (tid for tid in tids if _task_state(base / "task" / str(tid)) not in (b"Z", b"X"))
    return next(alive, None)


def proc_dir(pid: int) -> Path:
    """Where /proc shows process ``pid``'s maps, memory, files and root:
    /proc/PID, or /proc/PID/task/TID of a thread that lives when main has
    exited (pthread_exit) while others run, as /proc/PID then shows a
    zombie's: no maps, no memory, no root."""
    tid = live_thread(pid)
    base = Path(f"/proc/{pid}")
    return base if tid is None or tid == pid else base / "task" / str(tid)


def _read_proc(pid: int, name: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as file:
            return file.read()
    except OSError:
        return b""


def kernel_comm(pid: int) -> str:
    """The kernel's name of a process (its main thread's comm), or ""."""
    return _read_proc(pid, "comm").rstrip(b"\n").decode(errors="replace")


def namespace_pid(pid: int) -> int | None:
    """The process's pid in its own pid namespace (the last of /proc's
    NSpid), when it differs from ``pid``; None otherwise or once it is gone."""
    for line in _read_proc(pid, "status").splitlines():
        if line.startswith(b"NSpid:"):
            inner = line.split()[-1]
            return int(inner) if inner.isdigit() and int(inner) != pid else None
    return None


def described(pid: int, comm: str = "", ns_pid: int | None = None) -> str:
    """``pid 1234 (name; pid 1 in its pid namespace)``: how a process is shown."""
    notes = [note for note in (comm, ns_pid and f"pid {ns_pid} in its pid namespace") if note]
    return f"pid {pid}" + (f" ({'; '.join(notes)})" if notes else "")


def process_name(pid: int) -> str:
    """The name a process is shown and labelled by: its comm, except that a
    program run through the dynamic loader (``ld-linux-x86-64.so.2 PROG``,
    whose comm is the loader's) is named after PROG. "" once it is gone."""
    comm = kernel_comm(pid)
    if not comm.startswith(("ld-linux", "ld.so", "ld64.so")):
        return comm
    args = _read_proc(pid, "cmdline").split(b"\0")[1:]
    index = 0
    while index < len(args):
        arg = args[index].decode(errors="replace")
        if arg in _LDSO_VALUE_OPTIONS:
            index += 2
        elif arg.startswith("--"):
            index += 1
        elif arg:
            return os.path.basename(arg)
        else:
            break
    return comm


def process_cgroup(pid: int) -> str:
    """The process's cgroup v2 path (``0::/system.slice/x.scope``'s path), or
    "" once it is gone or on a machine with cgroup v1 only."""
    for line in _read_proc(pid, "cgroup").splitlines():
        if line.startswith(b"0::"):
            return line[3:].decode(errors="replace")
    return ""
