"""A fault of mtrace-live's own while tracing (tests/privileged/faults.py
injects one into the unwind tables, the ring reader and an output, one at
a time) ends the trace cleanly: one error line with its exit code, never a
traceback, every process it held continued, the probes detached, and the
other outputs written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO, built
from .test_holds import stopped_processes
from .tracing import wait_for_detach

OURS = {"alloc_free", "alloc_exit", "unwind_step"}  # some of the trace program's handlers


def loaded_programs() -> set[str]:
    shown = subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True, text=True,
                           check=True).stdout  # fmt: skip
    return {program.get("name", "") for program in json.loads(shown)}


@pytest.mark.parametrize(("fault", "code"), [("tables", 0), ("ring", 21), ("sink", 21)])
def test_a_fault_while_tracing_ends_the_trace_cleanly(tmp_path: Path, fault: str,
                                                      code: int) -> None:  # fmt: skip
    before = stopped_processes()
    assert not loaded_programs() & OURS
    # GIVEN the churn (forks, execs, dlopens: held again and again) run by a
    # tracer with a fault injected, writing JSON lines and a heap profile
    pprof = tmp_path / "heap.pb.gz"
    churn = [str(built("churn")), str(built("libcfi_plugin.so")), "2"]
    argv = [sys.executable, "-m", "tests.privileged.faults", fault, "run", "--follow-forks",
            "-o", "json", "--pprof", str(pprof), "--", *churn]  # fmt: skip
    run = subprocess.run(argv, input=b"g", capture_output=True, timeout=300, cwd=REPO)
    stderr = run.stderr.decode(errors="replace")
    # THEN it exits with the fault's code, and says so in one line, without a traceback
    assert run.returncode == code, stderr
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("mtrace-live: error:")]
    if code:
        assert len(errors) == 1 and "internal error while" in errors[0], stderr
        assert "a fault injected by the test" in errors[0]
    else:  # a process's tables: that process's alone, the trace goes on
        assert not errors and "unwind tables of pid" in stderr, stderr
    # AND the profile is written (and read by go tool pprof)
    top = subprocess.run(["go", "tool", "pprof", "-top", str(pprof)], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert top.returncode == 0 and "flat%" in top.stdout, top.stderr
    # AND nothing is left stopped, and the probes are detached
    assert not stopped_processes() - before
    wait_for_detach()
    assert not loaded_programs() & OURS
