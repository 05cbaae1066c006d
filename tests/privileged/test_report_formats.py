"""`report --format pprof` and `--format folded` on a record set of user-space
allocations (`record --libc`), read back by the real `go tool pprof` and held
to what the workload says it did (tests/workloads/alloc_workload.c)."""

from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from .conftest import MTRACE, built
from .test_allocations import pprof_top


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A record set of the allocation workload run from its first instruction."""
    tmp = tmp_path_factory.mktemp("report-formats")
    truth_file = tmp / "truth.json"
    done = subprocess.run(
        [*MTRACE, "record", "-o", str(tmp / "set"), "--libc", "--",
         str(built("alloc_workload")), "--out", str(truth_file)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return tmp / "set", json.loads(truth_file.read_text())


def by_function(truth: dict[str, Any], key: str) -> dict[str, int]:
    """The workload's own figure ``key`` summed by the function that allocated."""
    sums: dict[str, int] = defaultdict(int)
    for site in truth["sites"]:
        sums[site["function"]] += site[key]
    return sums


def test_report_as_pprof_reads_back_in_go_tool_pprof(
    recorded: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    # GIVEN the record set's profile, as report writes it
    records, truth = recorded
    profile = tmp_path / "heap.pb.gz"
    with open(profile, "wb") as out:
        argv = [*MTRACE, "report", str(records), "--format", "pprof"]
        done = subprocess.run(argv, stdout=out, stderr=subprocess.PIPE, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # WHEN go tool pprof reads it
    inuse = pprof_top(profile, "inuse_space")
    allocated = pprof_top(profile, "alloc_space")
    # THEN each of the workload's functions holds the bytes it leaked, and
    # allocated the bytes it asked for, exactly
    for function, nbytes in by_function(truth, "leaked_bytes").items():
        assert inuse.get(function, 0) == nbytes, (function, inuse)
    for function, nbytes in by_function(truth, "bytes").items():
        assert allocated.get(function, 0) == nbytes, (function, allocated)


def test_report_as_folded_stacks_holds_the_live_bytes(
    recorded: tuple[Path, dict[str, Any]],
) -> None:
    # GIVEN the record set's folded stacks, as report writes them
    records, truth = recorded
    done = subprocess.run([*MTRACE, "report", str(records), "--format", "folded"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    # THEN each line is a stack and a positive number of live bytes, and the
    # bytes under each of the workload's functions (the innermost frame) are
    # the bytes it leaked; functions that leaked nothing have no line
    live: dict[str, int] = defaultdict(int)
    for line in done.stdout.splitlines():
        stack, _, amount = line.rpartition(" ")
        assert stack and int(amount) > 0, line
        live[stack.split(";")[-1]] += int(amount)
    for function, nbytes in by_function(truth, "leaked_bytes").items():
        assert live.get(function, 0) == nbytes, (function, live)
