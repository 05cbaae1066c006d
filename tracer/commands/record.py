"""``mtrace-live record``: kmemtrace records of a live trace."""

from __future__ import annotations

from pathlib import Path

import click
from mtrace_live.tracer.commands import options
from mtrace_live.tracer.commands.trace import start_trace


@click.command(context_settings={"allow_interspersed_args": False})
@options.pid_option("Record this running process.")
@click.option("--all", "all_processes", is_flag=True, help="Record system-wide.")
@click.option(
    "--output",
    "-o",
    "directory",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("kmemtrace.d"),
    show_default=True,
    help="The record set directory to create.",
)
@click.option("--libc", "with_libc", is_flag=True, help="Record the libc probes' events too.")
@options.lib_option("With --libc: this libc.")
@options.sdt_glibc_option("Run COMMAND under the SDT glibc (implies --libc).")
@options.probes_option("With --libc: glob of probe names.")
@options.follow_forks_option(
    None, "Record the processes the target forks too (default: yes for COMMAND, no for --pid)."
)
@options.buffer_pages_option
@options.duration_option()
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def record(
    pid: int | None,
    all_processes: bool,
    directory: Path,
    with_libc: bool,
    lib: Path | None,
    sdt_glibc: bool,
    patterns: tuple[str, ...],
    follow_forks: bool | None,
    buffer_pages: int | None,
    duration: float | None,
    command: tuple[str, ...],
) -> None:
    """Record kernel allocations (and libc events) as kmemtrace records.

    Writes a directory laid out as kmemtrace's was: cpuN files, abi_version,
    total_overruns, plus kallsyms so that 'mtrace-live report' works on any
    machine. Give --pid N, --all or a COMMAND; stop with Ctrl-C or --duration.

    \b
        mtrace-live record -o out.d --all --duration 10
        mtrace-live record -o out.d --libc --sdt-glibc -- ./my-program
    """
    options.check(
        "record",
        {"pid": pid, "all_processes": all_processes, "command": command, "sdt_glibc": sdt_glibc},
    )
    start_trace(
        pid=pid,
        all_processes=all_processes,
        command=command,
        sdt_glibc=sdt_glibc,
        follow_forks=bool(command) if follow_forks is None else follow_forks,
        lib=lib,
        patterns=patterns,
        output="summary",
        buffer_pages=buffer_pages,
        duration=duration,
        interval=1.0,
        kmem=True,
        kmem_only=not (with_libc or sdt_glibc),
        files=(("kmemtrace", directory),),
    )
