"""The live trace: attach, stream events into the model and the output, end
cleanly, summarise.

``run_trace`` serves ``mtrace-live --pid N``, ``--all`` and ``run -- CMD``.
The loop polls the ring buffer's file descriptor (and a pidfd for the
target), reads everything committed in one bulk copy per wake-up, and hands
the batch to the allocator model and the output sink. At the end the handlers' gate
is closed first, then the ring is drained and the counters read, so that for
every probe kernel count = delivered + lost holds exactly. (Detaching the
uprobes comes last: the kernel takes about 0.1 s per site to unregister one.)
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import numpy as np
from mtrace_live.exporters.kmemtrace import (
    ALLOC_TASK_RECORD,
    FREE_TASK_RECORD,
    LIBC_ALLOCS,
    LIBC_FREES,
    PROBE_TASK_RECORD,
    KmemtraceWriter,
)
from mtrace_live.probes.catalog import load_catalog

from . import bpf_syscalls, package_version, target, usdt
from .bpf_backend import BpfProgram, require_privileges, tracepoint_format
from .errors import MtraceError, OutputClosedError, TargetError, TargetExecError
from .events import EVENT_DTYPE, Event, EventDecoder, EventKind
from .kallsyms import saved_text
from .kmem import KmemTotals, read_kernel_totals
from .launch import GatedCommand
from .model import AllocatorModel
from .output import Sink, make_sink
from .ringbuf import RingReader
from .sprtrace_writer import SpRtraceWriter
from .tracefs import kmem_defines

# Events handled between two looks at signals and deadlines: about 0.1 s of
# event lines in the slowest output (text).
LOOP_BATCH = 16384
DEFAULT_BUFFER_PAGES = 2048  # 8 MiB: about 95,000 events of slack
GATE_SETTLE_S = 0.01


@dataclass(frozen=True)
class TraceRequest:
    pid: int | None = None
    all_processes: bool = False
    command: tuple[str, ...] = ()
    lib: Path | None = None
    sdt_glibc: bool = False
    patterns: tuple[str, ...] = usdt.DEFAULT_PATTERNS
    output: str = "text"  # live, text or json
    follow_forks: bool = False
    buffer_pages: int = DEFAULT_BUFFER_PAGES
    duration: float | None = None
    interval: float = 1.0
    kmem: bool = False  # the kmem tracepoints too, aggregated per call site
    libc_probes: bool = True  # False: the kmem tracepoints only
    kmemtrace: Path | None = None  # write kmemtrace records here (implies kmem)
    comm: str | None = None  # trace the processes with this kernel name (serve)
    cgroup: str | None = None  # trace the tasks of this cgroup v2 and below (serve)
    end_with_target: bool = True  # False: go on after a --pid target exits (serve)
    sp_rtrace: Path | None = None  # write an sp-rtrace text report here while tracing
    stack_depth: int = 0  # > 0: a user (and kernel, for kmem) stack on each event
    stack_entries: int = 16384  # distinct stacks the BPF stack map holds

    @property
    def filtered_by_pid(self) -> bool:
        """The ``followed`` table decides (--pid, COMMAND, --comm)."""
        return not self.all_processes and self.cgroup is None


@dataclass
class KmemResult:
    totals: KmemTotals
    delivered: int
    lost: int
    records_written: int = 0
    overrun_bytes: int = 0
    directory: Path | None = None


@dataclass
class TraceResult:
    """What the trace saw; ``exit_code`` is the command's, for ``run``."""

    probes: tuple[str, ...]
    kernel_hits: dict[str, int]
    lost: dict[str, int]
    delivered: int
    lost_lifecycle: int
    per_process: dict[int, dict[str, int]]
    duration_s: float
    model: AllocatorModel
    exit_code: int | None = None
    ended_by: str = ""
    unreadable: list[str] = field(default_factory=list)
    kmem: KmemResult | None = None
    missed: dict[str, int] = field(default_factory=dict)  # handler runs the kernel skipped
    stacks_lost: tuple[int, int] = (0, 0)  # user, kernel stacks the stack map did not store

    @property
    def total_hits(self) -> int:
        return sum(self.kernel_hits.values())

    @property
    def total_lost(self) -> int:
        return sum(self.lost.values())


class _Stop:
    """SIGINT and SIGTERM end the trace at the next wake-up, not mid-batch.
    A signal also writes to ``fd`` (signal.set_wakeup_fd), which the loop
    polls, so that wake-up comes at once rather than at the poll's timeout."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.fd: int | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.signal = signum

    @contextlib.contextmanager
    def installed(self) -> Iterator[_Stop]:
        old = {sig: signal.signal(sig, self) for sig in (signal.SIGINT, signal.SIGTERM)}
        old_pipe = signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # EPIPE, not death
        read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        old_wakeup = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        self.fd = read_end
        try:
            yield self
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for sig, handler in old.items():
                signal.signal(sig, handler)
            signal.signal(signal.SIGPIPE, old_pipe)
            os.close(read_end)
            os.close(write_end)
            self.fd = None


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise TargetError(f"no process with pid {pid}") from None
    except OSError:
        return None


class LiveTrace:
    """One attached program, its ring buffer and its consumers."""

    def __init__(self, request: TraceRequest, libc: Path) -> None:
        self.request = request
        if request.libc_probes:
            self.selection = usdt.choose(libc, request.patterns)  # no-probe errors before root
        else:
            self.selection = usdt.ProbeSelection(libc, (), (), {})
        require_privileges()
        self.kmem = request.kmem or request.kmemtrace is not None or not request.libc_probes
        catalog = load_catalog()
        infos = self.selection.site_infos(catalog)
        self.decoder = EventDecoder(infos)
        main_arena = self.selection.symbol("main_arena")
        site_addresses = [lay.site.address for lay in self.selection.layouts]

        def main_arena_of(event: Event, site: int) -> int | None:
            if main_arena is None or event.ip == 0 or site >= len(site_addresses):
                return None
            return event.ip - site_addresses[site] + main_arena

        self.model = AllocatorModel(self.decoder, self.selection.probes, main_arena_of)
        defines = {
            "FILTER_PIDS": int(request.filtered_by_pid),
            "FOLLOW_FORKS": int(request.follow_forks or request.comm is not None),
            "WITH_EVENTS": 1,
            "RINGBUF_PAGES": request.buffer_pages,
            **usdt.site_defines(self.selection),
            "WITH_KMEM": int(self.kmem),
            "KMEM_EVENTS": int(request.kmemtrace is not None or request.sp_rtrace is not None),
            "PAGE_SHIFT_": mmap.PAGESIZE.bit_length() - 1,
            "WITH_STACKS": int(request.stack_depth > 0),
            "STACK_DEPTH": max(request.stack_depth, 1),
            "STACK_ENTRIES": request.stack_entries,
        }
        if request.comm is not None:
            low, high = target.comm_words(request.comm)
            defines.update({"FILTER_COMM": 1, "COMM_LO": low, "COMM_HI": high})
        if request.cgroup is not None:
            cgroup_id, level, _ = target.cgroup_target(request.cgroup)
            defines.update({"FILTER_CGROUP": 1, "CGROUP_ID": cgroup_id, "CGROUP_LEVEL": level})
        if self.kmem:
            defines.update(kmem_defines(tracepoint_format))
        self.writer: KmemtraceWriter | None = None
        if request.kmemtrace is not None:
            self.writer = KmemtraceWriter(request.kmemtrace, self.selection.probes, saved_text())
        self.sp_rtrace: SpRtraceWriter | None = None
        if request.sp_rtrace is not None:
            self.sp_rtrace = SpRtraceWriter(
                request.sp_rtrace, self.selection, self.kmem, package_version()
            )
            if request.command:
                self.sp_rtrace.process = Path(request.command[0]).name
        self.program = BpfProgram("trace", defines)
        if self.sp_rtrace is not None and request.stack_depth:
            self.sp_rtrace.use_stacks(self.program.stack, request.stack_depth)
        try:
            usdt.attach(self.program, self.selection)
            self.program.set_gate(True)
            self.reader = RingReader(
                self.program.map_fd("events"), request.buffer_pages * mmap.PAGESIZE, EVENT_DTYPE
            )
        except BaseException:
            self.program.close()
            raise

    def follow(self, pid: int) -> None:
        self.program.follow([pid])
        if self.sp_rtrace is not None and not self.sp_rtrace.pid:
            self.sp_rtrace.pid = pid

    more_waiting = False  # the last read left events in the ring
    delivered = 0  # probe events read from the ring (exec/exit ones not counted)
    kmem_delivered = 0
    _overrun_bytes = 0
    _lost_events = 0

    def drain(self, once: bool = False) -> Iterator[np.ndarray]:
        """Batches of libc events; kmem events go to the record writer here.
        Until the ring is empty, or with ``once`` one batch of at most
        LOOP_BATCH events: while tracing, events may come faster than a sink
        writes them, and the loop must still get to its signals and
        deadlines soon (a stop then flushes the rest)."""
        while True:
            batch = self.reader.read(LOOP_BATCH if once else None)
            self.more_waiting = len(batch) >= LOOP_BATCH
            if len(batch) == 0:
                return
            self.delivered += int(np.count_nonzero(batch["kind"] == EventKind.PROBE))
            if self.writer is not None:
                self.writer.write(batch, EventKind.KMEM, EventKind.PROBE)
            if self.sp_rtrace is not None:
                self.sp_rtrace.write(batch, EventKind.KMEM, EventKind.PROBE)
            if self.kmem:
                kmem_rows = batch["kind"] == EventKind.KMEM
                self.kmem_delivered += int(np.count_nonzero(kmem_rows))
                batch = batch[~kmem_rows]
            yield batch
            if once:
                return

    def result(self, started: float, ended_by: str, exit_code: int | None) -> TraceResult:
        totals = self.program.percpu_array_totals("hits")
        lost = self.program.percpu_array_totals("lost")
        names = self.selection.probes
        kmem = None
        if self.kmem:
            kernel = read_kernel_totals(self.program)
            kmem = KmemResult(kernel, self.kmem_delivered, kernel.lost_allocs + kernel.lost_frees)
            if self.writer is not None:
                kmem.records_written = self.writer.records
                kmem.directory = self.writer.directory
                kmem.overrun_bytes = (
                    kernel.lost_allocs * ALLOC_TASK_RECORD.itemsize
                    + kernel.lost_frees * FREE_TASK_RECORD.itemsize
                    + sum(lost[slot] * _record_size(name) for slot, name in enumerate(names))
                )
                self._overrun_bytes = kmem.overrun_bytes
        self._lost_events = sum(lost) + (kmem.lost if kmem is not None else 0)
        per_process: dict[int, dict[str, int]] = {}
        for row in self.program.process_hits():
            if row.probe < len(names):
                per_process.setdefault(row.tgid, {})[names[row.probe]] = row.hits
        return TraceResult(
            probes=names,
            kernel_hits={name: totals[slot] for slot, name in enumerate(names)},
            lost={name: lost[slot] for slot, name in enumerate(names)},
            delivered=self.delivered,
            lost_lifecycle=self.program.percpu_array_totals("lost_lifecycle")[0]
            if self.request.filtered_by_pid
            else 0,
            per_process=per_process,
            duration_s=time.monotonic() - started,
            model=self.model,
            exit_code=exit_code,
            ended_by=ended_by,
            unreadable=self.selection.unreadable(),
            missed={label: s.misses for label, s in self.program_stats().items() if s.misses},
            stacks_lost=self.stacks_lost(),
            kmem=kmem,
        )

    def stacks_lost(self) -> tuple[int, int]:
        if not self.request.stack_depth:
            return (0, 0)
        user, kernel = self.program.percpu_array_totals("stack_errors")
        return user, kernel

    def program_stats(self) -> dict[str, bpf_syscalls.RunStats]:
        """What the kernel counted for each handler, summed by what it
        traces: ``usdt:PROBE`` (over the probe's sites), ``tracepoint:CAT:NAME``."""
        layouts = self.selection.layouts
        totals: dict[str, bpf_syscalls.RunStats] = {}
        for name, fd in self.program.program_fds().items():
            if name.startswith("site_"):
                index = int(name[5:])
                label = f"usdt:{layouts[index].site.name}" if index < len(layouts) else name
            elif name.startswith("tracepoint__"):
                label = "tracepoint:" + name[len("tracepoint__") :].replace("__", ":", 1)
            else:
                label = name
            stats = bpf_syscalls.run_stats(fd)
            if stats is not None:
                before = totals.get(label, bpf_syscalls.RunStats(0, 0, 0))
                totals[label] = bpf_syscalls.RunStats(
                    *(a + b for a, b in zip(before, stats, strict=True))
                )
        return totals

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close(self._overrun_bytes)
            self.writer = None
        if self.sp_rtrace is not None:
            self.sp_rtrace.close(self._lost_events, sum(self.stacks_lost()))
            self.sp_rtrace = None
        self.reader.close()
        self.program.close()


def _record_size(probe: str) -> int:
    """The kmemtrace record a libc probe's event becomes."""
    if probe in LIBC_ALLOCS:
        return ALLOC_TASK_RECORD.itemsize
    if probe in LIBC_FREES:
        return FREE_TASK_RECORD.itemsize
    return PROBE_TASK_RECORD.itemsize


def run_trace(
    request: TraceRequest,
    sink: Sink | None = None,
    attached: Callable[[LiveTrace, Sink], Sink] | None = None,
) -> TraceResult:
    """``attached``, when given, runs once the programs are attached and
    returns the sink to use (the metrics exporter wraps the output there)."""
    libc, argv = usdt.resolve_libc(request.pid, request.command, request.lib, request.sdt_glibc)
    child = GatedCommand(argv) if argv is not None else None
    trace: LiveTrace | None = None
    try:
        trace = LiveTrace(request, libc)
        sink = sink or make_sink(request.output)
        if attached is not None:
            sink = attached(trace, sink)
    except BaseException:
        if child is not None:
            child.abandon()  # the command never ran
        if trace is not None:
            trace.close()
        raise
    try:
        with _Stop().installed() as stop:
            return _loop(trace, request, child, stop, sink)
    finally:
        trace.close()


def _loop(
    trace: LiveTrace,
    request: TraceRequest,
    child: GatedCommand | None,
    stop: _Stop,
    sink: Sink,
) -> TraceResult:
    target_pid = child.pid if child is not None else request.pid
    if target_pid is not None:
        trace.follow(target_pid)
    if request.comm is not None:  # later ones are followed from their exec, in the kernel
        for pid in target.processes_with_comm(request.comm):
            trace.follow(pid)
    pidfd = _pidfd(target_pid) if target_pid is not None else None
    poller = select.poll()
    poller.register(trace.reader.fd, select.POLLIN)
    if stop.fd is not None:
        poller.register(stop.fd, select.POLLIN)
    if pidfd is not None:
        poller.register(pidfd, select.POLLIN)
    started = time.monotonic()
    deadline = started + request.duration if request.duration else None
    sink.start(trace, target_pid)
    if child is not None:
        child.release()
    ended_by = ""
    failure: MtraceError | None = None
    exit_code: int | None = None
    wait_ms = int(min(request.interval, 0.25) * 1000)
    try:
        while not ended_by:
            # A full batch leaves events in the ring, which wakes no one: look again at once.
            ready = {fd for fd, _ in poller.poll(0 if trace.more_waiting else wait_ms)}
            if stop.fd is not None and stop.fd in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(stop.fd, 512)  # the signal's byte; its handler set stop.signal
            for batch in trace.drain(once=True):
                trace.model.consume(batch)
                sink.consume(batch)
                failure = failure or _exec_failure(request, batch)
            if failure is not None:
                ended_by = "exec"
            elif pidfd is not None and pidfd in ready:
                if request.end_with_target:
                    ended_by = "exit"
                else:
                    poller.unregister(pidfd)
                    print(f"mtrace-live: pid {target_pid} exited; still serving its metrics",
                          file=sys.stderr, flush=True)  # fmt: skip
            elif stop.signal is not None:
                ended_by = signal.Signals(stop.signal).name
            elif deadline is not None and time.monotonic() >= deadline:
                ended_by = "duration"
            sink.tick()
    except BrokenPipeError:
        ended_by = "output closed"
        failure = OutputClosedError(f"the output was closed after {sink.written} events")
        _silence_stdout()
    finally:
        trace.program.set_gate(False)
        time.sleep(GATE_SETTLE_S)  # a handler past the gate finishes its record
        if child is not None:
            by_signal = stop.signal is not None and ended_by == signal.Signals(stop.signal).name
            exit_code = child.finish(
                grace=0.0 if ended_by == "exit" else 1.0,
                first=signal.Signals(stop.signal) if by_signal and stop.signal else None,
            )
        if pidfd is not None:
            os.close(pidfd)
    for batch in trace.drain():  # everything committed before the detach
        trace.model.consume(batch)
        if failure is None:
            try:
                sink.consume(batch)
            except BrokenPipeError:
                failure = OutputClosedError(f"the output was closed after {sink.written} events")
                _silence_stdout()
    result = trace.result(started, ended_by, exit_code)
    sink.finish(result)
    if failure is not None:
        raise failure
    return result


def _exec_failure(request: TraceRequest, batch: np.ndarray) -> MtraceError | None:
    """With --pid, the target exec'ing ends the trace: its allocator is gone."""
    if request.pid is None:
        return None
    execs = batch[(batch["kind"] == EventKind.EXEC) & (batch["tgid"] == request.pid)]
    if len(execs) == 0:
        return None
    program = _exe(request.pid)
    return TargetExecError(
        f"pid {request.pid} exec'd {program}; its allocator state is gone, so the trace ends here"
    )


def _exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return "another program"


def _silence_stdout() -> None:
    """After EPIPE, point stdout at /dev/null so the final flush cannot fail."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
