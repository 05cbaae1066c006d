"""Giving up root once the BPF programs are attached.

What the exporter does afterwards needs no root: it reads BPF maps and the
ring buffer through file descriptors it already holds (since Linux 6.5 the
kernel checks CAP_BPF only when maps and programs are created, not on
operations through an fd), reads /proc/PID/comm and cmdline, which anyone
may, and answers HTTP on a socket already bound. So after attaching, root
switches to an unprivileged user (``nobody`` by default).

- The serving process, which answers the network, keeps no capability: a
  bug in the HTTP path is not a root bug.
- The tracing process keeps CAP_SYS_PTRACE alone (``keep``): the traced
  processes' maps, the files they map (through /proc/PID/root) and their
  memory (the arenas) are readable only with it once they are not the
  user's, and serve meets processes that start after the switch. It never
  attaches to a process with ptrace(2), and signals none: serve stops no
  process (tracer/processes/holds.py), so it needs no CAP_KILL.

On older kernels with unprivileged BPF disabled, map reads through an fd
still need CAP_BPF; there the switch is skipped and said so.
"""

from __future__ import annotations

import ctypes
import os
import pwd
from pathlib import Path

from mtrace_live.probes.errors import NotPrivilegedError, PrivilegeDropError
from mtrace_live.tracer.bpf.bpf_syscalls import kernel_version

# Capability bits from include/uapi/linux/capability.h.
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39


def _effective_capabilities() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def privilege_problem() -> str | None:
    """Why BPF programs cannot be loaded by this process, or None."""
    caps = _effective_capabilities()
    has_bpf = caps & (1 << CAP_BPF) and caps & (1 << CAP_PERFMON)
    if os.geteuid() != 0 and not has_bpf and not caps & (1 << CAP_SYS_ADMIN):
        return "loading BPF programs needs root (or CAP_BPF and CAP_PERFMON); run with sudo"
    return None


def require_privileges() -> None:
    """Fail early, with one line, when BPF programs cannot be loaded."""
    problem = privilege_problem()
    if problem:
        raise NotPrivilegedError(problem)


CAP_SYS_PTRACE = 19
TRACING_CAPABILITIES = (CAP_SYS_PTRACE,)  # kept by serve's tracing process
CAPABILITY_NAMES: dict[tuple[int, ...], str] = {
    TRACING_CAPABILITIES: "CAP_SYS_PTRACE alone (to read the traced processes' maps and files)"
}
_PR_SET_KEEPCAPS = 8
_CAPABILITY_VERSION_3 = 0x20080522
UNPRIVILEGED_BPF = Path("/proc/sys/kernel/unprivileged_bpf_disabled")
_FD_OPS_UNCHECKED_SINCE = (6, 5)


def resolve_user(name: str) -> pwd.struct_passwd:
    """Checked before anything is attached, so that a typo fails at once."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise PrivilegeDropError(f"no user {name!r} to run as after attaching (--user)") from None


def map_reads_need_capability() -> bool:
    try:
        disabled = UNPRIVILEGED_BPF.read_text(encoding="ascii").strip() != "0"
    except OSError:
        disabled = True
    return disabled and kernel_version() < _FD_OPS_UNCHECKED_SINCE


def drop_privileges(user: pwd.struct_passwd, keep: tuple[int, ...] = ()) -> str:
    """Switch to ``user`` for good (groups, gid, uid), keeping the
    capabilities ``keep`` only; say what was done."""
    if os.geteuid() != 0:
        return "not root: nothing to drop"
    if map_reads_need_capability():
        return (
            "kept root: this kernel checks CAP_BPF on every map read while "
            "kernel.unprivileged_bpf_disabled is set"
        )
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        if keep and libc.prctl(_PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        os.setgroups([])
        os.setresgid(user.pw_gid, user.pw_gid, user.pw_gid)
        os.setresuid(user.pw_uid, user.pw_uid, user.pw_uid)
        if keep:
            _keep_only(libc, keep)
            libc.prctl(_PR_SET_KEEPCAPS, 0, 0, 0, 0)
    except OSError as exc:
        raise PrivilegeDropError(f"cannot switch to user {user.pw_name}: {exc.strerror}") from None
    held = CAPABILITY_NAMES.get(keep, ", ".join(map(str, keep))) if keep else "no capabilities"
    return f"running as {user.pw_name} (uid {user.pw_uid}) from now on, with {held}"


def _keep_only(libc: ctypes.CDLL, caps: tuple[int, ...]) -> None:
    """capset(2): ``caps`` effective and permitted, nothing inheritable (the
    permitted set survived the uid switch through PR_SET_KEEPCAPS)."""
    header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # {effective, permitted, inheritable} for caps 0-31, 32-63
    for cap in caps:
        word, bit = divmod(cap, 32)
        data[3 * word] |= 1 << bit
        data[3 * word + 1] |= 1 << bit
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
