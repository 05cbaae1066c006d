"""``mtrace-live count``: exact in-kernel hit counts for libc USDT probes and
kmem tracepoints, for a process or a command run under it.

This is the smallest complete chain (probe -> BPF -> map -> user space) and the
reference the richer tracers are checked against: counts are kept per probe in
the kernel, so nothing is lost however fast probes fire. ``HitCounter`` holds
the program; ``run_count`` attaches it, runs or watches the target, and reports.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mtrace_live.probes.program import ProgramConfig
from mtrace_live.probes.records import KMEM_EVENTS
from mtrace_live.tracer.bpf.bpf_backend import BpfProgram
from mtrace_live.tracer.bpf.kmem_attach import kmem_switches
from mtrace_live.tracer.bpf.privileges import require_privileges
from mtrace_live.tracer.loop import usdt
from mtrace_live.tracer.processes import target
from mtrace_live.tracer.processes.launch import GatedCommand


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
            usdt.attach_sites(self._program, self.selection)
        try:
            self._program.tracepoints_attached()
        except BaseException:
            self._program.close()
            raise

    def start_up_notes(self) -> list[str]:
        return self._program.start_up_notes()

    def follow(self, pids: Iterable[int]) -> None:
        pids = list(pids)
        self._program.tables.follow(pids)
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


@dataclass(frozen=True)
class CountRequest:
    pid: int | None
    command: list[str]
    lib: Path | None
    sdt_glibc: bool
    patterns: list[str]
    kmem: bool
    usdt: bool
    follow_forks: bool
    duration: float | None
    derived: bool = False
    debug_file: Path | None = None


class _Stopped(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is: the counts are reported."""


def _terminate(signum: int, frame: object) -> None:
    raise _Stopped


def run_count(request: CountRequest) -> CountReport:
    old = signal.signal(signal.SIGTERM, _terminate)
    try:
        if request.pid is not None:
            return _count_pid(request, request.pid)
        return _count_command(request)
    finally:
        signal.signal(signal.SIGTERM, old)


def _count_pid(request: CountRequest, pid: int) -> CountReport:
    target.require_process(pid)
    libc: Path | None = None  # kmem-only counting needs no libc at all
    if request.usdt:
        libc, _ = usdt.resolve_libc(pid, (), request.lib, sdt=False)
    counter = _counter(request, libc)
    try:
        counter.follow([pid])
        _announce(counter, pid)
        _watch(pid, request.duration)
        return counter.report(pid, exit_code=None)
    finally:
        counter.close()


def _count_command(request: CountRequest) -> CountReport:
    libc, argv = usdt.resolve_libc(None, request.command, request.lib, request.sdt_glibc)
    assert argv is not None
    child = GatedCommand(argv)
    try:
        counter = _counter(request, libc)
    except BaseException:
        child.abandon()
        raise
    try:
        counter.follow([child.pid])
        _announce(counter, child.pid)
        child.release()
        try:
            exit_code = child.wait()
        except KeyboardInterrupt as stop:  # passed on to the command
            child.interrupt(signal.SIGTERM if isinstance(stop, _Stopped) else signal.SIGINT)
            exit_code = child.wait()
        return counter.report(child.pid, exit_code)
    finally:
        counter.close()


def _announce(counter: HitCounter, pid: int) -> None:
    """Say that counting has begun, as bpftrace says "Attaching N probes"."""
    for note in counter.start_up_notes():
        print(f"mtrace-live: {note}", file=sys.stderr, flush=True)
    what = [f"{len(counter.probes)} libc probes"] if counter.probes else []
    if counter.kmem:
        what.append("the kmem tracepoints")
    print(
        f"mtrace-live: counting {' and '.join(what)} for pid {pid}; Ctrl-C to stop",
        file=sys.stderr,
        flush=True,
    )


def _counter(request: CountRequest, libc: Path | None) -> HitCounter:
    return HitCounter(
        libc if request.usdt else None, request.patterns, request.follow_forks, request.kmem,
        request.derived, request.debug_file,
    )  # fmt: skip


def _watch(pid: int, duration: float | None) -> None:
    """Return when the process exits, the duration passes, or on Ctrl-C."""
    deadline = None if duration is None else time.monotonic() + duration
    with contextlib.suppress(KeyboardInterrupt):
        while deadline is None or time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
