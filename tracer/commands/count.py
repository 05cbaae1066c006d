"""``mtrace-live count``: exact hit counts, kept in the kernel."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
from mtrace_live.tracer.commands import options


@click.command(context_settings={"allow_interspersed_args": False})
@options.pid_option("Count hits of this running process.")
@options.lib_option("Attach to this libc instead of the one the target maps.")
@options.sdt_glibc_option("Run COMMAND under the SDT-enabled glibc built by 'make sdt-glibc'.")
@options.derived_options
@options.probes_option("Glob of libc probe names to count; repeatable.", default=("*",))
@click.option("--kmem", is_flag=True, help="Also count the kmem tracepoints for the target.")
@click.option(
    "--kmem-only", is_flag=True, help="Count only the kmem tracepoints (any libc will do)."
)
@options.follow_forks_option(True, "Count the target's child processes too.")
@options.duration_option("With --pid: stop after this many seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print the counts as JSON.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def count(
    pid: int | None,
    lib: Path | None,
    sdt_glibc: bool,
    derived: bool,
    debug_file: Path | None,
    patterns: tuple[str, ...],
    kmem: bool,
    kmem_only: bool,
    follow_forks: bool,
    duration: float | None,
    as_json: bool,
    command: tuple[str, ...],
) -> None:
    """Count libc probe hits, exactly, in the kernel.

    Either trace a running process (--pid N) or start COMMAND with the probes
    attached before its first instruction:

        mtrace-live count --sdt-glibc -- ./my-program arg

    Counts are printed when the target exits (or on Ctrl-C). With COMMAND,
    mtrace-live exits with the command's exit code.
    """
    options.check("count", {"pid": pid, "command": command, "sdt_glibc": sdt_glibc})
    from mtrace_live.tracer.loop.hit_counts import CountRequest, run_count

    request = CountRequest(
        pid=pid,
        command=list(command),
        lib=lib,
        sdt_glibc=sdt_glibc,
        patterns=list(patterns),
        kmem=kmem or kmem_only,
        usdt=not kmem_only,
        follow_forks=follow_forks,
        duration=duration,
        derived=derived,
        debug_file=debug_file,
    )
    report = run_count(request)
    if as_json:
        click.echo(json.dumps(report.as_json(), indent=2, sort_keys=True))
    else:
        _print_table(report.as_json())
    if report.exit_code is not None:
        sys.exit(report.exit_code)


def _print_table(report: dict[str, Any]) -> None:
    click.echo(f"pid {report['pid']}" + (f"  libc {report['libc']}" if report["libc"] else ""))
    sections = (("libc probe", "usdt"), ("kmem tracepoint", "kmem"), ("cache", "kmem_cache_allocs"))
    for title, key in sections:
        rows = sorted(
            ((name, hits) for name, hits in report[key].items() if hits),
            key=lambda kv: (-kv[1], kv[0]),
        )
        silent = len(report[key]) - len(rows)
        if not report[key]:
            continue
        width = max(len(title), *(len(name) for name in report[key]))
        click.echo(f"\n{title:<{width}}  {'hits':>10}")
        for name, hits in rows:
            click.echo(f"{name:<{width}}  {hits:>10}")
        if silent:
            click.echo(f"({silent} more attached, not hit; --json lists them all)")
