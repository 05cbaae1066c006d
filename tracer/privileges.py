"""Giving up root once the BPF programs are attached.

What the exporter does afterwards needs no privilege: it reads BPF maps and
the ring buffer through file descriptors it already holds (since Linux 6.5
the kernel checks CAP_BPF only when maps and programs are created, not on
operations through an fd), reads /proc/PID/comm and cmdline, which anyone
may, and answers HTTP on a socket already bound. So after attaching, root
switches to an unprivileged user (``nobody`` by default): the process keeps
no capability, and a bug in the HTTP path is not a root bug.

On older kernels with unprivileged BPF disabled, map reads through an fd
still need CAP_BPF; there the switch is skipped and said so.
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path

from mtrace_live.probes.elf.errors import PrivilegeDropError

UNPRIVILEGED_BPF = Path("/proc/sys/kernel/unprivileged_bpf_disabled")
_FD_OPS_UNCHECKED_SINCE = (6, 5)


def resolve_user(name: str) -> pwd.struct_passwd:
    """Checked before anything is attached, so that a typo fails at once."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise PrivilegeDropError(f"no user {name!r} to run as after attaching (--user)") from None


def _kernel_version() -> tuple[int, int]:
    release = os.uname().release.split("-", 1)[0].split(".")
    try:
        return int(release[0]), int(release[1])
    except (IndexError, ValueError):
        return 0, 0


def map_reads_need_capability() -> bool:
    try:
        disabled = UNPRIVILEGED_BPF.read_text(encoding="ascii").strip() != "0"
    except OSError:
        disabled = True
    return disabled and _kernel_version() < _FD_OPS_UNCHECKED_SINCE


def drop_privileges(user: pwd.struct_passwd) -> str:
    """Switch to ``user`` for good (groups, gid, uid); say what was done."""
    if os.geteuid() != 0:
        return "not root: nothing to drop"
    if map_reads_need_capability():
        return (
            "kept root: this kernel checks CAP_BPF on every map read while "
            "kernel.unprivileged_bpf_disabled is set"
        )
    try:
        os.setgroups([])
        os.setresgid(user.pw_gid, user.pw_gid, user.pw_gid)
        os.setresuid(user.pw_uid, user.pw_uid, user.pw_uid)
    except OSError as exc:
        raise PrivilegeDropError(f"cannot switch to user {user.pw_name}: {exc.strerror}") from None
    return f"running as {user.pw_name} (uid {user.pw_uid}) from now on, with no capabilities"
