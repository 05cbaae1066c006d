"""Prometheus metrics of a running trace, built at scrape time.

The tracer hands a ``Snapshot`` of plain numbers (read from the BPF maps and
the allocator model when Prometheus asks), and ``MtraceCollector`` turns it
into metric families for an explicit ``CollectorRegistry``. Nothing is
counted per event in Python: every counter is a value the kernel or the
model already holds.

Label values that can grow are capped, and the caps never make a counter go
down: a process name or a kernel function gets its own label value the
first time it is seen while there is room, keeps it for the exporter's
life, and everything after that is counted under ``other``.
"""

from __future__ import annotations

import platform
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from mtrace_live.probes.meanings import meanings
from mtrace_live.probes.records import UNWIND_ENDS, KmemType
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from .data.kmem import TYPE_NAMES, CallSite, KmemTotals
from .data.lock_waits import WaitTimes, bucket_bound_ns
from .prometheus_families import BUILD_INFO, PREFIX, MetricFamily, family, histogram_family

OTHER = "other"
UNKNOWN = "unknown"

# Probes whose hits are also published under a name of their own, as the
# catalog's specs mark them (probes/meanings.py).
RETRY_PROBES = meanings().retries
SETTINGS = meanings().settings
DOUBLE_FREE_PROBE = meanings().with_effect("double_free_check")[0]
REUSE_WAIT_PROBE = meanings().with_effect("arena_reuse_wait")[0]
MALLOPT_PROBE = meanings().with_effect("mallopt")[0]

# The lock-wait histogram's buckets: the kernel's log2 buckets (records.h)
# whose bound is a power of 4 from 2^10 ns (1.024 us) to 2^30 ns (1.07 s).
LOCK_WAIT_BUCKETS = tuple(range(10, 31, 2))


@dataclass
class ProcessFigures:
    """What the processes of one name did (counters include exited ones)."""

    hits: Counter[str] = field(default_factory=Counter)  # probe -> hits
    arena_lock_waits: int = 0
    live: int = 0  # gauges from here on: the live processes only
    arenas: int = 0
    heap_bytes: int = 0
    sbrk_bytes: int = 0

    def add(self, other: ProcessFigures) -> None:
        self.hits.update(other.hits)
        self.arena_lock_waits += other.arena_lock_waits
        self.live += other.live
        self.arenas += other.arenas
        self.heap_bytes += other.heap_bytes
        self.sbrk_bytes += other.sbrk_bytes


@dataclass
class LockFigures:
    """The lock waits in time of the processes of one name (every one
    traced, exited ones included: the kernel keeps their rows)."""

    waits: dict[str, WaitTimes] = field(default_factory=dict)  # main, non_main, other, unknown
    thread_ns: int = 0

    def add(self, other: LockFigures) -> None:
        for kind, times in other.waits.items():
            self.waits[kind] = self.waits.get(kind, WaitTimes()) + times
        self.thread_ns += other.thread_ns


@dataclass
class AllocFigures:
    """The allocation functions, for one scrape: per process name (counters
    include exited processes), and the top stacks by live bytes."""

    processes: Mapping[str, Mapping[str, int]]  # name -> calls, bytes, frees, ...
    # (process, function, stack, the provider called, its file, live bytes)
    stacks: list[tuple[str, str, str, str, str, int]]
    dropped: Mapping[str, int]  # table -> allocations it had no room for
    sampled: bool
    profiles: Mapping[str, int] = field(default_factory=dict)  # kind -> heap profiles served
    # name -> its allocator and that allocator's file ("jemalloc", "libjemalloc.so.2")
    allocators: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    # how the stacks were walked (unwind.bpf.c's unwind_misc, by its names); {}: by FP only
    walks: Mapping[str, int] = field(default_factory=dict)


@dataclass
class Snapshot:
    """The numbers of one scrape, read by the tracer."""

    libc: bool
    probe_hits: Mapping[str, int]
    probe_lost: Mapping[str, int]
    processes: Mapping[str, ProcessFigures]  # by process name
    process_hits_dropped: int
    kmem: KmemTotals | None  # sites carry their function name in ``symbol``
    events_processed: Mapping[str, int]  # by source: libc, kmem
    events_lost: Mapping[str, int]
    probes_attached: Mapping[str, int]  # usdt_probe, usdt_site, tracepoint
    bpf_runs: Mapping[str, tuple[int, int]] | None  # program -> (ns, runs); None: not counted
    bpf_misses: Mapping[str, int]  # program -> runs the kernel skipped
    started: float  # Unix time the trace began
    build: Mapping[str, str]
    allocs: AllocFigures | None = None
    locks: Mapping[str, LockFigures] | None = None  # by process name, where waits are timed


class StickyLabels:
    """At most ``limit`` distinct label values, each kept once given."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._kept: set[str] = set()

    def admit(self, values: Iterable[str]) -> None:
        """Give room to new values, in the order offered, while there is room."""
        for value in values:
            if len(self._kept) >= self.limit:
                return
            self._kept.add(value)

    def __call__(self, value: str) -> str:
        return value if value in self._kept else OTHER


class MtraceCollector(Collector):
    def __init__(
        self, snapshot: Callable[[], Snapshot], max_processes: int = 50, top_sites: int = 20,
        top_stacks: int = 20,
    ) -> None:  # fmt: skip
        self._snapshot = snapshot
        self._processes = StickyLabels(max_processes)
        self._functions = StickyLabels(top_sites)
        self._stacks = StickyLabels(top_stacks)
        self._lock = threading.Lock()  # the label caps are shared by concurrent scrapes

    def describe(self) -> Iterable[MetricFamily]:
        return []  # unchecked: the families depend on what is traced

    def collect(self) -> Iterator[MetricFamily | InfoMetricFamily]:
        snap = self._snapshot()
        with self._lock:
            if snap.libc:
                yield from self._libc(snap)
            if snap.kmem is not None:
                yield from self._kmem(snap.kmem)
            if snap.allocs is not None:
                yield from self._allocs(snap.allocs)
            if snap.locks is not None:
                yield from self._locks(snap.locks)
        yield from _self_metrics(snap)

    # ---- lock waits in time -------------------------------------------------
    def _locks(self, figures: Mapping[str, LockFigures]) -> Iterator[MetricFamily]:
        self._processes.admit(sorted(figures, key=lambda n: -figures[n].thread_ns))
        merged: dict[str, LockFigures] = defaultdict(LockFigures)
        for name, values in figures.items():
            merged[self._processes(name)].add(values)
        yield from _lock_families(merged)

    # ---- the allocation functions -------------------------------------------
    def _allocs(self, figures: AllocFigures) -> Iterator[MetricFamily]:
        self._processes.admit(
            sorted(figures.processes, key=lambda n: -figures.processes[n]["bytes"])
        )
        totals: dict[str, Counter[str]] = defaultdict(Counter)
        allocators: dict[str, set[Labels]] = defaultdict(set)
        for name, values in figures.processes.items():
            totals[self._processes(name)].update(values)
            allocators[self._processes(name)].add(figures.allocators.get(name, UNNAMED))
        yield from _alloc_processes(totals, figures.sampled, allocators)
        yield from _vm(totals)
        yield self._alloc_stacks(figures)
        yield _by_label(family("alloc_table_dropped"), figures.dropped)
        yield _by_label(family("alloc_profiles"), figures.profiles)
        yield from _walks(figures.walks)

    def _alloc_stacks(self, figures: AllocFigures) -> MetricFamily:
        stacks = family("alloc_stack_live_bytes", estimated=figures.sampled)
        ranked = sorted(figures.stacks, key=lambda row: -row[5])
        self._stacks.admit("\0".join(row[:5]) for row in ranked)
        rows: Counter[tuple[str, str, str, str, str]] = Counter()
        for *key, live in ranked:
            process = self._processes(key[0])
            if self._stacks("\0".join(key)) == OTHER:
                rows[(process, OTHER, OTHER, "", "")] += live
            else:
                rows[(process, key[1], key[2], key[3], key[4])] += live
        for labels, live in sorted(rows.items()):
            stacks.add_metric(list(labels), live)
        return stacks

    # ---- libc -------------------------------------------------------------
    def _libc(self, snap: Snapshot) -> Iterator[MetricFamily]:
        yield _by_label(family("libc_probe_hits"), snap.probe_hits)
        yield _by_label(family("libc_probe_events_lost"), snap.probe_lost)
        self._processes.admit(
            sorted(snap.processes, key=lambda n: (-sum(snap.processes[n].hits.values()), n))
        )
        merged: dict[str, ProcessFigures] = defaultdict(ProcessFigures)
        for name, figures in snap.processes.items():
            merged[self._processes(name)].add(figures)
        yield from _libc_processes(merged, snap.probe_hits)
        dropped = family("libc_process_hits_dropped")
        dropped.add_metric([], snap.process_hits_dropped)
        yield dropped

    # ---- kmem -------------------------------------------------------------
    def _kmem(self, kmem: KmemTotals) -> Iterator[MetricFamily]:
        yield _by_label(family("kmem_tracepoint_hits"), kmem.hits)
        kinds = {name: CallSite(0, type_) for type_, name in TYPE_NAMES.items()}
        functions: dict[str, CallSite] = {}
        for site in kmem.sites:
            kind = kinds.get(TYPE_NAMES.get(site.type, ""))
            if kind is None:
                continue
            _accumulate(kind, site)
            if site.type != KmemType.PAGES:
                function = site.symbol or UNKNOWN
                _accumulate(functions.setdefault(function, CallSite(0, site.type)), site)
        yield from _kmem_kinds(kinds)
        self._functions.admit(sorted(functions, key=lambda f: (-functions[f].bytes_alloc, f)))
        merged: dict[str, CallSite] = {}
        for function, site in functions.items():
            _accumulate(merged.setdefault(self._functions(function), CallSite(0, 0)), site)
        yield from _kmem_functions(merged)
        yield from _kmem_pages_and_tables(kmem)


# The per-process allocation counters: family -> key of AllocFigures.processes.
ALLOC_PROCESS_FAMILIES = {
    "alloc_calls": "calls", "alloc_bytes": "bytes", "free_calls": "frees",
    "free_unknown_calls": "unknown_frees", "alloc_untracked_calls": "untracked",
    "alloc_failed_calls": "failed",
    "alloc_live_bytes": "live_bytes", "alloc_live_objects": "live_objects",
}  # fmt: skip
# The allocator label of a process whose allocator is not known (gone before
# it was named), and of processes of one label on several.
Labels = tuple[str, str]  # allocator, allocator_lib
UNNAMED: Labels = ("unknown", "")
MIXED: Labels = ("mixed", "")
VM_SYSCALLS = ("mmap", "munmap", "mremap", "brk")
# vm_bytes' kind label -> key of AllocFigures.processes (less "vm_").
VM_BYTES = {
    "mmap_anonymous": "mmap_bytes", "mmap_file": "mmap_file_bytes", "munmap": "munmap_bytes",
    "mremap_grown": "mremap_grown", "mremap_shrunk": "mremap_shrunk",
    "brk_grown": "brk_grown", "brk_shrunk": "brk_shrunk",
}  # fmt: skip
# The kmem families by allocator kind: family -> CallSite attribute.
KMEM_KIND_FAMILIES = {
    "kmem_allocations": "allocs", "kmem_failed_allocations": "failed", "kmem_frees": "frees",
    "kmem_requested_bytes": "bytes_req", "kmem_allocated_bytes": "bytes_alloc",
    "kmem_freed_bytes": "bytes_freed", "kmem_cross_cpu_frees": "cross_cpu_frees",
    "kmem_mismatched_frees": "mismatched_frees",
}  # fmt: skip
KMEM_FUNCTION_FAMILIES = {
    "kmem_function_allocations": "allocs", "kmem_function_requested_bytes": "bytes_req",
    "kmem_function_allocated_bytes": "bytes_alloc", "kmem_function_frees": "frees",
}  # fmt: skip


def _alloc_processes(
    totals: Mapping[str, Counter[str]],
    sampled: bool,
    allocators: Mapping[str, set[tuple[str, str]]],
) -> Iterator[MetricFamily]:
    """The per-process families, each process labelled with its allocator
    (processes of one name, or under "other", on several: "mixed")."""
    labels = {name: list(next(iter(found)) if len(found) == 1 else MIXED)
              for name, found in allocators.items()}  # fmt: skip
    for name_, key in ALLOC_PROCESS_FAMILIES.items():
        metrics = family(name_, estimated=sampled)
        for name in sorted(totals):
            metrics.add_metric([name, *labels.get(name, UNNAMED)], totals[name][key])
        yield metrics


def _vm(totals: Mapping[str, Counter[str]]) -> Iterator[MetricFamily]:
    vm_calls, vm_bytes = family("vm_calls"), family("vm_bytes")
    for name in sorted(totals):
        counts = totals[name]
        for syscall in VM_SYSCALLS:
            vm_calls.add_metric([name, syscall], counts[f"vm_{syscall}_calls"])
        for label, key in VM_BYTES.items():
            vm_bytes.add_metric([name, label], counts[f"vm_{key}"])
    yield from (vm_calls, vm_bytes)


def _libc_processes(merged: Mapping[str, ProcessFigures],
                    probe_hits: Mapping[str, int]) -> Iterator[MetricFamily]:  # fmt: skip
    names = ("libc_process_probe_hits", "libc_allocation_retries",
             "libc_tcache_double_free_checks", "libc_arena_waits", "libc_mallopt_calls",
             "libc_setting_changes", "libc_processes", "libc_arenas", "libc_heap_bytes",
             "libc_sbrk_bytes")  # fmt: skip
    f = {name: family(name) for name in names}
    for name in sorted(merged):
        figures = merged[name]
        for probe, value in sorted(figures.hits.items()):
            f["libc_process_probe_hits"].add_metric([name, probe], value)
            if probe in RETRY_PROBES:
                f["libc_allocation_retries"].add_metric([name, RETRY_PROBES[probe]], value)
            elif probe in SETTINGS:
                f["libc_setting_changes"].add_metric([name, SETTINGS[probe]], value)
        if DOUBLE_FREE_PROBE in probe_hits:
            f["libc_tcache_double_free_checks"].add_metric(
                [name], figures.hits.get(DOUBLE_FREE_PROBE, 0)
            )
        if REUSE_WAIT_PROBE in probe_hits:
            f["libc_arena_waits"].add_metric(
                [name, "reuse_wait"], figures.hits.get(REUSE_WAIT_PROBE, 0)
            )
        f["libc_arena_waits"].add_metric([name, "lock_wait"], figures.arena_lock_waits)
        if MALLOPT_PROBE in probe_hits:
            f["libc_mallopt_calls"].add_metric([name], figures.hits.get(MALLOPT_PROBE, 0))
        f["libc_processes"].add_metric([name], figures.live)
        f["libc_arenas"].add_metric([name], figures.arenas)
        f["libc_heap_bytes"].add_metric([name], figures.heap_bytes)
        f["libc_sbrk_bytes"].add_metric([name], figures.sbrk_bytes)
    yield from f.values()


def lock_wait_buckets(times: WaitTimes) -> list[tuple[str, float]]:
    """The histogram's cumulative buckets, in seconds, from the kernel's log2 ones."""
    buckets, seen, hist = [], 0, times.hist
    for bucket in range(len(hist)):
        seen += hist[bucket]
        if bucket in LOCK_WAIT_BUCKETS:
            buckets.append((repr(bucket_bound_ns(bucket) / 1e9), float(seen)))
    buckets.append(("+Inf", float(times.count)))
    return buckets


def _lock_families(merged: Mapping[str, LockFigures]) -> Iterator[MetricFamily]:
    histogram = histogram_family("libc_arena_lock_wait_seconds")
    share, threads = family("libc_arena_lock_wait_share"), family("libc_thread_seconds")
    other_time = family("libc_other_lock_wait_seconds")
    other_count = family("libc_other_lock_waits")
    for name in sorted(merged):
        figures = merged[name]
        waited = 0
        for kind in ("main", "non_main"):
            times = figures.waits.get(kind, WaitTimes())
            waited += times.total_ns
            histogram.add_metric([name, kind], lock_wait_buckets(times), times.total_ns / 1e9)
        for kind in ("other", "unknown"):
            times = figures.waits.get(kind, WaitTimes())
            other_time.add_metric([name, kind], times.total_ns / 1e9)
            other_count.add_metric([name, kind], times.count)
        threads.add_metric([name], figures.thread_ns / 1e9)
        share.add_metric([name], waited / figures.thread_ns if figures.thread_ns else 0.0)
    yield from (histogram, share, threads, other_time, other_count)


def _kmem_kinds(kinds: Mapping[str, CallSite]) -> Iterator[MetricFamily]:
    for name, attribute in KMEM_KIND_FAMILIES.items():
        metrics = family(name)
        for kind_name, total in kinds.items():
            metrics.add_metric([kind_name], getattr(total, attribute))
        yield metrics
    fragmentation = family("kmem_fragmentation_ratio")
    for kind_name, total in kinds.items():
        if kind_name != "pages":
            fragmentation.add_metric([kind_name], total.fragmentation)
    yield fragmentation


def _kmem_functions(merged: Mapping[str, CallSite]) -> Iterator[MetricFamily]:
    site_families = {name: family(name) for name in KMEM_FUNCTION_FAMILIES}
    frag = family("kmem_function_fragmentation_ratio")
    live_bytes = family("kmem_function_live_bytes")
    for function in sorted(merged):
        site = merged[function]
        for name, metrics in site_families.items():
            metrics.add_metric([function], getattr(site, KMEM_FUNCTION_FAMILIES[name]))
        frag.add_metric([function], site.fragmentation)
        live_bytes.add_metric([function], max(site.outstanding_bytes, 0))
    yield from site_families.values()
    yield from (frag, live_bytes)


def _kmem_pages_and_tables(kmem: KmemTotals) -> Iterator[MetricFamily]:
    orders_alloc, orders_free = family("kmem_page_allocations"), family("kmem_page_frees")
    for order, (allocs, frees) in sorted(kmem.page_orders.items()):
        orders_alloc.add_metric([str(order)], allocs)
        orders_free.add_metric([str(order)], frees)
    yield from (orders_alloc, orders_free)
    tables = family("kmem_table_full_drops")
    tables.add_metric(["objects"], kmem.untracked)
    tables.add_metric(["call_sites"], kmem.sites_dropped)
    yield tables


def _accumulate(total: CallSite, site: CallSite) -> None:
    for attribute in KMEM_KIND_FAMILIES.values():
        setattr(total, attribute, getattr(total, attribute) + getattr(site, attribute))


def _self_metrics(snap: Snapshot) -> Iterator[MetricFamily | InfoMetricFamily]:
    yield _by_label(family("events_processed"), snap.events_processed)
    yield _by_label(family("events_lost"), snap.events_lost)
    yield _by_label(family("probes_attached"), snap.probes_attached)
    if snap.bpf_runs is not None:
        seconds, runs = family("bpf_program_run_seconds"), family("bpf_program_runs")
        for program, (ns, count) in sorted(snap.bpf_runs.items()):
            seconds.add_metric([program], ns / 1e9)
            runs.add_metric([program], count)
        yield from (seconds, runs)
    yield _by_label(family("bpf_program_missed_runs"), snap.bpf_misses)
    start = family("start_time_seconds")
    start.add_metric([], snap.started)
    yield start
    info = InfoMetricFamily(f"{PREFIX}_{BUILD_INFO[0]}", BUILD_INFO[1])
    info.add_metric([], {**snap.build, "python": platform.python_version()})
    yield info


# unwind_misc's names for the families' labels
WALK_ENDS = tuple(end.name.lower() for end in UNWIND_ENDS)


def _walks(walks: Mapping[str, int]) -> Iterator[MetricFamily]:
    """How the stacks were walked by CFI (nothing when by frame pointers only)."""
    if not walks:
        return
    yield _by_label(family("stack_walks"), {end: walks.get(end, 0) for end in WALK_ENDS})
    frames = {"cfi": walks.get("cfi_frames", 0), "frame_pointers": walks.get("fp_frames", 0)}
    yield _by_label(family("stack_frames"), frames)
    starts = {"no_tables": walks.get("no_tables", 0), "inherited": walks.get("inherited", 0)}
    yield _by_label(family("stack_walk_starts"), starts)
    if "vma_lookups" in walks:
        busy = walks.get("vma_busy", 0)
        yield _by_label(family("stack_mapping_lookups"),
                        {"found": walks.get("vma_lookups", 0) - busy, "busy": busy})  # fmt: skip
        unwritten = family("stack_frames_unwritten")
        unwritten.add_metric([], walks.get("unwritten", 0))
        yield unwritten


def _by_label(
    metrics: CounterMetricFamily | GaugeMetricFamily, values: Mapping[str, float]
) -> MetricFamily:
    """A family with one label, a sample per value, in label order."""
    for label, value in sorted(values.items()):
        metrics.add_metric([label], value)
    return metrics
