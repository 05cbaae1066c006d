"""What a process is called, read from /proc."""

from __future__ import annotations

import os

# ld.so's options that take a value (elf/rtld.c), for naming programs run
# through the loader explicitly (as the SDT glibc's testrun.sh does).
_LDSO_VALUE_OPTIONS = frozenset(
    {"--library-path", "--inhibit-rpath", "--audit", "--preload", "--argv0",
     "--glibc-hwcaps-prefix", "--glibc-hwcaps-mask"}
)  # fmt: skip


def _read_proc(pid: int, name: str) -> bytes:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as file:
            return file.read()
    except OSError:
        return b""


def kernel_comm(pid: int) -> str:
    """The kernel's name of a process (its main thread's comm), or ""."""
    return _read_proc(pid, "comm").rstrip(b"\n").decode(errors="replace")


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
