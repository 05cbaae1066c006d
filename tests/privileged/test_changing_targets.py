"""Targets that change under a trace: main ending first (pthread_exit), each
traced exactly against the workload's own count and bpftrace's in the same
run (bpftrace filters by pid in its program, so it follows every thread)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from mtrace_live.tracer.target import default_libc

from .conftest import MTRACE, built
from .tracing import (
    BPFTRACE_READY,
    Reaper,
    start_bpftrace,
    stop_bpftrace,
    wait_for_line,
)

READY = "Ctrl-C to stop"


def test_main_calling_pthread_exit_leaves_its_other_threads_traced(tmp_path: Path) -> None:
    with Reaper() as reaper:
        # GIVEN a process whose main thread ends first (pthread_exit) while
        # another thread goes on allocating, traced by pid beside bpftrace
        argv = [str(built("leader_exit")), "5000"]
        pipe = subprocess.PIPE
        workload = reaper.add(subprocess.Popen(argv, stdin=pipe, stdout=pipe))
        assert workload.stdout is not None and workload.stdin is not None
        assert workload.stdout.readline() == b"ready\n"
        pid = workload.pid
        body = f"uprobe:{default_libc()}:malloc /pid == $1/ {{ @hits[probe] = count(); }}"
        bpftrace, bpftrace_out = start_bpftrace(body, pid, tmp_path)
        reaper.add(bpftrace)
        wait_for_line(bpftrace_out, BPFTRACE_READY, bpftrace, timeout=120)
        err, out = tmp_path / "trace.err", tmp_path / "trace.out"
        with open(err, "wb") as errors, open(out, "wb") as lines:
            tracer = reaper.add(subprocess.Popen([*MTRACE, "--pid", str(pid), "-o", "json"],
                                                 stdout=lines, stderr=errors))  # fmt: skip
        wait_for_line(err, READY, tracer, timeout=120)
        # WHEN main makes its 5,000 pairs and calls pthread_exit, and the
        # other thread then makes its 5,000
        workload.stdin.write(b"go")
        workload.stdin.close()
        done = workload.stdout.readline().split()
        workload.stdout.close()
        assert workload.wait(timeout=120) == 0
        assert tracer.wait(timeout=120) == 0, err.read_text()
        counts = stop_bpftrace(bpftrace, bpftrace_out)
    # THEN every malloc of both threads is counted: as bpftrace counted, and
    # at least the workload's own (libc's come on top)
    tables = [json.loads(line) for line in out.read_text().splitlines() if '"table"' in line]
    (functions,) = [t for t in tables if t["table"] == "alloc_functions"]
    assert functions["calls"]["malloc"] == counts["malloc"] >= int(done[1])
    # AND the move of the probes to the thread that stayed is said, with no
    # call lost in it (the other thread was waiting in pthread_join)
    said = [line for line in err.read_text().splitlines() if "pthread_exit" in line]
    assert len(said) == 1 and f"thread {pid} of process {pid}" in said[0], said
    assert "0 calls in flight" in said[0]
