"""Finding the libc and ld.so a process really maps, including a process
whose root is elsewhere (a chroot, as in a container)."""

import os
import shutil
import subprocess
import time
from pathlib import Path

from mtrace_live.tracer.processes.target import mapped_glibc

from .tracing import Reaper

SLEEPER = "#include <unistd.h>\nint main(void) { pause(); return 0; }\n"


def wait_for_mapping(pid: int, path: str) -> None:
    """Until the process maps `path`. The launchers (chroot, sh) map the
    system libc first, so waiting for any libc would be too early."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if path in Path(f"/proc/{pid}/maps").read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} never mapped {path}")


def test_a_chrooted_process_is_resolved_through_proc_root(tmp_path: Path) -> None:
    # GIVEN a root directory holding a copy of this system's libc and ld.so,
    # and a program started inside it with chroot
    libc = mapped_glibc(os.getpid())
    assert libc.ld_so is not None
    root = tmp_path / "root"
    for lib in (libc.libc, libc.ld_so):
        inside = root / lib.relative_to("/")
        inside.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(lib, inside)
    interp = Path("/lib64/ld-linux-x86-64.so.2")
    (root / "lib64").mkdir(exist_ok=True)
    shutil.copy2(libc.ld_so, root / interp.relative_to("/"))
    (tmp_path / "sleeper.c").write_text(SLEEPER)
    subprocess.run(["gcc", "-o", str(root / "sleeper"), str(tmp_path / "sleeper.c")], check=True)
    with Reaper() as reaper:
        proc = reaper.add(subprocess.Popen(["chroot", str(root), "/sleeper"]))
        wait_for_mapping(proc.pid, str(root / libc.libc.relative_to("/")))
        # WHEN its glibc is resolved from outside
        found = mapped_glibc(proc.pid)
    # THEN the paths lead to the copies inside the chroot, not to the system's
    # files of the same names (the kernel shows map paths from the reader's
    # root, so here they are the full host paths into the chroot)
    copy = root / libc.libc.relative_to("/")
    assert os.stat(found.libc).st_ino == os.stat(copy).st_ino
    assert os.stat(found.libc).st_ino != os.stat(libc.libc).st_ino
    assert found.ld_so is not None
    assert found.ld_so.is_relative_to(root)


def test_a_process_in_another_mount_namespace_is_reached_through_proc_root(
    tmp_path: Path,
) -> None:
    # GIVEN a process in a new mount namespace that sees a private tmpfs,
    # holding a copy of libc, at a directory where this namespace sees nothing
    libc = mapped_glibc(os.getpid())
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (tmp_path / "sleeper.c").write_text(SLEEPER)
    subprocess.run(
        ["gcc", "-o", str(tmp_path / "sleeper"), str(tmp_path / "sleeper.c")], check=True
    )
    script = (
        f"mount -t tmpfs none {hidden} && cp {libc.libc} {hidden}/libc.so.6 && "
        f"exec env LD_PRELOAD={hidden}/libc.so.6 {tmp_path}/sleeper"
    )
    with Reaper() as reaper:
        proc = reaper.add(subprocess.Popen(["unshare", "--mount", "--propagation", "private",
                                            "sh", "-c", script]))  # fmt: skip
        wait_for_mapping(proc.pid, f"{hidden}/libc.so.6")
        # WHEN its glibc is resolved from outside, where hidden/ is empty
        assert not (hidden / "libc.so.6").exists()
        found = mapped_glibc(proc.pid)
        # THEN the libc path goes through /proc/PID/root and is readable here
        assert found.libc == Path(f"/proc/{proc.pid}/root") / (hidden / "libc.so.6").relative_to(
            "/"
        )
        assert found.libc.read_bytes()[:4] == b"\x7fELF"
