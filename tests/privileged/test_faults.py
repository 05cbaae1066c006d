"""A fault of mtrace-live's own while tracing (tests/privileged/faults.py
injects one into the unwind tables, the ring reader and an output, one at
a time) ends the trace cleanly: one error line with its exit code, never a
traceback, every process it held continued by the tracer itself (not let
go by the guardian past its bound), its own programs unloaded, and the
other outputs written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mtrace_live.tracer.bpf import bpf_syscalls

from .conftest import REPO, built
from .test_holds import CHURN_NAME, READY, own_churn, stopped
from .tracing import Reaper, programs_of, wait_for_line, wait_until


def churn_processes() -> set[int]:
    """The threads of every process of this run's churn (its own name),
    reparented ones included."""
    found: set[int] = set()
    for task in Path("/proc").glob("[0-9]*/task/[0-9]*"):
        try:
            if (task / "comm").read_text().strip() == CHURN_NAME:
                found.add(int(task.name))
        except OSError:
            continue
    return found


@pytest.mark.parametrize(("fault", "code"), [("tables", 0), ("ring", 21), ("sink", 21)])
def test_a_fault_while_tracing_ends_the_trace_cleanly(tmp_path: Path, fault: str,
                                                      code: int) -> None:  # fmt: skip
    # GIVEN the churn (forks, execs, dlopens: held again and again) run by a
    # tracer with a fault injected, writing JSON lines and a heap profile
    pprof = tmp_path / "heap.pb.gz"
    churn = [str(own_churn(tmp_path)), str(built("libcfi_plugin.so")), "2"]
    argv = [sys.executable, "-m", "tests.privileged.faults", fault, "run", "--follow-forks",
            "-o", "json", "--pprof", str(pprof), "--", *churn]  # fmt: skip
    err = tmp_path / "trace.err"
    with Reaper() as reaper:
        with open(err, "wb") as errors:
            run = reaper.add(subprocess.Popen(argv, stdin=subprocess.PIPE,
                                              stdout=subprocess.DEVNULL, stderr=errors,
                                              cwd=REPO))  # fmt: skip
        assert run.stdin is not None
        wait_for_line(err, READY, run, timeout=120)
        ours = programs_of(run.pid)
        assert ours, "the tracer holds no BPF program"
        run.stdin.write(b"g")  # the churn's go
        run.stdin.close()
        returncode = run.wait(timeout=300)
    stderr = err.read_text(errors="replace")
    # THEN it exits with the fault's code, and says so in one line, without a traceback
    assert returncode == code, stderr
    assert "Traceback" not in stderr
    errors_said = [line for line in stderr.splitlines() if line.startswith("mtrace-live: error:")]
    if code:
        assert len(errors_said) == 1 and "internal error while" in errors_said[0], stderr
        assert "a fault injected by the test" in errors_said[0]
    else:  # a process's tables: that process's alone, the trace goes on
        assert not errors_said and "unwind tables of pid" in stderr, stderr
    # AND the profile is written (and read by go tool pprof)
    top = subprocess.run(["go", "tool", "pprof", "-top", str(pprof)], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert top.returncode == 0 and "flat%" in top.stdout, top.stderr
    # AND the tracer continued what it held itself: the guardian let none go
    # past its bound ("N stops of processes were let go after 2 s ...")
    assert "let go after" not in stderr, stderr
    # AND none of the churn's processes is left stopped, and the tracer's
    # programs are unloaded (its perf events closed)
    assert not stopped(churn_processes())
    wait_until(lambda: not ours & set(bpf_syscalls.program_ids()), "its programs unloaded")
