"""The live loop: the plan of a trace, its loop, the allocator model and the
kernel's counters. The top room: it imports the others, none imports it."""

# mtrace-live's version: the one place it is written (pyproject.toml reads it
# from here, tool.setuptools.dynamic), read by a trace without the 20 ms
# importlib.metadata takes to find the installed distribution.
VERSION = "0.1.0"


def package_version() -> str:
    """mtrace-live's version (the one pyproject.toml gives the installed
    distribution)."""
    return VERSION
