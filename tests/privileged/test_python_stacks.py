"""Python frames in allocation stacks, on running CPython processes attached
afterwards (``--pid``), under each interpreter the project covers: Debian's
stripped /usr/bin/python3.11 (libpython linked in) and pyenv's 3.11, 3.12
and 3.13 (a shared libpython).

The workload (tests/workloads/py_chains.py) makes chains of known Python
calls, each reaching malloc or calloc with a size of its own, and prints its
ledger: per chain the calls, the bytes, the leaf's line and the Python
functions on the stack. Per chain, the trace's stacks whose Python frames
are those functions must hold exactly the ledger's calls and bytes; bpftrace
counts the same sizes in the same run; and where the workload runs
tracemalloc, tracemalloc's blocks per line of the workload equal the
trace's calls whose innermost Python frame is on that line.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mtrace_live.tracer.processes.target import mapped_libc

from tests.unit.profile_proto import parsed

from .conftest import MTRACE, REPO
from .test_cfi_stacks import go_traces
from .test_serve import free_port, start_serve, stop
from .tracing import BPFTRACE_READY, Reaper, interrupt_bpftrace, start_bpftrace, wait_for_line

WORKLOAD = REPO / "tests" / "workloads" / "py_chains.py"
READY = "Ctrl-C to stop"
PYENV = Path("/root/.pyenv/versions")
DEBIAN = Path("/usr/bin/python3.11")
# (interpreter, whether the workload runs tracemalloc as well, the trace's options)
INTERPRETERS = {
    "debian-3.11": (DEBIAN, True, ()),
    "pyenv-3.11.7": (PYENV / "3.11.7/bin/python3.11", False, ()),
    "pyenv-3.12.1": (PYENV / "3.12.1/bin/python3.12", False, ()),
    "pyenv-3.13.0": (PYENV / "3.13.0/bin/python3.13", True, ()),
}
# with --pymalloc: the interpreter's own allocator traced too
PYMALLOC_RUNS = {"pyenv-3.13.0-pymalloc": (PYENV / "3.13.0/bin/python3.13", False, ("--pymalloc",))}
# the process among every process (--all), not by its pid
TARGET_RUNS = {"debian-3.11-all": (DEBIAN, False, ("--all",))}
RUNS = {**INTERPRETERS, **PYMALLOC_RUNS, **TARGET_RUNS}
# the workload's ledger, the trace's stack rows, bpftrace's counts, the trace's stderr
Traced = tuple[dict[str, Any], list[dict[str, Any]], dict[str, Counter[int]], str]
DEPTH = 127  # frames a walk keeps
SIZES = "arg0 >= 41000 && arg0 <= 48000"


def bpftrace_sizes(libc: Path, interpreter: Path) -> str:
    """malloc and calloc calls of the workload's sizes, by size, and
    pymalloc's PyObject_Calloc(1, size) of sizes over 300."""
    return (f"uprobe:{libc}:malloc /pid == $1 && {SIZES}/ {{ @malloc[arg0] = count(); }}\n"
            f"uprobe:{libc}:calloc /pid == $1 && arg0 == 1 && arg1 >= 41000 && arg1 <= 48000/ "
            "{ @calloc[arg1] = count(); }\n"
            f"uprobe:{interpreter}:PyObject_Calloc /pid == $1 && arg0 == 1 && arg1 > 300/ "
            "{ @pymalloc_calloc[arg1] = count(); }\n")  # fmt: skip


def bpftrace_maps(out: Path) -> dict[str, Counter[int]]:
    maps: dict[str, Counter[int]] = {"malloc": Counter(), "calloc": Counter(),
                                     "pymalloc_calloc": Counter()}  # fmt: skip
    for line in out.read_text(errors="replace").splitlines():
        record = json.loads(line) if line.startswith("{") else {}
        if record.get("type") == "map":
            for name, values in record["data"].items():
                maps[name.lstrip("@")].update({int(k): int(v) for k, v in values.items()})
    return maps


def same_python_stack(functions: list[str], stack: dict[str, Any],
                      chain: dict[str, Any]) -> bool:  # fmt: skip
    """The Python functions of a stack are the chain's: all of them, or,
    where the walk stopped at its depth (the recursion 120 deep, below its
    native frames), as many as the walk kept, 100 at least."""
    expected = chain["python_stack"]
    if functions == expected:
        return True
    cut = len(stack["frames"]) >= DEPTH and len(functions) >= 100
    return cut and functions == expected[: len(functions)]


def interpreter_file(pid: int) -> Path:
    """The file of the process's interpreter: its libpython, else its executable."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        path = line.split(maxsplit=5)[5:] or [""]
        if "/libpython3" in path[0]:
            return Path(path[0])
    return Path(os.readlink(f"/proc/{pid}/exe"))


def chain_calls(stacks: list[dict[str, Any]], chain: dict[str, Any],
                provider: str) -> tuple[int, int]:  # fmt: skip
    """(calls, bytes) of the stacks of ``provider`` and the chain's size
    whose Python frames are the chain's; each one's leaf on the chain's line."""
    calls = nbytes = 0
    for stack in stacks:
        frames = python_frames(stack)
        if stack["allocator"] != chain["fn"] or stack["provider"] != provider or not frames:
            continue
        if stack["bytes"] != stack["calls"] * chain["size"]:
            continue  # the same Python line's other calls (ctypes' own objects)
        if not same_python_stack([frame["function"] for frame in frames], stack, chain):
            continue
        assert frames[0]["location"] == f"{chain['file']}:{chain['line']}", stack
        calls += stack["calls"]
        nbytes += stack["bytes"]
    return calls, nbytes


def python_frames(stack: dict[str, Any]) -> list[dict[str, Any]]:
    return [frame for frame in stack["frames"] if frame["kind"] == "python"]


ALL = pytest.mark.parametrize("traced", sorted(INTERPRETERS) + sorted(TARGET_RUNS),
                              indirect=True)  # fmt: skip
PYMALLOC = pytest.mark.parametrize("traced", sorted(PYMALLOC_RUNS), indirect=True)
# the runs where the workload runs tracemalloc too
TRACEMALLOC_RUNS = sorted(name for name, (_, with_it, _) in INTERPRETERS.items() if with_it)
WITH_TRACEMALLOC = pytest.mark.parametrize("traced", TRACEMALLOC_RUNS, indirect=True)


@contextlib.contextmanager
def attached(argv: list[str], options: tuple[str, ...], by_pid: bool, tmp: Path,
             ) -> Iterator[tuple[Reaper, subprocess.Popen[bytes], subprocess.Popen[bytes], Path,
                                 Path]]:  # fmt: skip
    """A Python program started first (it says "ready"), then mtrace-live
    attached (-o json, to its pid where ``by_pid``): the reaper, the
    program, the tracer, the tracer's stderr and stdout files."""
    with Reaper() as reaper, subprocess.Popen(argv, stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE) as proc:  # fmt: skip
        reaper.add(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        err, out = tmp / "trace.err", tmp / "trace.out"
        target = ["--pid", str(proc.pid)] if by_pid else []
        with open(err, "wb") as errors, open(out, "wb") as lines:
            tracer = reaper.add(subprocess.Popen([*MTRACE, *target, "-o", "json", *options],
                                                 stdout=lines, stderr=errors))  # fmt: skip
        wait_for_line(err, READY, tracer, timeout=120)
        yield reaper, proc, tracer, err, out


@pytest.fixture(scope="module")
def traced(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Traced:
    """The workload under one interpreter, started first, then traced by
    mtrace-live (--pid) and bpftrace: its ledger, the trace's stack rows,
    bpftrace's counts and the trace's stderr."""
    python, with_tracemalloc, options = RUNS[request.param]
    by_pid = "--all" not in options
    if not python.is_file():
        pytest.fail(f"{python} is missing: the Python frames are checked under every "
                    "interpreter (scripts/setup.sh installs them)")  # fmt: skip
    tmp = tmp_path_factory.mktemp(f"python-{request.param}")
    argv = [str(python), str(WORKLOAD), *(["--tracemalloc"] if with_tracemalloc else [])]
    with attached(argv, options, by_pid, tmp) as (reaper, proc, tracer, err, out):
        assert proc.stdout is not None and proc.stdin is not None
        bpftrace, bpftrace_out = start_bpftrace(
            bpftrace_sizes(mapped_libc(proc.pid), interpreter_file(proc.pid)), proc.pid, tmp
        )
        reaper.add(bpftrace)
        wait_for_line(bpftrace_out, BPFTRACE_READY, bpftrace, timeout=120)
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        ledger = json.loads(proc.stdout.readline())
        interrupt_bpftrace(bpftrace)
        proc.stdin.write(b"exit\n")
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0
        if not by_pid:  # (it goes on: every process)
            tracer.send_signal(signal.SIGINT)
        assert tracer.wait(timeout=120) == 0, err.read_text()
    stacks = [record for line in out.read_text().splitlines()
              if (record := json.loads(line)).get("table") == "alloc_stacks"
              and record["pid"] == proc.pid]  # fmt: skip
    return ledger, stacks, bpftrace_maps(bpftrace_out), err.read_text()


@ALL
def test_each_chain_is_its_python_functions_with_the_ledger_s_calls_and_bytes(
    traced: Traced,
) -> None:
    # GIVEN a Python program's chains, traced after it started
    ledger, stacks, bpftrace, errors = traced
    assert "Python frames are not shown" not in errors
    for chain in ledger["chains"]:
        # WHEN the stacks of its size whose Python frames are the chain's are summed
        calls, nbytes = chain_calls(stacks, chain, "glibc")
        if chain["provider"] == "pymalloc":  # served by pymalloc: not traced by default
            assert (calls, nbytes) == (0, 0), chain["name"]
            assert bpftrace["pymalloc_calloc"][chain["size"]] == chain["calls"], chain["name"]
            continue
        # THEN they are the ledger's, and bpftrace counted as many of its size
        assert (calls, nbytes) == (chain["calls"], chain["bytes"]), chain["name"]
        assert bpftrace[chain["fn"]][chain["size"]] == chain["calls"], chain["name"]


@PYMALLOC
def test_pymalloc_s_own_blocks_are_counted_exactly_by_the_option(traced: Traced) -> None:
    # GIVEN the workload traced with --pymalloc
    ledger, stacks, bpftrace, _ = traced
    for chain in ledger["chains"]:
        # WHEN its pymalloc chain (blocks of 333 bytes, which never reach the
        # libc) and its ctypes chains (the libc's own) are summed
        if chain["provider"] == "pymalloc":
            # THEN pymalloc's calls are the ledger's, named pymalloc, and
            # bpftrace's on PyObject_Calloc too
            assert chain_calls(stacks, chain, "pymalloc") == (chain["calls"], chain["bytes"])
            assert bpftrace["pymalloc_calloc"][chain["size"]] == chain["calls"]
        elif chain["native_frames"]:
            assert chain_calls(stacks, chain, "glibc") == (chain["calls"], chain["bytes"])


@ALL
def test_native_frames_lie_between_the_python_caller_and_malloc(
    traced: Traced,
) -> None:
    # GIVEN the chain that calls the libc's malloc through ctypes
    ledger, stacks, _, _ = traced
    (chain,) = [chain for chain in ledger["chains"] if chain["name"] == "ctypes_malloc"]
    found = [stack for stack in stacks if python_frames(stack)
             and python_frames(stack)[0]["function"] == chain["leaf"]]  # fmt: skip
    assert found
    for stack in found:
        kinds = [frame["kind"] for frame in stack["frames"]]
        first_python = kinds.index("python")
        # THEN native frames (ctypes, libffi) come before the Python caller,
        # and native frames (the interpreter, then the program's start) after it
        assert first_python >= 2 and all(kind != "python" for kind in kinds[:first_python])
        assert kinds[-1] != "python"
        assert stack["frames"][-1]["function"] == "_start"


@WITH_TRACEMALLOC
def test_tracemalloc_counts_the_same_blocks_per_line(
    traced: Traced,
) -> None:
    # GIVEN a run where the workload ran tracemalloc too (its blocks over 512
    # bytes, those the libc served, by line of the workload)
    ledger, stacks, _, _ = traced
    # WHEN the trace's calls are counted by their innermost Python frame's
    # line in the workload, for the stacks of the chains tracemalloc sees
    sizes = {chain["size"] for chain in ledger["chains"] if chain["tracemalloc"]}
    ours: Counter[int] = Counter()
    for stack in stacks:
        frames = python_frames(stack)
        if not frames or not stack["calls"] or stack["bytes"] // stack["calls"] not in sizes:
            continue
        path, _, line = frames[0]["location"].rpartition(":")
        if path == str(WORKLOAD):
            ours[int(line)] += stack["calls"]
    # THEN tracemalloc's count on each line is the trace's
    theirs = {entry["line"]: entry["count"] for entry in ledger["tracemalloc"]}
    assert theirs and dict(ours) == theirs


FORKER = REPO / "tests" / "workloads" / "py_forker.py"


def test_run_shows_the_python_frames_of_a_master_and_its_forked_workers(tmp_path: Path) -> None:
    # GIVEN a Python master that forks workers, started by the trace (run)
    python = INTERPRETERS["pyenv-3.12.1"][0]
    ledger_file = tmp_path / "ledger.json"
    argv = [*MTRACE, "run", "-o", "json", "--", str(python), str(FORKER), "2", str(ledger_file)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    ledger = json.loads(ledger_file.read_text())
    stacks = [record for line in done.stdout.splitlines()
              if (record := json.loads(line)).get("table") == "alloc_stacks"]  # fmt: skip
    # WHEN each process's stacks of its blocks' size are summed by their Python frames
    for pids, blocks in ((ledger["workers"], ledger["worker"]),
                         ([ledger["master"]], ledger["master_blocks"])):  # fmt: skip
        for pid in pids:
            calls = 0
            for stack in stacks:
                frames = python_frames(stack)
                if stack["pid"] != pid or stack["bytes"] != stack["calls"] * blocks["size"]:
                    continue
                # THEN each is its leaf's line, under the Python functions it ran
                assert [frame["function"] for frame in frames] == blocks["python_stack"], stack
                assert frames[0]["location"] == f"{ledger['file']}:{blocks['line']}"
                calls += stack["calls"]
            assert calls == blocks["calls"], (pid, blocks)


def test_serve_s_profiles_carry_the_python_functions(tmp_path: Path) -> None:
    # GIVEN the workload under pyenv's 3.13, then serve attached to the
    # processes of its name (--comm), every allocation kept (--exact)
    python = INTERPRETERS["pyenv-3.13.0"][0]
    port = free_port()
    profile = tmp_path / "allocs.pb.gz"
    with Reaper() as reaper, subprocess.Popen([str(python), str(WORKLOAD)],
                                              stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE) as proc:  # fmt: skip
        reaper.add(proc)
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline() == b"ready\n"
        serve, err = start_serve(["--comm", python.name, "--exact", "--web.listen-address",
                                  f"127.0.0.1:{port}"], tmp_path, reaper)  # fmt: skip
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        ledger = json.loads(proc.stdout.readline())
        # WHEN its allocation profile is scraped while the workload lives
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/debug/pprof/allocs",
                                    timeout=60) as response:  # fmt: skip
            profile.write_bytes(response.read())
        proc.stdin.write(b"exit\n")
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0
        assert stop(serve) == 0, err.read_text()
    # THEN go tool pprof reads it, and every chain the libc served is there,
    # under its Python functions, with the ledger's calls
    traces = go_traces(profile)
    assert traces
    samples = python_samples(profile)
    for chain in ledger["chains"]:
        if chain["provider"] != "glibc" or chain["name"] == "recursion":
            continue  # (the recursion's stack is cut at the walk's depth)
        calls = sum(objects for functions, objects, nbytes in samples
                    if functions == chain["python_stack"]
                    and nbytes == objects * chain["size"])  # fmt: skip
        assert calls == chain["calls"], chain["name"]
        # (go tool pprof shows a name in angle brackets, <module>, as its mapping's)
        shown = [name for name in chain["python_stack"] if not name.startswith("<")]
        assert any(shown == [f for f in frames if f in shown] for _, frames in traces), chain


def python_samples(profile: Path) -> list[tuple[list[str], int, int]]:
    """Each sample's Python functions (the frames of the [python] mapping,
    leaf first), its calls and its bytes."""
    prof = parsed(profile.read_bytes())
    strings = prof.string_table
    types = [strings[t.type] for t in prof.sample_type]
    objects, space = types.index("alloc_objects"), types.index("alloc_space")
    names = {f.id: strings[f.name] for f in prof.function}
    python = {m.id for m in prof.mapping if strings[m.filename] == "[python]"}
    located = {loc.id: [names[line.function_id] for line in loc.line]
               for loc in prof.location if loc.mapping_id in python}  # fmt: skip
    return [([name for loc in sample.location_id for name in located.get(loc, [])],
             int(sample.value[objects]), int(sample.value[space]))
            for sample in prof.sample]  # fmt: skip


def test_an_interpreter_whose_layout_is_unknown_gets_one_line_and_native_stacks(
    tmp_path: Path,
) -> None:
    # GIVEN a Python 3.10 process (a layout mtrace-live does not know)
    python = PYENV / "3.10.13/bin/python3.10"
    if not python.is_file():
        pytest.fail(f"{python} is missing: it is the interpreter whose layout is refused")
    script = "import sys\nprint('ready', flush=True)\nsys.stdin.readline()\n" \
             "keep = [bytearray(40001) for _ in range(9)]\nprint('done', flush=True)\n" \
             "sys.stdin.readline()\n"  # fmt: skip
    with attached([str(python), "-c", script], (), True, tmp_path) as (_, proc, tracer, err, out):
        assert proc.stdout is not None and proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == b"done\n"
        proc.stdin.write(b"exit\n")
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0
        # WHEN the trace ends with it
        assert tracer.wait(timeout=120) == 0, err.read_text()
    # THEN one line says why its Python frames are not shown
    said = [line for line in err.read_text().splitlines() if "Python frames are not shown" in line]
    assert len(said) == 1 and "3.10" in said[0], said
    # AND its stacks are native, whole, through the eval loop, with its 9 blocks
    stacks = [record for line in out.read_text().splitlines()
              if (record := json.loads(line)).get("table") == "alloc_stacks"]  # fmt: skip
    blocks = [stack for stack in stacks if stack["bytes"] == stack["calls"] * 40002]
    assert sum(stack["calls"] for stack in blocks) == 9
    for stack in blocks:
        functions = [frame["function"] for frame in stack["frames"]]
        assert not python_frames(stack) and "_PyEval_EvalFrameDefault" in functions
        assert functions[-1] == "_start"
