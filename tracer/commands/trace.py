"""The live trace itself: ``mtrace-live --pid N`` / ``--all`` (the group's
own action, tracer/cli.py), and the common start of ``run`` and ``record``."""

from __future__ import annotations

import sys
from pathlib import Path

from . import options


def start_trace(
    *,
    pid: int | None = None,
    all_processes: bool = False,
    command: tuple[str, ...] = (),
    sdt_glibc: bool = False,
    derived: bool = False,
    debug_file: Path | None = None,
    follow_forks: bool,
    lib: Path | None,
    patterns: tuple[str, ...],
    output: str | None,
    buffer_pages: int,
    duration: float | None,
    interval: float,
    kmem: bool = False,
    kmem_only: bool = False,
    classic_tracepoints: bool = False,
    files: tuple[tuple[str, Path], ...] = (),
    prometheus: str | None = None,
    web_config: Path | None = None,
    stack_depth: int = 0,
    stack_map_size: int = 16384,
    sample_bytes: int | None = None,
    max_outstanding: int = 262144,
    alloc_stacks: int = 16384,
    no_allocs: bool = False,
    leaks_older_than: float | None = None,
) -> None:
    """Trace, then exit with the command's exit code when there is one."""
    from ..live import run_trace
    from ..plan import TraceRequest
    from ..usdt import DEFAULT_PATTERNS

    if output is None:
        output = "live" if sys.stdout.isatty() else "text"
    request = TraceRequest(
        pid=pid,
        all_processes=all_processes,
        command=command,
        lib=lib,
        sdt_glibc=sdt_glibc,
        derived=derived,
        debug_file=debug_file,
        patterns=patterns or DEFAULT_PATTERNS,
        output=output,
        follow_forks=follow_forks,
        buffer_pages=buffer_pages,
        duration=duration,
        interval=interval,
        kmem=kmem or kmem_only,
        libc_probes=not kmem_only,
        classic_tracepoints=classic_tracepoints,
        files=files,
        stack_depth=stack_depth,
        stack_entries=stack_map_size,
        leaks_older_than=leaks_older_than,
        **options.alloc_settings(
            no_allocs or kmem_only, sample_bytes, max_outstanding, alloc_stacks
        ),
    )
    if prometheus is not None:
        from ..serve import ExportOptions, serve_trace

        result = serve_trace(request, ExportOptions(prometheus, web_config))
    else:
        result = run_trace(request)
    if result.exit_code is not None:
        sys.exit(result.exit_code)


def trace(name: str, **params: object) -> None:
    """Check the options of a tracing command (``trace``, ``run``) and trace."""
    options.check(name, params)
    files = options.file_outputs(params)
    start_trace(files=files, **params)  # type: ignore[arg-type]
