"""The live loop: the plan of a trace, its loop, the allocator model and the
kernel's counters. The top room: it imports the others, none imports it."""


def package_version() -> str:
    """mtrace-live's version (the installed distribution's: pyproject.toml
    reads it from the same constant)."""
    from mtrace_live.tracer import VERSION

    return VERSION
