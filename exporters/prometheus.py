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
from typing import TypeVar

from mtrace_live.probes.meanings import meanings
from mtrace_live.probes.records import KmemType
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from .data.kmem import TYPE_NAMES, CallSite, KmemTotals

PREFIX = "mtrace"
OTHER = "other"
UNKNOWN = "unknown"

# Probes whose hits are also published under a name of their own, as the
# catalog's specs mark them (probes/meanings.py).
RETRY_PROBES = meanings().retries
SETTINGS = meanings().settings
DOUBLE_FREE_PROBE = meanings().with_effect("double_free_check")[0]
REUSE_WAIT_PROBE = meanings().with_effect("arena_reuse_wait")[0]
MALLOPT_PROBE = meanings().with_effect("mallopt")[0]


Family = TypeVar("Family", CounterMetricFamily, GaugeMetricFamily)


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
class AllocFigures:
    """The allocation functions, for one scrape: per process name (counters
    include exited processes), and the top stacks by live bytes."""

    processes: Mapping[str, Mapping[str, int]]  # name -> calls, bytes, frees, ...
    stacks: list[tuple[str, str, str, int]]  # (process, allocator, stack, live bytes)
    dropped: Mapping[str, int]  # table -> allocations it had no room for
    sampled: bool


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

    def describe(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        return []  # unchecked: the families depend on what is traced

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | InfoMetricFamily]:
        snap = self._snapshot()
        with self._lock:
            if snap.libc:
                yield from self._libc(snap)
            if snap.kmem is not None:
                yield from self._kmem(snap.kmem)
            if snap.allocs is not None:
                yield from self._allocs(snap.allocs)
        yield from _self_metrics(snap)

    # ---- the allocation functions -------------------------------------------
    def _allocs(self, figures: AllocFigures) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        estimated = " (estimated from samples)" if figures.sampled else ""
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
            "calls": _counter("alloc_calls", "Allocations that returned a pointer (malloc, calloc, "
                              "realloc, memalign & co).", ["process"]),
            "bytes": _counter("alloc_bytes", "Bytes those allocations asked for.", ["process"]),
            "frees": _counter("free_calls", "free() of a non-NULL pointer, and realloc's "
                              "release of its old block.", ["process"]),
            "unknown_frees": _counter("free_unknown_calls", "Frees of pointers not seen "
                                      "allocated (before the trace, or not sampled).", ["process"]),
            "failed": _counter("alloc_failed_calls", "Allocations that returned NULL.",
                               ["process"]),
            "live_bytes": _gauge("alloc_live_bytes", "Bytes allocated during the trace and not "
                                 f"freed yet{estimated}.", ["process"]),
            "live_objects": _gauge("alloc_live_objects", "Blocks allocated during the trace and "
                                   f"not freed yet{estimated}.", ["process"]),
        }  # fmt: skip
        self._processes.admit(
            sorted(figures.processes, key=lambda n: -figures.processes[n]["bytes"])
        )
        totals: dict[str, Counter[str]] = defaultdict(Counter)
        for name, values in figures.processes.items():
            totals[self._processes(name)].update(values)
        for name in sorted(totals):
            for key, family in families.items():
                family.add_metric([name], totals[name][key])
        yield from families.values()
        vm_calls = _counter(
            "vm_calls",
            "mmap, munmap, mremap and brk calls that succeeded (brk: that moved the break).",
            ["process", "syscall"],
        )
        vm_bytes = _counter(
            "vm_bytes",
            "Bytes of memory the process mapped, unmapped, remapped "
            "or moved its break by, outside malloc.",
            ["process", "kind"],
        )
        for name in sorted(totals):
            counts = totals[name]
            for syscall in ("mmap", "munmap", "mremap", "brk"):
                vm_calls.add_metric([name, syscall], counts[f"vm_{syscall}_calls"])
            for kind in (
                "mmap_bytes",
                "mmap_file_bytes",
                "munmap_bytes",
                "mremap_grown",
                "mremap_shrunk",
                "brk_grown",
                "brk_shrunk",
            ):
                label = {
                    "mmap_bytes": "mmap_anonymous",
                    "mmap_file_bytes": "mmap_file",
                    "munmap_bytes": "munmap",
                }.get(kind, kind)
                vm_bytes.add_metric([name, label], counts[f"vm_{kind}"])
        yield from (vm_calls, vm_bytes)
        stacks = _gauge("alloc_stack_live_bytes", "Live bytes of the call stacks holding most "
                        "(at most --top-stacks of them; the rest under stack=\"other\")"
                        f"{estimated}.", ["process", "allocator", "stack"])  # fmt: skip
        ranked = sorted(figures.stacks, key=lambda row: -row[3])
        self._stacks.admit("\0".join(row[:3]) for row in ranked)
        rows: Counter[tuple[str, str, str]] = Counter()
        for process, allocator, stack, live in ranked:
            if self._stacks("\0".join((process, allocator, stack))) == OTHER:
                rows[(self._processes(process), OTHER, OTHER)] += live
            else:
                rows[(self._processes(process), allocator, stack)] += live
        for labels, live in sorted(rows.items()):
            stacks.add_metric(list(labels), live)
        yield stacks
        yield _by_label(
            _counter("alloc_table_dropped", "Allocations a kernel table had no room for: "
                     "outstanding (not matched to their free), stacks (not aggregated), "
                     "frames (aggregated by call site alone).",
                     ["table"]),
            figures.dropped,
        )  # fmt: skip

    # ---- libc -------------------------------------------------------------
    def _libc(self, snap: Snapshot) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield _by_label(
            _counter("libc_probe_hits", "libc SDT probe hits counted in the kernel.", ["probe"]),
            snap.probe_hits,
        )
        yield _by_label(
            _counter("libc_probe_events_lost", "libc probe hits whose event the ring buffer had "
                     "no room for (counted, not decoded).", ["probe"]),
            snap.probe_lost,
        )  # fmt: skip

        self._processes.admit(
            sorted(snap.processes, key=lambda n: (-sum(snap.processes[n].hits.values()), n))
        )
        merged: dict[str, ProcessFigures] = defaultdict(ProcessFigures)
        for name, figures in snap.processes.items():
            merged[self._processes(name)].add(figures)
        names = sorted(merged)

        by_process = _counter(
            "libc_process_probe_hits",
            "libc SDT probe hits by process name (capped; the rest are 'other').",
            ["process", "probe"],
        )
        retries = _counter(
            "libc_allocation_retries",
            "Allocations glibc retried in another arena after the first failed, by call.",
            ["process", "kind"],
        )
        double_frees = _counter(
            "libc_tcache_double_free_checks",
            "Frees that made glibc search a tcache bin for the chunk (memory_tcache_double_free). "
            "The check is probabilistic: most are not double frees, but one that is aborts "
            "the process.",
            ["process"],
        )
        waits = _counter(
            "libc_arena_waits",
            "Waits for a busy arena: reuse_wait when choosing one at the arena limit, lock_wait "
            "when blocking on the mutex of an arena already in use.",
            ["process", "kind"],
        )
        mallopt = _counter("libc_mallopt_calls", "mallopt() calls.", ["process"])
        settings = _counter(
            "libc_setting_changes",
            "Allocator parameters set, by mallopt() or by GLIBC_TUNABLES at start.",
            ["process", "setting"],
        )
        live = _gauge("libc_processes", "Traced processes alive with this name.", ["process"])
        arenas = _gauge(
            "libc_arenas", "Arenas seen in the live processes (main arena included).", ["process"]
        )
        heap = _gauge("libc_heap_bytes", "Bytes of the live mmapped (non-main) heaps.", ["process"])
        sbrk = _gauge(
            "libc_sbrk_bytes", "Net bytes the main heap grew by sbrk while traced.", ["process"]
        )
        for name in names:
            figures = merged[name]
            for probe, value in sorted(figures.hits.items()):
                by_process.add_metric([name, probe], value)
                if probe in RETRY_PROBES:
                    retries.add_metric([name, RETRY_PROBES[probe]], value)
                elif probe in SETTINGS:
                    settings.add_metric([name, SETTINGS[probe]], value)
            if DOUBLE_FREE_PROBE in snap.probe_hits:
                double_frees.add_metric([name], figures.hits.get(DOUBLE_FREE_PROBE, 0))
            if REUSE_WAIT_PROBE in snap.probe_hits:
                waits.add_metric([name, "reuse_wait"], figures.hits.get(REUSE_WAIT_PROBE, 0))
            waits.add_metric([name, "lock_wait"], figures.arena_lock_waits)
            if MALLOPT_PROBE in snap.probe_hits:
                mallopt.add_metric([name], figures.hits.get(MALLOPT_PROBE, 0))
            live.add_metric([name], figures.live)
            arenas.add_metric([name], figures.arenas)
            heap.add_metric([name], figures.heap_bytes)
            sbrk.add_metric([name], figures.sbrk_bytes)
        yield from (by_process, retries, double_frees, waits, mallopt, settings)
        yield from (live, arenas, heap, sbrk)
        dropped = _counter(
            "libc_process_hits_dropped",
            "Hits not counted by process because the per-process table was full.",
            [],
        )
        dropped.add_metric([], snap.process_hits_dropped)
        yield dropped

    # ---- kmem -------------------------------------------------------------
    def _kmem(self, kmem: KmemTotals) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield _by_label(
            _counter(
                "kmem_tracepoint_hits", "kmem tracepoint hits by the traced tasks.", ["tracepoint"]
            ),
            kmem.hits,
        )

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
        families = {
            "allocs": ("kmem_allocations", "Kernel allocations (failed ones included)."),
            "failed": ("kmem_failed_allocations", "Kernel allocations that returned NULL."),
            "frees": ("kmem_frees", "Frees of objects allocated while traced, matched by pointer."),
            "bytes_req": ("kmem_requested_bytes", "Bytes the callers asked for."),
            "bytes_alloc": ("kmem_allocated_bytes", "Bytes the allocator handed out."),
            "bytes_freed": ("kmem_freed_bytes", "Bytes freed of objects allocated while traced."),
            "cross_cpu_frees": (
                "kmem_cross_cpu_frees",
                "Frees on another CPU than the allocation's.",
            ),
            "mismatched_frees": (
                "kmem_mismatched_frees",
                "Frees by another allocator's free function.",
            ),
        }
        for attribute, (name, help_) in families.items():
            family = _counter(name, help_ + " By allocator kind.", ["kind"])
            for kind_name, total in kinds.items():
                family.add_metric([kind_name], getattr(total, attribute))
            yield family
        fragmentation = _gauge(
            "kmem_fragmentation_ratio",
            "Share of the allocated bytes that were not requested (1 - requested/allocated).",
            ["kind"],
        )
        for kind_name, total in kinds.items():
            if kind_name != "pages":
                fragmentation.add_metric([kind_name], total.fragmentation)
        yield fragmentation

        self._functions.admit(sorted(functions, key=lambda f: (-functions[f].bytes_alloc, f)))
        merged: dict[str, CallSite] = {}
        for function, site in functions.items():
            _accumulate(merged.setdefault(self._functions(function), CallSite(0, 0)), site)
        helps = {
            "allocs": (
                "kmem_function_allocations",
                "Slab allocations by calling kernel function (capped; the rest are 'other').",
            ),
            "bytes_req": ("kmem_function_requested_bytes", "Bytes requested by calling function."),
            "bytes_alloc": (
                "kmem_function_allocated_bytes",
                "Bytes allocated by calling function.",
            ),
            "frees": ("kmem_function_frees", "Frees of the objects each function allocated."),
        }
        site_families = {
            key: _counter(name, text, ["function"]) for key, (name, text) in helps.items()
        }
        frag = _gauge(
            "kmem_function_fragmentation_ratio",
            "Share of the bytes a kernel function was given that it did not ask for.",
            ["function"],
        )
        live_bytes = _gauge(
            "kmem_function_live_bytes",
            "Bytes a kernel function allocated while traced and that are not freed yet.",
            ["function"],
        )
        for function in sorted(merged):
            site = merged[function]
            for attribute, family in site_families.items():
                family.add_metric([function], getattr(site, attribute))
            frag.add_metric([function], site.fragmentation)
            live_bytes.add_metric([function], max(site.outstanding_bytes, 0))
        yield from site_families.values()
        yield from (frag, live_bytes)

        orders_alloc = _counter("kmem_page_allocations", "Page allocations by order.", ["order"])
        orders_free = _counter("kmem_page_frees", "Page frees by order.", ["order"])
        for order, (allocs, frees) in sorted(kmem.page_orders.items()):
            orders_alloc.add_metric([str(order)], allocs)
            orders_free.add_metric([str(order)], frees)
        yield from (orders_alloc, orders_free)
        tables = _counter(
            "kmem_table_full_drops",
            "Updates the in-kernel tables had no room for: objects not tracked by pointer, "
            "call-site updates dropped.",
            ["table"],
        )
        tables.add_metric(["objects"], kmem.untracked)
        tables.add_metric(["call_sites"], kmem.sites_dropped)
        yield tables


def _accumulate(total: CallSite, site: CallSite) -> None:
    for attribute in ("allocs", "failed", "frees", "bytes_req", "bytes_alloc", "bytes_freed",
                      "cross_cpu_frees", "mismatched_frees"):  # fmt: skip
        setattr(total, attribute, getattr(total, attribute) + getattr(site, attribute))


def _self_metrics(
    snap: Snapshot,
) -> Iterator[CounterMetricFamily | GaugeMetricFamily | InfoMetricFamily]:
    yield _by_label(
        _counter("events_processed", "Events the tracer processed: libc events read from the "
                 "ring buffer, kmem tracepoint hits aggregated in the kernel.", ["source"]),
        snap.events_processed,
    )  # fmt: skip
    yield _by_label(
        _counter("events_lost", "Events lost: libc and kmem, events the ring buffer had no room "
                 "for (the kernel's counts stay exact); *_missed, probe and tracepoint runs the "
                 "kernel skipped (not counted anywhere); lifecycle, exec and exit records.",
                 ["source"]),
        snap.events_lost,
    )  # fmt: skip
    yield _by_label(
        _gauge("probes_attached", "Probes attached: USDT probes and sites, tracepoints.", ["kind"]),
        snap.probes_attached,
    )
    if snap.bpf_runs is not None:
        seconds = _counter(
            "bpf_program_run_seconds",
            "Time the kernel spent running mtrace-live's BPF programs (kernel.bpf_stats_enabled).",
            ["program"],
        )
        runs = _counter("bpf_program_runs", "Runs of mtrace-live's BPF programs.", ["program"])
        for program, (ns, count) in sorted(snap.bpf_runs.items()):
            seconds.add_metric([program], ns / 1e9)
            runs.add_metric([program], count)
        yield from (seconds, runs)
    yield _by_label(
        _counter("bpf_program_missed_runs", "Runs of mtrace-live's BPF programs the kernel "
                 "skipped because another BPF program or a BPF map system call was active on "
                 "that CPU: events not seen at all.", ["program"]),
        snap.bpf_misses,
    )  # fmt: skip
    start = _gauge("start_time_seconds", "Unix time the trace began.", [])
    start.add_metric([], snap.started)
    yield start
    info = InfoMetricFamily(f"{PREFIX}_build", "mtrace-live's version and what it runs on.")
    info.add_metric([], {**snap.build, "python": platform.python_version()})
    yield info


def _by_label(family: Family, values: Mapping[str, float]) -> Family:
    """A family with one label, a sample per value, in label order."""
    for label, value in sorted(values.items()):
        family.add_metric([label], value)
    return family


def _counter(name: str, help_: str, labels: list[str]) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", help_, labels=labels)


def _gauge(name: str, help_: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", help_, labels=labels)
