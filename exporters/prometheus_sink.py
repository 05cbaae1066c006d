"""``--prometheus ADDR`` and ``serve``: the metrics endpoint as a sink of
the live trace. What a scrape reads from the running trace, and the
bookkeeping that keeps a long-running exporter's counters right and its
tables bounded.

``MetricsSource.snapshot`` runs on the HTTP server's threads: it reads the
kernel's counters (through ``TraceInfo.counters``, which reads the BPF maps
by their file descriptors, so it works after privileges are dropped) and
the allocator model's state under its lock.

``MetricsSource.housekeep`` runs on the tracing loop (``tick``) every few
seconds. A
process that has exited (seen gone twice in a row, so that its last events
are drained first) or that exec'd another program is retired: its per-process
hit counts are taken out of the BPF table and its model state dropped, and
what they counted is kept under its name, so counters by process name never
go down and the tables do not fill up with the dead.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector

from .alloc_table import stack_label
from .data.alloc_snapshot import AllocSnapshot, ProcessAllocs, StackColumns
from .data.allocator_state import arena_lock_waits
from .data.kallsyms import KernelSymbols
from .data.lock_waits import ARENA, MAIN, LockWaits, WaitTimes
from .data.processes import process_name
from .data.sink import RunStats, Sink, TraceInfo, TraceResult
from .exposition import PublishedApp, Renderer, SharedPages
from .heap_profiles import MAX_SAMPLES, HeapProfiles
from .profile_serving import ProfileChannel, ProfilesApp
from .prometheus import AllocFigures, LockFigures, MtraceCollector, ProcessFigures, Snapshot
from .web import MetricsEndpoint

T = TypeVar("T")
HOUSEKEEPING_S = 5.0
STACKS_READ = 200  # the top stacks by live bytes offered to the label cap each scrape


@dataclass(frozen=True)
class ExportOptions:
    address: str
    web_config: Path | None = None
    max_processes: int = 50
    top_functions: int = 20
    top_stacks: int = 20
    run_as: str | None = None  # drop root to this user once attached (serve)
    bpf_stats: bool = False
    read_interval: float = 0.5  # the page is rendered (the BPF maps read) this often while scraped
    profile_max_samples: int = MAX_SAMPLES  # a heap profile's samples at most (0: no bound)


class MetricsSource:
    def __init__(
        self,
        info: TraceInfo,
        symbols: KernelSymbols,
        read_interval: float = 0.5,
    ) -> None:
        self.info = info
        self.read_interval = read_interval
        self._read_lock = threading.Lock()
        self._last: tuple[float, Snapshot] | None = None
        self.counters = info.counters
        self.allocators = info.allocators
        self.probes = info.probes
        self.symbols = symbols
        self._functions: dict[int, str] = {}
        self._names: dict[int, str] = {}  # pid -> the name its counts are kept under
        self._lock_names: dict[int, str] = {}  # pid -> the name its lock waits are kept under
        self._retired: dict[str, ProcessFigures] = defaultdict(ProcessFigures)
        # what the kernel counted of the processes gone, whose rows are taken out
        self._retired_allocs: dict[str, Counter[str]] = defaultdict(Counter)
        self._retired_thread_ns: Counter[str] = Counter()
        self._allocators: dict[str, tuple[str, str]] = {}  # process name -> its allocator, file
        self._gone_before: set[int] = set()
        self.profiles_served: Mapping[str, int] = {}  # the heap profiles' own count, once served
        self._last_housekeeping = time.monotonic()
        self.started = time.time()
        self._build = {
            "version": info.version,
            "bcc": info.bcc_version,
            "kernel": os.uname().release,
        }

    # ---- the tracing loop's side ---------------------------------------
    def tick(self) -> None:
        now = time.monotonic()
        if now - self._last_housekeeping >= HOUSEKEEPING_S:
            self._last_housekeeping = now
            self.housekeep()

    def housekeep(self) -> None:
        # the kernel's rows after the model's lock is let go: a scrape takes
        # the read lock first, then the model's
        self._retire_kernel_rows(self._retire())

    def _retire(self) -> dict[int, str]:
        """Retire the processes gone (or exec'd): their libc hits and model
        state. Returns the gone ones, whose kernel rows are to go too."""
        model = self.allocators
        libc = self.info.libc_probes
        allocs, waits = self._kernel_rows()  # before the model's lock, which lock_waits takes
        kernel = {p.tgid for p in allocs.processes} if allocs is not None else set()
        kernel |= set(waits.threads) if waits is not None else set()
        with model.lock:
            rows = self.counters.process_hits() if libc else []
            hints = {row.tgid: row.comm for row in rows}
            if allocs is not None:
                hints.update({p.tgid: p.comm for p in allocs.processes if p.comm})
            retire: dict[int, str] = {}
            gone = set()
            for pid in set(model.processes) | set(hints) | kernel:
                name = self._name(pid, hints.get(pid, ""))
                if not os.path.exists(f"/proc/{pid}"):
                    gone.add(pid)
                    if pid in self._gone_before:
                        retire[pid] = name
                    continue
                current = process_name(pid)
                renamed = bool(current) and current != name
                if renamed:  # exec'd: what it did so far stays with the old name
                    retire[pid] = name
            self._gone_before = gone - set(retire)
            if not retire:
                return {}
            for row in self.counters.take_process_hits(set(retire)) if libc else []:
                if row.probe < len(self.probes):
                    self._retired[retire[row.tgid]].hits[self.probes[row.probe]] += row.hits
            for pid, name in retire.items():
                state = model.processes.pop(pid, None)
                if state is not None:
                    self._retired[name].arena_lock_waits += arena_lock_waits(state)
                self._names.pop(pid, None)
        return {pid: name for pid, name in retire.items() if pid in gone}

    def _kernel_rows(self) -> tuple[AllocSnapshot | None, LockWaits | None]:
        allocs = self.counters.allocations(named=False) if self.info.allocs else None
        return allocs, self.counters.lock_waits(stacks=False)

    def _retire_kernel_rows(self, names: dict[int, str]) -> None:
        """The kernel's rows of processes that are gone, taken out of its
        tables (so that they hold the live processes only) with what they
        counted kept under each one's name; a scrape sees them either here
        or there, never both or neither."""
        if not names:
            return
        with self._read_lock:
            allocs, waits = self._kernel_rows()
            vm = allocs.vm if allocs is not None else {}
            for proc in allocs.processes if allocs is not None else ():
                if proc.tgid in names:
                    figures = self._retired_allocs[names[proc.tgid]]
                    figures.update(_alloc_counts(proc, vm.get(proc.tgid, {})))
            for pid, time_ in waits.threads.items() if waits is not None else ():
                if pid in names:
                    name = self._lock_names.get(pid, names[pid])
                    self._retired_thread_ns[name] += time_.thread_ns
            self.counters.forget(set(names))
            self.info.frame_names.forget(set(names))
            for pid in names:  # a scrape since _retire may have named it again
                self._names.pop(pid, None)
                self._lock_names.pop(pid, None)
            self._last = None  # the next scrape reads the tables as they are now

    def _name(self, pid: int, hint: str = "") -> str:
        """The name a process's counts are kept under, fixed at first sight:
        its name when the model saw it, else now, else the name of the
        thread that hit a probe first, or the kernel's row (the process may
        be gone already). A process not named yet is "unknown" until a name
        comes."""
        name = self._names.get(pid)
        if name is None:
            state = self.allocators.processes.get(pid)
            name = (
                (state.comm if state is not None else "")
                or process_name(pid)
                or hint
                or self.info.frame_names.comms.get(pid, "")
            )
            if not name:
                return "unknown"
            self._names[pid] = name
        return name

    # ---- the scrape's side -----------------------------------------------
    def read_allocations(self, build: Callable[[AllocSnapshot, Callable[[int, str], str]], T]
                         ) -> T | None:  # fmt: skip
        """``build`` run on the allocation tables as they are now, with the
        name each process is kept under (heap profiles); under the read
        lock, so that no retirement runs in the middle. None without them."""
        if not self.info.allocs:
            return None
        with self._read_lock:
            snapshot = self.counters.allocations()
            return None if snapshot is None else build(snapshot, self._name)

    def snapshot(self) -> Snapshot:
        """The numbers now, or the last reading if it is younger than the
        read interval: every map read holds off the kernel's BPF programs on
        its CPU for a moment (their runs there are skipped and counted as
        missed), so a storm of scrapes must not become a storm of reads."""
        with self._read_lock:
            now = time.monotonic()
            if self._last is None or now - self._last[0] >= self.read_interval:
                self._last = (now, self._read())
            return self._last[1]

    def _read(self) -> Snapshot:
        info = self.info
        libc = info.libc_probes
        processes = self._processes() if libc else {}
        counters = self.counters.read(kmem=info.kmem, runs=True)
        kmem = None
        processed = {"libc": counters.delivered} if libc else {}
        events_lost = {"libc": sum(counters.probe_lost.values())} if libc else {}
        if info.filtered_by_pid:
            events_lost["lifecycle"] = counters.lost_lifecycle
        if info.kmem and counters.kmem is not None:
            kmem = counters.kmem
            for site in kmem.sites:
                site.symbol = self._function(site.address)
            processed["kmem"] = sum(kmem.hits.values())
            events_lost["kmem"] = kmem.lost_allocs + kmem.lost_frees
        misses = {label: s.misses for label, s in counters.runs.items()}
        if libc:
            events_lost["libc_missed"] = sum(
                n for label, n in misses.items() if label.startswith("usdt:")
            )
        if info.kmem:
            events_lost["kmem_missed"] = sum(
                n for label, n in misses.items() if label.startswith("tracepoint:kmem:")
            )
        return Snapshot(
            allocs=self._allocs() if info.allocs else None,
            locks=self._locks(),
            libc=libc,
            probe_hits=dict(counters.probe_hits) if libc else {},
            probe_lost=dict(counters.probe_lost) if libc else {},
            processes=processes,
            process_hits_dropped=counters.process_hits_dropped if libc else 0,
            kmem=kmem,
            events_processed=processed,
            events_lost=events_lost,
            probes_attached=self._attached(),
            bpf_runs=_runs(counters.runs) if counters.run_time_counted else None,
            bpf_misses=misses,
            started=self.started,
            build=self._build,
        )

    def _processes(self) -> dict[str, ProcessFigures]:
        """The libc figures by process name: the exited ones' and the live ones'."""
        processes: dict[str, ProcessFigures] = {}
        with self.allocators.lock:
            for name, figures in self._retired.items():
                processes[name] = _copy(figures)
            live: dict[int, ProcessFigures] = defaultdict(ProcessFigures)
            hints = {}
            for row in self.counters.process_hits():
                if row.probe < len(self.probes):
                    live[row.tgid].hits[self.probes[row.probe]] += row.hits
                    hints[row.tgid] = row.comm
            for pid, state in self.allocators.processes.items():
                figures = live[pid]
                figures.arena_lock_waits = arena_lock_waits(state)
                figures.arenas = len(state.arenas)
                figures.heap_bytes = state.heap_bytes
                figures.sbrk_bytes = state.sbrk_grown - state.sbrk_shrunk
            for pid, figures in live.items():
                figures.live = 1
                name = self._name(pid, hints.get(pid, ""))
                processes.setdefault(name, ProcessFigures()).add(figures)
        return processes

    def _allocs(self) -> AllocFigures | None:
        snapshot = self.counters.allocations()
        if snapshot is None:
            return None
        processes: dict[str, Counter[str]] = defaultdict(Counter)
        live = StackColumns.of(snapshot.stacks).live_by_process()
        for name, retired in self._retired_allocs.items():
            processes[name].update(retired)
        for proc in snapshot.processes:
            name = self._name(proc.tgid, proc.comm)
            figures = processes[name]
            figures.update(_alloc_counts(proc, snapshot.vm.get(proc.tgid, {})))
            if proc.allocator:  # kept for the name once the process is gone
                self._allocators[name] = (proc.allocator, proc.allocator_lib)
            objects, nbytes = live.get(proc.tgid, (0, 0))
            figures["live_objects"] += objects
            figures["live_bytes"] += nbytes
        names = self.info.frame_names
        stacks = [
            (self._name(row.tgid), row.function, stack_label(names, row.tgid, row.frames),
             row.provider, row.provider_lib, row.live_bytes)
            for row in snapshot.top("live", STACKS_READ)
        ]  # fmt: skip
        dropped = {"outstanding": snapshot.misc.get("outstanding_full", 0),
                   "stacks": snapshot.misc.get("stacks_full", 0),
                   "frames": snapshot.misc.get("frames_full", 0)}  # fmt: skip
        return AllocFigures(processes, stacks, dropped, sampled=bool(snapshot.sample_bytes),
                            profiles=dict(self.profiles_served),
                            allocators=dict(self._allocators),
                            walks=dict(snapshot.unwind))  # fmt: skip

    def _locks(self) -> dict[str, LockFigures] | None:
        """The lock waits in time by process name: the kernel keeps every
        traced process's rows, so a name once given to a pid stays its."""
        waits = self.counters.lock_waits(stacks=False)
        if waits is None:
            return None
        figures: dict[str, LockFigures] = defaultdict(LockFigures)
        kinds = {MAIN: "main", ARENA: "non_main"}
        for row in waits.rows:
            kind = kinds.get(row.kind, row.kind)
            named = figures[self._lock_name(row.pid)]
            named.waits[kind] = named.waits.get(kind, WaitTimes()) + row.times
        for name, thread_ns in self._retired_thread_ns.items():
            figures[name].thread_ns += thread_ns
        for pid, time_ in waits.threads.items():
            figures[self._lock_name(pid)].thread_ns += time_.thread_ns
        return dict(figures)

    def _lock_name(self, pid: int) -> str:
        name = self._lock_names.get(pid)
        if name is None:
            name = self._lock_names[pid] = self._name(pid)
        return name

    def _function(self, address: int) -> str:
        name = self._functions.get(address)
        if name is None:
            found = self.symbols.function(address)
            name = self._functions[address] = found[0] if found else "unknown"
        return name

    def _attached(self) -> dict[str, int]:
        attached = {"tracepoint": self.info.tracepoints}
        if self.info.libc_probes:
            attached["usdt_probe"] = len(self.probes)
            attached["usdt_site"] = len(self.info.sites)
        return attached


class PrometheusSink(Sink):
    """Serves the trace's metrics at an endpoint bound before the trace
    attached (so that a bad address or TLS file fails at once).

    The page is rendered on a thread of the tracing process into shared
    ``pages`` (exporters/exposition.py). Given ``pages``, another process
    (tracer/loop/metrics_endpoint.py's fork) answers the scrapes from them; without, the
    endpoint answers from this process, on its own threads."""

    def __init__(
        self,
        endpoint: MetricsEndpoint,
        options: ExportOptions,
        symbols: KernelSymbols,
        pages: SharedPages | None = None,
        server_alive: Callable[[], bool] | None = None,
        channel: ProfileChannel | None = None,
    ) -> None:
        """``symbols``: read while still root (serve gives root up before ``start``);
        ``server_alive``: whether the process answering from ``pages`` still runs;
        ``channel``: where that process asks for heap profiles."""
        self.endpoint = endpoint
        self.options = options
        self.symbols = symbols
        self.served_here = pages is None
        self.pages = pages if pages is not None else SharedPages()
        self.source: MetricsSource | None = None
        self.renderer: Renderer | None = None
        self._server_alive = server_alive
        self.channel = channel
        self.profiles: HeapProfiles | None = None
        self._next_server_check = time.monotonic() + HOUSEKEEPING_S

    def start(self, info: TraceInfo) -> None:
        # The renderer paces the reads: one per page.
        self.source = MetricsSource(info, self.symbols, read_interval=0.0)
        registry = self.endpoint.registry
        registry.register(
            MtraceCollector(
                self.source.snapshot, self.options.max_processes, self.options.top_functions,
                self.options.top_stacks,
            )
        )  # fmt: skip
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        # Everything loaded so far (bcc, numpy, the symbol table ...) lives
        # as long as the process: out of the collector's sight, a full
        # collection takes a fraction of a millisecond instead of 10-15 ms
        # in the middle of a render.
        gc.freeze()
        self.renderer = Renderer(registry, self.pages, self.options.read_interval,
                                 self.endpoint.report)  # fmt: skip
        self.renderer.start()
        self.profiles = HeapProfiles(self.source.read_allocations, info.frame_names,
                                     max_samples=self.options.profile_max_samples)  # fmt: skip
        self.source.profiles_served = self.profiles.served
        if self.channel is not None:
            threading.Thread(target=self.channel.answer_forever, name="heap-profiles",
                             args=(self.profiles.answer, self.endpoint.report),
                             daemon=True).start()  # fmt: skip
        if self.served_here:
            self.endpoint.serve_pages(PublishedApp(self.pages, self.options.read_interval))
            self.endpoint.serve_profiles(ProfilesApp(self.profiles.answer))
            self.endpoint.start()
        print(f"mtrace-live: serving metrics at {self.endpoint.url}", file=sys.stderr, flush=True)

    def tick(self) -> None:
        if self.source is not None:
            self.source.tick()
        self._check_server()

    def _check_server(self) -> None:
        """Says once, within a housekeeping period, that the serving process
        is gone: tracing goes on, but no scrape is answered any more."""
        now = time.monotonic()
        if self._server_alive is None or now < self._next_server_check:
            return
        self._next_server_check = now + HOUSEKEEPING_S
        if not self._server_alive():
            self._server_alive = None
            print(f"mtrace-live: warning: the process serving {self.endpoint.url} has exited; "
                  "scrapes go unanswered while tracing goes on",
                  file=sys.stderr, flush=True)  # fmt: skip

    def finish(self, result: TraceResult) -> None:
        if self.renderer is not None:
            self.renderer.close()
        if self.channel is not None:
            self.channel.close()
        if self.served_here:
            self.endpoint.close()


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=False)


def _runs(stats: dict[str, RunStats] | Mapping[str, RunStats]) -> dict[str, tuple[int, int]]:
    return {label: (s.run_time_ns, s.run_cnt) for label, s in stats.items()}


def _alloc_counts(proc: ProcessAllocs, vm: Mapping[str, int]) -> Counter[str]:
    """A process's counts as the allocation families take them (its live
    blocks apart)."""
    counts = Counter({"calls": proc.calls, "bytes": proc.bytes, "frees": proc.frees,
                      "unknown_frees": proc.unknown_frees, "untracked": proc.untracked,
                      "failed": proc.failed})  # fmt: skip
    counts.update({f"vm_{key}": value for key, value in vm.items()})
    return counts


def _copy(figures: ProcessFigures) -> ProcessFigures:
    copy = ProcessFigures()
    copy.add(figures)
    return copy
