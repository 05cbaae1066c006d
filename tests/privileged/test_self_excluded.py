"""mtrace-live never traces itself: under ``--all`` (every process, no
filter) its own process makes thousands of allocations (its Python, its
ring's reader), yet none of its calls is counted (common.bpf.h's self_set,
written before the gate opens). A workload run meanwhile is counted, so the
profile read is one that could show the tracer. Under ``serve`` the set
holds the tracer and every process it forked (its metrics endpoint), as
bpftool reads the map."""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
from pathlib import Path

from tests.unit.profile_proto import parsed

from .conftest import MTRACE
from .test_serve import SERVE_READY, free_port
from .tracing import Reaper, wait_for_line

READY = "Ctrl-C to stop"
# A Python workload allocating 300 blocks of 1 MiB through malloc.
WORKLOAD = "for _ in range(300):\n    bytearray(1 << 20)\n"


def pids_in(profile: Path) -> dict[int, int]:
    """alloc_objects per process, from the profile's pid labels."""
    prof = parsed(profile.read_bytes())
    strings = prof.string_table
    objects = [strings[t.type] for t in prof.sample_type].index("alloc_objects")
    found: dict[int, int] = {}
    for sample in prof.sample:
        pid = next(int(label.num) for label in sample.label if strings[label.key] == "pid")
        found[pid] = found.get(pid, 0) + int(sample.value[objects])
    return found


def test_all_processes_leave_out_the_tracer_itself(tmp_path: Path) -> None:
    profile, err = tmp_path / "heap.pb.gz", tmp_path / "trace.err"
    with Reaper() as reaper:
        # GIVEN a trace of every process
        with open(err, "wb") as sink:
            tracer = reaper.add(subprocess.Popen(
                [*MTRACE, "--all", "-o", "summary", "--pprof", str(profile)],
                stdout=sink, stderr=sink))  # fmt: skip
        wait_for_line(err, READY, tracer, timeout=120)
        # WHEN a workload runs to its end, then the trace stops
        workload = reaper.add(subprocess.Popen([sys.executable, "-c", WORKLOAD]))
        assert workload.wait(timeout=120) == 0
        tracer.send_signal(signal.SIGINT)
        assert tracer.wait(timeout=300) == 0, err.read_text()
    found = pids_in(profile)
    # THEN the workload's 300 blocks are there, and not one call of the tracer's
    assert found.get(workload.pid, 0) >= 300, sorted(found.items())[:20]
    assert tracer.pid not in found, found[tracer.pid]


def test_serve_names_the_tracer_and_its_endpoint_as_its_own(tmp_path: Path) -> None:
    err = tmp_path / "serve.err"
    with Reaper() as reaper:
        # GIVEN serve, system-wide, with its endpoint forked
        with open(err, "wb") as sink:
            tracer = reaper.add(subprocess.Popen(
                [*MTRACE, "serve", "--listen", f"127.0.0.1:{free_port()}"],
                stdout=sink, stderr=sink))  # fmt: skip
        wait_for_line(err, SERVE_READY, tracer, timeout=120)
        children = {int(pid) for task in Path(f"/proc/{tracer.pid}/task").iterdir()
                    for pid in (task / "children").read_text().split()}  # fmt: skip
        # WHEN its program's self_set is read by bpftool
        dump = subprocess.run(["bpftool", "-j", "map", "dump", "name", "self_set"],
                              capture_output=True, text=True, check=True)  # fmt: skip
        tracer.send_signal(signal.SIGINT)
        assert tracer.wait(timeout=300) == 0, err.read_text()
    # (its raw bytes: a map made again from the program cache has no BTF to format it)
    sets = [set(struct.unpack("=8I", bytes(int(byte, 16) for byte in entry["value"])))
            for entry in json.loads(dump.stdout)]  # fmt: skip
    # THEN one set holds the tracer and each of its children (the endpoint among them)
    assert children, "serve forked no endpoint"
    assert any({tracer.pid, *children} <= found for found in sets), (sets, tracer.pid, children)
