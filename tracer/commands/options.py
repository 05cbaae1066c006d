"""The options the commands share, declared once, and the one table of
which combinations of options are refused.

A command module takes its options from here (``lib_option(...)``,
``trace_options``, ...) and calls ``check(command, params)`` first thing;
the outputs' options come from exporters/registry.py, so a new output
appears on every trace command without touching them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from mtrace_live.exporters import registry
from mtrace_live.probes.program import part_constants

Decorator = Callable[[Any], Any]


class PowerOfTwo(click.ParamType[int]):
    name = "integer"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        number = click.INT.convert(value, param, ctx)
        if number < 1 or number & (number - 1):
            self.fail("must be a power of two", param, ctx)
        return number


class PositiveInt(click.ParamType[int]):
    name = "integer"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        number = click.INT.convert(value, param, ctx)
        if number < 1:
            self.fail(f"must be a positive number of bytes, not {number}", param, ctx)
        return number


class Positive(click.ParamType[float]):
    name = "float"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        number = click.FLOAT.convert(value, param, ctx)
        if not number > 0:
            self.fail("must be positive", param, ctx)
        return number


def pid_option(help: str) -> Decorator:
    return click.option("--pid", "-p", type=int, help=help)


def lib_option(help: str) -> Decorator:
    return click.option("--lib", type=click.Path(dir_okay=False, path_type=Path), help=help)


def sdt_glibc_option(help: str) -> Decorator:
    return click.option("--sdt-glibc", is_flag=True, help=help)


def derived_options(command: Any) -> Any:
    """Where the memory_* probes come from when the libc has SDT notes too."""
    options = [
        click.option(
            "--derived",
            is_flag=True,
            help="Derive the memory_* probes from system calls, exported symbols and debug "
            "info even when the libc has SDT notes (they are whenever it has none; "
            "docs/derived-probes.md).",
        ),
        click.option(
            "--debug-file",
            type=click.Path(dir_okay=False, path_type=Path),
            help="The libc's debug file, for the derived probes (default: found by build-id, "
            "as Debian's libc6-dbg installs it); refused if its build-id differs. 'none': "
            "derive without one.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def probes_option(help: str, default: tuple[str, ...] = ()) -> Decorator:
    return click.option(
        "--probes", "patterns", multiple=True, default=default, show_default=bool(default),
        help=help,
    )  # fmt: skip


def follow_forks_option(default: bool | None, help: str) -> Decorator:
    return click.option(
        "--follow-forks/--no-follow-forks", default=default, show_default=default is not None,
        help=help,
    )  # fmt: skip


def duration_option(help: str = "Stop after this many seconds.") -> Decorator:
    return click.option("--duration", type=float, help=help)


buffer_pages_option = click.option(
    "--buffer-pages",
    type=PowerOfTwo(),
    default=None,
    help="Room for events not yet read, in pages (a power of two); default 2048 (8 MiB), "
    "and 32768 (128 MiB, 1.4 million events) when kmem records go through it (record, "
    "--kmemtrace, --sp-rtrace), whose bursts outrun any reader. Above 512 pages, the "
    "kernel's ring is 512 pages and a copier thread empties it into a buffer of this size "
    "in user memory, unless kmem records go through it: then the kernel's ring is this size.",
)

wrappers_option = click.option(
    "--wrappers",
    multiple=True,
    metavar="PATTERNS",
    help="More allocation wrappers for allocinfo lines, which name the first frame outside "
    "them: function names or globs (demangled, e.g. 'my_xmalloc' or 'Arena::alloc*'), "
    "comma-separated; repeatable. The known ones are in docs/allocations.md.",
)

web_config_option = click.option(
    "--web.config.file",
    "web_config",
    type=click.Path(dir_okay=False, path_type=Path),
    help="TLS and basic auth for the metrics endpoint, in the Prometheus exporters' "
    "web config format (docs/prometheus.md).",
)


def output_options(command: Any) -> Any:
    """``--output`` with every stream of the registry, and one option per
    file output."""
    streams = registry.STREAMS
    options = [
        click.option(
            "--output",
            "-o",
            type=click.Choice([stream.name for stream in streams]),
            help="; ".join(f"{stream.name}: {stream.help}" for stream in streams) + ".",
        )
    ]
    for entry in registry.FILE_OUTPUTS:
        kind = click.Path(file_okay=not entry.directory, dir_okay=entry.directory, path_type=Path)
        options.append(
            click.option(
                f"--{entry.name}",
                file_output_param(entry.name),
                type=kind,
                metavar=entry.metavar,
                help=entry.help,
            )
        )
    for option in reversed(options):
        command = option(command)
    return command


def file_output_param(name: str) -> str:
    return "file_" + name.replace("-", "_")


def file_outputs(params: dict[str, Any]) -> tuple[tuple[str, Path], ...]:
    """The file outputs given (taken out of ``params``), as TraceRequest.files wants them."""
    chosen = []
    for entry in registry.FILE_OUTPUTS:
        value = params.pop(file_output_param(entry.name), None)
        if value is not None:
            chosen.append((entry.name, value))
    return tuple(chosen)


UNWIND_ROWS = part_constants("unwind.bpf.c")["UNWIND_ROWS"]  # the unwinder's rows, by default


def alloc_options(command: Any) -> Any:
    """How the allocation functions are traced."""
    options = [
        click.option(
            "--sample-bytes",
            type=PositiveInt(),
            default=None,
            help="Keep one allocation per N bytes allocated, on average (byte-based "
            "sampling, unbiased estimates); by default every allocation is kept "
            "(docs/allocations.md).",
        ),
        click.option(
            "--max-outstanding",
            type=click.IntRange(1),
            default=262144,
            show_default=True,
            help="Allocations tracked until freed; those beyond are counted, not matched.",
        ),
        click.option(
            "--alloc-stacks",
            type=click.IntRange(1),
            default=None,
            help="(process, call stack) rows the kernel aggregates; calls beyond are counted "
            "[default: 16384; 32768 when a target runs CPython, whose Python frames make "
            "many more stacks].",
        ),
        click.option(
            "--no-allocs",
            is_flag=True,
            help="Do not trace the allocation functions (malloc, free, ...).",
        ),
        click.option(
            "--unwind-rows",
            type=click.IntRange(1 << 16, 1 << 26),
            default=UNWIND_ROWS,
            show_default=True,
            help="Rows of the unwinder's tables, for all the mapped files together (16 "
            "bytes of kernel memory each, with the page index); a file with no room is "
            "walked by frame pointers, counted (docs/allocations.md).",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def alloc_settings(
    no_allocs: bool, sample_bytes: int | None, max_outstanding: int, alloc_stacks: int | None
) -> dict[str, Any]:
    """The TraceRequest fields of ``alloc_options``."""
    return {"allocs": not no_allocs, "sample_bytes": sample_bytes or 0,
            "max_outstanding": max_outstanding, "alloc_stacks": alloc_stacks}  # fmt: skip


# The options of the live trace (--pid/--all) and run, in the order --help lists them.
# CPython's: every tracing command's, serve's too
PYTHON_OPTIONS = [
    click.option(
        "--pymalloc",
        is_flag=True,
        help="Also trace CPython's own allocator (PyObject_Malloc, PyObject_Calloc, "
        "PyObject_Realloc, PyObject_Free and the PyMem_ ones) as allocator pymalloc: the "
        "objects of 512 bytes or less, which never reach malloc (docs/python.md).",
    ),
    click.option(
        "--no-python-frames",
        is_flag=True,
        help="Keep CPython's eval loop as native frames: do not put the Python functions it "
        "runs in its place in the stacks (docs/python.md).",
    ),
]


def _decorated(command: Any, options: list[Any]) -> Any:
    """``command`` with ``options``, in their order in --help."""
    for option in reversed(options):
        command = option(command)
    return command


def python_options(command: Any) -> Any:
    return _decorated(command, PYTHON_OPTIONS)


TRACE_OPTIONS = [
    lib_option("Attach to this libc (e.g. the SDT build) instead of the target's."),
    derived_options,
    probes_option(
        "Glob of libc probe names; repeatable. Default: memory_* and "
        "lll_lock_wait_private (see docs/performance.md)."
    ),
    output_options,
    buffer_pages_option,
    duration_option(),
    click.option(
        "--interval",
        type=Positive(),
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
        "--kmem-only", is_flag=True, help="Trace only the kmem tracepoints (any libc will do)."
    ),
    click.option(
        "--classic-tracepoints",
        is_flag=True,
        help="Attach the kmem tracepoints as classic tracepoints even where the kernel's "
        "BTF allows raw ones (to compare; 'mtrace-live doctor' says which are raw).",
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
        "--prometheus",
        metavar="ADDR",
        help="Also serve Prometheus metrics at ADDR (host:port) while tracing.",
    ),
    web_config_option,
    alloc_options,
    click.option(
        "--contention",
        is_flag=True,
        help="Watch arena contention with the least disturbance: the allocation functions "
        "are not traced (their probes lengthen every malloc, and so every hold of an "
        "arena's lock); the lock waits are timed (docs/contention.md).",
    ),
    click.option(
        "--no-lock-times",
        is_flag=True,
        help="Count the waits in the libc's lock-wait slow path without timing them "
        "(docs/contention.md).",
    ),
    click.option(
        "--frame-pointers",
        is_flag=True,
        help="Walk the stacks of allocations and lock waits by frame pointers only, not by "
        "the binaries' CFI: cheaper, but one frame deep in code built without frame "
        "pointers, as distributions build it (docs/allocations.md).",
    ),
    *PYTHON_OPTIONS,
    click.option(
        "--allocator-lib",
        "allocator_libs",
        multiple=True,
        type=click.Path(dir_okay=False, path_type=Path),
        metavar="PATH",
        help="Also trace the allocation functions this library exports (malloc, free and "
        "the other standard names, and C++'s operator new and delete): an allocator "
        "mtrace-live does not know. Known ones (glibc, jemalloc, tcmalloc, mimalloc) are "
        "found in each process (docs/allocations.md).",
    ),
    wrappers_option,
    click.option(
        "--leaks-older-than",
        type=click.FloatRange(0),
        metavar="SECONDS",
        help="List the allocations outstanding for at least this long, by stack "
        "(in the live view and the summary), as memleak's -o.",
    ),
]


def trace_options(command: Any) -> Any:
    """Options of the live trace (--pid/--all) and ``run``."""
    return _decorated(command, TRACE_OPTIONS)


# ---- combinations -------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    commands: frozenset[str]  # where the rule applies
    refused: Callable[[Mapping[str, Any]], bool]
    message: str


def _given(params: Mapping[str, Any], *names: str) -> int:
    """How many of ``names`` were given (a flag set, a value, arguments)."""
    return sum(1 for name in names if not _absent(params.get(name)))


def _absent(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, (tuple, str)) and not value)


TRACING = frozenset({"trace", "run"})
RULES = (
    Rule(frozenset({"trace"}), lambda p: _given(p, "pid", "all_processes") == 0,
         "give --pid N or --all, or a subcommand such as run"),
    Rule(frozenset({"trace"}), lambda p: _given(p, "pid", "all_processes") == 2,
         "give --pid or --all, not both"),
    Rule(TRACING, lambda p: _given(p, "web_config") == 1 and _given(p, "prometheus") == 0,
         "--web.config.file goes with --prometheus ADDR"),
    Rule(frozenset({"run", "serve"}), lambda p: _given(p, "sdt_glibc", "lib") == 2,
         "give --sdt-glibc or --lib, not both"),
    Rule(frozenset({"record"}), lambda p: _given(p, "pid", "all_processes", "command") != 1,
         "give exactly one of --pid N, --all or a COMMAND"),
    Rule(frozenset({"record"}), lambda p: _given(p, "sdt_glibc") == 1 and not p["command"],
         "--sdt-glibc starts a COMMAND"),
    Rule(frozenset({"serve"}), lambda p: _given(p, "pid", "comm", "cgroup") > 1,
         "give at most one of --pid, --comm and --cgroup"),
    Rule(frozenset({"serve"}), lambda p: _given(p, "exact", "sample_bytes") == 2,
         "give --exact or --sample-bytes N, not both"),
    Rule(frozenset({"serve"}), lambda p: _given(p, "no_libc", "no_kmem") == 2,
         "--no-libc and --no-kmem leave nothing to serve"),
    Rule(frozenset({"count"}), lambda p: _given(p, "pid", "command") != 1,
         "give either --pid N or a COMMAND to run, not both or neither"),
    Rule(frozenset({"count"}), lambda p: _given(p, "sdt_glibc", "pid") == 2,
         "--sdt-glibc starts a COMMAND; it cannot apply to --pid"),
    Rule(frozenset({"probes", "doctor"}), lambda p: _given(p, "pid", "lib") == 2,
         "give --pid or --lib, not both"),
    Rule(TRACING, lambda p: _given(p, "contention") == 1
         and _given(p, "sample_bytes", "kmem_only", "no_lock_times") > 0,
         "--contention times the lock waits and leaves the allocation functions alone: "
         "it goes with none of --sample-bytes, --kmem-only, --no-lock-times"),
)  # fmt: skip


def check(command: str, params: Mapping[str, Any]) -> None:
    """Refuse the first combination of ``params`` a rule of ``command`` refuses."""
    for rule in RULES:
        if command in rule.commands and rule.refused(params):
            raise click.UsageError(rule.message)
