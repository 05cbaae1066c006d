"""``mtrace-live report``: kmemtrace's user-space analysis of a record set.

Allocations and frees per call site, frees matched to their allocation by
pointer, cross-CPU frees, and the errors kmemtrace-report looked for.

Two ways to the same answer:
- ``stream``: one compiled pass (walker.c) merges the cpuN files by
  sequence number in fixed-size chunks and matches frees in a table of the
  allocations still live, so memory does not grow with the files. This is
  what the command uses.
- ``analyse``: every record decoded into memory, then matched by sorting
  (numpy). It is the reference the tests hold the pass to, and the fallback
  for a file whose sequence numbers go backwards, which no merge can order.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from mtrace_live.exporters.data.allocations import AllocSnapshot, FrameNames, StackRow, frame_text
from mtrace_live.exporters.data.kallsyms import KernelSymbols
from mtrace_live.exporters.data.kmem import CallSite, KmemTotals, name_sites
from mtrace_live.exporters.data.symbolize import ProcessSymbols
from mtrace_live.exporters.kmemtrace.abi import KERNEL_TYPES, SKIP_REASONS, EventId, TypeId
from mtrace_live.exporters.kmemtrace.reader import (
    RecordSet,
    RecordSetHeader,
    damage_line,
    parse_user_maps,
    read_record_set,
)
from mtrace_live.probes.elf.errors import RecordSetError
from mtrace_live.probes.records import ALLOC_FN_NAMES

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
class UserSite:
    """One user-space call site (process, allocating function, return address)."""

    pid: int
    function: str
    call_site: int
    allocs: int = 0
    bytes: int = 0
    frees: int = 0
    bytes_freed: int = 0
    name: str = ""  # function+0xoff (file:line), or the address and its module
    location: str | None = None  # file:line
    symbol: str | None = None  # the function holding the call site

    @property
    def live(self) -> int:
        return self.allocs - self.frees

    @property
    def live_bytes(self) -> int:
        return self.bytes - self.bytes_freed

    def as_json(self) -> dict[str, object]:
        return {"pid": self.pid, "allocator": self.function, "call_site": hex(self.call_site),
                "name": self.name, "allocs": self.allocs, "bytes": self.bytes,
                "frees": self.frees, "bytes_freed": self.bytes_freed, "live": self.live,
                "live_bytes": self.live_bytes}  # fmt: skip


@dataclass
class Source:
    """What a report says of the record set it read."""

    directory: Path
    abi_version: int
    records: int
    bytes_read: int
    total_overruns: int | None
    skipped: dict[str, int]
    damage: list[str]
    cpus: int  # CPUs with records
    user_maps: str

    @classmethod
    def of(cls, rs: RecordSet) -> Source:
        return cls(rs.directory, rs.abi_version, len(rs.unordered), rs.bytes_read,
                   rs.total_overruns, rs.skipped, rs.damage,
                   len(np.unique(rs.unordered["cpu"])), rs.user_maps)  # fmt: skip


@dataclass
class Report:
    source: Source
    kernel: KmemTotals
    findings: Findings
    cross_cpu_frees: int
    cross_node_allocs: int
    libc: dict[str, dict[str, int]] = field(default_factory=dict)
    probe_hits: dict[str, int] = field(default_factory=dict)
    user: list[UserSite] = field(default_factory=list)  # ABI 3: the allocation functions
    user_unknown_frees: int = 0

    def as_json(self) -> dict[str, object]:
        rs = self.source
        return {
            "record_set": str(rs.directory),
            "abi_version": rs.abi_version,
            "records": rs.records,
            "bytes": rs.bytes_read,
            "total_overruns": rs.total_overruns,
            "skipped": rs.skipped,
            "damage": rs.damage,
            "kernel": self.kernel.as_json(),
            "errors": self.findings.as_json(),
            "cross_cpu": {"frees": self.cross_cpu_frees, "node_allocs": self.cross_node_allocs},
            "libc": self.libc,
            "libc_probes": self.probe_hits,
            "user": [entry.as_json() for entry in self.user],
            "user_unknown_frees": self.user_unknown_frees,
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
        source=Source.of(rs),
        kernel=KmemTotals(sites=call_sites, page_orders=page_orders),
        findings=findings,
        cross_cpu_frees=int(np.count_nonzero(cross_cpu)),
        cross_node_allocs=int(np.count_nonzero(cross_node)),
        libc=_libc_totals(recs),
        probe_hits=_probe_hits(rs),
        **_user_sites(rs),
    )


def _user_sites(rs: RecordSet) -> dict[str, Any]:
    """Allocations and frees of the allocation functions (type USER), per
    (process, function, call site); frees matched by (process, pointer) in
    sequence order, at their allocation's site. Named through the mappings
    saved with the records (user_maps)."""
    recs = rs.unordered
    user = recs[(recs["type_id"] == TypeId.USER) & (recs["event_id"] <= EventId.FREE)]
    if len(user) == 0:
        return {}
    u = user[np.lexsort((user["seq"], user["ptr"], user["pid"]))]
    is_alloc = u["event_id"] == EventId.ALLOC
    same = np.zeros(len(u), dtype=bool)
    same[1:] = (u["ptr"][1:] == u["ptr"][:-1]) & (u["pid"][1:] == u["pid"][:-1])
    prev_alloc = np.zeros(len(u), dtype=bool)
    prev_alloc[1:] = is_alloc[:-1]
    matched = ~is_alloc & same & prev_alloc & (u["ptr"] != 0)
    alloc_of = np.flatnonzero(matched) - 1
    sites: dict[tuple[int, int, int], UserSite] = {}

    def site(pid: int, fn: int, call_site: int) -> UserSite:
        key = (pid, fn, call_site)
        found = sites.get(key)
        if found is None:
            found = sites[key] = UserSite(pid, _function(fn), call_site)
        return found

    allocs = u[is_alloc]
    for pid, fn, call_site, size in zip(allocs["pid"].tolist(), allocs["fn"].tolist(),
                                        allocs["call_site"].tolist(),
                                        allocs["bytes_req"].tolist(), strict=True):  # fmt: skip
        entry = site(pid, fn, call_site)
        entry.allocs += 1
        entry.bytes += size
    freed = u[alloc_of]
    for pid, fn, call_site, size in zip(freed["pid"].tolist(), freed["fn"].tolist(),
                                        freed["call_site"].tolist(),
                                        freed["bytes_req"].tolist(), strict=True):  # fmt: skip
        entry = site(pid, fn, call_site)
        entry.frees += 1
        entry.bytes_freed += size
    unknown = int(np.count_nonzero(~is_alloc & ~matched & (u["ptr"] != 0)))
    return {"user": _named(list(sites.values()), rs.user_maps), "user_unknown_frees": unknown}


def _named(sites: list[UserSite], user_maps: str) -> list[UserSite]:
    """User sites named through the saved mappings, most live bytes first
    (a stable sort: equal ones stay in the order given)."""
    maps = parse_user_maps(user_maps)
    names = {pid: ProcessSymbols(pid, saved=maps[pid]) for pid in {s.pid for s in sites}
             if pid in maps}  # fmt: skip
    for entry in sites:
        symbols = names.get(entry.pid)
        symbol = symbols.resolve(entry.call_site - 1) if symbols is not None else None
        if symbol is not None and symbol.function is not None:
            symbol = replace(symbol, offset=symbol.offset + 1)
        entry.name = frame_text(entry.call_site, symbol)
        entry.location = symbol.location if symbol is not None else None
        entry.symbol = symbol.function if symbol is not None else None
    return sorted(sites, key=lambda s: (-s.live_bytes, -s.bytes))


def user_snapshot(report: Report) -> tuple[AllocSnapshot, FrameNames]:
    """The user-space call sites as an allocation snapshot (one frame per
    row: records carry the call site, not the stack), with names from the
    saved mappings: for the pprof and folded formats."""
    rows = tuple(
        StackRow(s.pid, s.function, s.call_site, (s.call_site,), s.allocs, s.bytes, s.bytes,
                 s.frees, s.bytes_freed, s.bytes_freed, 0)
        for s in report.user
    )  # fmt: skip
    snapshot = AllocSnapshot(rows, (), {}, {}, 0, 0, 0)
    names = FrameNames(live=False)
    for pid, mappings in parse_user_maps(report.source.user_maps).items():
        names.symbols[pid] = ProcessSymbols(pid, saved=mappings)
    return snapshot, names


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
    return _probe_names(zip(numbers.tolist(), counts.tolist(), strict=True), rs.libc_probes)


def _probe_names(hits: Iterable[tuple[int, int]], names: list[str]) -> dict[str, int]:
    return {(names[num] if num < len(names) else f"probe {num}"): int(c) for num, c in hits}


def _function(fn: int) -> str:
    return ALLOC_FN_NAMES[fn] if fn < len(ALLOC_FN_NAMES) else f"fn{fn}"


# The pass's read size per file: at least two of the largest records (the
# event size is 16 bits), at most 1 MiB, and 64 MiB for all files together.
MIN_CHUNK, MAX_CHUNK, ALL_CHUNKS = 1 << 17, 1 << 20, 1 << 26
KERNEL_COLUMNS = (
    "allocs", "bytes_req", "bytes_alloc", "failed", "cross_node", "frees", "bytes_freed",
    "cross_cpu_frees", "mismatched_frees", "unknown_frees",
)  # fmt: skip


def stream(
    header: RecordSetHeader, symbols: KernelSymbols | None = None, chunk: int | None = None
) -> Report:
    """The report of a record set in one compiled pass over its files, in
    memory bounded by the chunks, the call sites and the allocations live at
    any one time. The same answer as ``analyse(read_record_set(...))``.
    ``chunk``: the read size per file (tests make it small to cross many
    chunk boundaries)."""
    from ._walker import report_pass

    files = header.files
    sizes = header.sizes()
    if chunk is None:
        chunk = max(MIN_CHUNK, min(MAX_CHUNK, ALL_CHUNKS // len(files)))
    try:
        found = report_pass([str(p) for p in files.values()], list(files),
                            [header.cpu_nodes.get(cpu, -1) for cpu in files], header.big,
                            PAGE_SIZE, chunk)  # fmt: skip
    except OSError as exc:
        where = exc.filename or header.directory
        raise RecordSetError(f"cannot read {where}: {exc.strerror}") from None
    if found["unsorted"]:
        return analyse(read_record_set(header.path, header.big), symbols)
    skipped = dict.fromkeys(SKIP_REASONS, 0)
    damage = []
    for (cpu, path), (count, status, offset, skips) in zip(files.items(), found["files"],
                                                          strict=True):  # fmt: skip
        for reason, n in zip(SKIP_REASONS, skips, strict=True):
            skipped[reason] += n
        line = damage_line(path, status, offset, sizes[cpu], count)
        if line is not None:
            damage.append(line)
    source = Source(header.directory, header.abi_version, found["records"], sum(sizes.values()),
                    header.total_overruns, {k: v for k, v in skipped.items() if v}, damage,
                    sum(1 for f in found["files"] if f[0]), header.user_maps)  # fmt: skip

    call_sites = [
        CallSite.with_counts(row[0], row[1], zip(KERNEL_COLUMNS, row[2:], strict=True))
        for row in sorted(found["kernel_sites"], key=lambda row: (row[0], row[1]))
    ]
    if symbols is not None:
        name_sites(call_sites, symbols)
    findings = Findings(*found["findings"])
    libc_types = (TypeId.SBRK, TypeId.HEAP, TypeId.ARENA)
    libc = {
        type_id.name.lower(): {"allocs": allocs, "bytes": total, "frees": frees}
        for type_id, (allocs, total, frees) in zip(libc_types, found["libc"], strict=True)
        if allocs or frees
    }
    # Sites in the order the sorting analysis meets them: by process, then
    # by the pointer and sequence of their first allocation.
    rows = sorted(found["user_sites"], key=lambda row: (row[0], row[7], row[8]))
    user = [UserSite(pid, _function(fn), call_site, allocs, total, frees, freed)
            for pid, fn, call_site, allocs, total, frees, freed, _, _ in rows]  # fmt: skip
    return Report(
        source=source,
        kernel=KmemTotals(sites=call_sites, page_orders=found["page_orders"]),
        findings=findings,
        cross_cpu_frees=found["cross_cpu_frees"],
        cross_node_allocs=found["cross_node_allocs"],
        libc=libc,
        probe_hits=_probe_names(found["probe_hits"].items(), header.libc_probes),
        user=_named(user, header.user_maps),
        user_unknown_frees=found["user_unknown_frees"],
    )


def render_text(report: Report, limit: int | None, sort: str) -> list[str]:
    from mtrace_live.exporters.kmem_table import render_orders, render_table

    rs = report.source
    overruns = "unknown" if rs.total_overruns is None else str(rs.total_overruns)
    lines = [
        f"record set {rs.directory}: ABI {rs.abi_version}, {rs.records} records "
        f"({rs.bytes_read} bytes, from {rs.cpus} CPUs), total_overruns {overruns}"
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
    if report.user:
        lines += ["", "user-space call sites (the allocation functions; frees matched by "
                  f"process and pointer; {report.user_unknown_frees} frees of unknown pointers):",
                  f"{'live bytes':>12} {'live':>8} {'allocs':>8} {'bytes':>12} {'frees':>8} "
                  f"{'pid':>7} {'function':<14} call site"]  # fmt: skip
        for entry in report.user[:limit] if limit else report.user:
            lines.append(f"{entry.live_bytes:>12} {entry.live:>8} {entry.allocs:>8} "
                         f"{entry.bytes:>12} {entry.frees:>8} {entry.pid:>7} "
                         f"{entry.function:<14} {entry.name}")  # fmt: skip
    return lines
