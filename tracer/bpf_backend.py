"""The one place mtrace-live imports bcc.

Everything else (decoding, aggregation, exporters, listing probes) runs
without root and without bcc; they receive plain data from here.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from mtrace_live.probes import bpf_source
from mtrace_live.probes.locations import ArgLocation

from .errors import AttachError, BccUnavailableError, NotPrivilegedError, TracepointMissingError

TRACEFS_ROOTS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))

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


def tracefs_root() -> Path:
    for root in TRACEFS_ROOTS:
        try:
            if (root / "events").is_dir():
                return root
        except PermissionError:
            raise NotPrivilegedError(f"cannot read {root}: permission denied") from None
    raise TracepointMissingError(
        "tracefs is not mounted; mount it with: mount -t tracefs tracefs /sys/kernel/tracing"
    )


def tracepoint_format(category: str, event: str) -> str:
    fmt = tracefs_root() / "events" / category / event / "format"
    try:
        return fmt.read_text(encoding="ascii", errors="replace")
    except PermissionError:
        raise NotPrivilegedError(f"cannot read {fmt}: permission denied") from None
    except FileNotFoundError:
        raise TracepointMissingError(f"this kernel has no tracepoint {category}:{event}") from None


def import_bcc() -> Any:
    try:
        import bcc
        from bcc import libbcc
    except ImportError:
        raise BccUnavailableError(
            "the bcc Python bindings are not importable; install Debian's python3-bpfcc "
            "(scripts/setup.sh does) and run from a Python that sees the distro's packages"
        ) from None
    _pass_ref_ctr_offset(libbcc.lib)
    return bcc


def _pass_ref_ctr_offset(lib: Any) -> None:
    """Make bcc's Python bindings pass bpf_attach_uprobe's 7th argument.

    Since bcc 0.17 the C function takes (..., pid, uint32 ref_ctr_offset), but
    the Python declaration (bcc 0.26 included; iovisor/bcc#5236) stops at pid,
    so the kernel receives whatever the register held. A uprobe registered
    with a stray ref_ctr_offset makes every later uprobe on the same site
    with another offset fail ("ref_ctr_offset mismatch" in dmesg, EINVAL),
    e.g. bpftrace's. mtrace-live's sites have no semaphore: pass 0.
    """
    declared = getattr(lib.bpf_attach_uprobe, "argtypes", None)
    if declared is None or len(declared) != 6:
        return  # already fixed upstream, or already wrapped
    full = lib["bpf_attach_uprobe"]  # a fresh function pointer
    full.restype = ctypes.c_int
    full.argtypes = [*declared, ctypes.c_uint32]

    def attach_uprobe(*args: Any) -> int:
        return int(full(*args, 0))

    attach_uprobe.argtypes = full.argtypes  # type: ignore[attr-defined]
    lib.bpf_attach_uprobe = attach_uprobe


class BpfProgram:
    """A compiled and attached bcc program built from one bundled .bpf.c file."""

    def __init__(self, name: str, defines: dict[str, int] | None = None) -> None:
        require_privileges()
        tracefs_root()
        bcc = import_bcc()
        src = bpf_source(name)
        cflags = [f"-D{key}={value}" for key, value in (defines or {}).items()]
        # Two warnings every kernel header of 6.x raises under bcc's clang;
        # they say nothing about mtrace-live's own C.
        cflags += ["-Wno-duplicate-decl-specifier", "-Wno-ignored-attributes"]
        try:
            self._bpf = bcc.BPF(src_file=str(src).encode(), cflags=cflags)
        except Exception as exc:
            raise AttachError(f"cannot load BPF program {name}: {exc}") from None

    def attach_uprobe(self, path: Path, file_offset: int, handler: str) -> None:
        """Attach ``handler`` at a file offset of ``path``, for every process."""
        try:
            self._bpf.attach_uprobe(name=str(path), addr=file_offset, fn_name=handler, pid=-1)
        except Exception as exc:
            raise AttachError(f"cannot attach to {path} at {file_offset:#x}: {exc}") from None

    def write_sites(self, layouts: Sequence[tuple[int, Sequence[ArgLocation]]]) -> None:
        """Fill the ``sites`` array: index i gets (probe slot, argument locations)."""
        table = self._bpf["sites"]
        for index, (probe, args) in enumerate(layouts):
            leaf = table.Leaf()
            leaf.probe = probe
            leaf.nargs = len(args)
            for slot, arg in enumerate(args[: len(leaf.args)]):
                desc = leaf.args[slot]
                desc.kind = int(arg.kind)
                desc.size = arg.size
                desc.is_signed = int(arg.signed)
                desc.reg = arg.reg
                desc.value = arg.value
            table[table.Key(index)] = leaf

    def map_fd(self, name: str) -> int:
        return int(self._bpf[name].map_fd)

    def pair_keyed_counts(self, table: str) -> dict[tuple[int, int], int]:
        """A hash keyed by struct {u32 tgid; u32 probe;} -> {(tgid, probe): count}."""
        counts = self._bpf[table]
        return {(int(k.tgid), int(k.probe)): int(v.value) for k, v in counts.items()}

    def set_gate(self, open_: bool) -> None:
        """Open or close trace.bpf.c's ``control`` gate for the site handlers."""
        control = self._bpf["control"]
        control[control.Key(0)] = control.Leaf(int(open_))

    def follow(self, pids: Iterable[int]) -> None:
        followed = self._bpf["followed"]
        for pid in pids:
            followed[followed.Key(pid)] = followed.Leaf(1)

    def percpu_array_totals(self, table: str) -> list[int]:
        values = self._bpf[table]
        return [sum(values[values.Key(i)]) for i in range(len(values))]

    def percpu_struct_totals(self, table: str) -> list[tuple[Any, list[int]]]:
        """Each entry of a per-CPU hash or array of u64-only structs, its
        fields summed over the CPUs: [(key, [field sums in declaration order])]."""
        values = self._bpf[table]
        fields = len(values.sLeaf._fields_)
        rows = []
        for key, per_cpu in values.items():
            summed = np.frombuffer(bytes(per_cpu), dtype=np.uint64).reshape(-1, fields).sum(axis=0)
            rows.append((key, [int(v) for v in summed]))
        return rows

    def string_keyed_counts(self, table: str) -> dict[str, int]:
        counts = self._bpf[table]
        return {
            bytes(key.name).split(b"\0", 1)[0].decode(errors="replace"): int(value.value)
            for key, value in counts.items()
        }

    def close(self) -> None:
        self._bpf.cleanup()
