"""Frees of blocks the trace could not track, told from those of memory
allocated before the trace.

A workload started by ``run`` holds more blocks at once than a small
``--max-outstanding`` can track, then frees them all: nothing was allocated
before the trace, so every free of a block not seen allocated is one the
full table left untracked, and the summary, the JSON tables and the
metrics must say so, with the counts of the workload and of bpftrace.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from mtrace_live.tracer.processes.target import default_libc

from .conftest import MTRACE, built
from .test_serve import free_port
from .test_short_processes import scrape
from .tracing import (
    BPFTRACE_READY,
    Reaper,
    start_bpftrace,
    stop_bpftrace,
    wait_for_line,
    wait_until,
)

BLOCKS = 20_000
MAX_OUTSTANDING = 1000
ROWS = 2048  # the outstanding table: 2 x --max-outstanding, rounded up to a power of two
READY = "Ctrl-C to stop"


Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def traced_run(
    tmp_path: Path,
) -> tuple[dict[str, Any], dict[str, int], str, list[dict[str, Any]], Metrics]:
    """The workload under run, with bpftrace: its truth, bpftrace's counts,
    the trace's summary and JSON lines, and the metrics once they held
    every free."""
    # GIVEN bpftrace counting the workload's malloc and free calls, and the
    # workload started by run with a table of outstanding blocks too small
    libc = default_libc()
    truth_file, gate = tmp_path / "truth.json", tmp_path / "gate"
    os.mkfifo(gate)
    port = free_port()
    where = 'comm == "hold_blocks"'
    script = (f"uprobe:{libc}:malloc /{where}/ {{ @hits[probe] = count(); }}\n"
              f"uprobe:{libc}:free /{where} && arg0 != 0/ "
              "{ @hits[probe] = count(); }\n")  # fmt: skip
    options = ["run", "--max-outstanding", str(MAX_OUTSTANDING), "-o", "json",
               "--prometheus", f"127.0.0.1:{port}"]  # fmt: skip
    # (the same trace once before bpftrace, whose libc uprobes trap in every
    # process: the program is compiled now, not under them, and cached)
    first = subprocess.run([*MTRACE, *options, "--", "true"], capture_output=True, timeout=600)
    assert first.returncode == 0, first.stderr
    with Reaper() as reaper:
        bpftrace, bpftrace_out = start_bpftrace(script, os.getpid(), tmp_path)
        reaper.add(bpftrace)
        wait_for_line(bpftrace_out, BPFTRACE_READY, bpftrace, timeout=120)
        out, err = tmp_path / "trace.json", tmp_path / "trace.err"
        with open(out, "wb") as lines, open(err, "wb") as errors:
            tracer = reaper.add(subprocess.Popen(
                [*MTRACE, *options, "--",
                 str(built("hold_blocks")), str(BLOCKS), str(truth_file), str(gate)],
                stdout=lines, stderr=errors))  # fmt: skip
        # WHEN it has freed every block (its truth written), the metrics are
        # scraped while it waits, then it ends and the trace with it
        wait_for_line(err, READY, tracer, timeout=600)
        wait_until(lambda: truth_file.exists() or tracer.poll() is not None, "the workload's frees")
        assert truth_file.exists(), err.read_text()
        # (the endpoint serves the figures of the trace's last read: until
        # they hold every free the workload made)
        truth = json.loads(truth_file.read_text())
        metrics: Metrics = {}

        def scraped_all() -> bool:
            metrics.clear()
            metrics.update(scrape(port))
            return of_workload(metrics, "mtrace_free_calls_total") == int(truth["frees"])

        wait_until(scraped_all, "the metrics of every free")
        with open(gate, "w") as release:
            release.write("x")
        assert tracer.wait(timeout=300) == 0, err.read_text()
        counts = stop_bpftrace(bpftrace, bpftrace_out)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return truth, counts, err.read_text(), rows, metrics


def test_frees_past_a_full_table_are_said_to_be_so_under_run(tmp_path: Path) -> None:
    truth, counts, summary, rows, metrics = traced_run(tmp_path)
    (table,) = [row for row in rows if row.get("table") == "alloc_processes"
                and row["pid"] == truth["pid"]]  # fmt: skip
    # THEN the calls and frees are the workload's and bpftrace's
    assert (table["calls"], table["frees"]) == (truth["mallocs"], truth["frees"])
    assert (counts["malloc"], counts["free"]) == (truth["mallocs"], truth["frees"])
    # AND at least the blocks the table could not hold were not tracked, and
    # each of their frees is one of a block not tracked (one thread, no fork,
    # nothing allocated before the trace)
    untracked = table["untracked"]
    assert truth["mallocs"] - ROWS <= untracked <= truth["mallocs"]
    assert table["unknown_frees"] == untracked
    assert table["unknown_frees_of"] == ["untracked"]
    # AND the summary says the table was full, never "before the trace"
    (line,) = [x for x in summary.splitlines()
               if x.startswith(f"allocations: pid {truth['pid']}:")]  # fmt: skip
    assert (
        f"{truth['frees']} frees ({untracked} of blocks not tracked: the tables were full "
        f"for {untracked} allocations, see --max-outstanding);" in line
    ), line
    assert "before the trace" not in summary
    assert re.search(rf"allocation tables full: {untracked} allocations not tracked until freed",
                     summary), summary  # fmt: skip

    # AND so do the metrics, for the workload's process
    assert of_workload(metrics, "mtrace_alloc_untracked_calls_total") == untracked
    assert of_workload(metrics, "mtrace_free_unknown_calls_total") == untracked


def of_workload(metrics: Metrics, family: str) -> float:
    """The workload's sample of ``family`` (its allocator label may not be
    known yet at a scrape: any is taken)."""
    return sum(value for (name, labels), value in metrics.items()
               if name == family and dict(labels)["process"] == "hold_blocks")  # fmt: skip
