"""Targets in other namespaces, and the kernel's errno when an attach fails.

A chrooted process maps its own copy of libc: /proc/PID/maps names it as
this process sees it (the chroot's directory first), and the uprobes go on
that file as it is named, not looked for again inside the chroot. The
workload, ``cxx_stacks``, says how many blocks it leaked and how many
buffers its vectors allocated; the trace must see exactly those.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mtrace_live.tracer.bpf import uprobe_attach

from .conftest import built
from .tracing import trace_cxx_stacks

LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")


def chroot_with_copies(root: Path, program: Path) -> Path:
    """A directory holding ``program`` and copies of every library it loads,
    at their paths (new files: other inodes than the host's)."""
    inside = root / "bin" / program.name
    inside.parent.mkdir(parents=True)
    shutil.copy2(program, inside)
    listed = subprocess.run(["ldd", str(program)], capture_output=True, text=True,
                            check=True).stdout  # fmt: skip
    for library in re.findall(r"(/\S+) \(0x", listed):
        copy = root / library.lstrip("/")
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.realpath(library), copy)
    return inside


# A container as runtimes make one: its own mount and pid namespaces, the
# directory bound on itself and made the root with pivot_root. Its maps then
# name its libc copy by the same path as this machine's libc.
PIVOT_ROOT = ('mount --bind "$0" "$0" && cd "$0" && mkdir -p old && pivot_root . old '
              '&& cd / && exec /bin/cxx_stacks 20')  # fmt: skip


def family(pid: int) -> list[int]:
    """``pid`` and every process descended from it, as /proc links them."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        found.append(parent)
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            todo += [int(child) for child in children.read_text().split()]
    return found


@pytest.mark.parametrize(
    "enter",
    [["chroot"], ["unshare", "--pid", "--mount", "--fork", "chroot"],
     ["unshare", "--pid", "--mount", "--fork", "sh", "-c", PIVOT_ROOT]],
    ids=["chroot", "chroot-in-pid-and-mount-namespaces", "pivot-root-container"],
)  # fmt: skip
def test_a_chrooted_process_with_its_own_libc_is_traced_exactly(
    enter: list[str], tmp_path: Path
) -> None:
    # GIVEN cxx_stacks in a chroot with its own copy of libc (and, second,
    # in pid and mount namespaces of its own too: its pid there is 1)
    root = tmp_path / "root"
    chroot_with_copies(root, built("cxx_stacks"))
    allocinfo = tmp_path / "allocinfo"

    def inner(started: int) -> int:
        """The workload's pid (a child of unshare's child, or chroot itself):
        the one process of this run's that runs it."""
        argv = b"/bin/cxx_stacks\x0020\x00"
        (pid,) = [p for p in family(started) if Path(f"/proc/{p}/cmdline").read_bytes() == argv]
        copy = os.stat(root / "lib/x86_64-linux-gnu/libc.so.6")
        mapped = [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
                  if line.endswith("/libc.so.6")]  # fmt: skip
        assert mapped and all(int(line.split()[4]) == copy.st_ino for line in mapped)
        return pid

    # WHEN it is traced by its pid as this machine sees it
    argv = [*enter, str(root)] if "sh" in enter else [*enter, str(root), "/bin/cxx_stacks", "20"]
    known = trace_cxx_stacks(argv, inner, ["--allocinfo", str(allocinfo)], tmp_path)
    # THEN what it leaked is every live block the trace saw, no more, no less
    lines = allocinfo.read_text().splitlines()[2:]
    assert sum(int(line.split()[1]) for line in lines) == known["leaked_objects"]
    assert any(line.endswith("func:fill_map(int)") for line in lines)
    # AND both its pids are shown where its own differs: here and in its namespace
    said = (tmp_path / "mtrace.err").read_text() + (tmp_path / "summary").read_text()
    host = re.search(r"for pid (\d+)", said)
    assert host is not None, said
    if "unshare" in enter:  # in the start line and the summary's process (pid 1 there)
        assert f"for pid {host[1]} (pid 1 in its pid namespace)" in said
        assert f"pid {host[1]} (cxx_stacks; pid 1 in its pid namespace):" in said
    else:
        assert "pid namespace" not in said


def test_an_attach_error_names_the_kernel_s_errno_and_its_cause(tmp_path: Path) -> None:
    # GIVEN attaches the kernel refuses (no program is needed to be refused)
    def refused(path: Path, offset: int, pid: int = -1) -> uprobe_attach.AttachFailure:
        with pytest.raises(uprobe_attach.AttachFailure) as caught:
            uprobe_attach.attach(path, offset, -1, pid)
        return caught.value

    # THEN a file that is gone is ENOENT, named as such
    gone = refused(tmp_path / "deleted.so", 0x1000)
    assert gone.errno == errno.ENOENT and "file is gone" in str(gone)
    # AND an offset past the end of the file is EINVAL
    past = refused(LIBC, LIBC.stat().st_size + 0x1000)
    assert past.errno == errno.EINVAL and "EINVAL" in str(past)
    # AND a pid no process can have (above any pid_max) is ESRCH
    nobody = refused(LIBC, 0x1000, pid=4_194_304)
    assert nobody.errno == errno.ESRCH and "exited" in str(nobody)


def test_an_unprivileged_attach_is_refused_with_the_fix_named() -> None:
    # GIVEN the attach made by a user without privileges (nobody)
    script = (
        "import os; from pathlib import Path; from mtrace_live.tracer.bpf import uprobe_attach\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "try:\n"
        f"    uprobe_attach.attach(Path('{LIBC}'), 0x1000, -1, os.getppid())\n"
        "except uprobe_attach.AttachFailure as failure:\n"
        "    print(failure.errno, failure)\n"
    )  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    # THEN the kernel says EACCES or EPERM, and the message names what is needed
    number, _, message = done.stdout.strip().partition(" ")
    assert int(number) in (errno.EACCES, errno.EPERM)
    assert "CAP_PERFMON" in message


def test_a_mount_namespace_where_the_libc_path_names_another_file(tmp_path: Path) -> None:
    # GIVEN cxx_stacks in a mount namespace of its own where the libc's
    # path, the same as here, names a copy (bound over it there only)
    copy = tmp_path / "libc.so.6"
    shutil.copy2(LIBC.resolve(), copy)
    allocinfo = tmp_path / "allocinfo"
    script = (f'mount --bind "{copy}" "{LIBC.resolve()}" && '
              f'exec "{built("cxx_stacks")}" 20')  # fmt: skip
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]

    def inner(started: int) -> int:
        maps = Path(f"/proc/{started}/maps").read_text()
        line = next(x for x in maps.splitlines() if x.endswith(str(LIBC.resolve())))
        assert int(line.split()[4]) == copy.stat().st_ino  # the copy, under the host's path
        return started

    # WHEN it is traced by its pid
    known = trace_cxx_stacks(argv, inner, ["--allocinfo", str(allocinfo)], tmp_path)
    # THEN the probes are on the file it maps: what it leaked is what the trace saw
    lines = allocinfo.read_text().splitlines()[2:]
    assert sum(int(line.split()[1]) for line in lines) == known["leaked_objects"]
