"""Every metric family mtrace-live publishes, as one table: its name (less
the ``mtrace_`` prefix), type, help and labels. The collector
(``prometheus.py``) reads its families from here, and docs/prometheus.md
describes them."""

from __future__ import annotations

from typing import NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

PREFIX = "mtrace"
COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
# Help texts with "{estimated}" say so when the allocation functions are sampled.
ESTIMATED = " (estimated from samples)"


class Family(NamedTuple):
    name: str
    type: str
    help: str
    labels: tuple[str, ...]


_P, _PK = ("process",), ("process", "kind")
_PA = ("process", "allocator", "allocator_lib")  # the allocator its malloc binds to, its file
FAMILIES = {f.name: f for f in (
    # ---- the allocation functions
    Family("alloc_calls", COUNTER, "Allocations that returned a pointer (malloc, calloc, "
           "realloc, memalign & co).", _PA),
    Family("alloc_bytes", COUNTER, "Bytes those allocations asked for.", _PA),
    Family("free_calls", COUNTER, "free() of a non-NULL pointer, and realloc's release of its "
           "old block.", _PA),
    Family("free_unknown_calls", COUNTER, "Frees of pointers not seen allocated (before the "
           "trace, not sampled, or not tracked: alloc_untracked_calls).", _PA),
    Family("alloc_untracked_calls", COUNTER, "Allocations not tracked until freed: the table of "
           "outstanding blocks (--max-outstanding) or of stacks (--alloc-stacks) had no room; "
           "their frees are among free_unknown_calls.", _PA),
    Family("alloc_failed_calls", COUNTER, "Allocations that returned NULL.", _PA),
    Family("alloc_live_bytes", GAUGE, "Bytes allocated during the trace and not freed "
           "yet{estimated}.", _PA),
    Family("alloc_live_objects", GAUGE, "Blocks allocated during the trace and not freed "
           "yet{estimated}.", _PA),
    Family("vm_calls", COUNTER, "mmap, munmap, mremap and brk calls that succeeded (brk: that "
           "moved the break).", ("process", "syscall")),
    Family("vm_bytes", COUNTER, "Bytes of memory the process mapped, unmapped, remapped or "
           "moved its break by, outside malloc.", _PK),
    Family("alloc_stack_live_bytes", GAUGE, "Live bytes of the call stacks holding most (at "
           "most --top-stacks of them; the rest under stack=\"other\"){estimated}.",
           ("process", "alloc_function", "stack", "allocator", "allocator_lib")),
    Family("alloc_table_dropped", COUNTER, "Allocations a kernel table had no room for: "
           "outstanding (not matched to their free), stacks (not aggregated), frames "
           "(aggregated by call site alone).", ("table",)),
    Family("stack_walks", COUNTER, "Stacks unwound by CFI in the kernel (allocations kept, lock "
           "waits), by how the walk ended: complete, depth (cut at the frame limit), no_cfi, "
           "unreadable, out_of_stack, bounds (the verifier's), lost.", ("ended",)),
    Family("stack_frames", COUNTER, "Frames of those stacks, by how each was found: cfi, "
           "frame_pointers (no CFI at the PC, or its file's rows not written yet).", ("by",)),
    Family("stack_walk_starts", COUNTER, "Stacks by what their walk started with: no_tables (the "
           "process's tables were not written yet: its mappings found in the kernel), "
           "inherited (the tables its parent had at its fork).", ("tables",)),
    Family("stack_mapping_lookups", COUNTER, "PCs in no mapping of their process's tables, looked "
           "up in the kernel (result=found), and those the kernel refused (result=busy: the "
           "process's mapping lock was taken; stepped by frame pointers).", ("result",)),
    Family("stack_frames_unwritten", COUNTER, "Frames in a file whose rows were not written yet "
           "(stepped by frame pointers; the file is asked for, and the next walk is whole).", ()),
    Family("alloc_profiles", COUNTER, "Heap profiles served at /debug/pprof/ (kind=whole, "
           "delta), and delta profiles begun (kind=delta_started).", ("kind",)),
    # ---- libc
    Family("libc_probe_hits", COUNTER, "libc SDT probe hits counted in the kernel.", ("probe",)),
    Family("libc_probe_events_lost", COUNTER, "libc probe hits whose event the ring buffer had "
           "no room for (counted, not decoded).", ("probe",)),
    Family("libc_process_probe_hits", COUNTER, "libc SDT probe hits by process name (capped; "
           "the rest are 'other').", ("process", "probe")),
    Family("libc_allocation_retries", COUNTER, "Allocations glibc retried in another arena "
           "after the first failed, by call.", _PK),
    Family("libc_tcache_double_free_checks", COUNTER, "Frees that made glibc search a tcache "
           "bin for the chunk (memory_tcache_double_free). The check is probabilistic: most "
           "are not double frees, but one that is aborts the process.", _P),
    Family("libc_arena_waits", COUNTER, "Waits for a busy arena: reuse_wait when choosing one "
           "at the arena limit, lock_wait when blocking on the mutex of an arena already in "
           "use.", _PK),
    Family("libc_arena_lock_wait_seconds", HISTOGRAM, "Time threads waited for an arena's "
           "lock in the libc's lock-wait slow path, by arena kind (main, non_main); one "
           "bucket per power of 4 from 1.024 us to 1.07 s.", ("process", "arena")),
    Family("libc_arena_lock_wait_share", GAUGE, "Share of the process's thread time since the "
           "attach spent waiting for arena locks (rate(..._arena_lock_wait_seconds_sum) / "
           "rate(..._libc_thread_seconds_total) gives it over a window).", _P),
    Family("libc_thread_seconds", COUNTER, "Time of the traced processes' threads since the "
           "attach: each thread from its start (or the attach) to its end (or now).", _P),
    Family("libc_other_lock_wait_seconds", COUNTER, "Time threads waited in the libc's "
           "lock-wait slow path for locks that are not arenas' (stdio's, the loader's, ...), "
           "or whose kind could not be read (lock=\"unknown\").", ("process", "lock")),
    Family("libc_other_lock_waits", COUNTER, "Waits counted in "
           "mtrace_libc_other_lock_wait_seconds_total.", ("process", "lock")),
    Family("libc_mallopt_calls", COUNTER, "mallopt() calls.", _P),
    Family("libc_setting_changes", COUNTER, "Allocator parameters set, by mallopt() or by "
           "GLIBC_TUNABLES at start.", ("process", "setting")),
    Family("libc_processes", GAUGE, "Traced processes alive with this name.", _P),
    Family("libc_arenas", GAUGE, "Arenas seen in the live processes (main arena included).", _P),
    Family("libc_heap_bytes", GAUGE, "Bytes of the live mmapped (non-main) heaps.", _P),
    Family("libc_sbrk_bytes", GAUGE, "Net bytes the main heap grew by sbrk while traced.", _P),
    Family("libc_process_hits_dropped", COUNTER, "Hits not counted by process because the "
           "per-process table was full.", ()),
    # ---- kmem, by allocator kind
    Family("kmem_tracepoint_hits", COUNTER, "kmem tracepoint hits by the traced tasks.",
           ("tracepoint",)),
    Family("kmem_allocations", COUNTER, "Kernel allocations (failed ones included). By "
           "allocator kind.", ("kind",)),
    Family("kmem_failed_allocations", COUNTER, "Kernel allocations that returned NULL. By "
           "allocator kind.", ("kind",)),
    Family("kmem_frees", COUNTER, "Frees of objects allocated while traced, matched by "
           "pointer. By allocator kind.", ("kind",)),
    Family("kmem_requested_bytes", COUNTER, "Bytes the callers asked for. By allocator kind.",
           ("kind",)),
    Family("kmem_allocated_bytes", COUNTER, "Bytes the allocator handed out. By allocator "
           "kind.", ("kind",)),
    Family("kmem_freed_bytes", COUNTER, "Bytes freed of objects allocated while traced. By "
           "allocator kind.", ("kind",)),
    Family("kmem_cross_cpu_frees", COUNTER, "Frees on another CPU than the allocation's. By "
           "allocator kind.", ("kind",)),
    Family("kmem_mismatched_frees", COUNTER, "Frees by another allocator's free function. By "
           "allocator kind.", ("kind",)),
    Family("kmem_fragmentation_ratio", GAUGE, "Share of the allocated bytes that were not "
           "requested (1 - requested/allocated).", ("kind",)),
    # ---- kmem, by calling function
    Family("kmem_function_allocations", COUNTER, "Slab allocations by calling kernel function "
           "(capped; the rest are 'other').", ("function",)),
    Family("kmem_function_requested_bytes", COUNTER, "Bytes requested by calling function.",
           ("function",)),
    Family("kmem_function_allocated_bytes", COUNTER, "Bytes allocated by calling function.",
           ("function",)),
    Family("kmem_function_frees", COUNTER, "Frees of the objects each function allocated.",
           ("function",)),
    Family("kmem_function_fragmentation_ratio", GAUGE, "Share of the bytes a kernel function "
           "was given that it did not ask for.", ("function",)),
    Family("kmem_function_live_bytes", GAUGE, "Bytes a kernel function allocated while traced "
           "and that are not freed yet.", ("function",)),
    Family("kmem_page_allocations", COUNTER, "Page allocations by order.", ("order",)),
    Family("kmem_page_frees", COUNTER, "Page frees by order.", ("order",)),
    Family("kmem_table_full_drops", COUNTER, "Updates the in-kernel tables had no room for: "
           "objects not tracked by pointer, call-site updates dropped.", ("table",)),
    # ---- the tracer itself
    Family("events_processed", COUNTER, "Events the tracer processed: libc events read from "
           "the ring buffer, kmem tracepoint hits aggregated in the kernel.", ("source",)),
    Family("events_lost", COUNTER, "Events lost: libc and kmem, events the ring buffer had no "
           "room for (the kernel's counts stay exact); *_missed, probe and tracepoint runs the "
           "kernel skipped (not counted anywhere); lifecycle, exec and exit records.",
           ("source",)),
    Family("probes_attached", GAUGE, "Probes attached: USDT probes and sites, tracepoints.",
           ("kind",)),
    Family("bpf_program_run_seconds", COUNTER, "Time the kernel spent running mtrace-live's "
           "BPF programs (kernel.bpf_stats_enabled).", ("program",)),
    Family("bpf_program_runs", COUNTER, "Runs of mtrace-live's BPF programs.", ("program",)),
    Family("bpf_program_missed_runs", COUNTER, "Runs of mtrace-live's BPF programs the kernel "
           "skipped because another BPF program or a BPF map system call was active on that "
           "CPU: events not seen at all.", ("program",)),
    Family("start_time_seconds", GAUGE, "Unix time the trace began.", ()),
)}  # fmt: skip
BUILD_INFO = ("build", "mtrace-live's version and what it runs on.")


MetricFamily = CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily


def family(name: str, estimated: bool = False) -> CounterMetricFamily | GaugeMetricFamily:
    """A new, empty counter or gauge family of the table's ``name``;
    ``estimated``: its help says the values are estimated from samples."""
    spec = FAMILIES[name]
    assert spec.type != HISTOGRAM, name
    help_ = spec.help.format(estimated=ESTIMATED if estimated else "")
    kind = CounterMetricFamily if spec.type == COUNTER else GaugeMetricFamily
    return kind(f"{PREFIX}_{name}", help_, labels=list(spec.labels))


def histogram_family(name: str) -> HistogramMetricFamily:
    """A new, empty histogram family of the table's ``name``."""
    spec = FAMILIES[name]
    assert spec.type == HISTOGRAM, name
    return HistogramMetricFamily(f"{PREFIX}_{name}", spec.help, labels=list(spec.labels))
