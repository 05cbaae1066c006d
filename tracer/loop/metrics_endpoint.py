"""Serving a running trace's metrics to Prometheus: ``mtrace-live serve``,
and ``--prometheus ADDR`` on the live trace.

Order matters and is the point of this module:

1. the web configuration is read and the address bound, before anything is
   attached, so a bad TLS file or a busy port fails at once (exit 17, 16);
2. the endpoint is handed to a process of its own, forked now, while the
   tracer holds no BPF object and runs no thread; it gives up root at once
   (``serve``) and answers every scrape from the last page the tracer
   rendered into shared memory (exporters/exposition.py), so no scrape
   waits for the tracing loop;
3. the programs are attached and the kernel's symbols read (root needed);
4. ``serve`` gives up root;
5. the metrics sink (exporters/prometheus_sink.py, a sink like any output)
   renders the page on a thread of its own every read interval while
   scrapes come, and the tracing loop goes on as for any live trace,
   housekeeping every few seconds.
"""

from __future__ import annotations

import os
import pwd
import sys
from dataclasses import replace

from mtrace_live.exporters.data.kallsyms import KernelSymbols
from mtrace_live.exporters.data.sink import Sink, TraceResult
from mtrace_live.exporters.exposition import ServingProcess, SharedPages
from mtrace_live.exporters.profile_serving import ProfileChannel
from mtrace_live.exporters.prometheus_sink import ExportOptions, PrometheusSink, new_registry
from mtrace_live.exporters.web import MetricsEndpoint, load_web_config
from mtrace_live.tracer.bpf.privileges import TRACING_CAPABILITIES, drop_privileges, resolve_user
from mtrace_live.tracer.loop.live import default_sinks, run_trace
from mtrace_live.tracer.loop.plan import TraceRequest

__all__ = ["ExportOptions", "serve_trace"]


def serve_trace(
    request: TraceRequest, options: ExportOptions, output: Sink | None = None
) -> TraceResult:
    """Run a live trace with its metrics served at ``options.address``;
    ``output`` replaces the request's stream on standard output."""
    config = load_web_config(options.web_config)
    user: pwd.struct_passwd | None = resolve_user(options.run_as) if options.run_as else None
    endpoint = MetricsEndpoint(options.address, new_registry(), config)
    pages = SharedPages()
    channel = ProfileChannel()  # heap profiles, asked for by the serving process
    server = ServingProcess(endpoint, pages, options.read_interval, channel)
    request = replace(
        request,
        bpf_stats=options.bpf_stats,
        privileges_dropped=user is not None and os.geteuid() == 0,
    )

    def make_sinks() -> list[Sink]:
        sinks = default_sinks(request)
        if output is not None:
            sinks[-1] = output
        metrics = PrometheusSink(endpoint, options, KernelSymbols.load(), pages, server.alive,
                                 channel)  # fmt: skip
        return [metrics, *sinks]

    def give_up_root() -> None:
        if user is not None:
            drop_privileges(user)

    def before_start() -> None:
        if user is not None:  # before the first request is answered
            said = drop_privileges(user, keep=TRACING_CAPABILITIES)
            print(f"mtrace-live: {said}", file=sys.stderr, flush=True)

    try:
        server.start(give_up_root)
        return run_trace(request, make_sinks, before_start)
    finally:
        server.close()
        channel.close()
        endpoint.close()
