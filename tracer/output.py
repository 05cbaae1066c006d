"""Where a live trace's events go: plain lines, JSON lines, or the live view;
and the summary printed when the trace ends."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, TextIO

import numpy as np

from .events import format_value
from .kallsyms import KernelSymbols
from .kmem import name_sites
from .model import ProcessState, SettingChange

if TYPE_CHECKING:
    from .live import KmemResult, LiveTrace, TraceResult


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends. A write to a full pipe
    that a signal interrupts returns short, and Python 3.11's text layer then
    drops the rest of the batch (seen as megabytes of event lines missing
    after Ctrl-C); held, the signal only sets the stop flag once the batch is
    out."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Sink(Protocol):
    written: int

    def start(self, trace: LiveTrace, pid: int | None) -> None: ...
    def consume(self, batch: np.ndarray) -> None: ...
    def tick(self) -> None: ...
    def finish(self, result: TraceResult) -> None: ...


class LineSink:
    """One line per event on stdout: text columns, or JSON objects."""

    def __init__(self, as_json: bool, stream: TextIO | None = None) -> None:
        self.as_json = as_json
        self.stream = stream or sys.stdout
        self.written = 0
        self._t0 = 0
        self._trace: LiveTrace | None = None

    def start(self, trace: LiveTrace, pid: int | None) -> None:
        self._trace = trace
        announce(trace, pid)
        if not self.as_json:
            self.stream.write(f"{'TIME(s)':>12} {'PID':>7} {'TID':>7} {'CPU':>3} PROBE ARGS\n")
            self.stream.flush()

    def consume(self, batch: np.ndarray) -> None:
        assert self._trace is not None
        events = self._trace.decoder.decode(batch)
        if not events:
            return
        if not self._t0:
            self._t0 = events[0].ts_ns
        if self.as_json:
            lines = [event.as_json() for event in events]
        else:
            lines = [event.text(self._t0) for event in events]
        with signals_held():
            self.stream.write("\n".join(lines) + "\n")
            self.stream.flush()
        self.written += len(events)

    def tick(self) -> None:
        pass

    def finish(self, result: TraceResult) -> None:
        print_summary(result, sys.stderr)


class SummarySink:
    """No per-event output: the model is fed, the summary printed at the end."""

    def __init__(self) -> None:
        self.written = 0

    def start(self, trace: LiveTrace, pid: int | None) -> None:
        announce(trace, pid)

    def consume(self, batch: np.ndarray) -> None:
        pass

    def tick(self) -> None:
        pass

    def finish(self, result: TraceResult) -> None:
        print_summary(result, sys.stdout)


def make_sink(output: str) -> Sink:
    if output == "live":
        from .view import LiveView

        return LiveView()
    if output == "summary":
        return SummarySink()
    return LineSink(as_json=output == "json")


def announce(trace: LiveTrace, pid: int | None) -> None:
    """Say that tracing has begun, as bpftrace says "Attaching N probes"."""
    request = trace.request
    if request.comm is not None:
        whom = f"the processes named {request.comm}"
    elif request.cgroup is not None:
        whom = f"cgroup {request.cgroup}"
    elif request.all_processes:
        whom = "every process mapping it" if request.libc_probes else "every process"
    elif request.command:
        whom = f"command pid {pid}" + (" and its children" if request.follow_forks else "")
    else:
        whom = f"pid {pid}" + (" and its children" if request.follow_forks else "")
    what = []
    if request.libc_probes:
        what.append(f"{len(trace.selection.probes)} probes ({len(trace.selection.layouts)} "
                    f"sites) in {trace.selection.libc}")  # fmt: skip
    if trace.kmem:
        what.append("the kmem tracepoints")
    if request.kmemtrace is not None:
        what[-1] += f", records to {request.kmemtrace}"
    print(
        f"mtrace-live: tracing {' and '.join(what)} for {whom}; Ctrl-C to stop",
        file=sys.stderr,
        flush=True,
    )
    for line in trace.selection.unreadable():
        print(f"mtrace-live: warning: argument not recorded: {line}", file=sys.stderr)


def print_summary(result: TraceResult, stream: TextIO) -> None:
    stream.write("\n".join(summary_lines(result)) + "\n")
    stream.flush()


def summary_lines(result: TraceResult) -> list[str]:
    ended = f"ended by {result.ended_by}" if result.ended_by else "ended"
    if result.exit_code is not None:
        ended += f", command exit code {result.exit_code}"
    lines = [f"mtrace-live: {result.duration_s:.1f} s, {ended}"]
    if result.probes:
        lines.append(f"events: {result.total_hits} in the kernel, {result.delivered} delivered, "
                     f"{result.total_lost} lost")  # fmt: skip
    if result.lost_lifecycle:
        lines.append(f"exec/exit records lost: {result.lost_lifecycle}")
    if any(result.stacks_lost):
        user, kernel = result.stacks_lost
        lines.append(
            f"stacks not stored (stack map full or colliding): {user} user, {kernel} kernel"
        )
    if result.missed:
        lines.append(
            "runs the kernel skipped (another BPF program, or a BPF map system call, was active "
            "on that CPU): " + ", ".join(f"{k} {v}" for k, v in sorted(result.missed.items()))
        )
    hit = sorted(
        ((name, n) for name, n in result.kernel_hits.items() if n),
        key=lambda kv: (-kv[1], kv[0]),
    )
    if hit:
        width = max(len(name) for name, _ in hit)
        lines.append(f"{'probe':<{width}}  {'hits':>10}  {'lost':>8}")
        lines += [f"{name:<{width}}  {n:>10}  {result.lost[name]:>8}" for name, n in hit]
    silent = len(result.kernel_hits) - len(hit)
    if silent:
        lines.append(f"({silent} more probes attached, not hit)")
    for state in sorted(result.model.processes.values(), key=lambda p: p.pid):
        lines += process_lines(state)
    if result.kmem is not None:
        lines += kmem_lines(result.kmem)
    return lines


def kmem_lines(kmem: KmemResult, limit: int = 10) -> list[str]:
    from mtrace_live.exporters.kmem_table import render_table

    totals = kmem.totals
    name_sites(totals.sites, KernelSymbols.load())
    hits = sum(totals.hits.values())
    lines = ["", f"kmem: {hits} tracepoint hits in the kernel; top call sites by bytes allocated:"]
    lines += render_table(totals, limit)
    if totals.untracked or totals.sites_dropped:
        lines.append(f"kmem tables full: {totals.untracked} objects not tracked by pointer, "
                     f"{totals.sites_dropped} updates of call sites dropped")  # fmt: skip
    if kmem.directory is not None:
        lines.append(
            f"kmemtrace: {kmem.records_written} records in {kmem.directory} "
            f"({kmem.delivered} kmem events delivered, {kmem.lost} lost; "
            f"total_overruns {kmem.overrun_bytes} bytes)"
        )
    return lines


def setting_change(change: SettingChange) -> str:
    """``old -> new`` for the probes that report both, ``= new`` for mallopt()."""
    new = "?" if change.new is None else str(change.new)
    return f"= {new}" if change.old is None else f"{change.old} -> {new}"


def process_lines(state: ProcessState) -> list[str]:
    lines = [f"pid {state.pid}" + (f" ({state.comm})" if state.comm else "") + ":"]
    if state.arenas:
        lines.append(
            f"  arenas: {len(state.arenas)} seen, "
            f"{sum(1 for a in state.arenas.values() if a.created_ns)} created; "
            f"contention waits {state.contention_waits}"
        )
        lines.append(
            f"    {'arena':<18} {'reused':>7} {'free-list':>9} {'reuse-waits':>11} "
            f"{'lock-waits':>10} {'retries':>7}"
        )
        for arena in sorted(state.arenas.values(), key=lambda a: (not a.main, a.address)):
            label = f"{arena.address:#x}" + (" main" if arena.main else "")
            lines.append(
                f"    {label:<18} {arena.reused:>7} {arena.free_list:>9} {arena.reuse_waits:>11} "
                f"{state.arena_lock_waits(arena):>10} {arena.retries:>7}"
            )
    if state.heaps or state.heap_bytes_grown:
        lines.append(
            f"  mmapped heaps: {len(state.heaps)} live, {state.heap_bytes} bytes; "
            f"grown {state.heap_bytes_grown}, released {state.heap_bytes_released}"
        )
    if state.sbrk_grown or state.sbrk_shrunk or state.sbrk_failed:
        lines.append(
            f"  sbrk: grown {state.sbrk_grown} bytes, shrunk {state.sbrk_shrunk}, "
            f"failed {state.sbrk_failed}"
        )
    if state.retries:
        lines.append(
            "  retries: " + ", ".join(f"{k} {v}" for k, v in sorted(state.retries.items()))
        )
    if state.double_free_checks:
        shown = ", ".join(
            f"{format_value(c.pointer, 'address')} (bin {c.tcache_bin})"
            for c in state.double_frees[:5]
        )
        lines.append(f"  tcache double-free checks: {state.double_free_checks}: {shown}")
    setjmps, longjmps = state.jumps
    if setjmps or longjmps:
        lines.append(f"  setjmp {setjmps}, longjmp {longjmps}")
    for change in state.settings:
        at = (change.ts_ns - state.first_ns) / 1e9 if state.first_ns else 0.0
        lines.append(f"  setting +{at:.3f}s {change.setting}: {setting_change(change)}")
    if state.execs:
        lines.append(f"  exec'd {state.execs} times")
    return lines
