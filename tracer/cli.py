"""The ``mtrace-live`` command line: the group, its own action (the live
trace of ``--pid N`` or ``--all``), and the table of subcommands.

Each subcommand is a module of tracer/commands/, imported only when it is
run or listed in ``--help``; each imports the tracing machinery (and with it
bcc) only when it runs, so ``--help`` and ``--version`` work without root
and without bcc.
"""

from __future__ import annotations

import atexit
import importlib
import os
import signal
import sys
import threading
from typing import Any, NoReturn

if __name__ == "__main__":  # python -m: begun as tracer/entry.py does
    from mtrace_live.probes.elf import kept_code

    kept_code.install()
    from mtrace_live.tracer.bpf.preload import begin_from_command_line

    begin_from_command_line(sys.argv[1:])

# numpy's BLAS (OpenBLAS) starts a pool of threads that spin on the other
# CPUs; mtrace-live does no linear algebra (set before numpy is imported)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click
from mtrace_live.probes.errors import InternalError, MtraceError
from mtrace_live.tracer.commands import options

PROG = "mtrace-live"

# Subcommand -> the module under tracer/commands/ that holds it, in --help's order.
COMMANDS = ("run", "record", "serve", "report", "convert", "count", "probes", "doctor")


class LazyGroup(click.Group):
    """Subcommands imported from tracer/commands/ when first needed."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return None
        module = importlib.import_module(f"{__package__}.commands.{cmd_name}")
        command: click.Command = getattr(module, cmd_name)
        return command


@click.group(
    cls=LazyGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
    invoke_without_command=True,
)
@click.version_option(None, "-V", "--version", package_name="mtrace-live", prog_name=PROG)
@options.pid_option("Trace this running process.")
@click.option("--all", "all_processes", is_flag=True, help="Trace every process mapping the libc.")
@options.follow_forks_option(False, "With --pid: trace the processes it forks from now on too.")
@options.trace_options
@click.pass_context
def cli(ctx: click.Context, /, pid: int | None, all_processes: bool, **params: Any) -> None:
    """Live memory-allocation tracer for Linux.

    mtrace-live attaches through eBPF to glibc's allocator probes (SDT/USDT)
    and to the kernel's kmem tracepoints, and shows what they report.

    \b
      mtrace-live --pid 1234              trace a running process
      mtrace-live --all                   every process mapping the libc
      mtrace-live run -- CMD ARGS         start CMD traced from its first instruction
      mtrace-live run --sdt-glibc -- CMD  ... under the SDT glibc 'make sdt-glibc' built
    """
    if ctx.invoked_subcommand is not None:
        if pid is not None or all_processes:
            raise click.UsageError(
                f"--pid and --all go without a subcommand, not with {ctx.invoked_subcommand}"
            )
        return
    if pid is None and not all_processes:
        click.echo(ctx.get_help())
    from mtrace_live.tracer.commands.trace import trace

    trace("trace", pid=pid, all_processes=all_processes, **params)


def main() -> None:
    # A closed pipe (| head) ends the output quietly, as for other Unix tools.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        cli.main(prog_name=PROG, standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except MtraceError as exc:
        click.echo(f"{PROG}: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # a fault of mtrace-live's own: one line, never a traceback
        error = InternalError.during("running", exc)
        click.echo(f"{PROG}: error: {error}", err=True)
        sys.exit(error.exit_code)


def main_and_leave() -> NoReturn:
    """``main()``, then the process ends at once with its exit code.

    The interpreter's own ending frees every object one by one: 50 to 70 ms
    after a trace (measured: ``run -o summary -- true``), much of it
    copy-on-write faults on pages shared with the trace's forked children
    and the trace's own free() calls passing its uprobes. Nothing of it is
    needed: the trace has closed its files and children by then. What the
    interpreter would still do is done here (its threads waited for, its
    exit functions run, stdout and stderr flushed); where a thread is still
    running or a flush fails, the interpreter ends as usual."""
    try:
        main()
    except SystemExit as exc:
        code = exc.code
    else:
        code = 0
    if code is not None and not isinstance(code, int):
        sys.exit(code)  # (a message: printed by the interpreter)
    current = threading.current_thread()
    if any(thread is not current and not thread.daemon and thread.is_alive()
           for thread in threading.enumerate()):  # fmt: skip
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):  # (None: started with that descriptor closed)
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            sys.exit(code)
    os._exit((code or 0) & 0xFF)  # (the status the system keeps, as sys.exit gives it)


if __name__ == "__main__":
    main_and_leave()
