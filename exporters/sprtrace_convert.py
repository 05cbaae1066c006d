"""kmemtrace record sets as sp-rtrace reports and as JSON lines.

Each allocation and free record becomes a call of its resource type
(kmalloc, kmem_cache, pages; sbrk, heap and arena for the libc probes
recorded as allocations), indexed in sequence order, stamped with its time
since the first record, with its call site as a one-frame backtrace, named
from the kallsyms saved with the records. The other libc probe records
become permanent comments.
"""

from __future__ import annotations

import json
import platform
import time
from collections import Counter
from collections.abc import Iterator

import numpy as np
from mtrace_live.tracer.kallsyms import KernelSymbols

from .kmemtrace import EventId, RecordSet, TypeId
from .sprtrace import Call, Comment, Frame, Resource, Trace, clock

KERNEL_MODULE = "[kernel.kallsyms]"
# type id -> (resource name, description, allocating function, freeing function, refcount)
RESOURCES = {
    TypeId.KMALLOC: ("kmalloc", "kernel kmalloc objects", "kmalloc", "kfree", False),
    TypeId.CACHE: (
        "kmem_cache",
        "kernel slab cache objects",
        "kmem_cache_alloc",
        "kmem_cache_free",
        False,
    ),
    TypeId.PAGES: ("pages", "kernel page allocations", "mm_page_alloc", "mm_page_free", False),
    TypeId.SBRK: (
        "sbrk",
        "main heap growth by sbrk",
        "memory_sbrk_more",
        "memory_sbrk_less",
        False,
    ),
    TypeId.HEAP: ("heap", "mmapped malloc heaps", "memory_heap_new", "memory_heap_free", False),
    TypeId.ARENA: ("arena", "malloc arenas", "memory_arena_new", "memory_arena_free", True),
}


def from_record_set(
    records: RecordSet, symbols: KernelSymbols, version: str, depth: int = 1
) -> Trace:
    recs = records.records
    pids = Counter(int(p) for p in recs["pid"][recs["has_task"] == 1]) if len(recs) else Counter()
    pid = pids.most_common(1)[0][0] if pids else 0
    start = int(recs["timestamp"].min()) if len(recs) else 0
    trace = Trace(header={
        "version": "1.0", "arch": platform.machine(),
        "timestamp": time.strftime("%Y.%-m.%-d %H:%M:%S"),
        "process": f"pid-{pid}" if pid else "kernel", "pid": str(pid),
        "backtrace depth": str(depth), "origin": f"mtrace-live {version}",
    })  # fmt: skip
    present = [
        t for t in RESOURCES if np.any((recs["type_id"] == t) & (recs["event_id"] != EventId.PROBE))
    ]
    trace.resources = [Resource(bit, *RESOURCES[t][:2], refcount=RESOURCES[t][4])
                       for bit, t in enumerate(present, 1)]  # fmt: skip
    modules: set[str] = set()
    resolved = False
    names: dict[int, tuple[str | None, str | None]] = {}
    probe_args = iter(records.args)
    for index, rec in enumerate(recs, 1):
        event, type_id = int(rec["event_id"]), int(rec["type_id"])
        stamp = int(rec["timestamp"]) - start
        if event == EventId.PROBE:
            args = next(probe_args)[:6]
            probe = int(rec["probe"])
            name = (
                records.libc_probes[probe] if probe < len(records.libc_probes) else f"probe{probe}"
            )
            values = " ".join(f"{int(a):#x}" for a in args)
            trace.items.append(
                Comment(f"## [{clock(stamp // 1_000_000)}] pid {int(rec['pid'])} {name} {values}")
            )
            continue
        resource, _, alloc_fn, free_fn, _ = RESOURCES[TypeId(type_id)]
        site = int(rec["call_site"])
        frame = Frame(site)
        if type_id <= TypeId.PAGES and site:
            if site not in names:
                found = symbols.function(site)
                names[site] = (found[0], found[2].strip("[]") or None) if found else (None, None)
            function, module = names[site]
            if function:
                frame.function, resolved = function, True
                frame.module = f"[{module}]" if module else KERNEL_MODULE
                modules.add(module or "")
        size = int(rec["bytes_req"]) if event == EventId.ALLOC else None
        if size is not None and type_id == TypeId.PAGES:
            size = int(rec["bytes_alloc"])
        function = alloc_fn if size is not None else free_fn
        frames = [frame] if site else []
        call = Call(
            index, function, resource, int(rec["ptr"]), size, stamp // 1_000_000, frames=frames
        )
        if size is not None:
            call.args = [str(int(rec["bytes_alloc"])), f"{int(rec['gfp_flags']):#x}"]
        trace.items.append(call)
    for module in sorted(modules):
        span = symbols.module_range(f"[{module}]" if module else "")
        if span:
            trace.mmaps.append((f"[{module}]" if module else KERNEL_MODULE, *span))
    if resolved:
        trace.add_filter("resolve")
    return trace


def json_lines(records: RecordSet, symbols: KernelSymbols) -> Iterator[str]:
    """One JSON object per record, in sequence order."""
    probe_args = iter(records.args)
    for rec in records.records:
        event, type_id = int(rec["event_id"]), int(rec["type_id"])
        doc: dict[str, object] = {
            "seq": int(rec["seq"]), "ts_ns": int(rec["timestamp"]), "cpu": int(rec["cpu"]),
            "pid": int(rec["pid"]), "tid": int(rec["tid"]),
            "event": ("alloc", "free", "probe")[event],
        }  # fmt: skip
        if event == EventId.PROBE:
            probe = int(rec["probe"])
            doc["probe"] = records.libc_probes[probe] if probe < len(records.libc_probes) else probe
            doc["args"] = [int(a) for a in next(probe_args)]
        else:
            doc["type"] = RESOURCES[TypeId(type_id)][0]
            doc["call_site"] = int(rec["call_site"])
            if type_id <= TypeId.PAGES and rec["call_site"]:
                doc["symbol"] = symbols.describe(int(rec["call_site"]))
            doc["ptr"] = int(rec["ptr"])
            if event == EventId.ALLOC:
                doc.update(bytes_req=int(rec["bytes_req"]), bytes_alloc=int(rec["bytes_alloc"]),
                           gfp_flags=int(rec["gfp_flags"]), node=int(rec["target"]))  # fmt: skip
        yield json.dumps(doc)
