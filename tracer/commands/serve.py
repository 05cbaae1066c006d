"""``mtrace-live serve``: Prometheus metrics of a long-running trace."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click
from mtrace_live.tracer.commands import options

# serve samples by bytes unless told --exact: one allocation kept per 512 KiB
# on average, as Go's heap profiles (runtime.MemProfileRate) do; the cost
# per call is then that of an empty probe, within 10% (docs/allocations.md).
SERVE_SAMPLE_BYTES = 512 * 1024

if TYPE_CHECKING:
    from mtrace_live.tracer.loop.metrics_endpoint import ExportOptions
    from mtrace_live.tracer.loop.plan import TraceRequest


@click.command(context_settings={"allow_interspersed_args": False})
@options.pid_option("Serve the metrics of this process only.")
@click.option("--comm", help="... of the processes with this kernel name (comm) only.")
@click.option("--cgroup", help="... of the tasks in this cgroup v2 (and below) only.")
@options.lib_option("The libc to attach to (default: the pid's, else the system's).")
@options.sdt_glibc_option("Attach to the SDT glibc 'make sdt-glibc' built.")
@options.probes_option("Glob of libc probe names; repeatable.")
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
@options.web_config_option
@click.option("--max-processes", type=click.IntRange(1), default=50, show_default=True,
              help="Process names with a label of their own; the rest are 'other'.")  # fmt: skip
@click.option("--top-functions", type=click.IntRange(1), default=20, show_default=True,
              help="Kernel functions with a label of their own; the rest are 'other'.")  # fmt: skip
@click.option("--user", default="nobody", show_default=True,
              help="When started as root, run as this user once attached.")  # fmt: skip
@click.option("--keep-privileges", is_flag=True, help="Stay root after attaching.")
@click.option("--bpf-stats", is_flag=True,
              help="Count the BPF programs' run time (costs ~20 ns per probe hit).")  # fmt: skip
@click.option("--read-interval", type=click.FloatRange(0.1), default=0.5, show_default=True,
              help="Render the metrics (reading the BPF maps) this often while scraped "
              "(seconds); every scrape gets the last page rendered.")  # fmt: skip
@click.option(
    "--top-stacks",
    type=click.IntRange(1),
    default=20,
    show_default=True,
    help="Allocation call stacks given a label of their own in "
    'mtrace_alloc_stack_live_bytes; the rest are summed under stack="other".',
)
@click.option(
    "--profile-max-samples",
    type=click.IntRange(0),
    help="Samples a heap profile holds at most [default: 16,000, the most Pyroscope takes]: "
    "the largest kept, each process's other stacks summed into one sample; 0: no bound. "
    "A profile's ?max_samples=N overrides it.",
)
@options.alloc_options
@options.python_options
@click.option("--exact", is_flag=True,
              help="Keep every allocation: exact counts per stack, at a higher cost per call "
              f"(serve samples one per {SERVE_SAMPLE_BYTES} bytes by default).")  # fmt: skip
@options.buffer_pages_option
def serve(**params: Any) -> None:
    """Serve Prometheus metrics of the allocation functions (malloc, free,
    ...), the libc allocator probes and the kernel kmem tracepoints until
    stopped (SIGTERM or Ctrl-C), and heap profiles at /debug/pprof/heap and
    /debug/pprof/allocs (docs/prometheus.md).

    System-wide by default; --pid, --comm or --cgroup narrow it. Binds
    127.0.0.1 unless told otherwise; --web.config.file adds TLS and basic
    auth. When started as root it runs as --user once attached.

    \b
      mtrace-live serve --sdt-glibc
      mtrace-live serve --no-libc --web.listen-address :9477
      mtrace-live serve --comm nginx --lib /opt/glibc-sdt/lib/libc.so.6
    """
    checked = (
        "pid",
        "comm",
        "cgroup",
        "no_libc",
        "no_kmem",
        "sdt_glibc",
        "lib",
        "exact",
        "sample_bytes",
    )
    options.check("serve", {key: params[key] for key in checked})
    from mtrace_live.exporters.summary import StopLine
    from mtrace_live.tracer.loop.metrics_endpoint import serve_trace

    serve_trace(_request(params), _export(params), StopLine())


def _request(params: dict[str, Any]) -> TraceRequest:
    from mtrace_live.tracer.loop.plan import TraceRequest
    from mtrace_live.tracer.loop.usdt import DEFAULT_PATTERNS
    from mtrace_live.tracer.processes.sdt_glibc import locate

    pid, comm, cgroup = params["pid"], params["comm"], params["cgroup"]
    no_libc = params["no_libc"]
    allocs = options.alloc_settings(
        params["no_allocs"] or no_libc,
        0 if params["exact"] else params["sample_bytes"] or SERVE_SAMPLE_BYTES,
        params["max_outstanding"],
        params["alloc_stacks"],
    )
    return TraceRequest(
        pid=pid,
        all_processes=pid is None and comm is None and cgroup is None,
        lib=locate().libc if params["sdt_glibc"] and not no_libc else params["lib"],
        patterns=params["patterns"] or DEFAULT_PATTERNS,
        output="summary",
        follow_forks=True,
        buffer_pages=params["buffer_pages"],
        kmem=not params["no_kmem"],
        libc_probes=not no_libc,
        comm=comm,
        cgroup=cgroup,
        end_with_target=False,
        unwind_rows=params["unwind_rows"],
        pymalloc=params["pymalloc"],
        no_python_frames=params["no_python_frames"],
        **allocs,
    )


def _export(params: dict[str, Any]) -> ExportOptions:
    from mtrace_live.tracer.loop.metrics_endpoint import ExportOptions

    return ExportOptions(
        address=params["address"],
        web_config=params["web_config"],
        max_processes=params["max_processes"],
        top_functions=params["top_functions"],
        top_stacks=params["top_stacks"],
        run_as=None if params["keep_privileges"] else params["user"],
        bpf_stats=params["bpf_stats"],
        read_interval=params["read_interval"],
        **(
            {"profile_max_samples": params["profile_max_samples"]}
            if params["profile_max_samples"] is not None
            else {}
        ),
    )
