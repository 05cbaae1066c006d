"""Privileged tests: root, bcc, BPF and the SDT-enabled glibc, for real.

They never skip. If BPF cannot run here, the session fails at once with the
reason, and a test that skips anyway (a mark, pytest.skip) is reported
failed, so CI cannot pass by skipping them.
"""

import os
import subprocess
import sys
import warnings
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
from mtrace_live.tracer.processes import sdt_glibc

from . import pid_max
from .tracing import wait_for_detach

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "build"
MTRACE = [sys.executable, "-m", "mtrace_live.tracer.cli"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.privileged)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    """A privileged test that skips (a skip mark, pytest.skip, importorskip,
    a fixture that skips) or is let fail (an xfail mark, pytest.xfail) is
    reported failed, with the reason it gave: here, nothing may pass by not
    running, or by not holding."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped or hasattr(report, "wasxfail"):
        _failed(report, "a privileged test skipped or was let fail, which fails here")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    """A privileged module that skips as it is collected (a module-level
    pytest.skip or importorskip) is reported failed too: its tests never
    reach ``pytest_runtest_makereport``."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and Path(str(collector.path)).is_relative_to(Path(__file__).parent):
        _failed(report, "a privileged module skipped, which fails here")


def _failed(report: pytest.TestReport | pytest.CollectReport, why: str) -> None:
    report.outcome = "failed"
    reason = getattr(report, "wasxfail", None) or report.longrepr
    report.longrepr = f"{why}: {reason}"
    if hasattr(report, "wasxfail"):
        del report.wasxfail


@pytest.fixture(scope="session", autouse=True)
def bpf_works() -> None:
    """Fail (never skip) the privileged tests when BPF cannot run here."""
    if os.geteuid() != 0:
        pytest.fail("privileged tests need root: run them with sudo (make test does in CI)")
    try:
        import bcc  # noqa: F401
    except ImportError:
        pytest.fail("bcc's Python bindings are missing: run scripts/setup.sh")
    probe = mtrace_count("--kmem-only", "--json", "--", "/bin/true")
    if probe.returncode != 0:
        pytest.fail(f"BPF does not work on this machine: {probe.stderr.strip()[-500:]}")


@pytest.fixture(scope="session", autouse=True)
def pid_max_as_found() -> None:
    """A pid_max that a killed run of the soak test left lowered is put back,
    and the run says so."""
    said = pid_max.restore_left_over()
    if said is not None:
        print(f"\n{said}", file=sys.stderr)
        warnings.warn(said, stacklevel=1)


@pytest.fixture(autouse=True)
def previous_traces_detached() -> None:
    """Each test starts once the traces before it have detached: their
    detacher still holds gated programs on the kmem tracepoints, which make
    the kernel skip runs of this test's programs in interrupts."""
    wait_for_detach()


@pytest.fixture(scope="session")
def sdt() -> sdt_glibc.SdtGlibc:
    return sdt_glibc.locate()


def mtrace_count(*args: str) -> subprocess.CompletedProcess[str]:
    """Run `mtrace-live count ARGS` to its end and capture what it printed."""
    return subprocess.run([*MTRACE, "count", *args], capture_output=True, text=True, timeout=300)


def built(name: str) -> Path:
    path = BUILD / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: build it with 'make exercisers'")
    return path


@pytest.fixture(scope="session")
def probe_exerciser() -> Path:
    return built("probe_exerciser")


@pytest.fixture(scope="session")
def kmem_exerciser() -> Path:
    return built("kmem_exerciser")
