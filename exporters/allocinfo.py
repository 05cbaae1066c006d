"""Allocations as /proc/allocinfo lines (Documentation/mm/allocation-profiling.rst).

Each line is ``bytes calls location func:name`` for what is still allocated.
The kernel prints ``file:line`` as the location. Without line information
mtrace-live prints a kernel call site as ``function+0xoffset``, with the
module in brackets for module code, and a user-space one as the module and
the offset from its load base.

A user-space line is the first frame of the allocation's stack outside the
allocation wrappers (exporters/data/wrappers.py, ``--wrappers``): the line
that asked for the memory, not ``operator new`` or ``g_malloc``, as the
kernel's alloc_hooks() charge the caller of a wrapper. In a stack with
Python frames (docs/python.md) it is the first Python frame: the line of
Python above the interpreter's and the extensions' native frames. The
kernel's lines are their call sites.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import PurePath

from mtrace_live.exporters.data.alloc_snapshot import (
    AllocSnapshot,
    FrameNames,
    StackRow,
    function_name,
)
from mtrace_live.exporters.data.kmem import CallSite, KmemTotals, sorted_sites
from mtrace_live.exporters.data.sink import FileAtEndSink, TraceInfo, TraceResult
from mtrace_live.exporters.data.wrappers import Wrappers
from mtrace_live.probes.frame_kinds import in_python

HEADER = ("allocinfo - version: 1.0", "#     <size>  <calls> <tag info>")


def location(site: CallSite) -> str:
    """``func+0x1a [module] func:func``, or the bare address when unknown."""
    if site.address == 0:
        return "(pages) func:mm_page_alloc"  # the page tracepoints carry no call site
    symbol = site.symbol or f"{site.address:#x}"
    return f"{symbol} func:{symbol.split('+', 1)[0]}"


def render_allocinfo(totals: KmemTotals) -> list[str]:
    lines = list(HEADER)
    for site in sorted_sites(totals.sites, "outstanding_bytes"):
        lines.append(f"{site.outstanding_bytes:12d} {site.outstanding:8d} {location(site)}")
    return lines


def allocating_line(row: StackRow, names: FrameNames, wrappers: Wrappers) -> str:
    """``location func:name`` of the stack's first frame outside the
    wrappers (its outermost frame when every one is a wrapper's). The
    location is file:line, else the module and the offset from its load
    base (``libfoo.so.1+0x1a2b``, as addr2line takes them)."""
    chosen = row.frames[-1] if row.frames else row.call_site
    python = [address for address in row.frames if in_python(address) is not None]
    for address in python or row.frames:
        if not wrappers.wraps(function_name(names.resolve(row.tgid, address), address)):
            chosen = address
            break
    symbol = names.resolve(row.tgid, chosen)
    if symbol is None:
        return f"{chosen:#x} func:{chosen:#x}"
    base = symbol.span[0] if symbol.span else 0
    place = symbol.location or f"{PurePath(symbol.module).name}+{chosen - base:#x}"
    return f"{place} func:{symbol.function or place}"


def user_allocinfo(snapshot: AllocSnapshot, names: FrameNames, wrappers: Wrappers) -> list[str]:
    """The allocations still live, by allocating line, most bytes first."""
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for row in snapshot.stacks:
        if row.live_objects <= 0 or row.live_bytes <= 0:
            continue
        line = totals[allocating_line(row, names, wrappers)]
        line[0] += row.live_bytes
        line[1] += row.live_objects
    ordered = sorted(totals.items(), key=lambda item: (-item[1][0], -item[1][1], item[0]))
    return [f"{size:12d} {calls:8d} {tag}" for tag, (size, calls) in ordered]


class AllocinfoSink(FileAtEndSink):
    """``--allocinfo FILE``: what is still allocated when the trace ends, as
    /proc/allocinfo lines: the kernel's call sites (with --kmem), then the
    user-space allocating lines."""

    wrappers = Wrappers()

    def start(self, info: TraceInfo) -> None:
        self.wrappers = info.wrappers

    def content(self, result: TraceResult) -> bytes | None:
        lines = render_allocinfo(result.kmem.totals) if result.kmem else list(HEADER)
        if result.allocations is not None:
            lines += user_allocinfo(result.allocations, result.frame_names, self.wrappers)
        return "".join(f"{line}\n" for line in lines).encode()
