"""The per-process and per-thread tables (common.bpf.h's PROC_TABLE):
allocated as their keys come where the kernel lets tracing programs use
such hash maps (Linux 6.1), as bpftool says the kernel made them. (What the
traces count through them is checked against the workloads and bpftrace
by the other tests, which run with them so.)"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from mtrace_live.tracer.bpf import bpf_syscalls
from mtrace_live.tracer.loop import plan

from .conftest import MTRACE
from .tracing import Reaper, wait_for_line

BPF_F_NO_PREALLOC = 1  # include/uapi/linux/bpf.h
PROC_TABLES = {"followed", "proc_hits", "alloc_procs", "unwind_procs", "vm_procs"}


def maps_of(pid: int) -> dict[str, dict[str, object]]:
    """The BPF maps a process holds, as bpftool shows them, by name."""
    ids = set()
    for entry in os.listdir(f"/proc/{pid}/fdinfo"):
        try:
            info = Path(f"/proc/{pid}/fdinfo/{entry}").read_text()
        except OSError:
            continue
        ids.update(int(line.split()[1]) for line in info.splitlines() if line.startswith("map_id:"))
    shown = {}
    for map_id in ids:
        done = subprocess.run(["bpftool", "-j", "map", "show", "id", str(map_id)],
                              capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
        row = json.loads(done.stdout)
        shown[row.get("name", "")] = row
    return shown


@pytest.mark.skipif(bpf_syscalls.kernel_version() < plan.TABLES_ON_DEMAND_SINCE,
                    reason="the kernel preallocates tracing programs' hash maps")  # fmt: skip
def test_a_traces_process_tables_are_allocated_as_their_keys_come(tmp_path: Path) -> None:
    err = tmp_path / "trace.err"
    with Reaper() as reaper:
        # GIVEN a trace of a sleeping process
        target = reaper.add(subprocess.Popen(["sleep", "600"]))
        with open(err, "wb") as errors:
            tracer = reaper.add(subprocess.Popen(
                [*MTRACE, "--pid", str(target.pid), "-o", "json"],
                stdout=subprocess.DEVNULL, stderr=errors,
            ))  # fmt: skip
        wait_for_line(err, "Ctrl-C to stop", tracer, timeout=120)
        # WHEN the kernel is asked what the trace's maps are
        maps = maps_of(tracer.pid)
        tracer.send_signal(2)
        assert tracer.wait(timeout=120) == 0, err.read_text()
    # THEN the process tables are hash maps made without preallocation
    assert set(maps) >= PROC_TABLES, sorted(maps)
    for name in PROC_TABLES:
        assert maps[name]["type"] == "hash", maps[name]
        assert int(maps[name]["flags"]) & BPF_F_NO_PREALLOC, maps[name]
    # AND a hash map that is not a process table (the files' entries) is preallocated still
    assert maps["unwind_files"]["type"] == "hash", maps["unwind_files"]
    assert not int(maps["unwind_files"]["flags"]) & BPF_F_NO_PREALLOC, maps["unwind_files"]
