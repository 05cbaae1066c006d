"""The one place mtrace-live imports bcc.

Everything else (decoding, aggregation, exporters, listing probes) runs
without root and without bcc; they receive plain data from here.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mtrace_live.probes import bpf_source

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


def require_privileges() -> None:
    """Fail early, with one line, when BPF programs cannot be loaded."""
    caps = _effective_capabilities()
    has_bpf = caps & (1 << CAP_BPF) and caps & (1 << CAP_PERFMON)
    if os.geteuid() != 0 and not has_bpf and not caps & (1 << CAP_SYS_ADMIN):
        raise NotPrivilegedError(
            "loading BPF programs needs root (or CAP_BPF and CAP_PERFMON); run with sudo"
        )


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
    except ImportError:
        raise BccUnavailableError(
            "the bcc Python bindings are not importable; install Debian's python3-bpfcc "
            "(scripts/setup.sh does) and run from a Python that sees the distro's packages"
        ) from None
    return bcc


class BpfProgram:
    """A compiled and attached bcc program built from one bundled .bpf.c file."""

    def __init__(self, name: str, defines: dict[str, int] | None = None) -> None:
        require_privileges()
        tracefs_root()
        bcc = import_bcc()
        src = bpf_source(name)
        cflags = [f"-I{src.parent}", "-Wno-macro-redefined"]
        cflags += [f"-D{key}={value}" for key, value in (defines or {}).items()]
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

    def follow(self, pids: Iterable[int]) -> None:
        followed = self._bpf["followed"]
        for pid in pids:
            followed[followed.Key(pid)] = followed.Leaf(1)

    def percpu_array_totals(self, table: str) -> list[int]:
        values = self._bpf[table]
        return [sum(values[values.Key(i)]) for i in range(len(values))]

    def string_keyed_counts(self, table: str) -> dict[str, int]:
        counts = self._bpf[table]
        return {
            bytes(key.name).split(b"\0", 1)[0].decode(errors="replace"): int(value.value)
            for key, value in counts.items()
        }

    def close(self) -> None:
        self._bpf.cleanup()
