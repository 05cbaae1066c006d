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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from mtrace_live.exporters import registry
from mtrace_live.exporters.data.alloc_snapshot import FrameNames
from mtrace_live.exporters.data.events import Event, EventDecoder
from mtrace_live.exporters.data.processes import described, namespace_pid
from mtrace_live.exporters.data.sink import (
    EventBatch,
    KmemResult,
    Sink,
    TraceInfo,
    TraceResult,
)
from mtrace_live.exporters.data.wrappers import Wrappers
from mtrace_live.probes.catalog import load_catalog
from mtrace_live.probes.elf import facts
from mtrace_live.probes.elf.lazy import lazy_module
from mtrace_live.probes.errors import (
    InternalError,
    MtraceError,
    NotPrivilegedError,
    OutputClosedError,
    OutputError,
    TargetError,
    TargetExecError,
)
from mtrace_live.probes.program import part_constants
from mtrace_live.probes.records import EVENT_DTYPE, EventKind
from mtrace_live.tracer.bpf import bpf_syscalls
from mtrace_live.tracer.bpf.bpf_backend import BpfProgram, bcc_version
from mtrace_live.tracer.bpf.kmem_attach import kmem_switches
from mtrace_live.tracer.bpf.privileges import require_privileges
from mtrace_live.tracer.bpf.ringbuf import RingReader
from mtrace_live.tracer.loop import alloc_probes, lock_waits, package_version, usdt
from mtrace_live.tracer.loop.counters import BpfCounters
from mtrace_live.tracer.loop.model import AllocatorModel
from mtrace_live.tracer.loop.plan import (
    PYTHON_ALLOC_STACKS,
    ProgramPlan,
    TraceRequest,
    choose_probes,
    program_plan,
)
from mtrace_live.tracer.processes import providers, target
from mtrace_live.tracer.processes.arena_walk import ArenaFinder, arena_symbols
from mtrace_live.tracer.processes.exec_watch import ExecWatch
from mtrace_live.tracer.processes.holds import BOUND_S, Guardian, Holds
from mtrace_live.tracer.processes.launch import GatedCommand
from mtrace_live.tracer.processes.retarget import KeptReturns, Moved, move_uprobes
from mtrace_live.tracer.unwind.native import NativeUnwinder
from mtrace_live.tracer.unwind.python import PythonUnwinder, runs_python
from mtrace_live.tracer.unwind.unwinder import Unwinder

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # (at the first use: probes/elf/lazy.py)

# Events handled between two looks at signals and deadlines: about 0.1 s of
# event lines in the slowest output (text).
LOOP_BATCH = 16384
GATE_SETTLE_S = 0.01


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

    # the unwinders plugged in (tracer/unwind/unwinder.py), made while attaching
    unwinders: tuple[Unwinder, ...] = ()
    ended_threads: set[int]  # the threads the uprobes moved off (pthread_exit)

    def __init__(
        self,
        request: TraceRequest,
        libc: Path,
        make_sinks: Callable[[], list[Sink]],
        target_pid: int | None = None,
        argv: Sequence[str] | None = None,
    ) -> None:
        """``make_sinks`` runs once the probes are chosen and root is
        confirmed, before the program is built: an output that cannot be
        written fails there, before anything attaches. ``target_pid``: the
        process of --pid or COMMAND, known before anything attaches."""
        self.request = request = _sized_for_python(request, argv)
        probes = choose_probes(request, libc)  # before root
        self.selection, self.sdt, self.alloc_plan = probes.selection, probes.sdt, probes.alloc_plan
        self.lock_plan = probes.lock_plan
        self.notices: list[str] = list(probes.notices)
        self._plan_providers(libc, target_pid, argv)
        traced = self.alloc_plan.libc if self.alloc_plan is not None else self.selection.libc
        followed = request.filtered_by_pid and not request.one_process
        uprobes = self.alloc_plan is not None or bool(self.sdt)
        self.exec_watch = ExecWatch(traced) if followed and uprobes and traced else None
        require_privileges()
        self.frame_names, self.ended_threads = FrameNames(), set()
        self.kmem = request.with_kmem
        self.sites = tuple(self.selection.site_infos(load_catalog()))
        self.decoder = EventDecoder(self.sites)
        self.model = AllocatorModel(self.decoder, self.selection.probes, self._main_arena_of())
        self.arenas = (ArenaFinder(libc, arena_symbols(libc, request.debug_file),
                                   named=self.model.named_arenas)
                       if request.libc_probes else None)  # fmt: skip
        self.sinks: list[Sink] = [self.model, *make_sinks()]
        switches = kmem_switches(request.classic_tracepoints) if self.kmem else None
        plan = program_plan(request, probes, target_pid, switches)
        self.hold, self.alloc_pid = plan.hold, plan.alloc_pid
        stats_fd = bpf_syscalls.enable_run_time_stats() if request.bpf_stats else None
        if request.bpf_stats and stats_fd is None and not bpf_syscalls.sysctl_enabled():
            raise NotPrivilegedError("--bpf-stats: this kernel refused to count BPF run time")
        self._load(plan, stats_fd)
        self._attach(plan, target_pid, stats_fd)
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
            arenas=self.arenas,
            lock_times=self.lock_plan is not None,
        )
        self.counters.traced_from_start = request.traced_from_start
        if self.unwinders:
            self.counters.table_counts = self._table_counts
        if self.alloc_plan is not None:
            self.counters.allocator_of = self.allocator_names.of
            if bpf_syscalls.attach_cookies():  # the stack rows say which provider was called
                self.counters.stack_reader.providers = self.provider_names

    def _plan_providers(self, libc: Path, target_pid: int | None,
                        argv: Sequence[str] | None) -> None:  # fmt: skip
        """The allocators the targets call beside the libc's, their sites
        chosen (before root), and what the once-a-second look starts from."""
        self.providers = self._providers(libc, target_pid, argv)
        self.allocator_names = providers.AllocatorNames(self.providers.per_process)
        self.provider_plans = tuple(alloc_probes.plan_sites(p.path, p.allocator, p.tables)
                                    for p in self.providers.extra)  # fmt: skip
        # each provider by its number in its sites' cookies and alloc_key
        # (0: the libc), when the kernel gives uprobes their cookies
        self.provider_names: list[tuple[str, str]] = [
            ("glibc", providers.soname_or(libc.name, libc)),
            *((p.allocator.name, p.name) for p in self.providers.extra),
        ]  # fmt: skip
        for given in self.provider_plans:  # --allocator-lib: a file with nothing to trace
            alloc_probes.check_attachable(given, None)
        # the files attached, and each process's program when the allocators
        # were last looked for (a command not exec'd yet has none: its
        # program is looked at)
        self._files_attached = {providers.file_identity(libc)} | {
            p.key for p in self.providers.extra}  # fmt: skip
        # (one process: only its own program is looked at again)
        pids = {target_pid} if self.request.one_process and target_pid else providers.every_pid()
        self._programs = {pid: providers.program_of(pid) for pid in pids}
        if argv is not None and target_pid is not None:
            self._programs.pop(target_pid, None)

    def _providers(self, libc: Path, target_pid: int | None,
                   argv: Sequence[str] | None) -> providers.TraceProviders:  # fmt: skip
        """The allocators beside the libc's that the targets call; a notice
        for each target whose malloc no known allocator provides."""
        request = self.request
        if self.alloc_plan is None:
            return providers.TraceProviders({}, ())
        command = (target_pid, argv) if argv is not None and target_pid is not None else None
        found = providers.for_trace(libc, running_targets(request), command,
                                    request.all_processes, request.allocator_libs,
                                    request.pymalloc)  # fmt: skip
        given = {provider.key for provider in found.extra if not provider.allocator.known}
        for pid, theirs in found.per_process.items():
            stranger = theirs.unknown_binding
            if stranger is not None and stranger.key not in given:
                self.notices.append(
                    f"process {pid}'s malloc is provided by {stranger.name}, an allocator "
                    "mtrace-live does not know: its calls are not traced (--allocator-lib "
                    "with the file's path traces its standard names)"
                )
        return found

    def _load(self, plan: ProgramPlan, stats_fd: int | None) -> None:
        """Load the program; where it may hold processes, start the
        guardian, forked now, before any uprobe: whatever becomes of this
        process, no process it held stays stopped (tracer/processes/holds.py).
        The program's loader threads may be running (tracer/bpf/preload.py,
        UprobeLinks.prefetch): the guardian's child makes only system calls
        and runs only its own Python, taking no lock they could hold."""
        try:
            self.program = BpfProgram(plan.config.source(), links=not plan.main_gone)
        except BaseException:
            bpf_syscalls.close(stats_fd)
            raise
        self.holds = Holds(self.program) if plan.holds else None
        self.guardian = Guardian(self.program) if plan.holds else None

    def _main_arena_of(self) -> Callable[[Event, int], int | None]:
        """main_arena's address in the process of an event at a site: its
        distance from the site's, in the libc, added to the event's ip."""
        main_arena = self.selection.symbol("main_arena")
        site_addresses = [lay.site.address for lay in self.selection.layouts]

        def main_arena_of(event: Event, site: int) -> int | None:
            if main_arena is None or event.ip == 0 or site >= len(site_addresses):
                return None
            return event.ip - site_addresses[site] + main_arena

        return main_arena_of

    def _attach(self, plan: ProgramPlan, target_pid: int | None, stats_fd: int | None) -> None:
        """Attach the loaded program, open its gate and its ring; on any
        failure, close it (and the run-time statistics) again."""
        self.notices.extend(self.program.start_up_notes())
        for event, why in self.program.typed_refused.items():
            self.notices.append(f"kmem:{event} attached as a raw tracepoint: the kernel refused "
                                f"its BTF-typed handler ({why})")  # fmt: skip
        request = self.request
        try:
            if plan.config.first_tgid and target_pid is not None:
                self.program.tables.set_first_target(target_pid)
            # in as few links as can be, at its end; the tail calls after them
            with self.program.uprobe_batch():
                self.unwinders = self._make_unwinders(plan)
                # (attached meanwhile: before the targets' tables are written;
                # the gate, closed until the end, lets no event through before)
                self.program.tracepoints_attached()
                # their tables before their first call (a process loaded
                # already, by the Python unwinder's look, is passed over by it)
                targets = running_targets(request)
                for pid in [*targets, *self._running_python(targets)]:
                    for unwinder in self.unwinders:
                        unwinder.load(pid)
                usdt.attach_sites(self.program, self.selection)
                self._attach_allocators()
                if self.lock_plan is not None:
                    lock_waits.attach_lock_waits(self.program, self.lock_plan, self.alloc_pid)
            # never its own processes (the file server, forked by an unwinder,
            # too), nor its guardian's or endpoint's: before the gate opens
            not_ours = [target_pid] if target_pid is not None else []
            self.program.tables.exclude_self(target.own_processes(not_ours))
            self.program.tables.set_gate(True)
            room = request.ring_buffer_pages
            self.reader = RingReader(
                self.program.map_fd("events"),
                plan.ring_pages * mmap.PAGESIZE,
                EVENT_DTYPE,
                room * mmap.PAGESIZE if room > plan.ring_pages else None,
            )
            musts = part_constants("common.bpf.h")["MUSTS_PAGES"] * mmap.PAGESIZE
            self.musts = RingReader(self.program.map_fd("musts"), musts, EVENT_DTYPE)
        except BaseException:
            events = getattr(self, "reader", None)  # (the musts ring's failed after it)
            if events is not None:
                events.close()
            for unwinder in self.unwinders:
                unwinder.close(rest=False)
            self._let_go()
            self.program.close()
            bpf_syscalls.close(stats_fd)
            raise

    def _attach_allocators(self) -> None:
        """The allocation functions' probes: the libc's, then each allocator
        beside it, once a file, by its number."""
        if self.alloc_plan is None:
            return
        request = self.request
        alloc_probes.attach_allocs(self.program, self.alloc_plan, request.sample_bytes,
                                   self.hold, self.alloc_pid)  # fmt: skip
        for number, more in enumerate(self.provider_plans, 1):
            alloc_probes.attach_allocs(self.program, more, 0, False, self.alloc_pid, number)

    def _make_unwinders(self, plan: ProgramPlan) -> tuple[Unwinder, ...]:
        """The unwinders the program has, their programs in their slots;
        none when stacks are walked by frame pointers only."""
        defines = plan.config.defines()
        if not defines.get("WITH_UNWIND"):
            return ()
        consumers = [name for name, plan_of in (("allocs", self.alloc_plan),
                                                 ("locks", self.lock_plan)) if plan_of]  # fmt: skip
        libc = self.alloc_plan.libc if self.alloc_plan is not None else self.lock_plan.libc  # type: ignore[union-attr]
        native = NativeUnwinder(self.program, defines, libc, consumers, self.holds,
                                self.frame_names, self._tables_written, self.alloc_pid,
                                self.notices)  # fmt: skip
        if not defines.get("WITH_PYTHON"):
            return (native,)
        try:
            python = PythonUnwinder(self.program, self.frame_names, self.request.all_processes)
            if self.request.all_processes:
                python.own = set(target.own_processes())  # (the file server's too: forked)
                python.look_around()
        except BaseException:
            native.close(rest=False)  # (its file server and thread)
            raise
        return (python, native)

    def _running_python(self, targets: list[int]) -> list[int]:
        """With --all, the running processes whose interpreter the Python
        unwinder took: their files' tables are written before the line, so
        that their first stacks reach their Python frames (another running
        process's files are written at the first walk's ask)."""
        if not self.request.all_processes:
            return []
        found = [u for u in self.unwinders if isinstance(u, PythonUnwinder)]
        # (mtrace-live's own are never among them: PythonUnwinder.own)
        passed = set(targets)
        return [pid for u in found for pid in sorted(u.processes) if pid not in passed]

    def _table_counts(self) -> dict[str, int]:
        """The unwinders' own counts, together."""
        counts: dict[str, int] = {}
        for unwinder in self.unwinders:
            counts.update(unwinder.counts())
        return counts

    def _tables_written(self, pid: int) -> None:
        """A process's unwind tables were written (its first traced call, a
        dlopen): its names and its allocator are read while it lives."""
        self.frame_names.refresh(pid)
        self.allocator_names.of(pid)

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
            wrappers=Wrappers().adding(request.wrappers),
        )

    def follow(self, pid: int, running: bool = True) -> None:
        """Trace process ``pid``: ``running`` its program (not a command
        that has yet to exec it, the one process mtrace-live starts, which
        alone may be held), whose arenas can then be read now."""
        if self.holds is not None and not running:
            self.holds.allow(pid)
        self.program.tables.follow([pid])
        usdt.seed_break(self.program, self.selection, pid)
        if self.arenas is not None and running:
            self.model.seed_arenas(pid, self.arenas.scan(pid), at_attach=True)
        for unwinder in self.unwinders if running else ():
            unwinder.load(pid)
        if self.lock_plan is not None:
            self.counters.thread_clock.seed(self.program, pid)
        if running:
            self.frame_names.refresh(pid)

    def _attach_new_allocators(self, pid: int | None, execs: Sequence[int] = ()) -> None:
        """Attach the allocators that processes started since the last look
        map, and no file attached yet does (every process, --comm, --cgroup,
        a command's children: the kernel's filter picks the traced ones);
        for one process (``pid``), those of the program it exec'd since
        (``run -- env LD_PRELOAD=... PROGRAM``); with ``execs``, those of
        the followed processes just seen exec'ing, alone."""
        if self.alloc_plan is None:
            return
        if execs:
            pids = set(execs)
        elif self.request.one_process:
            pids = {pid} if pid is not None else set()
        else:
            pids = providers.every_pid()
        programs = {each: providers.program_of(each) for each in pids}
        changed = [each for each, program in programs.items()
                   if program is not None and self._programs.get(each) != program]  # fmt: skip
        self._programs = {**self._programs, **programs} if execs else programs
        for found in providers.mapped_by(changed, self.request.pymalloc):
            if found.key in self._files_attached:
                continue
            self._files_attached.add(found.key)
            number = len(self.provider_names)  # named before its first site fires
            self.provider_names.append((found.allocator.name, found.name))
            try:
                plan = alloc_probes.plan_sites(found.path, found.allocator, found.tables)
                with self.program.uprobe_batch():
                    alloc_probes.attach_allocs(self.program, plan, 0, False, self.alloc_pid,
                                               number)  # fmt: skip
            except MtraceError as exc:
                print(f"mtrace-live: warning: {found.label} in {found.path}, mapped by a "
                      f"process started after the trace: not traced ({exc})",
                      file=sys.stderr)  # fmt: skip
                continue
            self.provider_plans += (plan,)
            print(f"mtrace-live: tracing {len(plan.sites)} allocation functions of "
                  f"{found.label} too, mapped by a program that started after the trace",
                  file=sys.stderr, flush=True)  # fmt: skip

    more_waiting = False  # the last read left events in the ring
    _next_allocator_look = 0.0  # when tick looks for processes on allocators not attached
    _next_look = 0.0  # when tick looks at the target again
    _next_return_look = 0.0  # when tick looks at the calls the moved uprobes' old returns await
    kept_returns: KeptReturns | None = None  # the process whose uprobes moved
    _next_unwind_look = 0.0  # when tick looks at the traced processes' mappings again
    _looks = 0

    def tick(self, pid: int | None) -> None:
        """A while after the start, then once a second: read the target's
        arenas again (a command's are made after it starts; a running
        server's change), and keep its maps up to date while it lives, so
        that its lock waits' stacks can be named after it is gone (the
        allocation probes hold an exiting process for that instead)."""
        now = time.monotonic()
        for unwinder in self.unwinders:  # what came in the rings of their own
            unwinder.pump()
        if self.kept_returns is not None and now >= self._next_return_look:
            self._next_return_look = now + 0.1  # the uprobes moved, calls may still be in flight
            self.kept_returns.look(self.program)
        for line in self.exec_watch.look() if self.exec_watch is not None else ():
            print(f"mtrace-live: warning: {line}", file=sys.stderr, flush=True)
        if self.exec_watch is not None and self.exec_watch.looked:
            # a followed process's new program: its allocators now, not within a second
            self._attach_new_allocators(pid, self.exec_watch.looked)
        if now >= self._next_allocator_look:
            self._next_allocator_look = now + 1.0
            self._attach_new_allocators(pid)
        if self.unwinders and now >= self._next_unwind_look:
            self._next_unwind_look = now + 1.0
            for unwinder in self.unwinders:
                unwinder.refresh()
        if pid is None or now < self._next_look:
            return
        self._next_look = now + (0.1 if self._looks == 0 else 1.0)
        self._looks += 1
        if self._looks == 1:
            return  # the first look is 0.1 s from now
        if not self.hold:
            self.frame_names.refresh(pid)
        if self.arenas is not None:
            self.model.seed_arenas(pid, self.arenas.scan(pid))

    def drain(self, once: bool = False) -> Iterator[EventBatch]:
        """Batches of events, until the ring is empty, or with ``once`` one
        batch of at most LOOP_BATCH events: while tracing, events may come
        faster than a sink writes them, and the loop must still get to its
        signals and deadlines soon (a stop then flushes the rest)."""
        while True:
            records = self.reader.read(LOOP_BATCH if once else None)
            self.more_waiting = len(records) >= LOOP_BATCH
            # moves, holds, asks: read after the others, handled before them
            # (with ``once``, older events may still wait in the ring)
            musts = self.musts.read()
            if len(musts):
                records = np.concatenate([musts, records])
            if len(records) == 0:
                return
            kinds = records["kind"]
            for unwinder in self.unwinders:
                unwinder.handle(records, kinds)
            if self.hold:
                self._continue_held(records[kinds == EventKind.HELD])
            if self.alloc_pid >= 0:
                self._move_uprobes(records[kinds == EventKind.RETARGET])
            if self.exec_watch is not None:
                self.exec_watch.exec_seen(records["tgid"][kinds == EventKind.EXEC].tolist())
            probes = kinds == EventKind.PROBE
            self.counters.delivered += int(np.count_nonzero(probes))
            self.counters.count_read(records["tgid"][probes], records["probe"][probes])
            if self.alloc_plan is not None:
                self.counters.alloc_delivered += int(
                    np.count_nonzero((kinds == EventKind.ALLOC) | (kinds == EventKind.FREE))
                )
            if self.lock_plan is not None and self.request.lock_events:
                self.counters.lock_delivered += int(np.count_nonzero(kinds == EventKind.LOCK_WAIT))
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

    def _move_uprobes(self, ending: np.ndarray) -> None:
        """The thread the uprobes are attached for is ending (tracer/processes/retarget.py)."""
        pairs = zip(ending["tgid"].tolist(), ending["tid"].tolist(), strict=True)
        for tgid, tid in sorted(set(pairs)):
            held = self.holds is not None and self.holds.is_held(tgid)
            release = self.holds.release if self.holds is not None and held else None
            self.ended_threads.add(tid)
            moved = move_uprobes(self.program, tgid, tid, release, self.ended_threads)
            if isinstance(moved, Moved):
                self.kept_returns = KeptReturns(tgid)
            if moved is not None:
                print(f"mtrace-live: {moved}", file=sys.stderr, flush=True)

    def _continue_held(self, held: np.ndarray) -> None:
        """Processes stopped in _exit: read their maps, then let them go."""
        for tgid in sorted(set(held["tgid"].tolist())):
            self.frame_names.remember(tgid)
            if self.holds is not None:
                self.holds.release(tgid)

    def result(self, started: float, ended_by: str, exit_code: int | None) -> TraceResult:
        for unwinder in self.unwinders:  # what is still owed to the names
            unwinder.settle()
        counters = self.counters.read(kmem=self.kmem, runs=True)
        lost_musts = self.program.percpu_array_totals("lost_musts")[0]
        if lost_musts:
            print(f"mtrace-live: warning: {lost_musts} records the trace needed (moves of "
                  "uprobes, holds, asks for unwind tables) found no room in their ring: "
                  "what followed them may be missing", file=sys.stderr, flush=True)  # fmt: skip
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
            lock_waits=self.counters.lock_waits(),
            lock_delivered=self.counters.lock_delivered if self.request.lock_events else None,
        )

    def _let_go(self) -> None:
        """Continue every process still held, and end the guardian."""
        if self.holds is not None:
            self.holds.release_all()
        if self.guardian is not None:
            self.guardian.close()

    def close(self) -> None:
        for unwinder in self.unwinders:
            unwinder.close()
        self._let_go()
        self.reader.close()
        self.musts.close()
        self.counters.close()
        self.program.close()
        facts.save()  # what was kept since the start (files met later; the handlers used)


class Fanout:
    """The sinks, in order. An output whose reader went away (EPIPE) gets
    no more batches, and the trace ends with OutputClosedError; the others
    (the model, the files) get every batch to the end."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks
        self.open = list(sinks)
        self.closed: OutputClosedError | None = None
        # an output that could not be written (a full disk), or that failed
        # (a fault of its own: it gets nothing more, the others go on)
        self.failed: OutputError | InternalError | None = None
        self.broken: list[Sink] = []

    def start(self, info: TraceInfo) -> None:
        for sink in self.sinks:
            sink.start(info)

    def consume(self, batch: EventBatch) -> None:
        for sink in list(self.open):
            try:
                sink.consume(batch)
            except BrokenPipeError:
                self.open.remove(sink)
                self._reader_gone(sink)
            except OutputError as error:
                self.open.remove(sink)
                self.failed = self.failed or error
            except Exception as exc:  # a fault of the sink's own: the others go on
                self._broke(sink, exc)

    def _reader_gone(self, sink: Sink) -> None:
        if self.closed is None:
            self.closed = OutputClosedError(f"the output was closed after {sink.written} events")
            _silence_stdout()

    def _broke(self, sink: Sink, exc: Exception) -> None:
        self.open.remove(sink)
        self.broken.append(sink)
        name = type(sink).__name__
        self.failed = self.failed or InternalError.during(f"writing an output ({name})", exc)

    def tick(self) -> None:
        for sink in list(self.open):
            try:
                sink.tick()
            except Exception as exc:
                self._broke(sink, exc)

    def finish(self, result: TraceResult) -> None:
        """Every sink finishes, even after one could not write its file;
        a sink that failed gets no finish."""
        for sink in self.sinks:
            if sink in self.broken:
                continue
            try:
                sink.finish(result)
            except BrokenPipeError:  # (its last lines: | head had read enough)
                self._reader_gone(sink)
            except OutputError as error:
                self.failed = self.failed or error
            except Exception as exc:
                self.broken.append(sink)
                self.failed = self.failed or InternalError.during("ending an output", exc)


def default_sinks(request: TraceRequest) -> list[Sink]:
    """The file outputs asked for, then the stream on standard output."""
    files = [registry.file_sink(name, path) for name, path in request.files]
    return [*files, registry.stream(request.output)]


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
        whom = described(pid, ns_pid=namespace_pid(pid)) if pid is not None else "pid ?"
        whom += " and its children" if request.follow_forks else ""
    what = []
    for notice in trace.notices:
        print(f"mtrace-live: {notice}", file=sys.stderr, flush=True)
    if trace.alloc_plan is not None:
        what.append(
            f"{len(trace.alloc_plan.sites)} allocation functions in {trace.alloc_plan.libc}"
        )
        what += [f"{len(more.sites)} of {more.allocator} in {more.libc}"
                 for more in trace.provider_plans]  # fmt: skip
    if trace.sdt:
        what.append(f"{len(trace.selection.probes)} probes ({len(trace.selection.layouts)} "
                    f"sites) in {trace.selection.libc}")  # fmt: skip
    if trace.kmem:
        what.append("the kmem tracepoints")
    records = request.file("kmemtrace")
    if records is not None:
        what[-1] += f", records to {records}"
    # its state as attached, before the line that says so (on which whoever
    # stopped it may continue it)
    state = target.process_state(pid) if pid is not None and not request.command else None
    print(
        f"mtrace-live: tracing {' and '.join(what)} for {whom}; Ctrl-C to stop",
        file=sys.stderr,
        flush=True,
    )
    for traced, theirs in trace.providers.per_process.items():
        if theirs.binding is not None:
            print(f"mtrace-live: pid {traced}: allocator: {theirs.binding.label}",
                  file=sys.stderr)  # fmt: skip
    for line in trace.selection.unreadable():
        print(f"mtrace-live: warning: argument not recorded: {line}", file=sys.stderr)
    if state is not None and state[0] in "Tt":
        how = "SIGSTOP" if state[0] == "T" else "by a debugger"
        print(f"mtrace-live: process {pid} is stopped ({how}): its calls are traced once it is "
              "continued", file=sys.stderr)  # fmt: skip


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
                          child.pid if child is not None else request.pid,
                          child.argv if child is not None else None)  # fmt: skip
    except BaseException:
        if child is not None:
            child.abandon()  # the command never ran
        raise
    try:
        with _Stop().installed() as stop:
            return _loop(trace, request, child, stop, before_start)
    finally:
        trace.close()


class _Watch:
    """What the loop waits on: the ring, the signal pipe and the target's
    pidfd; and what ends the trace."""

    def __init__(self, trace: LiveTrace, request: TraceRequest, stop: _Stop,
                 target_pid: int | None) -> None:  # fmt: skip
        self.request, self.stop, self.target_pid = request, stop, target_pid
        self.pidfd = _pidfd(target_pid) if target_pid is not None else None
        self.poller = select.poll()
        # (the mappings the walks found are read by the tables' serving thread)
        unwinders = [fd for unwinder in trace.unwinders for fd in unwinder.fds()]
        for fd in (trace.reader.fd, trace.musts.fd, *unwinders, stop.fd, self.pidfd):
            if fd is not None:
                self.poller.register(fd, select.POLLIN)
        self.deadline: float | None = None

    def wait(self, now: bool, wait_ms: int) -> set[int]:
        """The descriptors ready, at once (``now``) or within ``wait_ms``."""
        ready = {fd for fd, _ in self.poller.poll(0 if now else wait_ms)}
        if self.stop.fd is not None and self.stop.fd in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self.stop.fd, 512)  # the signal's byte; its handler set stop.signal
        return ready

    def ended_by(self, ready: set[int], sinks: Fanout, failure: MtraceError | None) -> str:
        """Why the trace ends now, or "" to go on."""
        if sinks.closed is not None:
            return "output closed"
        if sinks.failed is not None:
            return "output failed"
        if failure is not None:
            return "error" if isinstance(failure, InternalError) else "exec"
        if self.pidfd is not None and self.pidfd in ready:
            if self.request.end_with_target:
                return "exit"
            self.poller.unregister(self.pidfd)
            print(f"mtrace-live: pid {self.target_pid} exited; still serving its metrics",
                  file=sys.stderr, flush=True)  # fmt: skip
        elif self.stop.signal is not None:
            return signal.Signals(self.stop.signal).name
        elif self.deadline is not None and time.monotonic() >= self.deadline:
            return "duration"
        return ""

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)


def _sized_for_python(request: TraceRequest, argv: Sequence[str] | None) -> TraceRequest:
    """The request, its stack table sized for Python where a target runs
    CPython and no size was asked for."""
    if request.alloc_stacks is None and runs_python(running_targets(request), argv):
        return replace(request, alloc_stacks=PYTHON_ALLOC_STACKS)
    return request


def running_targets(request: TraceRequest) -> list[int]:
    """The running processes the trace names as it starts: --pid's, and
    those --comm or --cgroup name now (later ones are followed from their
    fork or exec)."""
    found = [request.pid] if request.pid is not None else []
    if request.comm is not None:
        found += target.processes_with_comm(request.comm)
    if request.cgroup is not None:
        found += target.cgroup_processes(request.cgroup)
    return found


def _start(trace: LiveTrace, request: TraceRequest,
           child: GatedCommand | None) -> tuple[int | None, Fanout]:  # fmt: skip
    """Follow the targets: the target's pid, and the sinks to hand batches to."""
    target_pid = child.pid if child is not None else request.pid
    if target_pid is not None:
        trace.follow(target_pid, running=child is None)
    if request.comm is not None:  # later ones are followed from their exec, in the kernel
        for pid in target.processes_with_comm(request.comm):
            trace.follow(pid)
    return target_pid, Fanout(trace.sinks)


def _release(trace: LiveTrace, request: TraceRequest, sinks: Fanout, child: GatedCommand | None,
             target_pid: int | None, before_start: Callable[[], None] | None) -> None:  # fmt: skip
    """Let the command run, announce the trace and start the sinks: once the
    line that says the trace is on is out, the command runs (a script that
    acts on that line, or stops the tracer then, finds it started). Its
    first events wait in the ring for the loop."""
    if child is not None:
        child.release()
    announce(trace, target_pid)
    facts.save()  # what the start read of files, for the next one (probes/elf/facts.py)
    if trace.alloc_plan is not None and target_pid is not None and request.privileges_dropped:
        trace.frame_names.preload(target_pid)
    if before_start is not None:
        before_start()
    sinks.start(trace.info(target_pid))


def _close_gate(trace: LiveTrace, child: GatedCommand | None, stop: _Stop,
                ended_by: str) -> tuple[list[EventBatch], int | None]:  # fmt: skip
    """Close the handlers' gate, read what the ring holds, end the command:
    the batches read and the command's exit code."""
    trace.program.tables.set_gate(False)
    time.sleep(GATE_SETTLE_S)  # a handler past the gate finishes its record
    # Read now what the ring holds: a process stopped in _exit just before
    # the gate closed (the command's own child, say) is continued as its
    # record is read, so the command is not left waiting for it while it
    # is asked to end.
    settled = _drained(trace)
    if trace.holds is not None:
        trace.holds.release_all()  # none stays stopped while the command is asked to end
    exit_code = None
    if child is not None:
        by_signal = stop.signal is not None and ended_by == signal.Signals(stop.signal).name
        exit_code = child.finish(
            grace=0.0 if ended_by == "exit" else FORWARDED_GRACE_S if by_signal else 1.0,
            first=signal.Signals(stop.signal) if by_signal and stop.signal else None,
        )
    return settled, exit_code


# A command given the signal that stopped the trace has this long to act on it
# (a shell runs its trap once its foreground child returns) before SIGTERM.
FORWARDED_GRACE_S = 5.0


def _loop(
    trace: LiveTrace,
    request: TraceRequest,
    child: GatedCommand | None,
    stop: _Stop,
    before_start: Callable[[], None] | None,
) -> TraceResult:
    target_pid, sinks = _start(trace, request, child)
    watch = _Watch(trace, request, stop, target_pid)
    started = time.monotonic()
    watch.deadline = started + request.duration if request.duration else None
    _release(trace, request, sinks, child, target_pid, before_start)
    ended_by = ""
    failure: MtraceError | None = None
    wait_ms = int(min(request.interval, 0.25) * 1000)
    try:
        while not ended_by:
            # A full batch leaves events in the ring, which wakes no one: look again at once.
            ready = watch.wait(trace.more_waiting, wait_ms)
            try:
                for batch in trace.drain(once=True):
                    sinks.consume(batch)
                    failure = failure or _exec_failure(request, batch.records)
                trace.tick(target_pid)
            except Exception as exc:  # a fault of the tracer's own: the trace ends cleanly
                failure = InternalError.during("reading the trace", exc)
            ended_by = watch.ended_by(ready, sinks, failure)
            sinks.tick()
    finally:
        settled, exit_code = _close_gate(trace, child, stop, ended_by)
        watch.close()
    for batch in [*settled, *_drained(trace)]:  # everything committed before the detach
        sinks.consume(batch)
        failure = failure or _exec_failure(request, batch.records)  # an exec read last
    result = trace.result(started, ended_by, exit_code)
    _say_holds(trace)
    sinks.finish(result)
    _debug_costs(trace)
    if sinks.closed is not None:
        raise sinks.closed
    if sinks.failed is not None:
        raise sinks.failed
    if failure is not None:
        raise failure
    return result


def _drained(trace: LiveTrace) -> list[EventBatch]:
    """What the ring still holds; nothing after a fault reading it."""
    try:
        return list(trace.drain())
    except Exception:  # the fault that ended the trace: it was said
        return []


def _say_holds(trace: LiveTrace) -> None:
    """A process the guardian let go before the tracer was done with it."""
    if trace.holds is None:
        return
    let_go = trace.holds.counts()["past_bound"]
    if let_go:
        print(f"mtrace-live: warning: {let_go} stops of processes were let go after "
              f"{BOUND_S:g} s before their tables or maps were written (their stacks were "
              "walked by frame pointers meanwhile)", file=sys.stderr, flush=True)  # fmt: skip


def _debug_costs(trace: LiveTrace) -> None:
    """With MTRACE_LIVE_DEBUG set, what the unwind tables and the naming of
    the frames took (bench/stacks_bench.py reads these lines)."""
    if os.environ.get("MTRACE_LIVE_DEBUG", "") in ("", "0"):
        return
    names = trace.frame_names
    print(f"mtrace-live: debug: named {names.named} frames in {names.naming_s:.3f} s",
          file=sys.stderr)  # fmt: skip
    for unwinder in trace.unwinders:
        for line in unwinder.debug_lines():
            print(f"mtrace-live: debug: {line}", file=sys.stderr)


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
