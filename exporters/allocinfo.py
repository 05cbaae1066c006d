"""Call sites as /proc/allocinfo lines (Documentation/mm/allocation-profiling.rst).

Each line is ``bytes calls location func:name`` for what is still allocated.
The kernel prints ``file:line`` as the location; without line information
mtrace-live prints ``function+0xoffset`` and the module in brackets, as
allocinfo does for module code.
"""

from __future__ import annotations

from mtrace_live.exporters.data.kmem import CallSite, KmemTotals, sorted_sites

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


def render_user_allocinfo(sites: list[tuple[int, int, str | None, str | None, str]]) -> list[str]:
    """User-space call sites as allocinfo lines: (live bytes, live blocks,
    file:line or None, function or None, the frame's text), most bytes
    first. The location is file:line from the DWARF line tables, else
    function+offset with the module."""
    lines = []
    for live_bytes, live, place, function, text in sorted(sites, key=lambda s: (-s[0], -s[1])):
        if live <= 0:
            continue
        where = place or text
        lines.append(f"{live_bytes:12d} {live:8d} {where} func:{function or text.split('+', 1)[0]}")
    return lines
