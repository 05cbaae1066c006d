"""The kernel's counters of a running trace, read from the BPF program's
maps: the one place a ``KernelCounters`` snapshot is made.

``BpfCounters`` is what the sinks are handed (``TraceInfo.counters``): they
read snapshots through it and never see the BPF program itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from mtrace_live.exporters.data.alloc_snapshot import AllocSnapshot, FrameNames, trimmed
from mtrace_live.exporters.data.kmem import CallSite, KmemTotals
from mtrace_live.exporters.data.lock_waits import LockWaits
from mtrace_live.exporters.data.sink import KernelCounters, ProcessHits, RunStats
from mtrace_live.probes.elf.lazy import lazy_module
from mtrace_live.probes.records import KMEM_EVENTS, SITE_FIELDS, KmemMisc
from mtrace_live.tracer.bpf import bpf_syscalls
from mtrace_live.tracer.bpf.bpf_backend import BpfProgram
from mtrace_live.tracer.loop import alloc_probes
from mtrace_live.tracer.loop.lock_waits import ThreadClock, read_lock_waits
from mtrace_live.tracer.processes.arena_walk import ArenaFinder

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # (at the first use: probes/elf/lazy.py)

# The hash maps keyed by a process's tgid that only the kernel adds to: its
# calls (alloc_procs), its memory system calls (vm_procs), its threads' time
# (thread_times), and its break as last seen (vm_brk, brk_last). (The
# unwinder's unwind_procs row goes at the process's exit, in the kernel.)
PER_PROCESS_TABLES = ("alloc_procs", "vm_procs", "thread_times", "vm_brk", "brk_last")


class BpfCounters:
    """A live trace's counters (``CounterSource``), read from its program's
    maps by their file descriptors (so that reading goes on after ``serve``
    drops root). The tracing loop adds what it has read from the ring."""

    def __init__(
        self,
        program: BpfProgram,
        probes: Sequence[str],
        site_probes: Sequence[str],
        libc: bool,
        kmem: bool,
        filtered_by_pid: bool,
        stats_fd: int | None = None,
        sample_bytes: int | None = None,
        frame_names: FrameNames | None = None,
        arenas: ArenaFinder | None = None,
        lock_times: bool = False,
    ) -> None:
        """``sample_bytes``: None when the allocation functions are not
        traced; ``lock_times``: lock waits are timed (locks.bpf.c), and
        ``arenas`` tells the arenas' locks from the others."""
        self.program = program
        self.probes = tuple(probes)
        self.site_probes = tuple(site_probes)  # site index -> probe name
        self.libc = libc
        self.kmem = kmem
        self.filtered_by_pid = filtered_by_pid
        self.stats_fd = stats_fd  # held while run time is counted (serve --bpf-stats)
        self.delivered = 0
        # what the CFI unwinder's tables hold and could not (tracer/unwind/unwind_tables.py)
        self.table_counts: Callable[[], Mapping[str, int]] | None = None
        # each process's allocator, as the outputs name it (tracer/processes/providers.py)
        self.allocator_of: Callable[[int], tuple[str, str]] | None = None
        # every process traced was started under the trace (run's command and its children)
        self.traced_from_start = False
        self.kmem_delivered = 0
        self.alloc_delivered = 0  # allocation and free events read from the ring
        self.lock_delivered = 0  # lock wait events read from the ring
        self.sample_bytes = sample_bytes
        self.frame_names = frame_names or FrameNames()
        self.stack_reader = alloc_probes.StackReader()  # the stack rows' keys, kept between reads
        self.arenas = arenas
        self.lock_times = lock_times
        self.thread_clock = ThreadClock()
        self._forgotten = 0  # times per-process rows were taken out (allocs.bpf.c alloc_procs_gen)
        self.started_ns = time.monotonic_ns()
        # (tgid, probe slot) -> probe records read from the ring: the kernel
        # counts per process only what the ring had no room for
        # (the trace program, name_process)
        self._read_by_process: dict[tuple[int, int], int] = {}
        self._by_process_lock = threading.Lock()

    def count_read(self, tgids: np.ndarray, probes: np.ndarray) -> None:
        """Adds the probe records just read from the ring to their processes."""
        if len(tgids) == 0:
            return
        keys = (tgids.astype(np.uint64) << np.uint64(32)) | probes.astype(np.uint64)
        unique, counts = np.unique(keys, return_counts=True)
        with self._by_process_lock:
            table = self._read_by_process
            for key, count in zip(unique.tolist(), counts.tolist(), strict=True):
                pair = (key >> 32, key & 0xFFFFFFFF)
                table[pair] = table.get(pair, 0) + count

    def _with_read(self, rows: list[ProcessHits], tgids: set[int] | None) -> list[ProcessHits]:
        """The kernel's rows (names, and hits without a record) plus the
        records read, by (tgid, probe); with ``tgids``, those processes'
        records are taken out too."""
        names = {row.tgid: row.comm for row in rows if row.comm}
        kernel = {(row.tgid, row.probe): row.hits for row in rows}
        with self._by_process_lock:
            read = self._read_by_process
            pairs = set(kernel) | {p for p in read if tgids is None or p[0] in tgids}
            hits = {pair: kernel.get(pair, 0) + read.get(pair, 0) for pair in pairs}
            if tgids is not None:
                for pair in pairs:
                    read.pop(pair, None)
        for tgid in {tgid for tgid, _ in hits} - set(names):
            names[tgid] = _comm(tgid)  # once a process, not once a probe
        return [ProcessHits(tgid, probe, count, names[tgid])
                for (tgid, probe), count in sorted(hits.items()) if count]  # fmt: skip

    def read(self, kmem: bool = False, runs: bool = False) -> KernelCounters:
        program = self.program
        hits = program.percpu_array_totals("hits") if self.libc else []
        lost = program.percpu_array_totals("lost") if self.libc else []
        return KernelCounters(
            probe_hits={name: hits[slot] for slot, name in enumerate(self.probes)},
            probe_lost={name: lost[slot] for slot, name in enumerate(self.probes)},
            delivered=self.delivered,
            kmem_delivered=self.kmem_delivered,
            process_hits_dropped=program.percpu_array_totals("proc_hits_dropped")[0]
            if self.libc
            else 0,
            lost_lifecycle=program.percpu_array_totals("lost_lifecycle")[0]
            if self.filtered_by_pid
            else 0,
            kmem=read_kernel_totals(program) if kmem and self.kmem else None,
            runs=self.runs() if runs else {},
            run_time_counted=self.stats_fd is not None or bpf_syscalls.sysctl_enabled(),
        )

    def process_hits(self) -> list[ProcessHits]:
        return self._with_read(self.program.tables.process_hits(), None) if self.libc else []

    def take_process_hits(self, tgids: set[int]) -> list[ProcessHits]:
        return self._with_read(self.program.tables.process_hits(tgids, take=True), tgids)

    def stack(self, stack_id: int) -> list[int]:
        return self.program.tables.stack(stack_id)

    def allocations(self, outstanding: bool = False, named: bool = True) -> AllocSnapshot | None:
        if self.sample_bytes is None:
            return None
        snapshot = alloc_probes.read_snapshot(
            self.program, self.sample_bytes, self.started_ns, outstanding, self.stack_reader
        )
        if self.traced_from_start:
            snapshot = replace(snapshot, traced_from_start=True)
        if snapshot.unwind and self.table_counts is not None:  # the tables' own, user space's
            tables = {f"tables_{key}": value for key, value in self.table_counts().items()}
            snapshot = replace(snapshot, unwind={**snapshot.unwind, **tables})
        if self.allocator_of is not None:
            processes = []
            called: dict[int, list[tuple[str, str, int, int]]] | None = None
            for proc in snapshot.processes:
                allocator, lib = self.allocator_of(proc.tgid)
                if not allocator and self.stack_reader.providers:
                    # gone before it was looked at: the provider it called most
                    called = snapshot.by_provider() if called is None else called
                    allocator, lib, _, _ = (called.get(proc.tgid) or [("", "", 0, 0)])[0]
                processes.append(replace(proc, allocator=allocator, allocator_lib=lib))
            snapshot = replace(snapshot, processes=tuple(processes))
        return trimmed(snapshot, self.frame_names) if named else snapshot

    def lock_waits(self, stacks: bool = True) -> LockWaits | None:
        if not self.lock_times:
            return None
        return read_lock_waits(self.program, self.arenas, stacks, self.thread_clock)

    def forget(self, tgids: set[int]) -> None:
        """Drop the per-process rows of processes that are gone, once their
        counts are kept elsewhere (serve's retirement): their calls, their
        memory system calls, their threads' time, and the state the
        handlers kept for them. The tables are bounded by the live
        processes, not by every process that ever ran."""
        for table in PER_PROCESS_TABLES:
            self.program.delete_keys(table, tgids)
        if self.program.has_table("alloc_procs_gen"):  # each thread makes its row anew
            self._forgotten += 1
            self.program.fill_array("alloc_procs_gen", [self._forgotten])
        for tgid in tgids:
            self.thread_clock.seen.pop(tgid, None)

    def stacks_lost(self, with_stacks: bool) -> tuple[int, int]:
        if not with_stacks:
            return (0, 0)
        user, kernel = self.program.percpu_array_totals("stack_errors")
        return user, kernel

    def runs(self) -> dict[str, RunStats]:
        """What the kernel counted for each handler, summed by what it
        traces: ``usdt:PROBE`` (over the probe's sites), ``tracepoint:CAT:NAME``."""
        totals: dict[str, RunStats] = {}
        for name, fd in self.program.program_fds().items():
            if name.startswith("site_"):
                index = int(name[5:])
                label = f"usdt:{self.site_probes[index]}" if index < len(self.site_probes) else name
            elif name.startswith("tracepoint__"):
                label = "tracepoint:" + name[len("tracepoint__") :].replace("__", ":", 1)
            elif name.startswith(("raw_tracepoint__", "rawtp__", "tp_btf__")):
                label = "tracepoint:kmem:" + name.split("__", 1)[1]  # only kmem events are raw
            else:
                label = name
            stats = bpf_syscalls.run_stats(fd)
            if stats is not None:
                before = totals.get(label, RunStats(0, 0, 0))
                totals[label] = RunStats(*(a + b for a, b in zip(before, stats, strict=True)))
        return totals

    def close(self) -> None:
        bpf_syscalls.close(self.stats_fd)
        self.stats_fd = None


def _comm(tgid: int) -> str:
    """A process's name from /proc, for one the kernel did not name (its
    pid reused on a CPU that had named the pid's previous process)."""
    try:
        return Path(f"/proc/{tgid}/comm").read_text(errors="replace").strip()
    except OSError:
        return ""


def read_kernel_totals(program: BpfProgram) -> KmemTotals:
    """The in-kernel aggregation of the trace program (WITH_KMEM)."""
    sites = [
        CallSite.with_counts(call_site, kind, zip(SITE_FIELDS, values, strict=True))
        for (call_site, kind, *_), values in program.slot_struct_totals(
            "site_count", "site_keys", "kmem_sites"
        )
    ]
    orders = {
        int(key.value): (values[0], values[1])
        for key, values in program.percpu_struct_totals("page_orders")
        if values[0] or values[1]
    }
    hits = program.percpu_array_totals("kmem_hits")
    misc = program.percpu_array_totals("kmem_misc")
    return KmemTotals(
        sites=sites,
        page_orders=orders,
        hits=dict(zip(KMEM_EVENTS, hits, strict=True)),
        untracked=misc[KmemMisc.OBJECTS_UNTRACKED],
        sites_dropped=misc[KmemMisc.SITES_DROPPED],
        lost_allocs=misc[KmemMisc.LOST_ALLOCS],
        lost_frees=misc[KmemMisc.LOST_FREES],
    )
