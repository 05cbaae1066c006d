"""``mtrace-live doctor``: is everything a trace needs here?"""

from __future__ import annotations

import sys
from pathlib import Path

import click
from mtrace_live.tracer.commands.probes import target_options, targets


@click.command()
@target_options
def doctor(pid: int | None, lib: Path | None) -> None:
    """Check that everything a trace of the target needs is here.

    One line per check, in order: privileges, kernel support, tracefs, kernel
    headers, bcc, the target libc's allocation functions and where each probe
    sits, its SDT notes, its debug info, the kmem tracepoints. Exits 0 when
    all pass ("--" marks a source that is unavailable but not needed: SDT
    notes, debug info); 3 when something is not permitted; 8 when something
    is not supported here.

        mtrace-live doctor --pid 1234
    """
    from mtrace_live.probes.catalog import load_catalog
    from mtrace_live.tracer.loop.checks import exit_code, run_checks

    checks = []
    for check in run_checks(targets("doctor", pid, lib, with_ld_so=False)[0], load_catalog()):
        click.echo(str(check))
        checks.append(check)
    sys.exit(exit_code(checks))
