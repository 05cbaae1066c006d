"""The ``mtrace-live`` command line.

Subcommands import the tracing machinery (and with it bcc) only when they run,
so ``--help`` and ``--version`` work without root and without bcc.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import click

from . import package_version
from .errors import MtraceError

PROG = "mtrace-live"


_web_config_option = click.option(
    "--web.config.file",
    "web_config",
    type=click.Path(dir_okay=False, path_type=Path),
    help="TLS and basic auth for the metrics endpoint, in the Prometheus exporters' "
    "web config format (docs/prometheus.md).",
)


def _trace_options(command: Any) -> Any:
    """Options shared by the live trace (--pid/--all) and ``run``."""
    options = [
        click.option(
            "--lib",
            type=click.Path(dir_okay=False, path_type=Path),
            help="Attach to this libc (e.g. the SDT build) instead of the target's.",
        ),
        click.option(
            "--probes",
            "patterns",
            multiple=True,
            help="Glob of libc probe names; repeatable. Default: memory_* and "
            "lll_lock_wait_private (see docs/performance.md).",
        ),
        click.option(
            "--output",
            "-o",
            type=click.Choice(["live", "text", "json", "summary"]),
            help="live: a top-like view (the default on a terminal); text: a line per "
            "event (the default otherwise); json: JSON lines of events; summary: "
            "only the summary at the end.",
        ),
        click.option(
            "--buffer-pages",
            type=int,
            default=2048,
            show_default=True,
            help="Ring buffer size in pages (a power of two).",
        ),
        click.option("--duration", type=float, help="Stop after this many seconds."),
        click.option(
            "--interval",
            type=float,
            default=1.0,
            show_default=True,
            help="Live view refresh, seconds.",
        ),
        click.option(
            "--kmem",
            is_flag=True,
            help="Also trace the kernel's kmem tracepoints, aggregated per call site.",
        ),
        click.option(
            "--kmem-only",
            is_flag=True,
            help="Trace only the kmem tracepoints (any libc will do).",
        ),
        click.option(
            "--kmemtrace",
            type=click.Path(file_okay=False, path_type=Path),
            help="Write kmemtrace records (kernel and libc events) to this new directory.",
        ),
        click.option(
            "--stack-depth",
            type=click.IntRange(0, 127),
            default=0,
            show_default=True,
            help="Record this many frames of each event's stack (user; kernel too for kmem) "
            "for --sp-rtrace backtraces; 0 for none.",
        ),
        click.option(
            "--stack-map-size",
            type=click.IntRange(1),
            default=16384,
            show_default=True,
            help="Distinct stacks the kernel keeps for --stack-depth; stacks beyond are counted.",
        ),
        click.option(
            "--sp-rtrace",
            type=click.Path(dir_okay=False, path_type=Path),
            help="Write the allocation events to this file as an sp-rtrace text report.",
        ),
        click.option(
            "--prometheus",
            metavar="ADDR",
            help="Also serve Prometheus metrics at ADDR (host:port) while tracing.",
        ),
        _web_config_option,
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _trace(
    *,
    pid: int | None = None,
    all_processes: bool = False,
    command: tuple[str, ...] = (),
    sdt_glibc: bool = False,
    follow_forks: bool,
    lib: Path | None,
    patterns: tuple[str, ...],
    output: str | None,
    buffer_pages: int,
    duration: float | None,
    interval: float,
    kmem: bool = False,
    kmem_only: bool = False,
    kmemtrace: Path | None = None,
    prometheus: str | None = None,
    web_config: Path | None = None,
    sp_rtrace: Path | None = None,
    stack_depth: int = 0,
    stack_map_size: int = 16384,
) -> None:
    from .live import TraceRequest, run_trace
    from .usdt import DEFAULT_PATTERNS

    if buffer_pages < 1 or buffer_pages & (buffer_pages - 1):
        raise click.BadParameter("must be a power of two", param_hint="--buffer-pages")
    if interval <= 0:
        raise click.BadParameter("must be positive", param_hint="--interval")
    if output is None:
        output = "live" if sys.stdout.isatty() else "text"
    request = TraceRequest(
        pid=pid,
        all_processes=all_processes,
        command=command,
        lib=lib,
        sdt_glibc=sdt_glibc,
        patterns=patterns or DEFAULT_PATTERNS,
        output=output,
        follow_forks=follow_forks,
        buffer_pages=buffer_pages,
        duration=duration,
        interval=interval,
        kmem=kmem or kmem_only,
        libc_probes=not kmem_only,
        kmemtrace=kmemtrace,
        sp_rtrace=sp_rtrace,
        stack_depth=stack_depth,
        stack_entries=stack_map_size,
    )
    if web_config is not None and prometheus is None:
        raise click.UsageError("--web.config.file goes with --prometheus ADDR")
    if prometheus is not None:
        from .serve import ExportOptions, serve_trace

        result = serve_trace(request, ExportOptions(prometheus, web_config))
    else:
        result = run_trace(request)
    if result.exit_code is not None:
        sys.exit(result.exit_code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, invoke_without_command=True)
@click.version_option(package_version(), "-V", "--version", prog_name=PROG)
@click.option("--pid", "-p", type=int, help="Trace this running process.")
@click.option("--all", "all_processes", is_flag=True, help="Trace every process mapping the libc.")
@click.option(
    "--follow-forks/--no-follow-forks",
    default=False,
    show_default=True,
    help="With --pid: trace the processes it forks from now on too.",
)
@_trace_options
@click.pass_context
def cli(ctx: click.Context, /, pid: int | None, all_processes: bool, **options: Any) -> None:
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
        raise click.UsageError("give --pid N or --all, or a subcommand such as run")
    if pid is not None and all_processes:
        raise click.UsageError("give --pid or --all, not both")
    _trace(pid=pid, all_processes=all_processes, **options)


@cli.command(context_settings={"allow_interspersed_args": False})
@click.option(
    "--sdt-glibc",
    is_flag=True,
    help="Run COMMAND under the SDT-enabled glibc built by 'make sdt-glibc'.",
)
@click.option(
    "--follow-forks/--no-follow-forks",
    default=True,
    show_default=True,
    help="Trace the processes the command forks too.",
)
@_trace_options
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(command: tuple[str, ...], sdt_glibc: bool, **options: Any) -> None:
    """Start COMMAND with the probes attached before its first instruction.

    The trace ends when the command exits; mtrace-live then exits with the
    command's exit code.

        mtrace-live run --sdt-glibc -- ./my-program arg
    """
    if sdt_glibc and options.get("lib"):
        raise click.UsageError("give --sdt-glibc or --lib, not both")
    _trace(command=command, sdt_glibc=sdt_glibc, **options)


@cli.command(context_settings={"allow_interspersed_args": False})
@click.option("--pid", "-p", type=int, help="Record this running process.")
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
@click.option(
    "--lib", type=click.Path(dir_okay=False, path_type=Path), help="With --libc: this libc."
)
@click.option("--sdt-glibc", is_flag=True, help="Run COMMAND under the SDT glibc (implies --libc).")
@click.option("--probes", "patterns", multiple=True, help="With --libc: glob of probe names.")
@click.option(
    "--follow-forks/--no-follow-forks",
    default=None,
    help="Record the processes the target forks too (default: yes for COMMAND, no for --pid).",
)
@click.option("--buffer-pages", type=int, default=2048, show_default=True,
              help="Ring buffer size in pages (a power of two).")  # fmt: skip
@click.option("--duration", type=float, help="Stop after this many seconds.")
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
    buffer_pages: int,
    duration: float | None,
    command: tuple[str, ...],
) -> None:
    """Record kernel allocations (and libc events) as kmemtrace records.

    Writes a directory laid out as kmemtrace's was: cpuN files, abi_version,
    total_overruns, plus kallsyms so that 'mtrace-live report' works on any
    machine. Give --pid N, --all or a COMMAND; stop with Ctrl-C or --duration.

        mtrace-live record -o out.d --all --duration 10
        mtrace-live record -o out.d --libc --sdt-glibc -- ./my-program
    """
    if sum((pid is not None, all_processes, bool(command))) != 1:
        raise click.UsageError("give exactly one of --pid N, --all or a COMMAND")
    if sdt_glibc and not command:
        raise click.UsageError("--sdt-glibc starts a COMMAND")
    _trace(
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
        kmemtrace=directory,
    )


@cli.command(context_settings={"allow_interspersed_args": False})
@click.option("--pid", "-p", type=int, help="Serve the metrics of this process only.")
@click.option("--comm", help="... of the processes with this kernel name (comm) only.")
@click.option("--cgroup", help="... of the tasks in this cgroup v2 (and below) only.")
@click.option(
    "--lib",
    type=click.Path(dir_okay=False, path_type=Path),
    help="The libc to attach to (default: the pid's, else the system's).",
)
@click.option("--sdt-glibc", is_flag=True, help="Attach to the SDT glibc 'make sdt-glibc' built.")
@click.option("--probes", "patterns", multiple=True, help="Glob of libc probe names; repeatable.")
@click.option("--no-libc", is_flag=True, help="Kernel kmem tracepoints only.")
@click.option("--no-kmem", is_flag=True, help="libc probes only.")
@click.option(
    "--web.listen-address",
    "--listen",
    "address",
    default="127.0.0.1:9477",
    show_default=True,
    help="Address to serve /metrics on; ':9477' means every address.",
)
@_web_config_option
@click.option("--max-processes", type=click.IntRange(1), default=50, show_default=True,
              help="Process names with a label of their own; the rest are 'other'.")  # fmt: skip
@click.option("--top-functions", type=click.IntRange(1), default=20, show_default=True,
              help="Kernel functions with a label of their own; the rest are 'other'.")  # fmt: skip
@click.option("--user", default="nobody", show_default=True,
              help="When started as root, run as this user once attached.")  # fmt: skip
@click.option("--keep-privileges", is_flag=True, help="Stay root after attaching.")
@click.option("--bpf-stats", is_flag=True,
              help="Count the BPF programs' run time (costs ~20 ns per probe hit).")  # fmt: skip
@click.option("--read-interval", type=click.FloatRange(0), default=0.5, show_default=True,
              help="Read the BPF maps at most this often (seconds); scrapes in between "
              "get the last reading.")  # fmt: skip
@click.option("--buffer-pages", type=int, default=2048, show_default=True,
              help="Ring buffer size in pages (a power of two).")  # fmt: skip
def serve(
    pid: int | None,
    comm: str | None,
    cgroup: str | None,
    lib: Path | None,
    sdt_glibc: bool,
    patterns: tuple[str, ...],
    no_libc: bool,
    no_kmem: bool,
    address: str,
    web_config: Path | None,
    max_processes: int,
    top_functions: int,
    user: str,
    keep_privileges: bool,
    bpf_stats: bool,
    read_interval: float,
    buffer_pages: int,
) -> None:
    """Serve Prometheus metrics of libc allocator probes and kernel kmem
    tracepoints until stopped (SIGTERM or Ctrl-C).

    System-wide by default; --pid, --comm or --cgroup narrow it. Binds
    127.0.0.1 unless told otherwise; --web.config.file adds TLS and basic
    auth. When started as root it runs as --user once attached.

    \b
      mtrace-live serve --sdt-glibc
      mtrace-live serve --no-libc --web.listen-address :9477
      mtrace-live serve --comm nginx --lib /opt/glibc-sdt/lib/libc.so.6
    """
    from .live import TraceRequest
    from .sdt_glibc import locate
    from .serve import ExportOptions, ServeSink, serve_trace
    from .usdt import DEFAULT_PATTERNS

    if sum(x is not None for x in (pid, comm, cgroup)) > 1:
        raise click.UsageError("give at most one of --pid, --comm and --cgroup")
    if no_libc and no_kmem:
        raise click.UsageError("--no-libc and --no-kmem leave nothing to serve")
    if sdt_glibc and lib is not None:
        raise click.UsageError("give --sdt-glibc or --lib, not both")
    if buffer_pages < 1 or buffer_pages & (buffer_pages - 1):
        raise click.BadParameter("must be a power of two", param_hint="--buffer-pages")
    request = TraceRequest(
        pid=pid,
        all_processes=pid is None and comm is None and cgroup is None,
        lib=locate().libc if sdt_glibc and not no_libc else lib,
        patterns=patterns or DEFAULT_PATTERNS,
        output="summary",
        follow_forks=True,
        buffer_pages=buffer_pages,
        kmem=not no_kmem,
        libc_probes=not no_libc,
        comm=comm,
        cgroup=cgroup,
        end_with_target=False,
    )
    options = ExportOptions(
        address=address,
        web_config=web_config,
        max_processes=max_processes,
        top_functions=top_functions,
        run_as=None if keep_privileges else user,
        bpf_stats=bpf_stats,
        read_interval=read_interval,
    )
    serve_trace(request, options, ServeSink())


@cli.command()
@click.argument("source", type=click.Path(path_type=Path))
@click.option(
    "--format",
    "-f",
    "fmt",
    type=click.Choice(["table", "allocinfo", "json"]),
    default="table",
    show_default=True,
    help="table: per call site, kmemtrace-report style; allocinfo: /proc/allocinfo lines; "
    "json: everything.",
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
def report(source: Path, fmt: str, sort: str, limit: int, kallsyms: Path | None) -> None:
    """Analyse a kmemtrace record set (a directory, or one cpuN file).

    Per call site: allocations, frees, bytes requested and allocated,
    fragmentation, cross-CPU frees, mismatched and unknown frees. Call sites
    are named from the kallsyms saved at record time. Exits 14 when SOURCE is
    not a readable record set, 15 when a file is damaged (after reporting
    what was read).
    """
    from mtrace_live.exporters.allocinfo import render_allocinfo
    from mtrace_live.exporters.kmemtrace import read_record_set

    from .errors import DamagedRecordsError
    from .kallsyms import KernelSymbols
    from .report import analyse, render_text

    records = read_record_set(source)
    if kallsyms is not None:
        symbols = KernelSymbols.load(kallsyms)
    elif records.kallsyms:
        symbols = KernelSymbols(records.kallsyms)
    else:
        symbols = KernelSymbols.load()
    result = analyse(records, symbols)
    if fmt == "json":
        click.echo(json.dumps(result.as_json(), indent=2))
    elif fmt == "allocinfo":
        click.echo("\n".join(render_allocinfo(result.kernel)))
    else:
        keys = {"bytes": "bytes_alloc", "calls": "allocs", "fragmentation": "fragmentation",
                "live": "outstanding_bytes"}  # fmt: skip
        click.echo("\n".join(render_text(result, limit or None, keys[sort])))
    if records.damage:
        for line in records.damage[:-1]:
            click.echo(f"{PROG}: error: {line}", err=True)
        raise DamagedRecordsError(records.damage[-1])


@cli.command()
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--to", "target", type=click.Choice(["sp-rtrace", "json", "kmemtrace"]),
              default="sp-rtrace", show_default=True,
              help="sp-rtrace: the sp-rtrace text protocol; json: JSON lines of a record set; "
              "kmemtrace: a record set again, from JSON lines (needs -o DIR).")  # fmt: skip
@click.option("--output", "-o", type=click.Path(path_type=Path),
              help="Write here instead of standard output "
              "(a new directory for kmemtrace).")  # fmt: skip
@click.option("--leaks", is_flag=True, help="Drop allocations that were freed, and the frees.")
@click.option("--compress", is_flag=True, help="Group the calls by backtrace.")
@click.option("--resolve", is_flag=True, help="Name unnamed kernel frames from kallsyms.")
@click.option("--kallsyms", type=click.Path(dir_okay=False, path_type=Path),
              help="Symbols to use instead of the ones saved with the records.")  # fmt: skip
def convert(**options: Any) -> None:
    """Convert a kmemtrace record set, or an sp-rtrace report, to an
    sp-rtrace text report; a record set to JSON lines, and JSON lines back
    into a record set.

    An sp-rtrace report can be read back and post-processed again: --leaks,
    --compress and --resolve are applied in that order and recorded in the
    header's filter key, and temporary ('# ') comments are dropped.

    \b
      mtrace-live convert out.d --to sp-rtrace --leaks -o leaks.txt
      mtrace-live convert leaks.txt --compress
      mtrace-live convert out.d --to json > out.jsonl
      mtrace-live convert out.jsonl --to kmemtrace -o again.d
    """
    from .convert import run_convert

    run_convert(version=package_version(), **options)


@cli.command(context_settings={"allow_interspersed_args": False})
@click.option("--pid", "-p", type=int, help="Count hits of this running process.")
@click.option(
    "--lib",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Attach to this libc instead of the one the target maps.",
)
@click.option(
    "--sdt-glibc",
    is_flag=True,
    help="Run COMMAND under the SDT-enabled glibc built by 'make sdt-glibc'.",
)
@click.option(
    "--probes",
    "patterns",
    multiple=True,
    default=("*",),
    show_default=True,
    help="Glob of libc probe names to count; repeatable.",
)
@click.option("--kmem", is_flag=True, help="Also count the kmem tracepoints for the target.")
@click.option(
    "--kmem-only", is_flag=True, help="Count only the kmem tracepoints (any libc will do)."
)
@click.option(
    "--follow-forks/--no-follow-forks",
    default=True,
    show_default=True,
    help="Count the target's child processes too.",
)
@click.option("--duration", type=float, help="With --pid: stop after this many seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print the counts as JSON.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def count(
    pid: int | None,
    lib: Path | None,
    sdt_glibc: bool,
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
    from .count_command import CountRequest, run_count

    if (pid is None) == (not command):
        raise click.UsageError("give either --pid N or a COMMAND to run, not both or neither")
    if sdt_glibc and pid is not None:
        raise click.UsageError("--sdt-glibc starts a COMMAND; it cannot apply to --pid")
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
    )
    report = run_count(request)
    if as_json:
        click.echo(json.dumps(report.as_json(), indent=2, sort_keys=True))
    else:
        _print_table(report.as_json())
    if report.exit_code is not None:
        sys.exit(report.exit_code)


def _target_options(command: Any) -> Any:
    command = click.option(
        "--lib",
        type=click.Path(dir_okay=False, path_type=Path),
        help="Look at this file (a libc, ld.so or any ELF file).",
    )(command)
    return click.option("--pid", "-p", type=int, help="Look at what this process maps.")(command)


def _targets(pid: int | None, lib: Path | None, with_ld_so: bool) -> list[Path]:
    from . import target

    if pid is not None and lib is not None:
        raise click.UsageError("give --pid or --lib, not both")
    if lib is not None:
        return [target.library_file(lib)]
    if pid is not None:
        mapped = target.mapped_glibc(pid)
        return [mapped.libc, *([mapped.ld_so] if with_ld_so and mapped.ld_so else [])]
    return [target.default_libc()]


@cli.command()
@_target_options
@click.option("--json", "as_json", is_flag=True, help="Print the listing as JSON.")
def probes(pid: int | None, lib: Path | None, as_json: bool) -> None:
    """List the SDT probes of a libc (and ld.so), decoded by the catalog.

    Each probe is shown with its sites and its arguments as
    name:type@location, and whether the catalog knows it. With --pid, the
    libc and ld.so the process really maps are listed; with neither option,
    the system's default libc.
    """
    from mtrace_live.probes.catalog import load_catalog

    from .errors import NoProbesError
    from .probe_listing import list_file, render_json, render_text

    catalog = load_catalog()
    libc, *others = _targets(pid, lib, with_ld_so=True)
    listings = [list_file(libc, catalog)]  # a libc without probes is the error
    bare = []  # ld.so without probes is only worth a line
    for path in others:
        try:
            listings.append(list_file(path, catalog))
        except NoProbesError:
            bare.append(path)
    if as_json:
        documents = [render_json(item) for item in listings]
        documents += [{"path": str(path), "probes": [], "catalog": None} for path in bare]
        click.echo(json.dumps(documents, indent=2))
        return
    for index, item in enumerate(listings):
        if index:
            click.echo()
        for line in render_text(item):
            click.echo(line)
    for path in bare:
        click.echo(f"\n{path}: no SDT probes")


@cli.command()
@_target_options
def doctor(pid: int | None, lib: Path | None) -> None:
    """Check that everything a trace of the target needs is here.

    One line per check, in order: privileges, kernel support, tracefs, kernel
    headers, bcc, the target libc's SDT notes, the kmem tracepoints. Exits 0
    only when all pass; 3 when something is not permitted; 8 when something
    is not supported here.
    """
    from mtrace_live.probes.catalog import load_catalog

    from .doctor import exit_code, run_checks

    checks = []
    for check in run_checks(_targets(pid, lib, with_ld_so=False)[0], load_catalog()):
        click.echo(str(check))
        checks.append(check)
    sys.exit(exit_code(checks))


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


if __name__ == "__main__":
    main()
