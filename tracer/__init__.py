"""mtrace-live's tracing pipeline: attach, read, decode, aggregate.

This package is installed as ``mtrace_live.tracer`` (see pyproject.toml).
"""
