"""Plain data for the sinks' tests: a trace description, batches of records
built the way the trace program writes them, and counters held in memory."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from mtrace_live.exporters.data.alloc_snapshot import AllocSnapshot, ProcessAllocs, StackRow
from mtrace_live.exporters.data.allocator_state import Allocators
from mtrace_live.exporters.data.events import EventDecoder, site_info
from mtrace_live.exporters.data.kmem import KmemTotals
from mtrace_live.exporters.data.lock_waits import LockWaits
from mtrace_live.exporters.data.sink import (
    EventBatch,
    KernelCounters,
    KmemResult,
    ProcessHits,
    TraceInfo,
    TraceResult,
)
from mtrace_live.probes.catalog import load_catalog
from mtrace_live.probes.locations import ArgKind, ArgLocation, SiteLayout
from mtrace_live.probes.records import EVENT_DTYPE, EventKind, KmemEvent, KmemType
from mtrace_live.probes.sdt_notes import SdtSite

# Above any pid_max (PID_MAX_LIMIT, 2^22): no process on the machine has it, so
# its name is never read from a real one that /proc happens to hold.
PID = 4_194_304
REG = ArgLocation(ArgKind.REG, 8, False, reg=14)
SIGNED = ArgLocation(ArgKind.REG, 4, True, reg=13)
# The probes of these tests, one site each, with their catalog arguments.
PROBES = (
    "memory_arena_new",
    "memory_arena_reuse_wait",
    "lll_lock_wait_private",
    "memory_sbrk_more",
    "memory_malloc_retry",
    "memory_mallopt_arena_max",
    "memory_tcache_double_free",
    "memory_mallopt",
)
SITE_ADDRESSES = tuple(0x9000 + 0x100 * slot for slot in range(len(PROBES)))


@dataclass
class PlainCounters:
    """A CounterSource over values a test sets."""

    hits: dict[str, int] = field(default_factory=dict)
    lost: dict[str, int] = field(default_factory=dict)
    processes: list[ProcessHits] = field(default_factory=list)
    kmem: KmemTotals | None = None
    stacks: dict[int, list[int]] = field(default_factory=dict)
    taken: list[set[int]] = field(default_factory=list)
    forgotten: list[set[int]] = field(default_factory=list)
    snapshot: AllocSnapshot | None = None  # what allocations() reads, where allocations are traced
    waits: LockWaits | None = None  # what lock_waits() reads, where lock waits are timed

    def read(self, kmem: bool = False, runs: bool = False) -> KernelCounters:
        return KernelCounters(
            probe_hits=dict(self.hits),
            probe_lost=dict(self.lost),
            delivered=sum(self.hits.values()) - sum(self.lost.values()),
            kmem=self.kmem if kmem else None,
        )

    def process_hits(self) -> list[ProcessHits]:
        return list(self.processes)

    def take_process_hits(self, tgids: set[int]) -> list[ProcessHits]:
        self.taken.append(set(tgids))
        taken = [row for row in self.processes if row.tgid in tgids]
        self.processes = [row for row in self.processes if row.tgid not in tgids]
        return taken

    def stack(self, stack_id: int) -> list[int]:
        return self.stacks.get(stack_id, [])

    def allocations(self, outstanding: bool = False, named: bool = True) -> AllocSnapshot | None:
        return self.snapshot

    def lock_waits(self, stacks: bool = True) -> LockWaits | None:
        return self.waits

    def forget(self, tgids: set[int]) -> None:
        self.forgotten.append(set(tgids))
        if self.snapshot is not None:
            kept = tuple(p for p in self.snapshot.processes if p.tgid not in tgids)
            self.snapshot = replace(self.snapshot, processes=kept)
        if self.waits is not None:
            threads = {pid: t for pid, t in self.waits.threads.items() if pid not in tgids}
            self.waits = replace(self.waits, threads=threads)


def sites() -> tuple[Any, ...]:
    catalog = load_catalog()
    out = []
    for name, address in zip(PROBES, SITE_ADDRESSES, strict=True):
        spec = catalog.probe("libc", name)
        assert spec is not None
        signed = name == "memory_mallopt"
        location = SIGNED if signed else REG
        layout = SiteLayout(SdtSite("libc", name, address, address, 0, ()),
                            tuple(location for _ in spec.args))  # fmt: skip
        out.append(site_info(layout, spec))
    return tuple(out)


def trace_info(counters: PlainCounters | None = None, **changes: Any) -> TraceInfo:
    info = TraceInfo(
        probes=PROBES,
        sites=sites(),
        site_addresses=SITE_ADDRESSES,
        libc=Path("/lib/x86_64-linux-gnu/libc.so.6"),
        counters=counters or PlainCounters(),
        allocators=Allocators(),
        pid=PID,
        version="test",
    )
    return replace(info, **changes)


def probe_records(rows: Sequence[tuple[str, Sequence[int]]], ts: int = 1_000_000) -> np.ndarray:
    """One record per (probe, arguments), in order."""
    batch = np.zeros(len(rows), dtype=EVENT_DTYPE)
    for index, (probe, args) in enumerate(rows):
        slot = PROBES.index(probe)
        record = batch[index]
        record["ts"] = ts + index * 1000
        record["ip"] = 0x7F0000000000 + SITE_ADDRESSES[slot]
        record["tgid"] = PID
        record["tid"] = PID + 1
        record["cpu"] = index % 2
        record["probe"] = slot
        record["site"] = slot
        record["kind"] = EventKind.PROBE
        record["nargs"] = len(args)
        record["args"][: len(args)] = [a & (2**64 - 1) for a in args]
        record["ustack"] = record["kstack"] = -1
    return batch


def kmem_records(count: int, ts: int = 1_000_500) -> np.ndarray:
    """kmalloc events (call site, pointer, requested, allocated, gfp, node)."""
    batch = np.zeros(count, dtype=EVENT_DTYPE)
    batch["ts"] = ts + np.arange(count) * 1000
    batch["ip"] = 0xFFFFFFFF81234567
    batch["tgid"] = PID
    batch["tid"] = PID + 1
    batch["kind"] = EventKind.KMEM
    batch["probe"] = KmemEvent.KMALLOC
    batch["site"] = KmemType.KMALLOC
    batch["nargs"] = 5
    batch["args"][:, 0] = 0xFFFF888000010000 + np.arange(count, dtype=np.uint64) * 64
    batch["args"][:, 1] = 40
    batch["args"][:, 2] = 64
    batch["args"][:, 4] = np.uint64(2**64 - 1)
    batch["ustack"] = batch["kstack"] = -1
    return batch


def batch(records: np.ndarray, info: TraceInfo) -> EventBatch:
    return EventBatch(records, EventDecoder(info.sites))


def result(
    info: TraceInfo, hits: Mapping[str, int], lost: Mapping[str, int] | None = None,
    kmem: KmemResult | None = None,
) -> TraceResult:  # fmt: skip
    lost = dict(lost or {})
    return TraceResult(
        probes=info.probes,
        kernel_hits={p: hits.get(p, 0) for p in info.probes},
        lost={p: lost.get(p, 0) for p in info.probes},
        delivered=sum(hits.values()) - sum(lost.values()),
        lost_lifecycle=0,
        per_process={},
        duration_s=1.5,
        model=info.allocators,
        ended_by="SIGINT",
        kmem=kmem,
    )


def alloc_snapshot(site: int) -> AllocSnapshot:
    """One process's allocations: 1,000 mallocs of 64 bytes at ``site``, 600
    of them freed (25,600 bytes live), and 7 frees of blocks from before."""
    stack = StackRow(PID, "malloc", site, (site,), 1000, 64_000, 64_000, 600, 38_400, 38_400, 0)
    return AllocSnapshot(
        stacks=(stack,),
        processes=(ProcessAllocs(PID, 1000, 64_000, 607, 7, 0),),
        calls={"malloc": 1000, "free": 607},
        misc={"outstanding_full": 0, "stacks_full": 0, "lost_events": 0, "nested": 0},
        sample_bytes=0,
        now_ns=2_000_000_000,
        started_ns=0,
    )
