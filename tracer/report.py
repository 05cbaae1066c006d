"""``mtrace-live report``: kmemtrace's user-space analysis of a record set.

Everything is computed in bulk with numpy from the decoded records (ordered
by sequence number): allocations and frees per call site, frees matched to
their allocation by pointer, cross-CPU frees, and the errors kmemtrace-report
looked for.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field

import numpy as np
from mtrace_live.exporters.data.kallsyms import KernelSymbols
from mtrace_live.exporters.data.kmem import CallSite, KmemTotals, name_sites
from mtrace_live.exporters.kmemtrace import KERNEL_TYPES, EventId, RecordSet, TypeId

PAGE_SIZE = mmap.PAGESIZE  # of the recording machine, assumed the same


@dataclass
class Findings:
    """Counts of what looks wrong, kmemtrace-report's "errors"."""

    mismatched_frees: int = 0  # kfree of a cache object, kmem_cache_free of a kmalloc one
    unknown_frees: int = 0  # a non-NULL pointer not allocated (or already freed) in the records
    requested_above_allocated: int = 0
    null_frees: int = 0  # kfree(NULL): legal, counted apart
    reallocated_live: int = 0  # an allocation of a pointer still live: its free was missed

    def as_json(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class Report:
    records: RecordSet
    kernel: KmemTotals
    findings: Findings
    cross_cpu_frees: int
    cross_node_allocs: int
    libc: dict[str, dict[str, int]] = field(default_factory=dict)
    probe_hits: dict[str, int] = field(default_factory=dict)

    def as_json(self) -> dict[str, object]:
        rs = self.records
        return {
            "record_set": str(rs.directory),
            "abi_version": rs.abi_version,
            "records": len(rs.unordered),
            "bytes": rs.bytes_read,
            "total_overruns": rs.total_overruns,
            "skipped": rs.skipped,
            "damage": rs.damage,
            "kernel": self.kernel.as_json(),
            "errors": self.findings.as_json(),
            "cross_cpu": {"frees": self.cross_cpu_frees, "node_allocs": self.cross_node_allocs},
            "libc": self.libc,
            "libc_probes": self.probe_hits,
        }


def _group(call_site: np.ndarray, type_id: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unique (call site, type) pairs and each row's group index."""
    sites, site_index = np.unique(call_site, return_inverse=True)
    pair = site_index.astype(np.int64) * 256 + type_id
    pairs, group = np.unique(pair, return_inverse=True)
    return sites[pairs // 256], (pairs % 256).astype(np.uint8), group


_EXACT = 1 << 53  # float64 holds every integer below this
_CHUNK_BITS = 21  # a 64-bit value in four chunks; 2**32 records' chunk sums stay exact


def _sum(group: np.ndarray, n: int, values: np.ndarray | None = None) -> np.ndarray:
    """Per group, the count (no values) or the exact sum of unsigned values,
    however large: a sum that would not be exact in float64 is made of
    21-bit chunks, each summed exactly, and comes back as Python ints."""
    if values is None or values.dtype == np.bool_:
        return np.bincount(group, weights=values, minlength=n).astype(np.int64)
    values = values.astype(np.uint64)
    if not len(values) or int(values.max()) * len(values) < _EXACT:
        return np.bincount(group, weights=values.astype(np.float64), minlength=n).astype(np.int64)
    total = np.zeros(n, dtype=object)
    mask = np.uint64((1 << _CHUNK_BITS) - 1)
    for shift in range(0, 64, _CHUNK_BITS):
        chunk = (values >> np.uint64(shift)) & mask
        sums = np.bincount(group, weights=chunk.astype(np.float64), minlength=n)
        total += np.array([int(x) << shift for x in sums.tolist()], dtype=object)
    return total


def exact_total(values: np.ndarray) -> int:
    """The exact sum of unsigned values, however large."""
    return int(_sum(np.zeros(len(values), dtype=np.int64), 1, values)[0])


def analyse(rs: RecordSet, symbols: KernelSymbols | None = None) -> Report:
    recs = rs.unordered
    kernel = recs[(recs["type_id"] <= max(KERNEL_TYPES)) & (recs["event_id"] <= EventId.FREE)]
    is_alloc = kernel["event_id"] == EventId.ALLOC
    findings = Findings()

    # Match frees to allocations: per pointer, in sequence order, a free
    # belongs to the allocation right before it.
    order = np.lexsort((kernel["seq"], kernel["ptr"]))
    k = kernel[order]
    alloc_k = is_alloc[order]
    same_ptr = np.zeros(len(k), dtype=bool)
    same_ptr[1:] = k["ptr"][1:] == k["ptr"][:-1]
    prev_alloc = np.zeros(len(k), dtype=bool)
    prev_alloc[1:] = alloc_k[:-1]
    nonnull = k["ptr"] != 0
    matched = ~alloc_k & same_ptr & prev_alloc & nonnull
    findings.null_frees = int(np.count_nonzero(~alloc_k & ~nonnull))
    unknown = ~alloc_k & nonnull & ~matched
    findings.unknown_frees = int(np.count_nonzero(unknown))
    findings.reallocated_live = int(np.count_nonzero(alloc_k & same_ptr & prev_alloc & nonnull))
    freed_rows = np.flatnonzero(matched)
    alloc_of = freed_rows - 1
    mismatched = k["type_id"][freed_rows] != k["type_id"][alloc_of]
    findings.mismatched_frees = int(np.count_nonzero(mismatched))
    cross_cpu = k["cpu"][freed_rows] != k["cpu"][alloc_of]

    allocs = kernel[is_alloc]
    findings.requested_above_allocated = int(
        np.count_nonzero(allocs["bytes_req"] > allocs["bytes_alloc"])
    )
    node_of_cpu = np.full(int(recs["cpu"].max()) + 1 if len(recs) else 1, -1, dtype=np.int64)
    for cpu, node in rs.cpu_nodes.items():
        if cpu < len(node_of_cpu):
            node_of_cpu[cpu] = node
    targeted = allocs["target"] >= 0
    cross_node = targeted & (allocs["target"] != node_of_cpu[allocs["cpu"]])

    # Per (call site, type): allocations at the allocating site; matched frees
    # at their allocation's site; unknown frees at the freeing site.
    unknown_rows = k[unknown]
    cs = np.concatenate([allocs["call_site"], k["call_site"][alloc_of], unknown_rows["call_site"]])
    ty = np.concatenate([allocs["type_id"], k["type_id"][alloc_of], unknown_rows["type_id"]])
    sites, types, group = _group(cs, ty)
    n = len(sites)
    na, nf = len(allocs), len(alloc_of)
    g_alloc, g_free, g_unknown = group[:na], group[na : na + nf], group[na + nf :]
    columns = {
        "allocs": _sum(g_alloc, n),
        "bytes_req": _sum(g_alloc, n, allocs["bytes_req"]),
        "bytes_alloc": _sum(g_alloc, n, allocs["bytes_alloc"]),
        "failed": _sum(g_alloc, n, (allocs["ptr"] == 0)),
        "cross_node": _sum(g_alloc, n, cross_node),
        "frees": _sum(g_free, n),
        "bytes_freed": _sum(g_free, n, k["bytes_alloc"][alloc_of]),
        "cross_cpu_frees": _sum(g_free, n, cross_cpu),
        "mismatched_frees": _sum(g_free, n, mismatched),
        "unknown_frees": _sum(g_unknown, n),
    }
    call_sites = [
        CallSite.with_counts(
            int(sites[i]), int(types[i]), ((name, int(col[i])) for name, col in columns.items())
        )
        for i in range(n)
    ]
    if symbols is not None:
        name_sites(call_sites, symbols)

    def orders(rows: np.ndarray) -> dict[int, int]:
        pages = rows[rows["type_id"] == TypeId.PAGES]
        order = np.log2(np.maximum(pages["bytes_alloc"] // PAGE_SIZE, 1)).astype(np.int64)
        found, counts = np.unique(order, return_counts=True)
        return dict(zip(found.tolist(), counts.tolist(), strict=True))

    allocated, freed = orders(allocs), orders(k[alloc_of])
    page_orders = {o: (allocated.get(o, 0), freed.get(o, 0)) for o in sorted({*allocated, *freed})}

    return Report(
        records=rs,
        kernel=KmemTotals(sites=call_sites, page_orders=page_orders),
        findings=findings,
        cross_cpu_frees=int(np.count_nonzero(cross_cpu)),
        cross_node_allocs=int(np.count_nonzero(cross_node)),
        libc=_libc_totals(recs),
        probe_hits=_probe_hits(rs),
    )


def _libc_totals(recs: np.ndarray) -> dict[str, dict[str, int]]:
    totals = {}
    for type_id in (TypeId.SBRK, TypeId.HEAP, TypeId.ARENA):
        mine = recs[(recs["type_id"] == type_id) & (recs["event_id"] <= EventId.FREE)]
        if len(mine) == 0:
            continue
        alloc = mine[mine["event_id"] == EventId.ALLOC]
        totals[type_id.name.lower()] = {
            "allocs": len(alloc),
            "bytes": exact_total(alloc["bytes_alloc"]),
            "frees": len(mine) - len(alloc),
        }
    return totals


def _probe_hits(rs: RecordSet) -> dict[str, int]:
    probes = rs.unordered["probe"][rs.unordered["event_id"] == EventId.PROBE]
    numbers, counts = np.unique(probes, return_counts=True)
    names = rs.libc_probes
    return {
        (names[num] if num < len(names) else f"probe {num}"): int(c)
        for num, c in zip(numbers.tolist(), counts.tolist(), strict=True)
    }


def render_text(report: Report, limit: int | None, sort: str) -> list[str]:
    from mtrace_live.exporters.kmem_table import render_orders, render_table

    rs = report.records
    cpus = len(np.unique(rs.unordered["cpu"])) if len(rs.unordered) else 0
    overruns = "unknown" if rs.total_overruns is None else str(rs.total_overruns)
    lines = [
        f"record set {rs.directory}: ABI {rs.abi_version}, {len(rs.unordered)} records "
        f"({rs.bytes_read} bytes, from {cpus} CPUs), total_overruns {overruns}"
    ]
    lines += [f"skipped: {count} ({reason})" for reason, count in rs.skipped.items()]
    lines.append("")
    lines += render_table(report.kernel, limit, sort)
    orders = render_orders(report.kernel)
    if orders:
        lines += ["", *orders]
    f = report.findings
    lines += [
        "",
        f"cross-CPU: {report.cross_cpu_frees} frees on another CPU than the allocation's, "
        f"{report.cross_node_allocs} allocations for another node",
        f"errors: {f.mismatched_frees} mismatched frees, {f.unknown_frees} frees of unknown "
        f"pointers, {f.requested_above_allocated} allocations with requested > allocated",
        f"also: {f.null_frees} frees of NULL, {f.reallocated_live} allocations of a pointer "
        "still live (its free not recorded)",
    ]
    for kind, totals in report.libc.items():
        lines.append(f"libc {kind}: {totals['allocs']} allocations, {totals['bytes']} bytes, "
                     f"{totals['frees']} frees")  # fmt: skip
    if report.probe_hits:
        lines.append("libc probes: " + ", ".join(f"{name} {n}" for name, n in
                                                  sorted(report.probe_hits.items())))  # fmt: skip
    return lines
