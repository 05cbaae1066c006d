"""A minute of churn (``make soak``'s run, shortened): ``serve`` system-wide
and ``serve --pid`` beside bpftrace while the churn workload forks, execs,
starts threads, dlopens and allocates in bursts. The 30-minute run and its
results are in docs/reliability.md."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from . import pid_max
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


WRAPPED_PID_MAX = 3072  # the churn's ~130-200 processes a second wrap it every 14-20 s
WRAPS = 2  # the churn goes on past its minute until its pids wrapped this often


@pytest.fixture
def pids_that_wrap() -> Iterator[None]:
    """This machine's pid_max lowered for the test, so that pids are reused
    within the minute as they are within hours on a machine with the default
    (the machine's: a pid namespace's own would not wrap the pids the
    tracers see, tests/privileged/pid_max.py). Refused at once if the
    machine's threads are near the lowered value."""
    with pid_max.lowered(WRAPPED_PID_MAX):
        yield


@pytest.mark.soak  # (make soak: slower than make test's budget)
def test_a_minute_of_churn_is_counted_exactly_and_leaves_nothing_behind(
    tmp_path: Path, pids_that_wrap: None
) -> None:
    # GIVEN a minute of churn under both tracers and bpftrace, its pids reused
    # every ~20 s (alone: at this pid_max, other programs beside it would be
    # given pids the churn freed within serve's retirement window, a limit
    # docs/reliability.md states; make soak runs them at the machine's pid_max)
    # (the churn goes on until its pids wrapped twice, however slow the machine)
    result = soak(60, tmp_path, every=5.0, maps_every=15.0, neighbours=False, wraps=WRAPS)
    # THEN the churn ran: processes by the thousand, its pids given out again,
    # and allocations by the million
    assert result.churn["failures"] == 0
    assert result.churn["wraps"] >= WRAPS, result.churn
    assert result.churn["processes"] + result.churn["execs"] >= WRAPPED_PID_MAX, result.churn
    own = result.churn["mallocs"] + result.churn["callocs"]
    # AND each tracer counted the churn's allocations exactly as bpftrace did
    # (libc's own on top of the churn's), under the churn's name, though a
    # pid's new process is not its old one
    for tracer in result.tracers:
        assert tracer.final["alloc_calls"] == result.bpftrace >= own, tracer.name
    # AND every other target of the soak was met: label caps, no map full, exit
    # 0 on SIGTERM with no traceback, no zombie, no program left loaded
    assert result.failures() == []
    # AND the kernel's per-process table of the trace that follows the churn
    # alone holds the processes of the last seconds, not every one that ran
    (following,) = [t for t in result.tracers if t.name == "serve --pid"]
    entries = following.samples[-1].maps["alloc_procs"][0]
    assert entries < result.churn["processes"] / 4, entries


def test_a_killed_run_s_lowered_pid_max_is_restored_by_the_next(tmp_path: Path) -> None:
    # GIVEN a run lowering pid_max, SIGKILLed inside the lowered block
    kept = tmp_path / "pid_max"
    before = pid_max.PID_MAX.read_text().strip()
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from tests.privileged import pid_max
        with pid_max.lowered(4000, kept=pid_max.Path({str(kept)!r})):
            print("lowered", flush=True)
            time.sleep(3600)
    """)
    run = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert run.stdout is not None and run.stdout.readline() == "lowered\n"
        assert pid_max.PID_MAX.read_text().strip() == "4000"
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait()
        assert run.stdout is not None
        run.stdout.close()
    # THEN it stays lowered, and the next run says so and restores it
    try:
        assert pid_max.PID_MAX.read_text().strip() == "4000"
        said = pid_max.restore_left_over(kept)
        assert said is not None and "was 4000" in said and f"restored to {before}" in said
        assert pid_max.PID_MAX.read_text().strip() == before
        assert not kept.exists()
        assert pid_max.restore_left_over(kept) is None  # and says nothing when all is well
    finally:
        pid_max.PID_MAX.write_text(before)


def test_pid_max_is_not_lowered_near_the_threads_in_use(tmp_path: Path) -> None:
    # GIVEN a bound that the machine's threads exceed (the value asked is the
    # one in force, so that a lowering let through would change nothing)
    kept = tmp_path / "pid_max"
    before = pid_max.PID_MAX.read_text().strip()
    near = int(before) // max(1, pid_max.threads_in_use() // 2)
    # WHEN the soak asks to lower pid_max THEN it is refused before anything is written
    refused = pytest.raises(RuntimeError, match="threads run on this machine")
    with refused, pid_max.lowered(int(before), kept=kept, near=near):
        pass
    assert not kept.exists()
    assert pid_max.PID_MAX.read_text().strip() == before
