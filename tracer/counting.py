"""Exact in-kernel hit counts for libc USDT probes and kmem tracepoints.

This is the smallest complete chain (probe -> BPF -> map -> user space) and the
reference the richer tracers are checked against: counts are kept per probe in
the kernel, so nothing is lost however fast probes fire.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mtrace_live.probes.program import ProgramConfig
from mtrace_live.probes.records import KMEM_EVENTS

from . import usdt
from .bpf_backend import BpfProgram, require_privileges
from .kmem_attach import kmem_switches


@dataclass
class CountReport:
    pid: int
    libc: Path | None
    usdt: dict[str, int] = field(default_factory=dict)
    kmem: dict[str, int] = field(default_factory=dict)
    kmem_cache_allocs: dict[str, int] = field(default_factory=dict)
    exit_code: int | None = None

    def as_json(self) -> dict[str, object]:
        return {
            "pid": self.pid,
            "libc": str(self.libc) if self.libc else None,
            "usdt": self.usdt,
            "kmem": self.kmem,
            "kmem_cache_allocs": self.kmem_cache_allocs,
            "exit_code": self.exit_code,
        }


class HitCounter:
    """Counts hits of the chosen libc probes, and optionally the kmem
    tracepoints, for one followed process tree, in a single BPF program."""

    def __init__(
        self,
        libc: Path | None,
        patterns: Sequence[str],
        follow_forks: bool = True,
        kmem: bool = False,
        derive: bool = False,
        debug_file: Path | None = None,
    ) -> None:
        """``libc=None`` counts no USDT probe (kmem tracepoints only). The
        probes are derived (probes/derived.py) with ``derive``, or when the
        libc has no SDT notes."""
        self.selection = (
            usdt.choose_source(libc, patterns, derive, debug_file) if libc is not None else None
        )
        require_privileges()
        self.probes = list(self.selection.probes) if self.selection else []
        self.kmem = kmem
        switches = kmem_switches() if kmem else None
        self._has_cache_name = bool(switches and switches["HAVE_CACHE_NAME"])
        self._caches_by_pointer = bool(switches and switches.get("RAW_CACHE_ALLOC"))
        self.libc = libc
        config = ProgramConfig(events=False, follow_forks=follow_forks, kmem=switches,
                               sites=usdt.site_defines(self.selection),
                               derived=usdt.derived_defines(self.selection))  # fmt: skip
        self._program = BpfProgram(config.source())
        if self.selection is not None:
            usdt.attach(self._program, self.selection)

    def start_up_notes(self) -> list[str]:
        return self._program.start_up_notes()

    def follow(self, pids: Iterable[int]) -> None:
        pids = list(pids)
        self._program.follow(pids)
        if self.selection is not None:
            for pid in pids:
                usdt.seed_break(self._program, self.selection, pid)

    def usdt_counts(self) -> dict[str, int]:
        totals = self._program.percpu_array_totals("hits")
        return {name: totals[slot] for slot, name in enumerate(self.probes)}

    def kmem_counts(self) -> dict[str, int]:
        if not self.kmem:
            return {}
        totals = self._program.percpu_array_totals("kmem_hits")
        return dict(zip(KMEM_EVENTS, totals, strict=True))

    def cache_allocs(self) -> dict[str, int]:
        if not self._has_cache_name:
            return {}
        if self._caches_by_pointer:
            return self._program.slot_named_counts("cache_keys", "cache_names", "cache_counts")
        return self._program.string_keyed_counts("cache_allocs")

    def report(self, pid: int, exit_code: int | None) -> CountReport:
        return CountReport(
            pid=pid,
            libc=self.libc,
            usdt=self.usdt_counts(),
            kmem=self.kmem_counts(),
            kmem_cache_allocs=self.cache_allocs(),
            exit_code=exit_code,
        )

    def close(self) -> None:
        self._program.close()
