"""A trace loaded from the compiled-program cache (tracer/bpf/bpf_cache.py)
sees exactly what a compiled one sees: the same run twice, the first
compiling and storing, the second loading what the first stored, both
checked against what the workloads know they did."""

from __future__ import annotations

import json
import os
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

from mtrace_live.tracer.processes.sdt_glibc import SdtGlibc

from .conftest import MTRACE, built
from .test_allocations import by_site
from .test_live_trace import events_of, summary_numbers
from .test_usdt_counts import DOCUMENTED_PROBES

COMPILED = "debug: BPF program trace compiled in"
FROM_CACHE = "debug: BPF program trace loaded from the cache in"
UNUSABLE = "warning: the cached BPF program is unusable, compiled it anew"


def traced(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """mtrace-live ARGS with ``cache`` as its program cache, saying in its
    start-up report where its program came from."""
    env = {**os.environ, "MTRACE_LIVE_BPF_CACHE": str(cache), "MTRACE_LIVE_DEBUG": "1"}
    return subprocess.run([*MTRACE, *args], capture_output=True, text=True, timeout=300, env=env)


def origin(done: subprocess.CompletedProcess[str]) -> str:
    """Where the run's program came from, as its start-up report says."""
    said = [line for line in done.stderr.splitlines() if "debug: BPF program" in line]
    assert len(said) == 1, done.stderr
    return "cache" if FROM_CACHE in said[0] else "compiled" if COMPILED in said[0] else said[0]


def stored(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.json"))


def test_a_live_trace_loaded_from_the_cache_counts_every_probe_and_allocation(
    sdt: SdtGlibc, probe_exerciser: Path, tmp_path: Path
) -> None:
    # GIVEN an empty cache, and the probe exerciser run twice under `run`
    # (its pid known before loading: the followed-pid shortcut; allocation
    # functions and the kmem tracepoints attached too)
    cache = tmp_path / "cache"
    counts, origins = [], []
    for attempt in range(2):
        truth_file = tmp_path / f"truth{attempt}.json"
        done = traced(cache, "run", "--sdt-glibc", "--probes", "*", "--kmem", "-o", "json",
                      "--", str(probe_exerciser), "--out", str(truth_file))  # fmt: skip
        assert done.returncode == 0, done.stderr
        origins.append(origin(done))
        truth = json.loads(truth_file.read_text())
        by_probe: dict[str, int] = {}
        for event in events_of(done.stdout):
            by_probe[event["probe"]] = by_probe.get(event["probe"], 0) + 1
        counts.append(({n: by_probe.get(n, 0) for n in DOCUMENTED_PROBES},
                       {n: truth["probes"][n]["count"] for n in DOCUMENTED_PROBES}))  # fmt: skip
        kernel, delivered, lost = summary_numbers(done.stderr)
        assert (kernel, lost) == (delivered, 0)
    # THEN the first run compiled and stored the program, the second loaded
    # it from the cache (and stored nothing new)
    assert origins == ["compiled", "cache"]
    assert len(stored(cache)) == 1
    # AND both runs counted every probe hit the exerciser made, exactly
    for seen, truth in counts:
        assert seen == truth


def test_allocations_traced_from_the_cache_are_exact_per_call_site(tmp_path: Path) -> None:
    # GIVEN an empty cache, and the allocation workload run twice under `run`
    cache = tmp_path / "cache"
    for attempt, expected in enumerate(["compiled", "cache"]):
        truth_file = tmp_path / f"truth{attempt}.json"
        done = traced(cache, "run", "-o", "json", "--", str(built("alloc_workload")),
                      "--out", str(truth_file))  # fmt: skip
        assert done.returncode == 0, done.stderr
        # WHEN the second loads what the first compiled
        assert origin(done) == expected
        # THEN each counted every call site's calls, bytes and leaks exactly
        truth = json.loads(truth_file.read_text())
        tables: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for line in done.stdout.splitlines():
            record = json.loads(line)
            if "table" in record:
                tables[record["table"]].append(record)
        found = by_site(tables["alloc_stacks"])
        for site in truth["sites"]:
            got = found[(site["function"], site["fn"])]
            assert (got["calls"], got["bytes"], got["live_bytes"]) == (
                site["calls"], site["bytes"], site["leaked_bytes"]), (attempt, site)  # fmt: skip
        (functions,) = tables["alloc_functions"]
        assert functions["lost_events"] == 0


def test_kmem_counts_for_one_pid_are_exact_from_the_cache(
    kmem_exerciser: Path, tmp_path: Path
) -> None:
    # GIVEN an empty cache, and the kmem exerciser counted twice
    cache = tmp_path / "cache"
    sockets = 300
    reports = []
    for attempt in range(2):
        truth_file = tmp_path / f"truth{attempt}.json"
        done = traced(cache, "count", "--kmem-only", "--json", "--", str(kmem_exerciser),
                      "--sockets", str(sockets), "--pipes", "0",
                      "--out", str(truth_file))  # fmt: skip
        assert done.returncode == 0, done.stderr
        truth = json.loads(truth_file.read_text())
        reports.append((json.loads(done.stdout), truth, origin(done)))
    # THEN the first compiled, and the second loaded the first's program
    assert [said for _, _, said in reports] == ["compiled", "cache"]
    # AND each counted exactly the sockets its exerciser made (the raw
    # tracepoints, attached from the cache as bcc attaches them)
    for report, truth, _ in reports:
        expected = truth["expected"]["kmem_cache_alloc"]["sock_inode_cache"]
        assert report["kmem_cache_allocs"]["sock_inode_cache"] == expected == sockets


def test_a_cache_that_does_not_parse_is_compiled_over(kmem_exerciser: Path, tmp_path: Path) -> None:
    # GIVEN a cache whose stored program was damaged
    cache = tmp_path / "cache"
    argv = ["count", "--kmem-only", "--json", "--", str(kmem_exerciser), "--sockets", "50",
            "--pipes", "0", "--out", str(tmp_path / "t.json")]  # fmt: skip
    assert origin(traced(cache, *argv)) == "compiled"
    damaged = stored(cache)[0]
    damaged.write_text('{"functions": ')
    # WHEN the same trace runs again
    done = traced(cache, *argv)
    # THEN it said the stored program was unusable, compiled it (as without
    # a cache), counted, and stored a good copy, which a third run loads
    assert done.returncode == 0, done.stderr
    (warning,) = [line for line in done.stderr.splitlines() if UNUSABLE in line]
    assert str(damaged) in warning and "does not read as a stored program" in warning
    assert origin(done) == "compiled"
    assert json.loads(done.stdout)["kmem_cache_allocs"]["sock_inode_cache"] == 50
    assert json.loads(damaged.read_text())["functions"]
    again = traced(cache, *argv)
    assert origin(again) == "cache" and UNUSABLE not in again.stderr
