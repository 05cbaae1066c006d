"""Which libc a trace attaches to: the one a process maps, or a named file."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from mtrace_live.exporters.data.processes import kernel_comm, live_thread, proc_dir
from mtrace_live.probes.elf.maps import read_maps
from mtrace_live.probes.errors import (
    NotPrivilegedError,
    TargetError,
)

# glibc's soname; the versioned file name older glibcs installed; and libc.so,
# the real file name in a glibc build tree, where libc.so.6 is a symlink to it
# (/proc/PID/maps shows the file, not the link).
_LIBC_NAME = re.compile(r"^libc(\.so\.6|\.so|-\d+\.\d+\.so)$")
# The dynamic linker: ld-linux-x86-64.so.2, ld-linux-aarch64.so.1, ld.so ...
_LDSO_NAME = re.compile(r"^ld(-linux[-\w.]*\.so\.\d+|\.so|-\d+\.\d+\.so)$")


@dataclass(frozen=True)
class MappedGlibc:
    """The glibc objects a process maps, as paths readable from here."""

    libc: Path
    ld_so: Path | None


def require_process(pid: int) -> None:
    if not Path(f"/proc/{pid}").is_dir():
        raise TargetError(f"no process with pid {pid}")
    refuse_zombie(pid)


def process_state(pid: int) -> tuple[str, int] | None:
    """Process ``pid``'s state letter (R, S, D, T, t, Z, ...) and its parent's
    pid, from /proc/PID/stat; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes().rpartition(b") ")[2].split()
        return fields[0].decode(), int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def refuse_zombie(pid: int) -> None:
    """A zombie has exited; only its exit status waits for its parent. A
    process whose main thread alone has exited (pthread_exit) while others
    run shows as one too (Z), and is no zombie: it is traced."""
    state = process_state(pid)
    if state is not None and state[0] == "Z" and live_thread(pid) is None:
        raise TargetError(f"process {pid} has exited: it is a zombie that its parent (pid "
                          f"{state[1]}) has not reaped, with nothing left to trace")  # fmt: skip


def current_break(pid: int) -> int | None:
    """Where process ``pid``'s break is: the end of its [heap] mapping (the
    break rounded up to a page; glibc keeps it page-aligned), or, before the
    heap has grown, its start_brk (field 47 of /proc/PID/stat); None if gone."""
    try:
        heap = next((m for m in read_maps(proc_dir(pid)) if m.path == "[heap]"), None)
        if heap is not None:
            return heap.end
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return int(fields[47 - 3])
    except (OSError, ValueError, IndexError):
        return None


def mapped_glibc(pid: int) -> MappedGlibc:
    """The libc and dynamic linker process ``pid`` really maps."""
    found: dict[str, Path] = {}
    for path, inode in _mapped_paths(pid):
        name = os.path.basename(path)
        if "libc" not in found and _LIBC_NAME.match(name):
            found["libc"] = _reachable(pid, Path(path), inode)
        elif "ld" not in found and _LDSO_NAME.match(name):
            found["ld"] = _reachable(pid, Path(path), inode)
    if "libc" not in found:
        refuse_zombie(pid)
        raise TargetError(f"process {pid} maps no glibc libc (statically linked, or not glibc)")
    return MappedGlibc(libc=found["libc"], ld_so=found.get("ld"))


def _mapped_paths(pid: int) -> list[tuple[str, int]]:
    """(path, inode) of each file mapping, as /proc/PID/maps shows them."""
    maps = proc_dir(pid) / "maps"
    try:
        mappings = read_maps(proc_dir(pid))
    except FileNotFoundError:
        raise TargetError(f"no process with pid {pid}") from None
    except PermissionError:
        raise NotPrivilegedError(f"cannot read {maps}: permission denied") from None
    except ProcessLookupError:
        raise TargetError(f"process {pid} exited") from None
    return [(m.path, m.inode[1]) for m in mappings if m.is_file]


def mapped_libc(pid: int) -> Path:
    """The libc that process ``pid`` really maps, as a path readable from here.

    A process in another mount namespace is reached through /proc/PID/root.
    """
    return mapped_glibc(pid).libc


def _reachable(pid: int, path: Path, inode: int) -> Path:
    """A path, valid from here, to the file the process maps at ``path``.

    The kernel prints map paths relative to the reader's root: a chrooted
    process's libc already shows with its full path from here, while a file
    in another mount namespace that is not visible here shows relative to
    that namespace's root and must be reached through /proc/PID/root. The
    candidate whose inode is the one the maps line names is the file.
    """
    root = proc_dir(pid) / "root"
    candidates = (path, root / path.relative_to("/"))
    for candidate in candidates:
        try:
            if os.stat(candidate).st_ino == inode:
                return candidate
        except PermissionError:
            raise NotPrivilegedError(f"cannot read {root}: permission denied") from None
        except OSError:
            continue
    if not Path(f"/proc/{pid}").exists():
        raise TargetError(f"process {pid} exited")
    raise TargetError(f"cannot find the file process {pid} maps as {path}")


def library_file(path: str | os.PathLike[str]) -> Path:
    lib = Path(path)
    if not lib.is_file():
        raise TargetError(f"no such library file: {lib}")
    return lib.absolute()


def default_libc() -> Path:
    """The system's default libc: the one this very process maps."""
    return mapped_libc(os.getpid())


# ---- serve's targets: a process name, a cgroup ------------------------------

COMM_LEN = 16  # TASK_COMM_LEN, the terminating NUL included


def comm_words(name: str) -> tuple[int, int]:
    """``name`` as the kernel stores a comm: 16 bytes (NUL-padded), read by
    the trace program as two little-endian u64."""
    raw = name.encode()
    if not raw or len(raw) >= COMM_LEN or b"\0" in raw:
        raise TargetError(
            f"process name {name!r} cannot be a kernel comm: it must be 1 to "
            f"{COMM_LEN - 1} bytes (the kernel truncates longer names)"
        )
    padded = raw.ljust(COMM_LEN, b"\0")
    return int.from_bytes(padded[:8], "little"), int.from_bytes(padded[8:], "little")


def own_processes(not_ours: Iterable[int] = ()) -> list[int]:
    """mtrace-live's own processes: this one and the children it has forked
    (the guardian, the metrics endpoint), less ``not_ours`` (run's command,
    which is traced), from /proc/self/task/*/children. None is ever a target."""
    found = [os.getpid()]
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with (contextlib.suppress(OSError, ValueError),
                  open(f"/proc/self/task/{task}/children") as children):  # fmt: skip
                found += [int(pid) for pid in children.read().split()]
    skip = set(not_ours)
    return list(dict.fromkeys(pid for pid in found if pid not in skip))


def processes_with_comm(name: str) -> list[int]:
    """The running processes whose main thread's comm is ``name``, but
    mtrace-live's own."""
    ours = set(own_processes())
    pids = (int(entry) for entry in os.listdir("/proc") if entry.isdigit())
    return sorted(pid for pid in pids if pid not in ours and kernel_comm(pid) == name)


def cgroup_target(path: str) -> tuple[int, int, Path]:
    """(id, level, directory) of a cgroup v2, given as a path under the
    cgroup2 mount (as /proc/PID/cgroup shows it) or as its directory; its id
    is the directory's inode, its level the depth below the root."""
    root = cgroup2_root()
    given = Path(path)
    if given.is_relative_to(root):
        directory = given
    else:  # "/system.slice/x.service" as /proc/PID/cgroup shows it, or relative
        directory = root / given.relative_to(given.anchor) if given.is_absolute() else root / given
    try:
        directory = directory.resolve(strict=True)
        stat = os.stat(directory)
    except OSError:
        raise TargetError(f"no cgroup {path} (looked for {directory})") from None
    if not (directory / "cgroup.procs").is_file():
        raise TargetError(f"{directory} is not a cgroup v2 directory")
    try:
        level = len(directory.relative_to(root.resolve()).parts)
    except ValueError:
        raise TargetError(f"{directory} is not under the cgroup v2 mount {root}") from None
    return stat.st_ino, level, directory


def cgroup_processes(path: str) -> list[int]:
    """The processes in cgroup v2 ``path`` and below it, now, but
    mtrace-live's own."""
    directory = cgroup_target(path)[2]
    found: set[int] = set()
    for procs in directory.rglob("cgroup.procs"):
        try:
            found.update(int(pid) for pid in procs.read_text().split())
        except (OSError, ValueError):
            continue  # a cgroup removed meanwhile
    return sorted(found - set(own_processes()))


def cgroup2_root() -> Path:
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or
    /sys/fs/cgroup/unified on a hybrid layout)."""
    try:
        mounts = Path("/proc/self/mounts").read_text(encoding="utf-8").splitlines()
    except OSError:
        mounts = []
    for line in mounts:
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            return Path(fields[1])
    raise TargetError("no cgroup v2 hierarchy is mounted; --cgroup needs cgroup v2")
