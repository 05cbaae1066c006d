"""A reader that stops: the tracer is SIGSTOPped while the workload makes
600,000 allocation and free calls, far more than a ring of 64 pages holds.
What the ring could not hold is lost, and counted exactly: the events
delivered (each a JSON line) and those counted lost add up to the calls the
kernel counted in its tables, which nothing loses, and those are the
workload's own calls and the few its thread's start made."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

from .conftest import MTRACE, built
from .tracing import Reaper, wait_for_line

ITERATIONS = 300_000  # malloc(32) and free pairs, in one thread


def test_a_stopped_tracer_loses_only_what_the_ring_cannot_hold_counted_exactly(
    tmp_path: Path,
) -> None:
    lines, err = tmp_path / "events.jsonl", tmp_path / "mtrace.err"
    with Reaper() as reaper:
        work = reaper.add(subprocess.Popen(
            [str(built("alloc_bench")), str(ITERATIONS), "1", "0"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env={**os.environ, "GATE": "1"}))  # fmt: skip
        assert work.stdin is not None and work.stdout is not None
        with open(lines, "wb") as out, open(err, "wb") as stderr:
            tracer = reaper.add(subprocess.Popen(
                [*MTRACE, "--pid", str(work.pid), "-o", "json", "--buffer-pages", "64"],
                stdout=out, stderr=stderr))  # fmt: skip
        wait_for_line(err, "Ctrl-C to stop", tracer, timeout=120)
        # GIVEN the tracer stopped for the whole of the workload's loop
        tracer.send_signal(signal.SIGSTOP)
        work.stdin.write(b"x")
        work.stdin.flush()
        said = [work.stdout.readline(), work.stdout.readline()]  # "wall", "calls": its loop ended
        assert said[1].startswith(b"calls "), said
        calls = int(said[1].split()[1])
        # WHEN it goes on, and is stopped
        tracer.send_signal(signal.SIGCONT)
        tracer.send_signal(signal.SIGINT)
        assert tracer.wait(timeout=120) == 0, err.read_text()
        work.stdin.close()
        work.stdout.close()
        assert work.wait(timeout=60) == 0
    summary = err.read_text()
    events = re.search(r"allocation events: (\d+) delivered, (\d+) lost", summary)
    counted = re.search(r"allocations: pid \d+: (\d+) calls, .*?; (\d+) frees", summary)
    probes = re.search(r"events: \d+ in the kernel, (\d+) delivered, 0 lost", summary)
    assert events and counted and probes, summary
    delivered, lost = int(events[1]), int(events[2])
    # THEN the ring overflowed, and delivered + lost is every call the kernel counted
    assert lost > 0
    assert delivered + lost == int(counted[1]) + int(counted[2])
    # AND those are the workload's calls, and the few of its thread's start
    assert 0 <= int(counted[1]) + int(counted[2]) - calls <= 16, (counted[0], calls)
    # AND each delivered event is a JSON line
    written = [x for x in lines.read_text().splitlines() if not x.startswith('{"table"')]
    assert len(written) == delivered + int(probes[1])
