"""A kmem tracepoint counted for one pid only, against what the workload did."""

import json
import subprocess
from pathlib import Path

from .conftest import mtrace_count

SOCKETS = 500


def test_sock_inode_cache_allocations_equal_sockets_made_by_the_traced_pid_only(
    kmem_exerciser: Path, tmp_path: Path
) -> None:
    # GIVEN a decoy process making many more sockets at the same time
    decoy = subprocess.Popen(
        [
            str(kmem_exerciser),
            "--sockets",
            str(20 * SOCKETS),
            "--pipes",
            "0",
            "--out",
            str(tmp_path / "decoy.json"),
        ]
    )
    # WHEN mtrace-live starts the exerciser and counts kmem tracepoints for it
    truth_file = tmp_path / "truth.json"
    done = mtrace_count(
        "--kmem-only",
        "--json",
        "--",
        str(kmem_exerciser),
        "--sockets",
        str(SOCKETS),
        "--pipes",
        str(SOCKETS),
        "--out",
        str(truth_file),
    )
    assert decoy.wait(timeout=120) == 0
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    truth = json.loads(truth_file.read_text())

    # THEN every socket() of the traced pid, and nothing of the decoy's, was counted
    assert truth["pid"] == report["pid"]
    expected = truth["expected"]["kmem_cache_alloc"]["sock_inode_cache"]
    assert report["kmem_cache_allocs"]["sock_inode_cache"] == expected == SOCKETS
    # AND the tracepoint totals include those allocations
    assert report["kmem"]["kmem_cache_alloc"] >= SOCKETS
    assert report["kmem"]["kmalloc"] >= SOCKETS  # each pipe kmallocs its pipe_inode_info
