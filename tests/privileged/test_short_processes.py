"""Short programs exec'd by the thousand, each whole from its first
allocation, with none held: ``build/short_chain`` (-O2, no frame pointers,
PIE: its 50 mallocs each through main > outer > middle > inner) run 1,000
times by a Python loop of subprocess.run, each process gone a millisecond or
so after its exec, before user space could read its maps.

A walk that meets a PC in no mapping of its process's tables finds the
mapping in the kernel (unwind_vma.bpf.c: bpf_find_vma) and the file's rows
by (device, inode); the first walk to meet the program's file asks for its
rows, written within milliseconds by the file server, so
only the first few processes of the loop step by frame pointers there. Each
process's frames are stored by file and link-time address (a frame in a
numbered file, probes/frame_kinds.py), so they are named without its maps,
and are the same in every process (checked against nm's symbols of the
program); the frames stepped by frame pointers before are named by the
mappings its walks found. Checked, under
``--all``, ``run --follow-forks``, ``serve --comm`` and ``serve``: every
malloc of the loop's processes counted as bpftrace counts them in the same
run, and at least 99% of them with the whole chain down to main (from the
pprof profile), or (serve, which keeps no stack of a process gone) at least
99% of the walks complete (from /metrics)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from mtrace_live.probes.frame_kinds import in_file
from mtrace_live.tracer.processes.target import default_libc
from prometheus_client.parser import text_string_to_metric_families

from .conftest import MTRACE, built
from .test_serve import SERVE_READY, free_port
from .tracing import (
    BPFTRACE_READY,
    Reaper,
    interrupt_bpftrace,
    malloc_samples,
    nm_symbols,
    parsed,
    start_bpftrace,
    wait_for_line,
    wait_until,
)

RUNS = 1000
ALLOCS = 50  # each run's mallocs (short_chain.c)
CHAIN = ["inner", "middle", "outer", "main", "__libc_start_call_main"]
READY = "Ctrl-C to stop"
# bpftrace: every process's mallocs, and those the program made (after its
# exec; the loop's child makes none before)
COUNT = (
    "uprobe:{libc}:malloc {{ @mallocs[pid] = count(); }}\n"
    'uprobe:{libc}:malloc /comm == "short_chain"/ {{ @programs[pid] = count(); }}\n'
)


@pytest.fixture(scope="module")
def short_chain() -> Path:
    return built("short_chain")


def loop(program: Path) -> list[str]:
    """A loop running ``program`` RUNS times, one after the other (Python's
    subprocess: its child execs without a call of its own before)."""
    script = (
        "import subprocess, sys\n"
        f"for _ in range({RUNS}):\n    subprocess.run(sys.argv[1:], check=True)\n"
    )
    return [sys.executable, "-c", script, str(program)]


def bpftrace_maps(out: Path) -> dict[str, dict[int, int]]:
    """bpftrace's maps, by name, each by process."""
    maps: dict[str, dict[int, int]] = {}
    for line in out.read_text(errors="replace").splitlines():
        record = json.loads(line) if line.startswith("{") else {}
        if record.get("type") == "map":
            for name, counts in record["data"].items():
                maps.setdefault(name, {}).update({int(k): int(v) for k, v in counts.items()})
    return maps


def nm_spans(program: Path) -> dict[str, tuple[int, int]]:
    """Each function's [start, end) link-time addresses, as nm reads them."""
    return {name: (start, start + size) for name, (start, size, kind) in nm_symbols(program).items()
            if kind in "tT" and size}  # fmt: skip


def chain_frames(profile: Path) -> set[tuple[int, ...]]:
    """The location addresses of the program's four frames (inner to
    main) in each sample whose stack is the whole chain."""
    prof = parsed(profile.read_bytes())
    strings = prof.string_table
    names = {f.id: strings[f.name] for f in prof.function}
    locations = {loc.id: loc for loc in prof.location}
    found = set()
    for sample in prof.sample:
        stack = [locations[i] for i in sample.location_id]
        named = [names[line.function_id] for loc in stack for line in loc.line]
        if named[: len(CHAIN)] == CHAIN:
            found.add(tuple(loc.address for loc in stack[:4]))
    return found


def assert_named_by_file(profile: Path, program: Path) -> None:
    """The chain's frames are frames in a file: one set of values in all
    1,000 processes (addresses in each would differ: each process is
    placed anew), of the kind FRAME_KIND_FILE, whose link-time addresses
    lie in the functions nm names."""
    found = chain_frames(profile)
    assert len(found) == 1, found
    spans = nm_spans(program)
    for value, function in zip(found.pop(), CHAIN, strict=False):
        placed = in_file(value)
        assert placed is not None, hex(value)
        start, end = spans[function]
        assert start < placed[1] <= end, (function, hex(placed[1]), spans[function])


def chains_by_pid(profile: Path) -> tuple[Counter[int], Counter[int]]:
    """Per process, its malloc calls (alloc_objects), and those whose stack
    is the program's whole chain: inner, middle, outer, main, the libc's
    caller of main."""
    calls: Counter[int] = Counter()
    whole: Counter[int] = Counter()
    for pid, n, stack in malloc_samples(profile):
        calls[pid] += n
        if stack[: len(CHAIN)] == CHAIN:
            whole[pid] += n
    return calls, whole


@pytest.fixture
def counted(tmp_path: Path) -> Iterator[tuple[Reaper, subprocess.Popen[bytes], Path]]:
    """bpftrace counting the loop's mallocs, ready."""
    with Reaper() as reaper:
        bpftrace, out = start_bpftrace(COUNT.format(libc=default_libc()), 0, tmp_path)
        reaper.add(bpftrace)
        wait_for_line(out, BPFTRACE_READY, bpftrace, timeout=120)
        yield reaper, bpftrace, out


def bpftrace_counts(bpftrace: subprocess.Popen[bytes], out: Path) -> tuple[dict[int, int], int]:
    """bpftrace's count of each of the loop's processes' mallocs (the
    shell's before the exec too), and of the program's own."""
    interrupt_bpftrace(bpftrace)
    maps = bpftrace_maps(out)
    programs = maps.get("@programs", {})
    assert len(programs) == RUNS and set(programs.values()) == {ALLOCS}, Counter(programs.values())
    return {pid: maps["@mallocs"][pid] for pid in programs}, sum(programs.values())


def assert_whole(profile: Path, stderr: str, counts: tuple[dict[int, int], int]) -> None:
    """Every malloc of the loop's processes counted as bpftrace counted it,
    and 99% of the program's with the whole chain."""
    assert "Traceback" not in stderr and "error:" not in stderr, stderr
    calls, whole = chains_by_pid(profile)
    by_pid, programs = counts
    # THEN each of the 1,000 processes has its mallocs, as bpftrace counted them
    assert {pid: calls[pid] for pid in by_pid} == by_pid
    # AND at least 99% of the program's have the whole chain down to main
    share = sum(whole[pid] for pid in by_pid) / programs
    print(f"whole down to main: {share:.2%} of {programs} mallocs")  # (pytest -s, the docs' figure)
    assert share >= 0.99, (share, stderr[-3000:])


# (--all in make soak: slower than make test's budget, which run's case keeps)
@pytest.mark.parametrize("mode", [pytest.param("--all", marks=pytest.mark.soak), "run"])
def test_a_thousand_short_processes_are_whole_from_their_first_allocation(
    mode: str, short_chain: Path, counted: tuple[Reaper, subprocess.Popen[bytes], Path],
    tmp_path: Path,
) -> None:  # fmt: skip
    reaper, bpftrace, out = counted
    profile, err = tmp_path / "heap.pb.gz", tmp_path / "trace.err"
    # (each process's stacks are rows of their own: room for 1,000 processes beside pytest's)
    outputs = ["-o", "summary", "--alloc-stacks", "131072", "--pprof", str(profile)]
    # GIVEN a trace of every process, or of a command and its children
    # WHEN the loop runs its 1,000 short processes to their end
    with open(err, "wb") as sink:
        if mode == "run":
            tracer = reaper.add(subprocess.Popen(
                [*MTRACE, "run", "--follow-forks", *outputs, "--", *loop(short_chain)],
                stdout=sink, stderr=sink))  # fmt: skip
        else:
            tracer = reaper.add(subprocess.Popen([*MTRACE, "--all", *outputs], stdout=sink,
                                                 stderr=sink))  # fmt: skip
    wait_for_line(err, READY, tracer, timeout=120)
    if mode != "run":
        assert reaper.add(subprocess.Popen(loop(short_chain))).wait(timeout=300) == 0
        tracer.send_signal(signal.SIGINT)
    assert tracer.wait(timeout=300) == 0, err.read_text()
    assert_whole(profile, err.read_text(), bpftrace_counts(bpftrace, out))
    # AND the program's frames name themselves: by file, the same in every process
    assert_named_by_file(profile, short_chain)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip


def walks(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> Counter[str]:
    return Counter({dict(labels)["ended"]: int(value) for (name, labels), value in metrics.items()
                    if name == "mtrace_stack_walks_total"})  # fmt: skip


def rendered(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
    return metrics[("mtrace_metrics_rendered_time_seconds", ())]


def short_chain_calls(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> int:
    return int(sum(value for (name, labels), value in metrics.items()
                   if name == "mtrace_alloc_calls_total"
                   and dict(labels)["process"] == "short_chain"))  # fmt: skip


# (system-wide in make soak: slower than make test's budget, which --comm's case keeps)
@pytest.mark.parametrize("narrowed", [True, pytest.param(False, marks=pytest.mark.soak)],
                         ids=["comm", "system-wide"])  # fmt: skip
def test_serve_walks_a_thousand_short_processes_whole(
    narrowed: bool, short_chain: Path, counted: tuple[Reaper, subprocess.Popen[bytes], Path],
    tmp_path: Path,
) -> None:  # fmt: skip
    reaper, bpftrace, out = counted
    port, err = free_port(), tmp_path / "serve.err"
    # GIVEN serve, of the program's processes only or of every process,
    # every allocation kept (--exact: serve samples by default)
    comm = ["--comm", "short_chain"] if narrowed else []
    with open(err, "wb") as sink:
        tracer = reaper.add(subprocess.Popen(
            [*MTRACE, "serve", "--exact", "--listen", f"127.0.0.1:{port}", *comm],
            stdout=sink, stderr=sink))  # fmt: skip
    wait_for_line(err, SERVE_READY, tracer, timeout=120)
    # (the test's own first scrape loads its HTTP client: the walks of its
    # first calls in those files are in the page read next, before the loop)
    scrape(port)
    warmed = time.time()
    wait_until(lambda: rendered(scrape(port)) > warmed, "a page read after the first")
    before = walks(scrape(port))
    # WHEN the loop runs its 1,000 short processes to their end
    assert reaper.add(subprocess.Popen(loop(short_chain))).wait(timeout=300) == 0
    ended = time.time()
    # the figures of a page read since (serve renders a page at most so often),
    # before bpftrace ends (its own calls then)
    wait_until(lambda: rendered(scrape(port)) > ended, "a page read after the loop")
    during = walks(scrape(port)) - before
    by_pid, expected = bpftrace_counts(bpftrace, out)
    assert sum(by_pid.values()) == expected  # none before an exec
    # THEN serve counts the program's mallocs as bpftrace counted them (the
    # processes gone are retired, their counts kept under their name)
    wait_until(lambda: short_chain_calls(scrape(port)) >= expected, f"{expected} mallocs")
    metrics = scrape(port)
    assert short_chain_calls(metrics) == expected, metrics
    # AND at least 99% of the walks meanwhile were complete (system-wide, the
    # few of the other processes among them: the test's own, the shell's)
    assert during.total() >= expected, during
    share = during["complete"] / during.total()
    print(f"complete walks: {share:.2%} of {during.total()}")  # (pytest -s, the docs' figure)
    assert share >= 0.99, (during, err.read_text()[-3000:])
    tracer.send_signal(signal.SIGTERM)
    assert tracer.wait(timeout=120) == 0, err.read_text()
