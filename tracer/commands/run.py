"""``mtrace-live run -- COMMAND``."""

from __future__ import annotations

from typing import Any

import click
from mtrace_live.tracer.commands import options
from mtrace_live.tracer.commands.trace import trace


@click.command(context_settings={"allow_interspersed_args": False})
@options.sdt_glibc_option("Run COMMAND under the SDT-enabled glibc built by 'make sdt-glibc'.")
@options.follow_forks_option(True, "Trace the processes the command forks too.")
@options.trace_options
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(**params: Any) -> None:
    """Start COMMAND with the probes attached before its first instruction.

    The trace ends when the command exits; mtrace-live then exits with the
    command's exit code.

        mtrace-live run --sdt-glibc -- ./my-program arg
    """
    trace("run", **params)
