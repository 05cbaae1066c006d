"""Whole call stacks on code built as distributions build it (-O2, no frame
pointers, PIE, shared libraries, libstdc++), unwound by the binaries' own
CFI: checked frame by frame against the chains the workloads know they
made, and against heaptrack (libunwind, in the process) on the same
program. The profiles are read by the real ``go tool pprof``: the files of
traced runs, and serve's ``/debug/pprof/allocs`` over HTTP.

``cfi_stacks`` allocates at the end of five chains: in the program, through
a shared library, deeper than a walk keeps (127 frames), through a library
it loads with dlopen while traced, and in a thread; it prints each chain
with its count. ``cxx_stacks`` allocates through std::map, std::string and
std::vector, whose code is libstdc++'s.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from mtrace_live.exporters.sprtrace import text as sprtrace

from .conftest import MTRACE, REPO, built
from .test_serve import free_port, start_serve, stop
from .tracing import Reaper, pprof_mappings, readelf_build_id, trace_cxx_stacks

CALLS = 150
DEEP = 200  # deeper than the 127 frames a walk keeps
THREAD_ROOT = "__clone3"  # glibc's thread entry, where the CFI says the stack ends
PROGRAM_ROOT = "_start"


def go_traces(profile: Path | str, index: str = "alloc_objects") -> list[tuple[int, list[str]]]:
    """(value, frames innermost first) of each sample, as ``go tool pprof
    -traces`` prints them; ``profile``: a file, or a URL to fetch it from."""
    env = dict(os.environ, PPROF_TMPDIR=tempfile.gettempdir())  # where a fetched profile is kept
    text = subprocess.run(["go", "tool", "pprof", f"-sample_index={index}", "-traces",
                           str(profile)], capture_output=True, text=True, check=True,
                          timeout=120, env=env).stdout  # fmt: skip
    traces = []
    for block in text.split("-----------+")[1:]:
        frames, value = [], None
        for line in block.splitlines()[1:]:
            # a label is right-aligned to the separator's width, or starts the
            # line when its name is longer (provider_lib)
            if not line.strip() or re.match(r"^\s*\w+:\s", line):
                continue  # the separator's tail, a label
            if value is None:
                first = line.split(maxsplit=1)
                value, line = int(float(first[0])), first[1]
            frames.append(line.strip())
        if value is not None:
            traces.append((value, frames))
    return traces


def heaptrack_stacks(argv: list[str], tmp: Path, stdin: str) -> Counter[tuple[str, ...]]:
    """Allocation calls by stack, as heaptrack records ``argv`` (folded_stacks)."""
    run = subprocess.run(["heaptrack", "-o", str(tmp / "heaptrack"), *argv], input=stdin,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    return folded_stacks(tmp)


def folded_stacks(tmp: Path) -> Counter[tuple[str, ...]]:
    """Allocation calls by stack (outermost caller first, file names
    dropped), as ``heaptrack_print -F`` folds heaptrack's recording in ``tmp``."""
    (recorded,) = sorted(tmp.glob("heaptrack.*zst")) or sorted(tmp.glob("heaptrack.*gz"))
    folded = tmp / "heaptrack.fold"
    subprocess.run(["heaptrack_print", "-F", str(folded), str(recorded)], capture_output=True,
                   check=True, timeout=300)  # fmt: skip
    stacks: Counter[tuple[str, ...]] = Counter()
    for line in folded.read_text().splitlines():
        path, _, count = line.rpartition(" ")
        frames = [re.sub(r" \([^()]*\)$", "", f) for f in path.rstrip(";").split(";")]
        stacks[tuple(frames)] += int(count)
    return stacks


def known_chains(out: str) -> list[tuple[int, int, tuple[str, ...]]]:
    """(calls, size, frames outermost first) of each chain the workload made."""
    chains = []
    for line in out.splitlines():
        if line.startswith("stack "):
            _, calls, size, frames = line.split()
            chains.append((int(calls), int(size), tuple(frames.split(";"))))
    return chains


def traces_with(traces: list[tuple[int, list[str]]],
                frames: tuple[str, ...]) -> list[tuple[int, list[str]]]:  # fmt: skip
    """The traces whose innermost frames are ``frames`` (outermost first), in order."""
    inner = list(reversed(frames))
    return [t for t in traces if t[1][: len(inner)] == inner]


PROFILE: dict[str, Path] = {}


@pytest.fixture(scope="module")
def cfi_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[tuple[int, list[str]]]]:
    """cfi_stacks traced from its start (``run``): its output, with the
    summary, and its profile's traces."""
    tmp = tmp_path_factory.mktemp("cfi")
    profile = PROFILE["cfi"] = tmp / "allocs.pb.gz"
    workload = [str(built("cfi_stacks")), str(built("libcfi_plugin.so")), str(CALLS), str(DEEP)]
    argv = [*MTRACE, "run", "--pprof", str(profile), "-o", "summary", "--", *workload]
    run = subprocess.run(argv, input="xy", capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout, go_traces(profile)


def assert_chains_whole(out: str, traces: list[tuple[int, list[str]]],
                        started: bool = True) -> None:  # fmt: skip
    """Each chain the workload made (but those deeper than a walk keeps) is
    one stack, frame by frame from the function that called malloc to main
    (or the thread's function), then the libc's start to the outermost
    frame, with as many calls. A process the trace did not start
    (``started`` False) is not stopped when it dlopens the plugin: the
    plugin's calls made before its tables are written end in the plugin
    (its code keeps no frame pointers), and are all there."""
    chains = known_chains(out)
    assert len(chains) == 5
    for calls, _, frames in chains:
        if len(frames) > 127:
            continue
        if not started and "run_plugin" in frames:
            plugin = traces_with(traces, frames[-1:])
            assert sum(value for value, _ in plugin) == calls == CALLS, plugin
            assert all(got[-1] == PROGRAM_ROOT for _, got in plugin if len(got) > 1), plugin
            continue
        found = traces_with(traces, frames)
        assert len(found) == 1, (frames, [t for t in traces if t[1][0] == frames[-1]])
        value, got = found[0]
        assert value == calls == CALLS
        root = THREAD_ROOT if frames[0] == "thread_main" else PROGRAM_ROOT
        assert got[-1] == root, got


def test_every_chain_is_whole_down_to_the_program_s_or_the_thread_s_start(
    cfi_run: tuple[str, list[tuple[int, list[str]]]],
) -> None:
    out, traces = cfi_run
    assert_chains_whole(out, traces)


def test_serve_unwinds_by_cfi_after_giving_up_root(tmp_path: Path) -> None:
    # GIVEN cfi_stacks waiting, traced by serve --exact (which gives up root,
    # keeping what it needs to read the process's mappings)
    port = free_port()
    argv = [str(built("cfi_stacks")), str(built("libcfi_plugin.so")), str(CALLS), "8"]
    with Reaper() as reaper:
        work = reaper.add(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           text=True))  # fmt: skip
        assert work.stdin is not None and work.stdout is not None
        assert work.stdout.readline() == "ready\n"
        serve, err = start_serve(["--pid", str(work.pid), "--exact", "--no-kmem",
                                  "--web.listen-address", f"127.0.0.1:{port}"],
                                 tmp_path, reaper)  # fmt: skip
        # WHEN it makes its five chains (one through a library it loads
        # now), and go tool pprof reads serve's allocs profile
        work.stdin.write("x")
        work.stdin.flush()
        said = []
        for line in work.stdout:  # its chains, until "done" (or its end)
            if line == "done\n":
                break
            said.append(line)
        out = "".join(said)
        traces = go_traces(f"http://127.0.0.1:{port}/debug/pprof/allocs?pid={work.pid}")
        work.stdin.write("y")
        work.stdin.close()
        work.stdout.close()
        assert work.wait(timeout=60) == 0
        assert stop(serve) == 0, err.read_text()
    # THEN each chain is one whole stack with its count, as a traced run's,
    # but the calls through the library it loaded while traced that came
    # before the library's tables (it is not stopped for them)
    assert_chains_whole(out, traces, started=False)


def test_a_chain_deeper_than_the_walk_is_cut_at_127_frames_and_counted(
    cfi_run: tuple[str, list[tuple[int, list[str]]]],
) -> None:
    out, traces = cfi_run
    # THEN the chain of 200 calls keeps its first 127 callers of the call site
    deep = [t for t in traces if t[1][0] == "deep_leaf" and len(t[1]) > 100]
    assert len(deep) == 1 and deep[0][0] == CALLS
    got = deep[0][1]
    assert got == ["deep_leaf"] + ["deep_chain"] * 127
    # AND the summary counts each of those walks as cut by the depth, and no other
    match = re.search(r"stacks unwound by CFI: (\d+), (\d+) whole; cut: (\d+) at 127 frames, "
                      r"(\d+) at code with no CFI", out)  # fmt: skip
    assert match is not None, out
    walks, whole, depth, no_cfi = (int(g) for g in match.groups())
    assert depth == CALLS and no_cfi == 0 and whole == walks - depth
    # every call of the five chains, and the few the libc and the loader make
    assert walks >= 5 * CALLS
    # AND no stack of the process was walked before its tables were written
    assert "stacks of processes whose tables were not written yet: 0," in out


def test_the_profile_s_mappings_carry_each_module_s_build_id(
    cfi_run: tuple[str, list[tuple[int, list[str]]]],
) -> None:
    # GIVEN the profile's mappings, as go tool pprof -raw lists them
    raw = subprocess.run(["go", "tool", "pprof", "-raw", str(PROFILE["cfi"])], capture_output=True,
                         text=True, check=True, timeout=120).stdout  # fmt: skip
    listed = pprof_mappings(raw)
    # THEN each of the workload's modules is there with the build-id readelf reads in it
    for name in ("cfi_stacks", "libcfi_deep.so", "libcfi_plugin.so"):
        path = str(built(name))
        assert listed.get(path) == readelf_build_id(path), (path, listed)


def test_heaptrack_sees_the_same_chains_with_the_same_counts(tmp_path: Path) -> None:
    # GIVEN one run of the program under heaptrack (which unwinds in the
    # process with libunwind), traced by mtrace-live from its start
    profile = tmp_path / "allocs.pb.gz"
    workload = [str(built("cfi_stacks")), str(built("libcfi_plugin.so")), str(CALLS), "8"]
    argv = [*MTRACE, "run", "--pprof", str(profile), "-o", "summary", "--",
            "heaptrack", "-o", str(tmp_path / "heaptrack"), *workload]  # fmt: skip
    run = subprocess.run(argv, input="xy", capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    theirs = folded_stacks(tmp_path)
    # (mtrace-live sees the program call heaptrack's malloc, which calls the
    # libc's: that first frame is heaptrack's, and left out, as are the
    # allocations heaptrack makes itself; a leading underscore of glibc's
    # symbol, __clone3, is not in the DWARF name heaptrack shows, clone3)
    ours: Counter[tuple[str, ...]] = Counter()
    for count, frames in go_traces(profile):
        if frames[:1] in (["malloc"], ["calloc"]) and not any("heaptrack" in f for f in frames):
            ours[tuple(f.lstrip("_") for f in reversed(frames[1:]))] += count
    # THEN the workload made its five chains
    chains = known_chains(run.stdout)
    assert len(chains) == 5, run.stdout
    for calls, _, frames in chains:
        # AND heaptrack has each as one stack, from main (or the thread's
        # start) in, with its count
        (stack,) = [stack for stack in theirs if stack[-len(frames) :] == frames]
        assert theirs[stack] == calls, (frames, theirs[stack])
        # AND mtrace-live has the same stack, frame for frame from heaptrack's
        # outermost in (its own goes on through the libc's start), with as many calls
        plain = tuple(f.lstrip("_") for f in stack)
        same = {mine: n for mine, n in ours.items() if mine[-len(plain) :] == plain}
        assert sum(same.values()) == calls, (stack, same)


def test_frame_pointers_alone_lose_the_callers_in_this_code(tmp_path: Path) -> None:
    # GIVEN the workload traced with the frame-pointer walk only
    profile = tmp_path / "allocs.pb.gz"
    argv = [*MTRACE, "run", "--frame-pointers", "--pprof", str(profile), "-o", "summary", "--",
            str(built("cfi_stacks")), str(built("libcfi_plugin.so")), str(CALLS), "8"]  # fmt: skip
    run = subprocess.run(argv, input="xy", capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    # THEN no chain is whole: the code keeps no frame pointers (which is why
    # the CFI is read), and the summary says nothing of a CFI walk
    traces = go_traces(profile)
    chains = known_chains(run.stdout)
    assert len(chains) == 5 and all(traces_with(traces, frames[-1:]) for _, _, frames in chains)
    assert not any(traces_with(traces, frames) for _, _, frames in chains)
    assert "stacks unwound by CFI" not in run.stdout


def simple_name(name: str) -> str:
    """A C++ function's name without its parameters, template arguments,
    return type or clone suffix, as go tool pprof shows it."""
    name = re.sub(r" \[clone [^\]]*\]", "", name)
    while re.search(r"<[^<>]*>", name):
        name = re.sub(r"<[^<>]*>", "", name)
    while name.endswith(")"):
        depth, i = 0, len(name) - 1
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                break
        name = name[:i]
    at = name.find("operator")
    return name[at:] if at >= 0 else name.rsplit(" ", 1)[-1]


@dataclass(frozen=True)
class CxxRun:
    """cxx_stacks traced by pid, with every output of whole stacks."""

    traces: list[tuple[int, list[str]]]  # the profile's, as go tool pprof -traces reads them
    allocinfo: list[str]
    folded: list[str]
    sp_rtrace: sprtrace.Trace
    known: dict[str, int]  # what the workload says it did: leaked_objects, vector_allocs


@pytest.fixture(scope="module")
def cxx_run(tmp_path_factory: pytest.TempPathFactory) -> CxxRun:
    tmp = tmp_path_factory.mktemp("cxx")
    out = {name: tmp / name for name in ("allocs.pb.gz", "allocinfo", "folded", "sp-rtrace")}
    outputs = ["--pprof", str(out["allocs.pb.gz"]), "--allocinfo", str(out["allocinfo"]),
               "--folded", str(out["folded"]), "--sp-rtrace", str(out["sp-rtrace"])]  # fmt: skip
    known = trace_cxx_stacks([str(built("cxx_stacks")), "20"], lambda pid: pid, outputs, tmp)
    text = out["sp-rtrace"].read_text().splitlines()
    return CxxRun(go_traces(out["allocs.pb.gz"]), out["allocinfo"].read_text().splitlines(),
                  out["folded"].read_text().splitlines(), sprtrace.parse(text, "sp-rtrace"),
                  known)  # fmt: skip


def test_cxx_stacks_through_libstdcxx_are_heaptrack_s_frame_for_frame(
    cxx_run: CxxRun, tmp_path: Path
) -> None:
    # GIVEN C++ code and libstdc++, neither with frame pointers, traced by
    # pid, and the same program under heaptrack
    ours: Counter[tuple[str, ...]] = Counter()
    traces = cxx_run.traces
    # THEN the names are demangled as heaptrack and c++filt show them
    names = {name for _, frames in traces for name in frames}
    assert {"operator new(unsigned long)", "fill_map(int)", "grow_vector(int)"} <= names
    assert not any(name.startswith("_Z") for name in names)
    for value, frames in traces:
        while frames and frames[0].startswith("operator new"):
            frames = frames[1:]  # heaptrack shows operator new's caller first
        frames = [simple_name(f) for f in frames]  # demangled in full: the same simplification
        if "main" in frames:
            ours[tuple(reversed(frames[: frames.index("main") + 1]))] += value
    theirs: Counter[tuple[str, ...]] = Counter()
    argv = [str(built("cxx_stacks")), "20"]
    for stack, count in heaptrack_stacks(argv, tmp_path, "xy").items():
        if "main" in stack:
            theirs[tuple(simple_name(f) for f in stack[stack.index("main") :])] += count
    # AND the ten stacks heaptrack counts most allocations on are ours, with the same counts
    top = [stack for stack, _ in theirs.most_common(10)]
    assert len(top) == 10 and max(len(s) for s in top) > 3
    assert {s: ours[s] for s in top} == {s: theirs[s] for s in top}


def test_allocinfo_charges_the_leak_to_the_code_that_called_operator_new(
    cxx_run: CxxRun,
) -> None:
    # GIVEN the allocinfo table written when the trace ended
    header, lines = cxx_run.allocinfo[:2], cxx_run.allocinfo[2:]
    assert header == ["allocinfo - version: 1.0", "#     <size>  <calls> <tag info>"]
    rows = [re.match(r"^\s*(\d+)\s+(\d+) (.+) func:(.+)$", line) for line in lines]
    assert rows and all(rows), lines
    # THEN its lines hold every block the workload leaked, and no other
    assert sum(int(m.group(2)) for m in rows if m) == cxx_run.known["leaked_objects"]
    # AND no line is operator new's: each is the first frame past it, one of
    # the functions the stacks name, the leaked map's own in fill_map
    functions = {m.group(4) for m in rows if m}
    assert not any(f.startswith("operator new") for f in functions), functions
    names = {name for _, frames in cxx_run.traces for name in frames}
    assert functions <= names and "fill_map(int)" in functions
    # AND the lines are ordered by bytes, most first, as allocinfo users sort them
    sizes = [int(m.group(1)) for m in rows if m]
    assert sizes == sorted(sizes, reverse=True)


def test_folded_stacks_and_sp_rtrace_backtraces_are_whole(cxx_run: CxxRun) -> None:
    # THEN every live stack, folded, runs from the program's start through
    # main and fill_map (where all that was leaked was allocated) to operator new
    assert cxx_run.folded
    for line in cxx_run.folded:
        stack = line.rpartition(" ")[0].split(";")
        assert stack[0] == PROGRAM_ROOT and stack[-1].startswith("operator_new"), line
        assert stack.index("main") < stack.index("fill_map(int)"), line
    # AND every allocation's sp-rtrace backtrace reaches main, and those in
    # grow_vector are as many as the buffers the workload's vectors allocated
    allocations = [c for c in cxx_run.sp_rtrace.calls if c.resource == "memory" and c.is_alloc]
    assert allocations
    frames = [[f.function or "" for f in call.frames] for call in allocations]
    assert all("main" in names for names in frames), [f for f in frames if "main" not in f][:3]
    in_vector = sum("grow_vector(int)" in names for names in frames)
    assert in_vector == cxx_run.known["vector_allocs"]


def test_wrappers_given_move_allocinfo_lines_to_their_callers(tmp_path: Path) -> None:
    # GIVEN cxx_stacks traced with fill_map named as an allocation wrapper
    allocinfo = tmp_path / "allocinfo"
    argv = [*MTRACE, "run", "--wrappers", "grow_vector*, fill_map*", "--allocinfo",
            str(allocinfo), "-o", "summary", "--", str(built("cxx_stacks")), "20"]  # fmt: skip
    run = subprocess.run(argv, input="xy", capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    leaked = int(re.search(r"^leaked_objects (\d+)$", run.stdout, re.M).group(1))  # type: ignore[union-attr]
    # THEN the map fill_map leaked itself (operator new's caller was
    # fill_map) is main's, which called fill_map: one block
    lines = allocinfo.read_text().splitlines()[2:]
    assert not any(line.endswith("func:fill_map(int)") for line in lines), lines
    mains = [line.split() for line in lines if line.endswith("func:main")]
    assert [int(fields[1]) for fields in mains] == [1]
    # AND the rest of the leak is where it was, in the map's and strings' code
    assert sum(int(line.split()[1]) for line in lines if "func:std::" in line
               or "basic_string" in line) == leaked - 1  # fmt: skip


@pytest.mark.parametrize("frame_pointers", [True, False], ids=["frame-pointers", "none"])
def test_code_without_cfi_is_walked_by_its_frame_pointers(
    tmp_path: Path, frame_pointers: bool
) -> None:
    # GIVEN a library with no call-frame information at all, with frame
    # pointers or without, called from a program that has CFI
    source = REPO / "tests" / "workloads" / "cfi"
    library, program = tmp_path / "libnocfi.so", tmp_path / "nocfi_main"
    pointers = "-fno-omit-frame-pointer" if frame_pointers else "-fomit-frame-pointer"
    subprocess.run(["gcc", "-O1", pointers, "-fno-asynchronous-unwind-tables",
                    "-fno-unwind-tables", "-fPIC", "-shared", "-o", str(library),
                    str(source / "nocfi.c")], check=True)  # fmt: skip
    subprocess.run(["gcc", "-O2", "-fomit-frame-pointer", "-o", str(program),
                    str(source / "nocfi_main.c"), f"-L{tmp_path}", "-lnocfi",
                    "-Wl,-rpath,$ORIGIN"], check=True)  # fmt: skip
    # WHEN its allocations are traced from its start
    profile = tmp_path / "allocs.pb.gz"
    run = subprocess.run([*MTRACE, "run", "--pprof", str(profile), "-o", "summary", "--",
                          str(program), str(CALLS)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    chain = ["nocfi_leaf", *["nocfi_chain"] * 4]
    found = [(n, frames) for n, frames in go_traces(profile) if frames[:1] == ["nocfi_leaf"]]
    cut = re.search(r"(\d+) at code with no CFI and no frame pointer", run.stdout)
    assert cut is not None, run.stdout
    if frame_pointers:
        # THEN with frame pointers, each stack is whole: the library's chain
        # by its frame pointers, then main and the libc's start by their CFI
        assert found == [(CALLS, [*chain, "main", "__libc_start_call_main",
                                  "__libc_start_main_alias_2", "_start"])], found  # fmt: skip
        assert int(cut[1]) == 0
    else:
        # AND without them, the walk ends in the library, and says so, once a stack
        assert sum(n for n, _ in found) == CALLS and all(f[:1] == chain[:1] for _, f in found)
        assert all("main" not in frames for _, frames in found), found
        assert int(cut[1]) >= CALLS
