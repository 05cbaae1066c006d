"""A live trace's plan: what it attaches and how its program is built.

Everything here is decided before anything is loaded: the libc's probes and
the allocation functions' sites (read from its ELF files, before root), and
the program's configuration (``ProgramConfig``) from the request, the
probes, the target and this kernel's kmem switches. ``tracer/loop/live.py``'s
``LiveTrace`` is the session that compiles, attaches and runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mtrace_live.exporters import registry
from mtrace_live.exporters.data.processes import live_thread
from mtrace_live.probes.errors import NoProbesError, NotPrivilegedError, TracepointMissingError
from mtrace_live.probes.program import ProgramConfig
from mtrace_live.tracer.bpf import bpf_syscalls, kernel_btf, tracefs
from mtrace_live.tracer.loop import alloc_probes, lock_waits, usdt
from mtrace_live.tracer.processes import target
from mtrace_live.tracer.unwind import python, unwind_tables

DEFAULT_BUFFER_PAGES = ProgramConfig.ring_pages  # 8 MiB: about 87,000 events of slack
# With kmem records in the ring (record, --kmemtrace, --sp-rtrace): 128 MiB,
# 1.4 million events. A burst of kmem events outruns the reader (1.9 million
# in 0.4 s from the kmem exerciser): 8 MiB lost 40% of such a burst, this
# none (docs/reliability.md).
RECORD_BUFFER_PAGES = 32768
# The kernel's ring when the buffer asked for is larger: a ring that stays in
# the CPU's cache costs the probed program less per record, and a thread of
# its own (tracer/bpf/ring_copy.c) empties it, every millisecond while records
# come fast, into a buffer of the size asked for (docs/live-tracing.md).
# 2 MiB lasts 9 ms at 2.4 M records a second, where the copier was seen to
# wait up to 5 ms for a CPU.
KERNEL_RING_PAGES = 512


ALLOC_STACKS = 16384  # --alloc-stacks' default
GROUP_DEAD_RECORD = "trace_event_raw_sched_process_exit"  # the tracepoint's record, in BTF
# Tracing programs may use hash maps allocated as their keys come, without
# the kernel's warning, since Linux 6.1 (the BPF memory allocator)
TABLES_ON_DEMAND_SINCE = (6, 1)
PYTHON_ALLOC_STACKS = 32768  # ... where a target runs CPython: each line of Python is a frame


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
    buffer_pages: int | None = None  # None: ring_buffer_pages decides
    duration: float | None = None
    interval: float = 1.0
    kmem: bool = False  # the kmem tracepoints too, aggregated per call site
    libc_probes: bool = True  # False: the kmem tracepoints only
    classic_tracepoints: bool = False  # no raw kmem tracepoints (tracer/bpf/kmem_attach.py)
    # File outputs (exporters/registry.py: FILE_OUTPUTS) -> where each writes.
    files: tuple[tuple[str, Path], ...] = ()
    comm: str | None = None  # trace the processes with this kernel name (serve)
    cgroup: str | None = None  # trace the tasks of this cgroup v2 and below (serve)
    end_with_target: bool = True  # False: go on after a --pid target exits (serve)
    stack_depth: int = 0  # > 0: a user (and kernel, for kmem) stack on each event
    stack_entries: int = ProgramConfig.stack_entries  # distinct stacks the BPF stack map holds
    bpf_stats: bool = False  # have the kernel count the handlers' run time (serve --bpf-stats)
    allocs: bool = True  # the allocation functions (malloc, free, ...)
    sample_bytes: int = 0  # > 0: keep one allocation per this many bytes, on average
    max_outstanding: int = 262144  # allocations tracked until freed
    # (process, stack) rows aggregated; None: ALLOC_STACKS, or PYTHON_ALLOC_STACKS
    # when a target runs CPython (tracer/unwind/python.py: python_targets)
    alloc_stacks: int | None = None
    leaks_older_than: float | None = None  # list what has been outstanding this long (seconds)
    lock_times: bool = True  # time the waits in the libc's lock-wait slow path
    frame_pointers: bool = False  # walk stacks by frame pointers only, not by the CFI
    no_python_frames: bool = False  # CPython's eval loop stays native in the CFI walk's stacks
    pymalloc: bool = False  # CPython's own allocator traced too (allocator pymalloc)
    unwind_rows: int = unwind_tables.DEFAULT_ROWS  # the unwinder's rows, all files together
    wrappers: tuple[str, ...] = ()  # --wrappers: allocation wrappers beyond the known ones
    allocator_libs: tuple[Path, ...] = ()  # --allocator-lib: an unknown allocator's files
    # serve gives up root in before_start: then no process can be held in
    # _exit (it could not be continued), and the target's symbols are read
    # before, while /proc/PID/maps and its files can still be read.
    privileges_dropped: bool = False

    @property
    def filtered_by_pid(self) -> bool:
        """The ``followed`` table decides (--pid, COMMAND, --comm)."""
        return not self.all_processes and self.cgroup is None

    @property
    def holds(self) -> bool:
        """A process may be stopped while user space does its part: only
        when mtrace-live starts it (COMMAND, and the children it forks).
        Nothing else is ever stopped (tracer/processes/holds.py)."""
        return bool(self.command) and self.filtered_by_pid and not self.privileges_dropped

    @property
    def traced_from_start(self) -> bool:
        """Every process traced is started under the trace (COMMAND, and
        the children it forks): none holds memory allocated before it."""
        return bool(self.command) and self.filtered_by_pid and self.comm is None

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
    def lock_events(self) -> bool:
        """The stream shows each lock wait (its duration) as an event."""
        return registry.stream_wants_events(self.output)

    @property
    def exact_times(self) -> bool:
        """An output shows each probe event's time to the nanosecond (the
        others get it to the clock tick: the trace program, PROBE_EXACT_TIME)."""
        files = any(registry.file_output(name).event_times for name, _ in self.files)
        return files or registry.stream_shows_times(self.output)

    @property
    def ring_buffer_pages(self) -> int:
        """The room for events not yet read: as asked, else by what goes
        through the ring (kmem records come in bursts)."""
        if self.buffer_pages is not None:
            return self.buffer_pages
        return RECORD_BUFFER_PAGES if self.kernel_records else DEFAULT_BUFFER_PAGES

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


@dataclass(frozen=True)
class Probes:
    """The probes a trace attaches in the libc: its SDT (or derived) sites
    and the allocation functions' sites, with what to say of them."""

    selection: usdt.ProbeSelection
    sdt: bool  # libc probes are traced (False: the allocation functions only)
    alloc_plan: alloc_probes.AllocPlan | None
    notices: tuple[str, ...]
    lock_plan: lock_waits.LockWaitPlan | None = None  # None: not timed (a notice says why)


def choose_probes(request: TraceRequest, libc: Path) -> Probes:
    """The libc's probes the request asks for: NoProbesError when it has
    none and the allocation functions are not asked for either."""
    selection = usdt.ProbeSelection(libc, (), (), {})
    sdt, sdt_problem = request.libc_probes, None
    if request.libc_probes:
        try:
            selection = usdt.choose_source(libc, request.patterns, request.derived,
                                           request.debug_file)  # fmt: skip
        except NoProbesError as exc:
            if not request.allocs:
                raise
            sdt, sdt_problem = False, str(exc)
    notices = derived_notices(selection)
    alloc_plan = alloc_probes.plan_sites(libc) if request.allocs and request.libc_probes else None
    if alloc_plan is not None:
        alloc_probes.check_attachable(alloc_plan, sdt_problem)
        if sdt_problem is not None:
            notices.append(
                f"no libc probes: {sdt_problem}; the allocation functions are traced "
                "('mtrace-live doctor' says what each source needs)"
            )
    lock_plan = None
    if request.lock_times and request.libc_probes:
        lock_plan = lock_waits.plan_lock_waits(libc)
        if not lock_plan.timed:
            notices.append(lock_plan.problem)
            lock_plan = None
    return Probes(selection, sdt, alloc_plan, tuple(notices), lock_plan)


@dataclass(frozen=True)
class ProgramPlan:
    """The program to build, and what attaching it needs beside."""

    config: ProgramConfig
    ring_pages: int  # the kernel's ring
    hold: bool  # a process mtrace-live started calling _exit is held until its maps are read
    alloc_pid: int  # the one process the uprobes are attached for, or -1
    holds: bool  # processes mtrace-live started may be held (HOLDS): a guardian watches
    # alloc_pid is a thread of the process, its main one gone (pthread_exit):
    # uprobe links, which find a process by its main thread, cannot follow it
    main_gone: bool = False


def program_plan(request: TraceRequest, probes: Probes, target_pid: int | None,
                 kmem_switches: dict[str, int] | None) -> ProgramPlan:  # fmt: skip
    """``target_pid``: the process of --pid or COMMAND, if known;
    ``kmem_switches``: this kernel's kmem variants and raw handlers
    (tracer/bpf/tracefs.py, tracer/bpf/kmem_attach.py), or None without kmem."""
    # kmem records come in bursts faster than any copier wakes (a softirq
    # freeing an RCU batch writes thousands within a millisecond): with
    # them in the ring, the kernel's ring is all the room asked for.
    room = request.ring_buffer_pages
    ring_pages = room if request.kernel_records else min(room, KERNEL_RING_PAGES)
    # One process alone: its uprobes are attached for it alone.
    alloc_pid = -1
    if request.one_process and target_pid is not None:
        # a thread that lives: main's, unless it has exited (pthread_exit)
        alloc_pid = live_thread(target_pid) or target_pid
    hold, alloc_defines = False, None
    if probes.alloc_plan is not None:
        hold = request.holds and probes.alloc_plan.exit_offset is not None
        alloc_defines = alloc_probes.defines(request.sample_bytes, request.alloc_events, walk=True,
                                       outstanding=request.max_outstanding,
                                       stacks=request.alloc_stacks or ALLOC_STACKS,
                                       hold=hold,
                                       one_process=alloc_pid >= 0)  # fmt: skip
    config = ProgramConfig(
        filter_pids=request.filtered_by_pid,
        follow_forks=request.follow_forks or request.comm is not None,
        first_tgid=request.filtered_by_pid and request.comm is None and target_pid is not None,
        comm=target.comm_words(request.comm) if request.comm is not None else None,
        cgroup=target.cgroup_target(request.cgroup)[:2] if request.cgroup is not None else None,
        ring_pages=ring_pages,
        exact_times=request.exact_times,
        sites=usdt.site_defines(probes.selection),
        derived=usdt.derived_defines(probes.selection),
        kmem=kmem_switches,
        kmem_events=request.kernel_records,
        stack_depth=request.stack_depth,
        stack_entries=request.stack_entries,
        allocs=alloc_defines,
        locks=_lock_defines(request, probes, alloc_pid),
        unwind=_unwind_defines(request),
        holds=request.holds,
        exit_group_dead=exit_says_group_dead(),
        tables_on_demand=bpf_syscalls.kernel_version() >= TABLES_ON_DEMAND_SINCE,
        site_registers=bpf_syscalls.attach_cookies(),
    )
    main_gone = target_pid is not None and alloc_pid not in (-1, target_pid)
    return ProgramPlan(config, ring_pages, hold, alloc_pid, request.holds, main_gone)


def exit_says_group_dead() -> bool:
    """sched_process_exit has ``group_dead`` (Linux 6.14 and later): a
    process ends with its last thread, not with main's (which may call
    pthread_exit while the others go on). Older kernels end it with main's.

    Read from the kernel's BTF (the tracepoint's record, a kernel fact kept
    between runs: tracer/bpf/kernel_btf.py), and from its tracefs format
    only without BTF: a format file is read under the kernel's event_mutex,
    which the start's own tracepoint attaches (on their thread) and the last
    trace's detacher hold, so reading it at each start waited 10-15 ms."""
    try:
        (member,), _ = kernel_btf.kernel_facts([(GROUP_DEAD_RECORD, "group_dead")])
        return member is not None
    except kernel_btf.BtfUnavailable:
        pass
    try:
        text = tracefs.tracepoint_format("sched", "sched_process_exit")
    except (TracepointMissingError, NotPrivilegedError):
        return False
    return tracefs.parse_format("sched", "sched_process_exit", text).has("group_dead")


def _unwind_defines(request: TraceRequest) -> dict[str, int] | None:
    """The unwinder's switches, its tables sized by --unwind-rows; None with
    --frame-pointers."""
    if not unwinds(request):
        return None
    defines = unwind_tables.unwind_defines(rows=request.unwind_rows, pages=request.unwind_rows)
    if not request.no_python_frames:
        defines.update(python.python_defines())
    return defines


def unwinds(request: TraceRequest) -> bool:
    """Whether stacks are unwound by CFI: not with --frame-pointers. A trace
    that gives up root (serve) keeps what reading the mapped files needs
    (tracer/bpf/privileges.py)."""
    return not request.frame_pointers


def _lock_defines(request: TraceRequest, probes: Probes, one_pid: int) -> dict[str, int] | None:
    """The lock waits' switches, when they are timed (``one_pid``: the one
    process the uprobes are attached for, or -1)."""
    if probes.lock_plan is None:
        return None
    events = request.lock_events
    return lock_waits.lock_defines(stacks=True, events=events, one_process=one_pid >= 0)
