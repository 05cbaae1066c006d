"""The live trace: attach, stream events to the sinks, end cleanly.

``run_trace`` serves ``mtrace-live --pid N``, ``--all``, ``run -- CMD``,
``record`` and ``serve``. The loop polls the ring buffer's file descriptor
(and a pidfd for the target), reads everything committed in one bulk copy
per wake-up, and hands the batch to every sink in turn (exporters/data/sink.py):
the allocator model first, then the outputs. At the end the handlers' gate is
closed first, then the ring is drained and the counters read, so that for
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
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import numpy as np
from mtrace_live.exporters import registry
from mtrace_live.exporters.data.allocations import FrameNames
from mtrace_live.exporters.data.events import Event, EventDecoder
from mtrace_live.exporters.data.sink import (
    EventBatch,
    KmemResult,
    Sink,
    TraceInfo,
    TraceResult,
)
from mtrace_live.probes.catalog import load_catalog
from mtrace_live.probes.elf.errors import (
    MtraceError,
    NoProbesError,
    NotPrivilegedError,
    OutputClosedError,
    TargetError,
    TargetExecError,
)
from mtrace_live.probes.program import ProgramConfig
from mtrace_live.probes.records import EVENT_DTYPE, EventKind

from . import allocs, bpf_syscalls, package_version, target, usdt
from .bpf_backend import BpfProgram, bcc_version, require_privileges, tracepoint_format
from .counters import BpfCounters
from .kmem_attach import kmem_attach
from .launch import GatedCommand
from .model import AllocatorModel
from .ringbuf import RingReader
from .tracefs import kmem_defines

# Events handled between two looks at signals and deadlines: about 0.1 s of
# event lines in the slowest output (text).
LOOP_BATCH = 16384
DEFAULT_BUFFER_PAGES = 2048  # 8 MiB: about 95,000 events of slack
# The kernel's ring when the buffer asked for is larger: a ring that stays in
# the CPU's cache costs the probed program less per record, and a thread of
# its own (tracer/ring_copy.c) empties it, every millisecond while records
# come fast, into a buffer of the size asked for (docs/live-tracing.md).
# 2 MiB lasts 9 ms at 2.4 M records a second, where the copier was seen to
# wait up to 5 ms for a CPU.
KERNEL_RING_PAGES = 512
GATE_SETTLE_S = 0.01


@dataclass(frozen=True)
class TraceRequest:
    pid: int | None = None
    all_processes: bool = False
    command: tuple[str, ...] = ()
    lib: Path | None = None
    sdt_glibc: bool = False
    derived: bool = False  # derive the memory_* probes even when the libc has SDT notes
    debug_file: Path | None = None  # the libc's debug file, for the derived probes
    patterns: tuple[str, ...] = usdt.DEFAULT_PATTERNS
    output: str = "text"  # live, text or json
    follow_forks: bool = False
    buffer_pages: int = DEFAULT_BUFFER_PAGES
    duration: float | None = None
    interval: float = 1.0
    kmem: bool = False  # the kmem tracepoints too, aggregated per call site
    libc_probes: bool = True  # False: the kmem tracepoints only
    classic_tracepoints: bool = False  # no raw kmem tracepoints (tracer/kmem_attach.py)
    # File outputs (exporters/registry.py: FILE_OUTPUTS) -> where each writes.
    files: tuple[tuple[str, Path], ...] = ()
    comm: str | None = None  # trace the processes with this kernel name (serve)
    cgroup: str | None = None  # trace the tasks of this cgroup v2 and below (serve)
    end_with_target: bool = True  # False: go on after a --pid target exits (serve)
    stack_depth: int = 0  # > 0: a user (and kernel, for kmem) stack on each event
    stack_entries: int = 16384  # distinct stacks the BPF stack map holds
    bpf_stats: bool = False  # have the kernel count the handlers' run time (serve --bpf-stats)
    allocs: bool = True  # the allocation functions (malloc, free, ...)
    sample_bytes: int = 0  # > 0: keep one allocation per this many bytes, on average
    max_outstanding: int = 262144  # allocations tracked until freed
    alloc_stacks: int = 16384  # (process, stack) rows aggregated
    leaks_older_than: float | None = None  # list what has been outstanding this long (seconds)
    # serve gives up root in before_start: then no process can be held in
    # _exit (it could not be continued), and the target's symbols are read
    # before, while /proc/PID/maps and its files can still be read.
    privileges_dropped: bool = False

    @property
    def filtered_by_pid(self) -> bool:
        """The ``followed`` table decides (--pid, COMMAND, --comm)."""
        return not self.all_processes and self.cgroup is None

    @property
    def one_process(self) -> bool:
        """One process is traced, and only it (--pid or COMMAND, without
        --follow-forks): its uprobes can be attached for it alone."""
        return (
            (self.pid is not None or bool(self.command))
            and not self.follow_forks
            and self.comm is None
            and self.filtered_by_pid
        )

    @property
    def alloc_events(self) -> bool:
        """An output wants each allocation and free through the ring."""
        files = any(registry.file_output(name).alloc_records for name, _ in self.files)
        return files or registry.stream_wants_events(self.output)

    @property
    def exact_times(self) -> bool:
        """An output shows each probe event's time to the nanosecond (the
        others get it to the clock tick: the trace program, PROBE_EXACT_TIME)."""
        files = any(registry.file_output(name).event_times for name, _ in self.files)
        return files or registry.stream_shows_times(self.output)

    @property
    def kernel_records(self) -> bool:
        """A file output wants each kmem event through the ring."""
        return any(registry.file_output(name).kernel_records for name, _ in self.files)

    @property
    def with_kmem(self) -> bool:
        """The kmem tracepoints are attached: asked for, needed by a file
        output, or all there is (no libc probes)."""
        outputs = any(registry.file_output(name).kmem for name, _ in self.files)
        return self.kmem or outputs or not self.libc_probes

    def file(self, name: str) -> Path | None:
        return next((path for output, path in self.files if output == name), None)


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
    """One attached program, its ring buffer and its sinks."""

    def __init__(
        self,
        request: TraceRequest,
        libc: Path,
        make_sinks: Callable[[], list[Sink]],
        target_pid: int | None = None,
    ) -> None:
        """``make_sinks`` runs once the probes are chosen and root is
        confirmed, before the program is built: an output that cannot be
        written fails there, before anything attaches. ``target_pid``: the
        process of --pid or COMMAND, known before anything attaches."""
        self.request = request
        self.notices: list[str] = []
        self.sdt = request.libc_probes
        self.selection = usdt.ProbeSelection(libc, (), (), {})
        sdt_problem = None
        if request.libc_probes:
            try:  # before root
                self.selection = usdt.choose_source(
                    libc, request.patterns, request.derived, request.debug_file
                )
            except NoProbesError as exc:
                if not request.allocs:
                    raise
                self.sdt = False
                sdt_problem = str(exc)
        self.notices.extend(derived_notices(self.selection))
        self.alloc_plan = allocs.plan(libc) if request.allocs and request.libc_probes else None
        if self.alloc_plan is not None:
            allocs.check_attachable(self.alloc_plan, sdt_problem)
            if sdt_problem is not None:
                self.notices.append(
                    f"no libc probes: {sdt_problem}; the allocation functions are traced "
                    "('mtrace-live doctor' says what each source needs)"
                )
        require_privileges()
        self.frame_names = FrameNames()
        self.kmem = request.with_kmem
        catalog = load_catalog()
        self.sites = tuple(self.selection.site_infos(catalog))
        self.decoder = EventDecoder(self.sites)
        main_arena = self.selection.symbol("main_arena")
        site_addresses = [lay.site.address for lay in self.selection.layouts]

        def main_arena_of(event: Event, site: int) -> int | None:
            if main_arena is None or event.ip == 0 or site >= len(site_addresses):
                return None
            return event.ip - site_addresses[site] + main_arena

        self.model = AllocatorModel(self.decoder, self.selection.probes, main_arena_of)
        self.sinks: list[Sink] = [self.model, *make_sinks()]
        # kmem records come in bursts faster than any copier wakes (a softirq
        # freeing an RCU batch writes thousands within a millisecond): with
        # them in the ring, the kernel's ring is all the room asked for.
        ring_pages = (request.buffer_pages if request.kernel_records
                      else min(request.buffer_pages, KERNEL_RING_PAGES))  # fmt: skip
        self.hold = False
        # One process alone: its uprobes are attached for it alone.
        self.alloc_pid = target_pid if request.one_process and target_pid is not None else -1
        alloc_defines = None
        if self.alloc_plan is not None:
            self.hold = not request.privileges_dropped and self.alloc_plan.exit_offset is not None
            alloc_defines = allocs.defines(request.sample_bytes, request.alloc_events, walk=True,
                                           outstanding=request.max_outstanding,
                                           stacks=request.alloc_stacks, hold=self.hold,
                                           one_process=self.alloc_pid >= 0)  # fmt: skip
        kmem_switches = None
        if self.kmem:
            variants = kmem_defines(tracepoint_format)
            raw = kmem_attach(variants, request.classic_tracepoints).defines
            kmem_switches = {**variants, **raw}
        config = ProgramConfig(
            filter_pids=request.filtered_by_pid,
            follow_forks=request.follow_forks or request.comm is not None,
            first_tgid=request.filtered_by_pid and request.comm is None and target_pid is not None,
            comm=target.comm_words(request.comm) if request.comm is not None else None,
            cgroup=target.cgroup_target(request.cgroup)[:2] if request.cgroup is not None else None,
            ring_pages=ring_pages,
            exact_times=request.exact_times,
            sites=usdt.site_defines(self.selection),
            derived=usdt.derived_defines(self.selection),
            kmem=kmem_switches,
            kmem_events=request.kernel_records,
            stack_depth=request.stack_depth,
            stack_entries=request.stack_entries,
            allocs=alloc_defines,
        )
        stats_fd = bpf_syscalls.enable_run_time_stats() if request.bpf_stats else None
        if request.bpf_stats and stats_fd is None and not bpf_syscalls.sysctl_enabled():
            raise NotPrivilegedError("--bpf-stats: this kernel refused to count BPF run time")
        try:
            self.program = BpfProgram(config.source())
        except BaseException:
            bpf_syscalls.close(stats_fd)
            raise
        self.notices.extend(self.program.start_up_notes())
        for event, why in self.program.typed_refused.items():
            self.notices.append(f"kmem:{event} attached as a raw tracepoint: the kernel refused "
                                f"its BTF-typed handler ({why})")  # fmt: skip
        try:
            if config.first_tgid and target_pid is not None:
                self.program.set_first_target(target_pid)
            usdt.attach(self.program, self.selection)
            if self.alloc_plan is not None:
                allocs.attach(self.program, self.alloc_plan, request.sample_bytes, self.hold,
                              self.alloc_pid)  # fmt: skip
            self.program.set_gate(True)
            self.reader = RingReader(
                self.program.map_fd("events"),
                ring_pages * mmap.PAGESIZE,
                EVENT_DTYPE,
                request.buffer_pages * mmap.PAGESIZE if request.buffer_pages > ring_pages else None,
            )
        except BaseException:
            self.program.close()
            bpf_syscalls.close(stats_fd)
            raise
        self.counters = BpfCounters(
            self.program,
            self.selection.probes,
            [layout.site.name for layout in self.selection.layouts],
            libc=self.sdt,
            kmem=self.kmem,
            filtered_by_pid=request.filtered_by_pid,
            stats_fd=stats_fd,
            sample_bytes=request.sample_bytes if self.alloc_plan is not None else None,
            frame_names=self.frame_names,
        )

    def info(self, pid: int | None) -> TraceInfo:
        request = self.request
        return TraceInfo(
            probes=tuple(self.selection.probes),
            sites=self.sites,
            site_addresses=tuple(layout.site.address for layout in self.selection.layouts),
            libc=self.selection.libc if self.sdt else None,
            counters=self.counters,
            allocators=self.model.state,
            pid=pid,
            command=request.command,
            all_processes=request.all_processes,
            filtered_by_pid=request.filtered_by_pid,
            kmem=self.kmem,
            kmem_records=request.kernel_records and self.kmem,
            interval=request.interval,
            stack_depth=request.stack_depth,
            tracepoints=sum(
                1 for name in self.program.program_fds() if name.startswith("tracepoint__")
            ),
            version=package_version(),
            bcc_version=bcc_version(),
            allocs=self.alloc_plan is not None,
            alloc_events=self.alloc_plan is not None and request.alloc_events,
            sample_bytes=request.sample_bytes,
            frame_names=self.frame_names,
            leaks_older_than=request.leaks_older_than,
        )

    def follow(self, pid: int) -> None:
        self.program.follow([pid])
        usdt.seed_break(self.program, self.selection, pid)

    more_waiting = False  # the last read left events in the ring

    def drain(self, once: bool = False) -> Iterator[EventBatch]:
        """Batches of events, until the ring is empty, or with ``once`` one
        batch of at most LOOP_BATCH events: while tracing, events may come
        faster than a sink writes them, and the loop must still get to its
        signals and deadlines soon (a stop then flushes the rest)."""
        while True:
            records = self.reader.read(LOOP_BATCH if once else None)
            self.more_waiting = len(records) >= LOOP_BATCH
            if len(records) == 0:
                return
            kinds = records["kind"]
            if self.hold:
                self._continue_held(records[kinds == EventKind.HELD])
            probes = kinds == EventKind.PROBE
            self.counters.delivered += int(np.count_nonzero(probes))
            self.counters.count_read(records["tgid"][probes], records["probe"][probes])
            if self.alloc_plan is not None:
                self.counters.alloc_delivered += int(
                    np.count_nonzero((kinds == EventKind.ALLOC) | (kinds == EventKind.FREE))
                )
            libc = records
            if self.kmem:
                kmem_rows = kinds == EventKind.KMEM
                kmem = int(np.count_nonzero(kmem_rows))
                self.counters.kmem_delivered += kmem
                if kmem:
                    libc = records[~kmem_rows]
            yield EventBatch(records, self.decoder, libc)
            if once:
                return

    def _continue_held(self, held: np.ndarray) -> None:
        """Processes stopped in _exit: read their maps, then let them go."""
        for tgid in sorted(set(held["tgid"].tolist())):
            self.frame_names.remember(tgid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(tgid, signal.SIGCONT)

    def result(self, started: float, ended_by: str, exit_code: int | None) -> TraceResult:
        counters = self.counters.read(kmem=self.kmem, runs=True)
        names = self.selection.probes
        kmem = None
        if counters.kmem is not None:
            kernel = counters.kmem
            kmem = KmemResult(
                kernel, counters.kmem_delivered, kernel.lost_allocs + kernel.lost_frees
            )
        per_process: dict[int, dict[str, int]] = {}
        for row in self.counters.process_hits():
            if row.probe < len(names):
                per_process.setdefault(row.tgid, {})[names[row.probe]] = row.hits
        return TraceResult(
            probes=names,
            kernel_hits=dict(counters.probe_hits),
            lost=dict(counters.probe_lost),
            delivered=counters.delivered,
            lost_lifecycle=counters.lost_lifecycle,
            per_process=per_process,
            duration_s=time.monotonic() - started,
            model=self.model.state,
            exit_code=exit_code,
            ended_by=ended_by,
            unreadable=self.selection.unreadable(),
            missed={label: s.misses for label, s in counters.runs.items() if s.misses},
            stacks_lost=self.counters.stacks_lost(self.request.stack_depth > 0),
            kmem=kmem,
            allocations=self.counters.allocations(outstanding=True)
            if self.alloc_plan is not None
            else None,
            frame_names=self.frame_names,
            leaks_older_than=self.request.leaks_older_than,
            alloc_delivered=self.counters.alloc_delivered,
        )

    def close(self) -> None:
        self.reader.close()
        self.counters.close()
        self.program.close()


class Fanout:
    """The sinks, in order. An output whose reader went away (EPIPE) gets
    no more batches, and the trace ends with OutputClosedError; the others
    (the model, the files) get every batch to the end."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks
        self.open = list(sinks)
        self.closed: OutputClosedError | None = None

    def start(self, info: TraceInfo) -> None:
        for sink in self.sinks:
            sink.start(info)

    def consume(self, batch: EventBatch) -> None:
        for sink in list(self.open):
            try:
                sink.consume(batch)
            except BrokenPipeError:
                self.open.remove(sink)
                if self.closed is None:
                    self.closed = OutputClosedError(
                        f"the output was closed after {sink.written} events"
                    )
                    _silence_stdout()

    def tick(self) -> None:
        for sink in self.open:
            sink.tick()

    def finish(self, result: TraceResult) -> None:
        for sink in self.sinks:
            sink.finish(result)


def default_sinks(request: TraceRequest) -> list[Sink]:
    """The file outputs asked for, then the stream on standard output."""
    files = [registry.file_sink(name, path) for name, path in request.files]
    return [*files, registry.stream(request.output)]


def derived_notices(selection: usdt.ProbeSelection) -> list[str]:
    """What a trace on derived probes says first: where they come from, and
    what is missing."""
    plan = selection.derived
    if plan is None:
        return []
    notes = [
        f"{plan.libc}: memory_* probes derived from system calls, exported symbols"
        + (f" and {plan.debug_file}" if plan.debug_file else "")
        + " ('mtrace-live probes --derived' shows each source)"
    ]
    if plan.debug_problem:
        notes.append(f"{plan.debug_problem}: the arena and retry probes are not derived")
    return notes


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
    for notice in trace.notices:
        print(f"mtrace-live: {notice}", file=sys.stderr, flush=True)
    if trace.alloc_plan is not None:
        what.append(
            f"{len(trace.alloc_plan.sites)} allocation functions in {trace.alloc_plan.libc}"
        )
    if trace.sdt:
        what.append(f"{len(trace.selection.probes)} probes ({len(trace.selection.layouts)} "
                    f"sites) in {trace.selection.libc}")  # fmt: skip
    if trace.kmem:
        what.append("the kmem tracepoints")
    records = request.file("kmemtrace")
    if records is not None:
        what[-1] += f", records to {records}"
    print(
        f"mtrace-live: tracing {' and '.join(what)} for {whom}; Ctrl-C to stop",
        file=sys.stderr,
        flush=True,
    )
    for line in trace.selection.unreadable():
        print(f"mtrace-live: warning: argument not recorded: {line}", file=sys.stderr)


def run_trace(
    request: TraceRequest,
    make_sinks: Callable[[], list[Sink]] | None = None,
    before_start: Callable[[], None] | None = None,
) -> TraceResult:
    """Trace until the target ends, a signal, or the duration. ``make_sinks``
    gives the outputs (by default those ``request`` names: its file outputs
    and its stream); ``before_start`` runs once everything is attached,
    before the sinks start (``serve`` gives up root there)."""
    libc, argv = usdt.resolve_libc(request.pid, request.command, request.lib, request.sdt_glibc)
    child = GatedCommand(argv) if argv is not None else None
    trace: LiveTrace | None = None
    try:
        trace = LiveTrace(request, libc, make_sinks or (lambda: default_sinks(request)),
                          child.pid if child is not None else request.pid)  # fmt: skip
    except BaseException:
        if child is not None:
            child.abandon()  # the command never ran
        raise
    try:
        with _Stop().installed() as stop:
            return _loop(trace, request, child, stop, before_start)
    finally:
        trace.close()


def _loop(
    trace: LiveTrace,
    request: TraceRequest,
    child: GatedCommand | None,
    stop: _Stop,
    before_start: Callable[[], None] | None,
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
    sinks = Fanout(trace.sinks)
    announce(trace, target_pid)
    if trace.alloc_plan is not None and target_pid is not None and request.privileges_dropped:
        trace.frame_names.preload(target_pid)
    if before_start is not None:
        before_start()
    sinks.start(trace.info(target_pid))
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
                sinks.consume(batch)
                failure = failure or _exec_failure(request, batch.records)
            if sinks.closed is not None:
                ended_by = "output closed"
            elif failure is not None:
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
            sinks.tick()
    finally:
        trace.program.set_gate(False)
        time.sleep(GATE_SETTLE_S)  # a handler past the gate finishes its record
        # Read now what the ring holds: a process stopped in _exit just before
        # the gate closed (the command's own child, say) is continued as its
        # record is read, so the command is not left waiting for it while it
        # is asked to end.
        settled = list(trace.drain())
        if child is not None:
            by_signal = stop.signal is not None and ended_by == signal.Signals(stop.signal).name
            exit_code = child.finish(
                grace=0.0 if ended_by == "exit" else 1.0,
                first=signal.Signals(stop.signal) if by_signal and stop.signal else None,
            )
        if pidfd is not None:
            os.close(pidfd)
    for batch in [*settled, *trace.drain()]:  # everything committed before the detach
        sinks.consume(batch)
    result = trace.result(started, ended_by, exit_code)
    sinks.finish(result)
    if sinks.closed is not None:
        raise sinks.closed
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
