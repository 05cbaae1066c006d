"""Lock waits by call stack, against a workload whose waiting chains are
known (tests/workloads/cfi/lock_chains.c: three chains, each waiting on a
malloc arena's own lock, built without frame pointers, each wait timed by the
workload itself): the JSON ``lock_stacks`` table, ``--pprof-mutex`` as
``go tool pprof`` reads it, and the summary's "top stacks by arena lock wait
time"."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

from .conftest import MTRACE, built
from .test_heap_profiles import go_raw
from .tracing import Reaper, wait_for_line

WAITS = 40  # per chain


def function(frame: str) -> str:
    """A frame's function, without its offset and line ("wait_a+0x7d (f.c:88)")."""
    return re.sub(r"\+0x[0-9a-f]+$", "", frame.split(" ")[0])


def is_whole(frames: list[str], chain: tuple[str, ...]) -> bool:
    """``frames`` (innermost first) are ``chain``'s, whole: the chain, then
    the libc's start of the thread (start_thread, then the clone) or of the
    program (down to _start)."""
    names = [function(f) for f in frames]
    inner, rest = names[: len(chain)], names[len(chain) :]
    started = rest[:1] == ["start_thread"] if chain[0] != "main" else rest[-1:] == ["_start"]
    return inner == list(reversed(chain)) and started and len(rest) in (2, 3)


def traced_chains(tmp: Path) -> tuple[dict[tuple[str, ...], tuple[int, int]], list[dict[str, Any]],
                                      str, Path]:  # fmt: skip
    """The workload's chains (frames outermost first -> its waits and their
    time by its own clock), mtrace-live's JSON documents and standard error
    (with the summary), and its contention profile."""
    profile = tmp / "mutex.pb.gz"
    with Reaper() as reaper:
        work = reaper.add(subprocess.Popen([str(built("lock_chains")), str(WAITS)],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           text=True))  # fmt: skip
        assert work.stdout is not None and work.stdin is not None
        assert work.stdout.readline() == "ready\n"
        out, err = tmp / "mtrace.out", tmp / "mtrace.err"
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            tracer = reaper.add(subprocess.Popen(
                [*MTRACE, "--pid", str(work.pid), "--no-allocs", "-o", "json",
                 "--pprof-mutex", str(profile)], stdout=stdout, stderr=stderr))  # fmt: skip
        wait_for_line(err, "Ctrl-C to stop", tracer, timeout=120)
        work.stdin.write("x")
        work.stdin.flush()
        lines = [work.stdout.readline() for _ in range(3)]
        work.stdin.write("y")
        work.stdin.close()
        assert work.wait(timeout=120) == 0
        work.stdout.close()
        assert tracer.wait(timeout=120) == 0, err.read_text()
    chains = {}
    for line in lines:
        _, calls, total, frames = line.split()
        chains[tuple(frames.split(";"))] = (int(calls), int(total))
    docs = [json.loads(line) for line in out.read_text().splitlines()
            if line.startswith("{")]  # fmt: skip
    return chains, docs, err.read_text(), profile


def test_each_waiting_chain_is_one_stack_with_its_waits_and_time(tmp_path: Path) -> None:
    # GIVEN three chains waiting on an arena's lock, traced by pid
    chains, docs, err, profile = traced_chains(tmp_path)
    assert [calls for calls, _ in chains.values()] == [WAITS] * 3
    # THEN the JSON table has each chain as one stack, whole to the thread's
    # start, with its waits; its time within the workload's own clock of
    # each call (which brackets it) and near it (the probes' cost apart)
    rows = [doc for doc in docs if doc.get("table") == "lock_stacks"]
    assert {row["lock"] for row in rows} == {"arena"}
    assert sum(row["waits"] for row in rows) == 3 * WAITS, rows
    for chain, (calls, total_ns) in chains.items():
        (row,) = [r for r in rows if is_whole(r["frames"], chain)]
        assert row["waits"] == calls, row
        assert 0.8 * total_ns <= row["total_ns"] <= total_ns, (chain, row, total_ns)
        assert row["max_ns"] <= row["total_ns"]
    # AND go tool pprof reads the contention profile: each chain's stack with
    # its contentions and its delay in nanoseconds, as the table has them
    raw = go_raw(str(profile), tmp_path)
    for chain in chains:
        (row,) = [r for r in rows if is_whole(r["frames"], chain)]
        found = [s.values for s in raw.samples if is_whole(s.frames, chain)]
        assert found == [[row["waits"], row["total_ns"]]], (chain, found)
    # AND the summary lists the three stacks by wait time, each with its waits
    # (its first six frames)
    top = err.partition("top stacks by arena lock wait time:")[2].splitlines()[2:5]
    shown = [re.sub(r"\+0x[0-9a-f]+( \([^)]*\))?", "", line) for line in top]
    for chain, (calls, _) in chains.items():
        (line,) = [ln for ln in shown if " < ".join(reversed(chain)) + " < " in ln]
        assert re.search(rf"\s{calls}\s.*\sarena\s", line), line
