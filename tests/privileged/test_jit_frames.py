"""Frames of JIT code in allocation stacks, on a running Node.js process
attached afterwards (``--pid``): kept, named from the perf map V8 writes
with ``--perf-basic-prof``, and shown as ``[jit] 0x...`` without one.

The workload (tests/workloads/node_buffers.js) calls outer -> middle -> leaf
from JavaScript, compiled to machine code in anonymous executable memory,
and leaf makes a Buffer whose data is one malloc of a size nothing else in
Node asks for; it prints its ledger: the calls, the bytes, the functions.
Below the JavaScript frames the stack goes on through V8's entry, Node's
callbacks and libuv's loop to the program's start: Node's ``main`` is one
jump to ``node::Start`` (a tail call), which stands in its place, called by
the libc's ``__libc_start_call_main`` and so from ``_start``.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.unit.profile_proto import parsed

from .conftest import MTRACE, REPO
from .test_cfi_stacks import go_traces
from .tracing import Reaper, wait_for_line

NODE = Path("/usr/bin/node")
WORKLOAD = REPO / "tests" / "workloads" / "node_buffers.js"
READY = "Ctrl-C to stop"
# every function compiled to machine code at its first call, each its own frame
JIT_FLAGS = ["--always-sparkplug", "--no-turbo-inlining"]
# the frames below the JavaScript ones, outermost last: the event loop, Node's
# start (in main's place), the libc's call of main, the program's entry
BELOW = ["uv_run", "node::Start(int, char**)", "__libc_start_call_main"]
PROGRAM_ROOT = "_start"
# V8's perf map names a function's code "JS:" + its tier's mark (~ ^ + *) +
# its name, then its script:line:column
JS_NAME = re.compile(r"^JS:[~^+*]?(?P<name>\S*) (?P<script>.+):\d+:\d+$")
# (the trace's JSON lines, its pprof profile, its folded stacks)
Traced = tuple[dict[str, Any], list[dict[str, Any]], Path, str]


def trace_workload(perf_map: bool, tmp: Path) -> Traced:
    """The workload started first (with V8's perf map or without), then
    traced by mtrace-live (--pid) through its chain: its ledger, the
    trace's stack rows, its pprof profile and its folded stacks. The trace
    ends while the workload still runs."""
    if not NODE.is_file():
        pytest.fail(f"{NODE} is missing: the JIT frames are checked on Node.js "
                    "(scripts/setup.sh installs it)")  # fmt: skip
    argv = [str(NODE), *(["--perf-basic-prof"] if perf_map else []), *JIT_FLAGS, str(WORKLOAD)]
    profile, folded = tmp / "allocs.pb.gz", tmp / "allocs.folded"
    # (in tmp: with --perf-basic-prof V8 writes its log, isolate-*-v8.log, where it runs)
    with Reaper() as reaper, subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                              cwd=tmp) as proc:  # fmt: skip
        reaper.add(proc)
        try:
            assert proc.stdout is not None and proc.stdin is not None
            assert proc.stdout.readline() == b"ready\n"
            err, out = tmp / "trace.err", tmp / "trace.out"
            with open(err, "wb") as errors, open(out, "wb") as lines:
                tracer = reaper.add(subprocess.Popen(
                    [*MTRACE, "--pid", str(proc.pid), "-o", "json", "--pprof", str(profile),
                     "--folded", str(folded)], stdout=lines, stderr=errors))  # fmt: skip
            wait_for_line(err, READY, tracer, timeout=120)
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            ledger = json.loads(proc.stdout.readline())
            tracer.send_signal(signal.SIGINT)
            assert tracer.wait(timeout=120) == 0, err.read_text()
            proc.stdin.write(b"exit\n")
            proc.stdin.close()
            assert proc.wait(timeout=120) == 0
        finally:
            Path(f"/tmp/perf-{proc.pid}.map").unlink(missing_ok=True)  # V8 leaves it
    assert ledger["perf_map"] == perf_map
    stacks = [record for line in out.read_text().splitlines()
              if (record := json.loads(line)).get("table") == "alloc_stacks"]  # fmt: skip
    return ledger, stacks, profile, folded.read_text()


@pytest.fixture(scope="module")
def named(tmp_path_factory: pytest.TempPathFactory) -> Traced:
    """The workload traced while V8 writes its perf map."""
    return trace_workload(True, tmp_path_factory.mktemp("jit-named"))


@pytest.fixture(scope="module")
def unnamed(tmp_path_factory: pytest.TempPathFactory) -> Traced:
    """The workload traced while V8 writes no perf map."""
    return trace_workload(False, tmp_path_factory.mktemp("jit-unnamed"))


def ledger_stacks(ledger: dict[str, Any], stacks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The workload's stack rows: its allocating function, its size alone."""
    return [stack for stack in stacks if stack["pid"] == ledger["pid"]
            and stack["allocator"] == ledger["fn"]
            and stack["bytes"] == stack["calls"] * ledger["size"]]  # fmt: skip


def holds_chain(names: list[str], chain: list[str]) -> bool:
    """The workload's first JavaScript functions among ``names`` are ``chain``."""
    return workload_functions(list(names))[: len(chain)] == chain


def workload_functions(names: list[str | None]) -> list[str]:
    """The workload's own JavaScript functions among frame names, in their order."""
    found = [JS_NAME.match(name or "") for name in names]
    return [m["name"] for m in found if m is not None and m["script"] == str(WORKLOAD)]


def test_the_javascript_frames_are_named_from_the_perf_map_down_to_the_start(
    named: Traced,
) -> None:
    # GIVEN the workload's calls, traced
    ledger, stacks, _, folded = named
    mine = ledger_stacks(ledger, stacks)
    assert mine
    for stack in mine:
        names = [frame["function"] for frame in stack["frames"]]
        # THEN each stack holds its chain's functions, innermost first, as
        # JIT frames named by the perf map
        chain = ledger["functions"]
        assert holds_chain(names, chain), names
        jit = [frame for frame in stack["frames"] if frame["kind"] == "jit"]
        assert jit and all(frame["module"] == "[jit]" and frame["function"] for frame in jit)
        # AND goes on below them to the program's start
        outer = max(index for index, name in enumerate(names)
                    if workload_functions([name]) == chain[-1:])  # fmt: skip
        below = [name for name in names[outer:] if name in BELOW]
        assert below == BELOW and names[-1] == PROGRAM_ROOT, names
        # AND the folded stacks show the same names (spaces written as "_")
        assert all(f";{frame['function'].replace(' ', '_')};" in folded for frame in jit)
    # AND the calls and bytes are the ledger's
    assert sum(stack["calls"] for stack in mine) == ledger["calls"]
    assert sum(stack["bytes"] for stack in mine) == ledger["bytes"]


def heap_samples(profile: Path) -> list[tuple[int, int, int, list[tuple[str, str]]]]:
    """Each sample of a heap profile the trace wrote: its process, calls
    (alloc_objects), bytes (alloc_space), and frames (function, the file of
    its location's mapping), innermost first."""
    prof = parsed(profile.read_bytes())
    strings = prof.string_table
    kinds = [strings[kind.type] for kind in prof.sample_type]
    calls, nbytes = kinds.index("alloc_objects"), kinds.index("alloc_space")
    names = {function.id: strings[function.name] for function in prof.function}
    files = {mapping.id: strings[mapping.filename] for mapping in prof.mapping}
    frames = {loc.id: [(names[line.function_id], files.get(loc.mapping_id, ""))
                       for line in loc.line] for loc in prof.location}  # fmt: skip
    pids = [next(label.num for label in sample.label if strings[label.key] == "pid")
            for sample in prof.sample]  # fmt: skip
    return [(pid, sample.value[calls], sample.value[nbytes],
             [frame for loc in sample.location_id for frame in frames[loc]])
            for pid, sample in zip(pids, prof.sample, strict=True)]  # fmt: skip


def test_the_pprof_profile_places_the_javascript_frames_under_jit(named: Traced) -> None:
    # GIVEN the trace's profile, read by protobuf's parser and by go tool pprof
    ledger, stacks, profile, _ = named
    chain = ledger["functions"]
    # WHEN the samples of the workload's size (by go tool pprof, which
    # prints no sizes: those of the function that called malloc for it)
    # holding the chain are summed
    ours = [(calls, frames) for pid, calls, nbytes, frames in heap_samples(profile)
            if pid == ledger["pid"] and nbytes == calls * ledger["size"]
            and holds_chain([name for name, _ in frames], chain)]  # fmt: skip
    callers = {stack["frames"][0]["function"] for stack in ledger_stacks(ledger, stacks)}
    theirs = [value for value, frames in go_traces(profile)
              if frames[0] in callers and holds_chain(frames, chain)]  # fmt: skip
    # THEN the chain's functions are in the mapping [jit], and both count the ledger's calls
    assert ours and all(file == "[jit]" for _, frames in ours for name, file in frames
                        if workload_functions([name]))  # fmt: skip
    assert sum(calls for calls, _ in ours) == ledger["calls"]
    assert sum(theirs) == ledger["calls"]


def test_jit_frames_no_perf_map_names_show_as_addresses_and_do_not_cut(unnamed: Traced) -> None:
    # GIVEN the same calls, traced while V8 writes no perf map
    ledger, stacks, _, folded = unnamed
    mine = ledger_stacks(ledger, stacks)
    assert sum(stack["calls"] for stack in mine) == ledger["calls"]
    assert sum(stack["bytes"] for stack in mine) == ledger["bytes"]
    for stack in mine:
        # THEN their JIT frames are kept, unnamed, one at least per function
        # of the chain, and the stack goes on below them to the program's start
        kinds = [frame["kind"] for frame in stack["frames"]]
        jit = [frame for frame in stack["frames"] if frame["kind"] == "jit"]
        assert len(jit) >= len(ledger["functions"])
        assert all(frame["module"] == "[jit]" and frame["function"] is None for frame in jit)
        names = [frame["function"] for frame in stack["frames"]]
        below = [name for name in names[kinds.index("jit") :] if name in BELOW]
        assert below == BELOW and names[-1] == PROGRAM_ROOT, names
        # AND the folded stacks show each as [jit] and its address (a
        # name's spaces written as "_")
        assert all(f";[jit]_{frame['address']};" in folded for frame in jit)
