"""Serving a running trace's metrics to Prometheus: ``mtrace-live serve``,
and ``--prometheus ADDR`` on the live trace.

Order matters and is the point of this module:

1. the web configuration is read and the address bound, before anything is
   attached, so a bad TLS file or a busy port fails at once (exit 17, 16);
2. the programs are attached and the kernel's symbols read (root needed);
3. ``serve`` gives up root;
4. the endpoint starts answering on its own threads, while the tracing loop
   goes on as for any live trace, housekeeping every few seconds.
"""

from __future__ import annotations

import gc
import pwd
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from mtrace_live.exporters.prometheus import MtraceCollector
from mtrace_live.exporters.web import MetricsEndpoint, load_web_config
from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector

from . import bpf_syscalls
from .errors import NotPrivilegedError
from .kallsyms import KernelSymbols
from .live import LiveTrace, TraceRequest, TraceResult, run_trace
from .metrics import MetricsSource
from .output import Sink, SummarySink, make_sink
from .privileges import drop_privileges, resolve_user


@dataclass(frozen=True)
class ExportOptions:
    address: str
    web_config: Path | None = None
    max_processes: int = 50
    top_functions: int = 20
    run_as: str | None = None  # drop root to this user once attached (serve)
    bpf_stats: bool = False
    read_interval: float = 0.5  # BPF maps are read at most this often


class ExportingSink:
    """Wraps a live trace's sink: the same output, plus the metrics endpoint."""

    def __init__(
        self,
        inner: Sink,
        source: MetricsSource,
        endpoint: MetricsEndpoint,
        run_as: pwd.struct_passwd | None = None,
    ) -> None:
        self.inner = inner
        self.source = source
        self.endpoint = endpoint
        self.run_as = run_as
        self._closed = False

    @property
    def written(self) -> int:
        return self.inner.written

    @written.setter
    def written(self, value: int) -> None:
        self.inner.written = value

    def start(self, trace: LiveTrace, pid: int | None) -> None:
        self.inner.start(trace, pid)
        if self.run_as is not None:  # before the first request is answered
            print(f"mtrace-live: {drop_privileges(self.run_as)}", file=sys.stderr, flush=True)
        # Everything loaded so far (bcc, numpy, the symbol table ...) lives
        # as long as the process: out of the collector's sight, a full
        # collection takes a fraction of a millisecond instead of 10-15 ms
        # in the middle of a scrape.
        gc.freeze()
        self.endpoint.start()
        print(f"mtrace-live: serving metrics at {self.endpoint.url}", file=sys.stderr, flush=True)

    def consume(self, batch: np.ndarray) -> None:
        self.inner.consume(batch)

    def tick(self) -> None:
        self.source.tick()
        self.inner.tick()

    def finish(self, result: TraceResult) -> None:
        self.close()
        self.inner.finish(result)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.endpoint.close()
            self.source.close()


class ServeSink(SummarySink):
    """No per-event output; at the end one line on stderr, not a report."""

    def finish(self, result: TraceResult) -> None:
        print(
            f"mtrace-live: stopped after {result.duration_s:.1f} s ({result.ended_by or 'ended'}); "
            f"{result.total_hits} libc probe hits, {result.total_lost} events lost",
            file=sys.stderr,
            flush=True,
        )


def serve_trace(
    request: TraceRequest, options: ExportOptions, sink: Sink | None = None
) -> TraceResult:
    """Run a live trace with its metrics served at ``options.address``."""
    config = load_web_config(options.web_config)
    user: pwd.struct_passwd | None = resolve_user(options.run_as) if options.run_as else None
    endpoint = MetricsEndpoint(options.address, CollectorRegistry(auto_describe=False), config)

    def attached(trace: LiveTrace, inner: Sink) -> Sink:
        stats_fd = bpf_syscalls.enable_run_time_stats() if options.bpf_stats else None
        if options.bpf_stats and stats_fd is None and not bpf_syscalls.sysctl_enabled():
            raise NotPrivilegedError("--bpf-stats: this kernel refused to count BPF run time")
        source = MetricsSource(trace, KernelSymbols.load(), stats_fd, options.read_interval)
        registry = endpoint.registry
        registry.register(
            MtraceCollector(source.snapshot, options.max_processes, options.top_functions)
        )
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        return ExportingSink(inner, source, endpoint, user)

    try:
        return run_trace(request, sink or make_sink(request.output), attached)
    finally:
        endpoint.close()
