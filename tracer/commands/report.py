"""``mtrace-live report``: a kmemtrace record set, analysed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click
from mtrace_live.tracer.commands.options import wrappers_option

if TYPE_CHECKING:
    from mtrace_live.exporters.kmemtrace.analysis import Report


@click.command()
@click.argument("source", type=click.Path(path_type=Path))
@click.option(
    "--format",
    "-f",
    "fmt",
    type=click.Choice(["table", "allocinfo", "json", "pprof", "folded"]),
    default="table",
    show_default=True,
    help="table: per call site, kmemtrace-report style; allocinfo: /proc/allocinfo lines; "
    "json: everything; pprof: the user-space allocations as a gzipped pprof profile on "
    "standard output; folded: the same as folded stacks (live bytes) for flame graphs.",
)
@click.option(
    "--sort",
    type=click.Choice(["bytes", "calls", "fragmentation", "live"]),
    default="bytes",
    show_default=True,
    help="Order of the call sites in the table.",
)
@click.option("--limit", type=int, default=30, show_default=True, help="Table rows; 0 for all.")
@click.option(
    "--kallsyms",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Symbols to use instead of the ones saved with the records.",
)
@wrappers_option
def report(
    source: Path, fmt: str, sort: str, limit: int, kallsyms: Path | None, wrappers: tuple[str, ...]
) -> None:
    """Analyse a kmemtrace record set (a directory, or one cpuN file).

    Per call site: allocations, frees, bytes requested and allocated,
    fragmentation, cross-CPU frees, mismatched and unknown frees. Call sites
    are named from the kallsyms saved at record time. Exits 14 when SOURCE is
    not a readable record set, 15 when a file is damaged (after reporting
    what was read).

        mtrace-live report ./kmem.rec --sort live --limit 10
    """
    from mtrace_live.exporters.data.kallsyms import KernelSymbols
    from mtrace_live.exporters.kmemtrace.analysis import report_lines, stream_report
    from mtrace_live.exporters.kmemtrace.reader import open_record_set
    from mtrace_live.probes.errors import DamagedRecordsError

    header = open_record_set(source)
    if kallsyms is not None:
        symbols = KernelSymbols.load(kallsyms)
    elif header.kallsyms:
        symbols = KernelSymbols(header.kallsyms)
    else:
        symbols = KernelSymbols.load()
    result = stream_report(header, symbols)
    if fmt == "json":
        click.echo(json.dumps(result.as_json(), indent=2))
    elif fmt in ("allocinfo", "pprof", "folded"):
        _user_output(fmt, result, source, wrappers)
    else:
        keys = {"bytes": "bytes_alloc", "calls": "allocs", "fragmentation": "fragmentation",
                "live": "outstanding_bytes"}  # fmt: skip
        click.echo("\n".join(report_lines(result, limit or None, keys[sort])))
    damage = result.source.damage
    if damage:
        for line in damage[:-1]:
            click.echo(f"mtrace-live: error: {line}", err=True)
        raise DamagedRecordsError(damage[-1])


def _user_output(fmt: str, result: Report, source: Path, wrappers: tuple[str, ...]) -> None:
    """The user-space allocations of ``report``'s result, in ``fmt``."""
    from mtrace_live.exporters.kmemtrace.analysis import user_snapshot

    snapshot, names = user_snapshot(result)
    if fmt == "allocinfo":
        from mtrace_live.exporters.allocinfo import render_allocinfo, user_allocinfo
        from mtrace_live.exporters.data.wrappers import Wrappers

        user = user_allocinfo(snapshot, names, Wrappers().adding(wrappers))
        click.echo("\n".join([*render_allocinfo(result.kernel), *user]))
    elif fmt == "folded":
        from mtrace_live.exporters.folded import folded_lines

        lines = folded_lines(snapshot, names)
        click.echo("\n".join(lines), nl=bool(lines))
    else:
        import sys

        from mtrace_live.exporters.pprof import build_profile

        comment = f"mtrace-live report {source}"
        sys.stdout.buffer.write(build_profile(snapshot, names, comments=[comment]))
        sys.stdout.buffer.flush()
