"""``mtrace-live report``: kmemtrace's user-space analysis of a record set.

Allocations and frees per call site, frees matched to their allocation by
pointer, cross-CPU frees, and the errors kmemtrace-report looked for.

The walker (walker.c) analyses the records, in sequence order, two ways:
- ``stream_report``: one compiled pass merges the cpuN files by sequence number in
  fixed-size chunks and matches frees in a table of the allocations still
  live, so memory does not grow with the files. This is what the command
  uses.
- ``analyse``: every record decoded into memory by the walker and sorted
  (the reader), then the same analysis over the array. It is the fallback
  for a file whose sequence numbers go backwards, which no merge can order,
  and what the tests hold the merge to.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from mtrace_live.exporters.data.alloc_snapshot import (
    AllocSnapshot,
    FrameNames,
    StackRow,
    frame_text,
)
from mtrace_live.exporters.data.kallsyms import KernelSymbols
from mtrace_live.exporters.data.kmem import CallSite, KmemTotals, name_sites
from mtrace_live.exporters.data.symbolize import ProcessSymbols
from mtrace_live.exporters.kmemtrace.abi import SKIP_REASONS, TypeId
from mtrace_live.exporters.kmemtrace.reader import (
    RecordSet,
    RecordSetHeader,
    damage_line,
    parse_user_maps,
    read_record_set,
)
from mtrace_live.probes.errors import RecordSetError
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


def _probe_names(hits: Iterable[tuple[int, int]], names: list[str]) -> dict[str, int]:
    return {(names[num] if num < len(names) else f"probe {num}"): int(c) for num, c in hits}


def _function_name(fn: int) -> str:
    return ALLOC_FN_NAMES[fn] if fn < len(ALLOC_FN_NAMES) else f"fn{fn}"


# The pass's read size per file: at least two of the largest records (the
# event size is 16 bits), at most 1 MiB, and 64 MiB for all files together.
MIN_CHUNK, MAX_CHUNK, ALL_CHUNKS = 1 << 17, 1 << 20, 1 << 26
KERNEL_COLUMNS = (
    "allocs", "bytes_req", "bytes_alloc", "failed", "cross_node", "frees", "bytes_freed",
    "cross_cpu_frees", "mismatched_frees", "unknown_frees",
)  # fmt: skip


def analyse(rs: RecordSet, symbols: KernelSymbols | None = None) -> Report:
    """The report of a record set read whole (``read_record_set``): the
    walker's analysis of its records in sequence order. For a set whose
    files no merge can order, where ``stream_report`` falls back to it."""
    from ._walker import report_records

    nodes = [rs.cpu_nodes.get(cpu, -1) for cpu in range(max(rs.cpu_nodes, default=-1) + 1)]
    found = report_records(np.ascontiguousarray(rs.records), nodes, PAGE_SIZE)
    return _report(found, Source.of(rs), symbols, rs.libc_probes, rs.user_maps)


def stream_report(
    header: RecordSetHeader, symbols: KernelSymbols | None = None, chunk: int | None = None
) -> Report:
    """The report of a record set in one compiled pass over its files, in
    memory bounded by the chunks, the call sites and the allocations live at
    any one time. The same answer as ``analyse(read_record_set(...))``.
    ``chunk``: the read size per file (tests make it small to cross many
    chunk boundaries)."""
    from ._walker import report_pass

    files = header.files
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
    return _report(found, _source(header, found), symbols, header.libc_probes, header.user_maps)


def _source(header: RecordSetHeader, found: dict[str, Any]) -> Source:
    """What the pass says of the files it read: records, skips, damage."""
    sizes = header.sizes()
    skipped = dict.fromkeys(SKIP_REASONS, 0)
    damage = []
    for (cpu, path), (count, status, offset, skips) in zip(header.files.items(), found["files"],
                                                          strict=True):  # fmt: skip
        for reason, n in zip(SKIP_REASONS, skips, strict=True):
            skipped[reason] += n
        line = damage_line(path, status, offset, sizes[cpu], count)
        if line is not None:
            damage.append(line)
    return Source(header.directory, header.abi_version, found["records"], sum(sizes.values()),
                  header.total_overruns, {k: v for k, v in skipped.items() if v}, damage,
                  sum(1 for f in found["files"] if f[0]), header.user_maps)  # fmt: skip


def _report(found: dict[str, Any], source: Source, symbols: KernelSymbols | None,
            libc_probes: list[str], user_maps: str) -> Report:  # fmt: skip
    """The walker's figures (report_pass, report_records) as a Report."""
    call_sites = [
        CallSite.with_counts(row[0], row[1], zip(KERNEL_COLUMNS, row[2:], strict=True))
        for row in sorted(found["kernel_sites"], key=lambda row: (row[0], row[1]))
    ]
    if symbols is not None:
        name_sites(call_sites, symbols)
    libc_types = (TypeId.SBRK, TypeId.HEAP, TypeId.ARENA)
    libc = {
        type_id.name.lower(): {"allocs": allocs, "bytes": total, "frees": frees}
        for type_id, (allocs, total, frees) in zip(libc_types, found["libc"], strict=True)
        if allocs or frees
    }
    # Sites by process, then by the pointer and sequence of their first
    # allocation (then, in _named, by live bytes).
    rows = sorted(found["user_sites"], key=lambda row: (row[0], row[7], row[8]))
    user = [UserSite(pid, _function_name(fn), call_site, allocs, total, frees, freed)
            for pid, fn, call_site, allocs, total, frees, freed, _, _ in rows]  # fmt: skip
    return Report(
        source=source,
        kernel=KmemTotals(sites=call_sites, page_orders=found["page_orders"]),
        findings=Findings(*found["findings"]),
        cross_cpu_frees=found["cross_cpu_frees"],
        cross_node_allocs=found["cross_node_allocs"],
        libc=libc,
        probe_hits=_probe_names(found["probe_hits"].items(), libc_probes),
        user=_named(user, user_maps),
        user_unknown_frees=found["user_unknown_frees"],
    )


def report_lines(report: Report, limit: int | None, sort: str) -> list[str]:
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
