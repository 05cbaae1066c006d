"""A trace loaded from the compiled-program cache (tracer/bpf_cache.py)
sees exactly what a compiled one sees: the same run twice, the first
compiling and storing, the second loading what the first stored, both
checked against what the workloads know they did."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from mtrace_live.tracer.sdt_glibc import SdtGlibc

from .conftest import MTRACE
from .test_live_trace import events_of, summary_numbers
from .test_usdt_counts import DOCUMENTED_PROBES

LONG_AGO = 1_000_000_000  # 2001: a cache file loaded since has a newer mtime


def traced(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MTRACE_LIVE_BPF_CACHE": str(cache)}
    return subprocess.run([*MTRACE, *args], capture_output=True, text=True, timeout=300, env=env)


def stored(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.json"))


def test_a_live_trace_loaded_from_the_cache_counts_every_probe_and_allocation(
    sdt: SdtGlibc, probe_exerciser: Path, tmp_path: Path
) -> None:
    # GIVEN an empty cache, and the probe exerciser run twice under `run`
    # (its pid known before loading: the followed-pid shortcut; allocation
    # functions and the kmem tracepoints attached too)
    cache = tmp_path / "cache"
    counts, calls = [], []
    for attempt in range(2):
        truth_file = tmp_path / f"truth{attempt}.json"
        done = traced(cache, "run", "--sdt-glibc", "--probes", "*", "--kmem", "-o", "json",
                      "--", str(probe_exerciser), "--out", str(truth_file))  # fmt: skip
        assert done.returncode == 0, done.stderr
        # WHEN the first run has stored the program (then aged, to see the second load it)
        if attempt == 0:
            files = stored(cache)
            assert len(files) == 1
            os.utime(files[0], (LONG_AGO, LONG_AGO))
        truth = json.loads(truth_file.read_text())
        by_probe: dict[str, int] = {}
        for event in events_of(done.stdout):
            by_probe[event["probe"]] = by_probe.get(event["probe"], 0) + 1
        counts.append(({n: by_probe.get(n, 0) for n in DOCUMENTED_PROBES},
                       {n: truth["probes"][n]["count"] for n in DOCUMENTED_PROBES}))  # fmt: skip
        kernel, delivered, lost = summary_numbers(done.stderr)
        assert (kernel, lost) == (delivered, 0)
        tables = [json.loads(line) for line in done.stdout.splitlines() if '"table"' in line]
        calls.append(sum(row.get("calls", 0) for row in tables
                         if row.get("table") == "alloc_processes"))  # fmt: skip
    # THEN the second run loaded the stored program (and stored nothing new)
    files = stored(cache)
    assert len(files) == 1
    assert files[0].stat().st_mtime > LONG_AGO
    # AND both runs counted every probe hit the exerciser made, exactly
    for seen, truth in counts:
        assert seen == truth
    # AND both saw the exerciser's allocation calls
    assert calls[0] > 0 and calls[1] > 0


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
        if attempt == 0:
            os.utime(stored(cache)[0], (LONG_AGO, LONG_AGO))
        truth = json.loads(truth_file.read_text())
        reports.append((json.loads(done.stdout), truth))
    # THEN the second loaded the first's program
    assert stored(cache)[0].stat().st_mtime > LONG_AGO
    # AND each counted exactly the sockets its exerciser made (the raw
    # tracepoints, attached from the cache as bcc attaches them)
    for report, truth in reports:
        expected = truth["expected"]["kmem_cache_alloc"]["sock_inode_cache"]
        assert report["kmem_cache_allocs"]["sock_inode_cache"] == expected == sockets


def test_a_cache_that_does_not_parse_is_compiled_over(kmem_exerciser: Path, tmp_path: Path) -> None:
    # GIVEN a cache whose stored program was damaged
    cache = tmp_path / "cache"
    argv = ["count", "--kmem-only", "--json", "--", str(kmem_exerciser), "--sockets", "50",
            "--pipes", "0", "--out", str(tmp_path / "t.json")]  # fmt: skip
    assert traced(cache, *argv).returncode == 0
    damaged = stored(cache)[0]
    damaged.write_text('{"functions": ')
    # WHEN the same trace runs again
    done = traced(cache, *argv)
    # THEN it compiled (as without a cache), counted, and stored a good copy
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["kmem_cache_allocs"]["sock_inode_cache"] == 50
    assert json.loads(damaged.read_text())["functions"]
