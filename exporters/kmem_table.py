"""Kernel allocations per call site as a text table, kmemtrace-report style."""

from __future__ import annotations

from mtrace_live.exporters.data.kmem import CallSite, KmemTotals, sorted_sites

COLUMNS = (
    ("allocs", "allocs"),
    ("frees", "frees"),
    ("bytes_req", "requested"),
    ("bytes_alloc", "allocated"),
    ("outstanding_bytes", "live bytes"),
    ("cross_cpu_frees", "x-cpu frees"),
    ("mismatched_frees", "mismatched"),
    ("unknown_frees", "unknown frees"),
)


def _row(site: CallSite) -> list[str]:
    cells = [str(getattr(site, name)) for name, _ in COLUMNS]
    return [site.symbol or f"{site.address:#x}", site.type_name, *cells,
            f"{100 * site.fragmentation:.1f}%"]  # fmt: skip


def render_table(
    totals: KmemTotals, limit: int | None = None, sort: str = "bytes_alloc"
) -> list[str]:
    sites = sorted_sites(totals.sites, sort)
    shown = sites[:limit] if limit else sites
    header = ["call site", "type", *(title for _, title in COLUMNS), "frag"]
    rows = [_row(site) for site in shown]
    total_row = ["total", "", *(str(totals.total(name)) if name != "outstanding_bytes" else
                                str(totals.total("bytes_alloc") - totals.total("bytes_freed"))
                                for name, _ in COLUMNS),
                 f"{100 * totals.fragmentation:.1f}%"]  # fmt: skip
    widths = [max(len(r[i]) for r in (header, *rows, total_row)) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = f"{cells[0]:<{widths[0]}}  {cells[1]:<{widths[1]}}"
        rest = "  ".join(f"{c:>{w}}" for c, w in zip(cells[2:], widths[2:], strict=True))
        return f"{first}  {rest}".rstrip()

    lines = [line(header), *(line(r) for r in rows)]
    if len(shown) < len(sites):
        lines.append(f"({len(sites) - len(shown)} more call sites)")
    lines.append(line(total_row))
    return lines


def render_orders(totals: KmemTotals) -> list[str]:
    if not totals.page_orders:
        return []
    lines = ["page order  allocs  frees"]
    lines += [
        f"{order:>10}  {a:>6}  {f:>5}" for order, (a, f) in sorted(totals.page_orders.items())
    ]
    return lines
