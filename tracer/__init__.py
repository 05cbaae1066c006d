"""mtrace-live's tracing: attach (bcc, in ``bpf_backend`` only), read the
ring (``ringbuf``), run the trace and hand every batch to the outputs
(``live``), model each process's allocator (``model``), and the commands
(``cli``, ``commands/``).

The top layer: it imports the outputs (mtrace_live.exporters) and the probes,
never the reverse. Installed as ``mtrace_live.tracer`` (see pyproject.toml).
"""


def package_version() -> str:
    """mtrace-live's installed version ("unknown" outside an install)."""
    # imported here: importlib.metadata costs a trace's start 25 ms
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mtrace-live")
    except PackageNotFoundError:
        return "unknown"
