"""mtrace-live's tracing, one room (subpackage) per concern, each importing
only the rooms below it: ``loop`` (the plan, the trace's loop that hands
every batch to the outputs, the allocator model, the counters) -> ``unwind``
(the unwinders' tables) -> ``processes`` (targets, providers, arenas,
launches, holds, moves) -> ``bpf`` (loading with bcc, in ``bpf_backend``
only; attaching, maps and rings). The commands (``cli``, ``commands/``) are
above them all.

The top layer: it imports the outputs (mtrace_live.exporters) and the probes,
never the reverse. Installed as ``mtrace_live.tracer`` (see pyproject.toml).
"""
