"""A minute of churn (``make soak``'s run, shortened): ``serve`` system-wide
and ``serve --pid`` beside bpftrace while the churn workload forks, execs,
starts threads, dlopens and allocates in bursts. The 30-minute run and its
results are in docs/reliability.md."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from .conftest import REPO


def _soak_module() -> object:
    """tests/soak/soak.py, which make soak runs as a script."""
    path = REPO / "tests" / "soak" / "soak.py"
    spec = importlib.util.spec_from_file_location("mtrace_soak", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


soak = _soak_module().soak  # type: ignore[attr-defined]


def test_a_minute_of_churn_is_counted_exactly_and_leaves_nothing_behind(tmp_path: Path) -> None:
    # GIVEN a minute of churn under both tracers and bpftrace
    result = soak(60, tmp_path, every=5.0, maps_every=15.0)
    # THEN the churn ran: processes by the thousand, and allocations by the million
    assert result.churn["failures"] == 0
    assert result.churn["processes"] + result.churn["execs"] >= 1000
    own = result.churn["mallocs"] + result.churn["callocs"]
    # AND each tracer counted the churn's allocations exactly as bpftrace did
    # (libc's own on top of the churn's), under the churn's name
    for tracer in result.tracers:
        assert tracer.final["alloc_calls"] == result.bpftrace >= own, tracer.name
    # AND every other target of the soak was met: label caps, no map full, exit
    # 0 on SIGTERM with no traceback, no zombie, no program left loaded
    assert result.failures() == []
    # AND the kernel's per-process tables hold the processes of the last
    # seconds, not every one that ran
    for tracer in result.tracers:
        entries = tracer.samples[-1].maps["alloc_procs"][0]
        assert entries < result.churn["processes"] / 4, (tracer.name, entries)
