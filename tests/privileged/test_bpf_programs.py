"""Reading every loaded BPF program's run statistics by id, as the benchmark
harness does to compare tracers: checked against a program whose runs the
test makes itself."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from mtrace_live.tracer.bpf import bpf_syscalls

from .tracing import BPFTRACE_READY, Reaper, programs_of, wait_for_line

CALLS = 5000


def runs_by_program(ids: set[int]) -> dict[int, bpf_syscalls.RunStats]:
    """The run statistics of the programs ``ids`` that are loaded, found by id
    among every loaded program as the harness finds them."""
    found = {}
    for prog_id in set(bpf_syscalls.program_ids()) & ids:
        fd = bpf_syscalls.program_fd(prog_id)
        if fd is None:
            continue  # unloaded since it was listed
        try:
            stats = bpf_syscalls.run_stats(fd)
        finally:
            bpf_syscalls.close(fd)
        if stats is not None:
            found[prog_id] = stats
    return found


def test_a_program_is_found_by_id_with_the_runs_and_time_it_took(tmp_path: Path) -> None:
    stats_fd = bpf_syscalls.enable_run_time_stats()
    assert stats_fd is not None
    script = tmp_path / "getppid.bt"
    probe = f"tracepoint:syscalls:sys_enter_getppid /pid == {os.getpid()}/ {{ @ = count(); }}"
    script.write_text(f'BEGIN {{ printf("{BPFTRACE_READY}\\n"); }}\n{probe}')
    log = tmp_path / "bpftrace.out"
    try:
        with Reaper() as reaper, open(log, "wb") as sink:
            tracer = reaper.add(subprocess.Popen(["bpftrace", str(script)], stdout=sink,
                                                 stderr=sink))  # fmt: skip
            wait_for_line(log, BPFTRACE_READY, tracer, timeout=60)
            # bpftrace's own programs (its pid's descriptors): other tools'
            # programs, loaded or run meanwhile, are not this test's
            held = programs_of(tracer.pid)
            before = runs_by_program(held)
            for _ in range(CALLS):
                os.getppid()
            after = runs_by_program(held)
    finally:
        bpf_syscalls.close(stats_fd)
    assert set(before) == set(after) == held  # each found by id, before and after
    grown = {i: after[i].run_cnt - before[i].run_cnt for i in after}
    ours = [i for i, n in grown.items() if n >= CALLS]
    assert len(ours) == 1, grown  # the getppid program, run at least once per call
    assert grown[ours[0]] < CALLS + 100  # other threads' getppid calls are few
    assert after[ours[0]].run_time_ns > before[ours[0]].run_time_ns
