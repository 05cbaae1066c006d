"""mtrace-live's tracing pipeline: attach, read, decode, aggregate.

This package is installed as ``mtrace_live.tracer`` (see pyproject.toml).
"""

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    """mtrace-live's installed version ("unknown" outside an install)."""
    try:
        return version("mtrace-live")
    except PackageNotFoundError:
        return "unknown"
