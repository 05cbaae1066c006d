"""The per-process and per-thread tables (common.bpf.h's PROC_TABLE):
allocated as their keys come where the kernel lets tracing programs use
such hash maps (Linux 6.1), as bpftool says the kernel made them. (What the
traces count through them is checked against the workloads and bpftrace
by the other tests, which run with them so.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mtrace_live.tracer.bpf import bpf_syscalls
from mtrace_live.tracer.loop import plan

from .conftest import MTRACE
from .tracing import bpf_fdinfo, bpftool_show, tracing_a_sleeper

BPF_F_NO_PREALLOC, BPF_F_MMAPABLE = 1, 1 << 10  # include/uapi/linux/bpf.h
PROC_TABLES = {"followed", "proc_hits", "alloc_procs", "unwind_procs", "vm_procs"}


def maps_of(pid: int) -> dict[str, dict[str, Any]]:
    """The BPF maps a process holds, as bpftool shows them, by name."""
    shown = (bpftool_show("map", int(fields["map_id"]))
             for fields in bpf_fdinfo(pid, "bpf-map").values())  # fmt: skip
    return {row.get("name", ""): row for row in shown}


def test_a_traces_process_tables_are_allocated_as_their_keys_come(tmp_path: Path) -> None:
    # GIVEN a trace of a sleeping process (on a kernel older than 6.1, whose
    # tracing programs warn on such maps, the tables stay preallocated)
    on_demand = bpf_syscalls.kernel_version() >= plan.TABLES_ON_DEMAND_SINCE
    # WHEN the kernel is asked what the trace's maps are, while it traces
    _, maps = tracing_a_sleeper(tmp_path, MTRACE, ["-o", "json"], maps_of)
    # THEN the process tables are hash maps made without preallocation where it may
    assert set(maps) >= PROC_TABLES, sorted(maps)
    for name in PROC_TABLES:
        assert maps[name]["type"] == "hash", maps[name]
        assert bool(int(maps[name]["flags"]) & BPF_F_NO_PREALLOC) == on_demand, maps[name]
    # AND the stack rows are an array mapped into the tracer (read by copy, not through bpf(2))
    assert maps["alloc_stacks"]["type"] == "array", maps["alloc_stacks"]
    assert int(maps["alloc_stacks"]["flags"]) & BPF_F_MMAPABLE, maps["alloc_stacks"]
    # AND a hash map that is not a process table (the files' entries) is preallocated still
    assert maps["unwind_files"]["type"] == "hash", maps["unwind_files"]
    assert not int(maps["unwind_files"]["flags"]) & BPF_F_NO_PREALLOC, maps["unwind_files"]
