"""The live loop: the plan of a trace, its loop, the allocator model and the
kernel's counters. The top room: it imports the others, none imports it."""


def package_version() -> str:
    """mtrace-live's installed version ("unknown" outside an install)."""
    # imported here: importlib.metadata costs a trace's start 25 ms
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mtrace-live")
    except PackageNotFoundError:
        return "unknown"
