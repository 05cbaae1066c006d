"""The live trace itself: ``mtrace-live --pid N`` / ``--all`` (the group's
own action, tracer/cli.py), and the common start of ``run`` and ``record``."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtrace_live.tracer.commands import options

if TYPE_CHECKING:
    from mtrace_live.tracer.loop.plan import TraceRequest


def start_trace(*, prometheus: str | None = None, web_config: Path | None = None,
                **params: Any) -> None:  # fmt: skip
    """Trace, then exit with the command's exit code when there is one.
    ``params``: the tracing options (trace_request)."""
    _preload(params, prometheus)
    if params.get("command"):
        # a command's whole run is the wait its user sees (run, record), not
        # the line: numpy, which its first events need, is imported now, while
        # the programs begun are in the verifier, not after the line
        # (docs/performance.md, section 12: 0.40 -> 0.35 s end to end)
        import numpy  # noqa: F401
    from mtrace_live.tracer.loop.live import run_trace

    request = trace_request(params)
    if prometheus is not None:
        from mtrace_live.tracer.loop.metrics_endpoint import ExportOptions, serve_trace

        result = serve_trace(request, ExportOptions(prometheus, web_config))
    else:
        result = run_trace(request)
    if result.exit_code is not None:
        sys.exit(result.exit_code)


def _preload(params: dict[str, Any], prometheus: str | None) -> None:
    """The program these options loaded last time, made meanwhile
    (tracer/bpf/preload.py): before anything else is imported."""
    from mtrace_live.tracer.bpf import preload

    if preload.begun():
        return  # from the command line, before it was parsed (tracer/entry.py)
    # (--duration left out, as from the command line's key)
    unkeyed = ("pid", "command", preload.UNKEYED.removeprefix("--"))
    options = {name: value for name, value in params.items() if name not in unkeyed}
    options["prometheus"] = prometheus is not None
    command = params.get("command") or ()
    pid = params.get("pid")
    program = None
    if command:
        program = os.path.basename(str(command[0]))
    elif pid:
        with contextlib.suppress(OSError):
            program = os.readlink(f"/proc/{pid}/exe")
    preload.begin(preload.options_key(options, program))


def trace_request(params: dict[str, Any]) -> TraceRequest:
    """The request of a tracing command's options: the options TraceRequest
    has as fields, plus ``output`` (None: live on a terminal, else text),
    ``kmem_only``, ``stack_map_size`` and the allocation functions' options."""
    from mtrace_live.tracer.loop.plan import TraceRequest
    from mtrace_live.tracer.loop.usdt import DEFAULT_PATTERNS

    rest = dict(params)
    kmem_only = rest.pop("kmem_only", False)
    contention = rest.pop("contention", False)  # the allocation functions left alone
    # an option a command does not have takes the request's default
    allocs = options.alloc_settings(
        rest.pop("no_allocs", False) or kmem_only or contention, rest.pop("sample_bytes", None),
        rest.pop("max_outstanding", TraceRequest.max_outstanding),
        rest.pop("alloc_stacks", TraceRequest.alloc_stacks))  # fmt: skip
    output = rest.pop("output", None) or ("live" if sys.stdout.isatty() else "text")
    return TraceRequest(
        output=output,
        patterns=rest.pop("patterns", ()) or DEFAULT_PATTERNS,
        kmem=rest.pop("kmem", False) or kmem_only,
        libc_probes=not kmem_only,
        stack_entries=rest.pop("stack_map_size", TraceRequest.stack_entries),
        lock_times=not rest.pop("no_lock_times", False),
        **allocs,
        **rest,
    )


def trace(name: str, **params: object) -> None:
    """Check the options of a tracing command (``trace``, ``run``) and trace."""
    options.check(name, params)
    files = options.file_outputs(params)
    start_trace(files=files, **params)  # type: ignore[arg-type]
