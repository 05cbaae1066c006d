"""The allocator a process really calls: jemalloc, tcmalloc and mimalloc,
each preloaded into the allocation workload (tests/workloads/alloc_workload.c)
and linked into it, traced by --pid with no library named, against what the
workload says it did and against bpftrace on the same allocator's functions
in the same run; each one's own entry points and C++'s operator new and
delete, called by dlsym (tests/workloads/allocator_entries.c), per call site;
an allocator mtrace-live does not know, named and traced by --allocator-lib;
one built into a program; those of programs started later.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from .conftest import MTRACE, built
from .test_allocations import COUNTED, READY, Traced, by_site, start_workload, trace_launched
from .tracing import Reaper, end_held_workload, nm_symbols, wait_for_line

LIBS = Path("/usr/lib/x86_64-linux-gnu")
ALLOCATORS = {
    "jemalloc": LIBS / "libjemalloc.so.2",
    "tcmalloc": LIBS / "libtcmalloc_minimal.so.4",
    "mimalloc": LIBS / "libmimalloc.so.2",
    "unknown": Path(__file__).parents[2] / "build" / "libbump_malloc.so",  # given by its path
}
OUTER = "outer"


def outer_calls_script(lib: Path, where: str = "pid == $1",
                       allocating: Sequence[str] = ()) -> str:  # fmt: skip
    """bpftrace counting each standard function's calls made outside every
    other (a thread's depth in them), by the probe that took them, in the
    processes ``where`` says; ``allocating``: the allocating functions
    counted, if not the standard ones (one depth per thread, whatever the
    library: a script may count several)."""
    allocating = allocating or [name for name in COUNTED if name != "free"]
    entries = ",".join(f"uprobe:{lib}:{name}" for name in allocating)
    returns = ",".join(f"uretprobe:{lib}:{name}" for name in allocating)
    return (
        f"{entries} /{where}/ {{ if (@depth[tid] == 0) {{ @hits[probe] = count(); }} "
        "@depth[tid]++; }\n"
        f"{returns} /{where} && @depth[tid] > 0/ {{ @depth[tid]--; }}\n"
        f"uprobe:{lib}:free /{where} && @depth[tid] == 0 && arg0 != 0/ "
        "{ @hits[probe] = count(); }\n"
    )


# Each allocator preloaded into the workload, and the workload linked against
# it (Makefile: alloc_workload-<library>; its DT_NEEDED comes before the libc's).
WAYS = [(name, "preloaded") for name in sorted(ALLOCATORS)] + [
    ("jemalloc", "linked"), ("tcmalloc", "linked"), ("mimalloc", "linked")]  # fmt: skip
LINKED = {"jemalloc": "jemalloc", "tcmalloc": "tcmalloc_minimal", "mimalloc": "mimalloc"}


@pytest.fixture(scope="module", params=WAYS, ids=[f"{name}-{way}" for name, way in WAYS])
def preloaded(request: pytest.FixtureRequest,
              tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Traced]:  # fmt: skip
    name, way = request.param
    lib = ALLOCATORS[name]
    assert lib.exists(), f"{lib} is missing: make setup installs {name}'s Debian package"
    tmp = tmp_path_factory.mktemp(f"allocator-{name}-{way}")
    truth = tmp / "truth.json"
    if way == "linked":
        argv = [str(built(f"alloc_workload-{LINKED[name]}")), "--wait", "--out", str(truth)]
    else:
        argv = ["env", f"LD_PRELOAD={lib}", str(built("alloc_workload")), "--wait", "--out",
                str(truth)]  # fmt: skip
    extra = ("--allocator-lib", str(lib)) if name == "unknown" else ()
    return name, trace_launched(argv, lambda _: lib, truth, tmp, extra, lib_option=False,
                                script=outer_calls_script)  # fmt: skip


def test_each_allocator_is_found_and_named(preloaded: tuple[str, Traced]) -> None:
    # GIVEN the workload with an allocator preloaded, traced by --pid alone
    name, traced = preloaded
    # THEN the trace names the allocator and its library
    soname = ALLOCATORS[name].name
    assert f"pid {traced.truth['pid']}: allocator: {name} ({soname})" in traced.stderr


def test_every_call_site_counts_exactly_what_the_workload_did(
    preloaded: tuple[str, Traced],
) -> None:
    # GIVEN what the workload says each of its call sites did
    _, traced = preloaded
    found = by_site(traced.tables["alloc_stacks"])
    for site in traced.truth["sites"]:
        key = (site["function"], site["fn"])
        # THEN its calls, bytes and leaks equal the trace's, exactly
        assert key in found, (key, sorted(found))
        got = found[key]
        assert (got["calls"], got["bytes"]) == (site["calls"], site["bytes"]), key
        assert (got["live_objects"], got["live_bytes"]) == (
            site["leaked_calls"], site["leaked_bytes"]), key  # fmt: skip


def test_calls_of_each_function_equal_bpftraces_on_the_allocator(
    preloaded: tuple[str, Traced],
) -> None:
    # GIVEN bpftrace's count of each of the allocator's standard functions'
    # outermost calls, in the same run
    name, traced = preloaded
    theirs = traced.bpftrace
    # THEN mtrace-live's calls of each kind, all call sites summed, are the same
    ours: dict[str, int] = defaultdict(int)
    for row in traced.tables["alloc_stacks"]:
        ours[row["allocator"]] += row["calls"]
    for function in COUNTED:
        if function != "free":
            assert ours.get(function, 0) == theirs.get(function, 0), (name, function)
    assert theirs.get("malloc", 0) >= sum(
        s["calls"] for s in traced.truth["sites"] if s["fn"] == "malloc"
    )


# The entry points tests/workloads/allocator_entries.c calls in each allocator
# (beside C++'s operator new and delete), as the libraries' symbols name them.
CXX_ENTRIES = ("_Znwm", "_ZdlPv", "_ZdlPvm", "_Znam", "_ZdaPv", "_ZnwmSt11align_val_t",
               "_ZdlPvSt11align_val_t")  # fmt: skip
OWN_ENTRIES = {
    "jemalloc": ("mallocx", "rallocx", "sdallocx"),
    "tcmalloc": ("tc_new", "tc_delete_sized"),
    "mimalloc": ("mi_zalloc", "mi_heap_malloc", "mi_heap_zalloc", "mi_heap_calloc",
                 "mi_heap_mallocn", "mi_heap_malloc_aligned", "mi_heap_realloc",
                 "mi_heap_reallocn", "mi_free", "mi_free_size"),
}  # fmt: skip


def entry_calls_script(lib: Path, names: Sequence[str]) -> str:
    """bpftrace counting the calls of ``names`` in ``lib`` in process $1, by
    the name and the address each returns to (at an entry, the stack
    pointer points at it). Names at one address (tcmalloc's _Znwm, _Znam
    and tc_new) each count every call of it."""
    entries = ",".join(f"uprobe:{lib}:{name}" for name in names)
    return f'{entries} /pid == $1/ {{ @hits[probe, *(uint64 *)reg("sp")] = count(); }}\n'


@pytest.fixture(scope="module", params=sorted(OWN_ENTRIES))
def entry_points(request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Traced]:  # fmt: skip
    """The entry points' workload with allocator ``name`` preloaded, traced
    by --pid, and bpftrace on the same entry points in the same run."""
    name = request.param
    lib = ALLOCATORS[name]
    tmp = tmp_path_factory.mktemp(f"entries-{name}")
    truth = tmp / "truth.json"
    argv = ["env", f"LD_PRELOAD={lib}", str(built("allocator_entries")), name, "--out",
            str(truth)]  # fmt: skip
    names = OWN_ENTRIES[name] + CXX_ENTRIES
    return name, trace_launched(argv, lambda _: lib, truth, tmp, lib_option=False,
                                script=lambda path: entry_calls_script(path, names))  # fmt: skip


def calls_by_site(traced: Traced) -> dict[str, int]:
    """bpftrace's calls of each call site's entry point made from the site:
    those that return into the site's function (its address from the
    workload, its size from nm). The others (the allocator's calls of its
    own functions, the libc's of malloc and free) are not the site's."""
    sizes = {name: size for name, (_, size, _) in nm_symbols(built("allocator_entries")).items()}
    calls: dict[str, int] = defaultdict(int)
    for key, count in traced.bpftrace.items():
        name, _, address = key.partition(",")
        for site in traced.truth["sites"]:
            at = site["at"]
            if name == site["entry"] and at <= int(address) < at + sizes[site["function"]]:
                calls[site["function"]] += count
    return calls


def site_rows(traced: Traced) -> dict[str, list[dict[str, Any]]]:
    """The trace's stacks of the workload's process, by their first frame's function."""
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in traced.tables["alloc_stacks"]:
        if row["pid"] == traced.truth["pid"]:
            rows[row["frames"][0]["function"]].append(row)
    return rows


def test_each_call_site_of_an_allocators_own_entry_points_counts_what_it_did(
    entry_points: tuple[str, Traced],
) -> None:
    # GIVEN the workload calling each of the allocator's own entry points,
    # and C++'s operator new and delete, each from a call site of its own,
    # and what it says each site did
    name, traced = entry_points
    sites = traced.truth["sites"]
    assert sorted(site["entry"] for site in sites) == sorted(OWN_ENTRIES[name] + CXX_ENTRIES)
    rows = site_rows(traced)
    for site in sites:
        mine = rows.get(site["function"], [])
        if site["fn"] == "free":
            assert mine == [], site  # a free allocates nothing
            continue
        # THEN each allocating site's calls are of the kind its arguments
        # make them, in the allocator's library
        assert {(row["allocator"], row["provider_lib"]) for row in mine} == {
            (site["fn"], site["lib"])}, site  # fmt: skip
        # AND its calls, bytes and live blocks (after the frees, sized and
        # aligned ones included, and reallocations of other sites) are the
        # workload's, exactly
        got = [sum(row[key] for row in mine) for key in ("calls", "bytes", "live_objects",
                                                         "live_bytes")]  # fmt: skip
        assert got == [site["calls"], site["bytes"], site["leaked_calls"],
                       site["leaked_bytes"]], site  # fmt: skip


def test_each_call_site_of_an_allocators_own_entry_points_equals_bpftraces_count(
    entry_points: tuple[str, Traced],
) -> None:
    # GIVEN bpftrace's count of the calls of the same entry points, by the
    # call site they return into, in the same run
    name, traced = entry_points
    theirs = calls_by_site(traced)
    rows = site_rows(traced)
    for site in traced.truth["sites"]:
        # THEN each site made the calls the workload says it made
        assert theirs.get(site["function"], 0) == site["calls"], (name, site)
        # AND the trace counted each allocating call once
        if site["fn"] != "free":
            ours = sum(row["calls"] for row in rows[site["function"]])
            assert ours == theirs[site["function"]], (name, site)


def test_a_process_on_an_unknown_allocator_is_named_with_the_option_that_traces_it(
    tmp_path: Path,
) -> None:
    # GIVEN the workload on an allocator mtrace-live does not know, traced
    # by --pid without --allocator-lib
    lib = ALLOCATORS["unknown"]
    with Reaper() as reaper:
        argv = ["env", f"LD_PRELOAD={lib}", str(built("alloc_workload")), "--wait"]
        proc = start_workload([*argv, "--out", str(tmp_path / "truth.json")], reaper)
        done = subprocess.run([*MTRACE, "--pid", str(proc.pid), "-o", "summary",
                               "--duration", "1"],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.close()  # the workload goes on, and ends
        assert proc.wait(timeout=120) == 0
    # THEN one line names the object that provides malloc, and the option
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "libbump_malloc.so" in line]
    assert len(said) == 2, done.stderr  # the notice, and the process's allocator
    assert "an allocator mtrace-live does not know" in said[0]
    assert "--allocator-lib" in said[0]
    assert said[1].endswith(f"pid {proc.pid}: allocator: unknown (libbump_malloc.so)")


def test_all_attaches_an_allocator_first_mapped_by_a_process_started_after_it(
    tmp_path: Path,
) -> None:
    # GIVEN a trace of every process, and then the workload started on a
    # copy of mimalloc: a file no process mapped before it, whatever runs on
    # the machine (a process on the installed mimalloc has it attached at
    # the trace's start, and no later attach to test)
    lib = tmp_path / ALLOCATORS["mimalloc"].name
    shutil.copyfile(ALLOCATORS["mimalloc"], lib)
    truth = tmp_path / "truth.json"
    err, out = tmp_path / "trace.err", tmp_path / "trace.out"
    with Reaper() as reaper:
        with open(err, "wb") as errors, open(out, "wb") as lines:
            tracer = reaper.add(subprocess.Popen([*MTRACE, "--all", "-o", "json"],
                                                 stdout=lines, stderr=errors))  # fmt: skip
        wait_for_line(err, READY, tracer, timeout=120)
        argv = ["env", f"LD_PRELOAD={lib}", str(built("alloc_workload")), "--wait", "--hold",
                "--out", str(truth)]  # fmt: skip
        proc = reaper.add(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        assert proc.stdin is not None and proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        # WHEN the trace has attached the copy (it says so), the workload goes on
        wait_for_line(err, "allocation functions of mimalloc (libmimalloc.so.2) too", tracer,
                      timeout=120)  # fmt: skip
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        # and ends once the trace has delivered its calls
        facts = end_held_workload(proc, truth, out, tracer)
        tracer.send_signal(signal.SIGINT)
        assert tracer.wait(timeout=120) == 0, err.read_text()
    # THEN every call site of the workload is counted exactly
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    stacks = [r for r in rows if r.get("table") == "alloc_stacks" and r["pid"] == facts["pid"]]
    found = by_site(stacks)
    for site in facts["sites"]:
        got = found[(site["function"], site["fn"])]
        assert (got["calls"], got["bytes"], got["live_bytes"]) == (
            site["calls"], site["bytes"], site["leaked_bytes"]), site  # fmt: skip
    # and its allocator is named in the process's table
    (mine,) = [r for r in rows if r.get("table") == "alloc_processes" and r["pid"] == facts["pid"]]
    assert (mine["allocator"], mine["allocator_lib"]) == ("mimalloc", "libmimalloc.so.2")


def test_run_attaches_the_allocator_of_the_program_its_command_execs(tmp_path: Path) -> None:
    # GIVEN run's command, env, which execs the workload with jemalloc
    # preloaded: env itself allocates from glibc
    lib = ALLOCATORS["jemalloc"]
    truth = tmp_path / "truth.json"
    err, out = tmp_path / "trace.err", tmp_path / "trace.out"
    command = ["env", f"LD_PRELOAD={lib}", str(built("alloc_workload")), "--wait", "--out",
               str(truth)]  # fmt: skip
    with Reaper() as reaper, open(err, "wb") as errors, open(out, "wb") as lines:
        tracer = reaper.add(subprocess.Popen([*MTRACE, "run", "-o", "json", "--", *command],
                                             stdin=subprocess.PIPE, stdout=lines,
                                             stderr=errors))  # fmt: skip
        # WHEN the trace has attached jemalloc once the workload runs, it goes on
        wait_for_line(err, "allocation functions of jemalloc (libjemalloc.so.2) too", tracer,
                      timeout=120)  # fmt: skip
        assert tracer.stdin is not None
        tracer.stdin.write(b"go\n")
        tracer.stdin.close()
        assert tracer.wait(timeout=120) == 0, err.read_text()
    # THEN every call site of the workload is counted exactly
    facts = json.loads(truth.read_text())
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    found = by_site([r for r in rows if r.get("table") == "alloc_stacks"])
    for site in facts["sites"]:
        got = found[(site["function"], site["fn"])]
        assert (got["calls"], got["bytes"], got["live_bytes"]) == (
            site["calls"], site["bytes"], site["leaked_bytes"]), site  # fmt: skip


def run_released(tmp_path: Path, command: list[str],
                 options: tuple[str, ...] = ()) -> tuple[list[dict[str, Any]], str]:  # fmt: skip
    """``command`` (a workload that waits for a line before it allocates) run
    by ``mtrace-live run -o json``, released once the trace has started:
    the JSON objects of its output and the tracer's, and the tracer's stderr."""
    err, out = tmp_path / "trace.err", tmp_path / "trace.out"
    with Reaper() as reaper, open(err, "wb") as errors, open(out, "wb") as lines:
        tracer = reaper.add(subprocess.Popen(
            [*MTRACE, "run", "-o", "json", *options, "--", *command],
            stdin=subprocess.PIPE, stdout=lines, stderr=errors))  # fmt: skip
        wait_for_line(err, READY, tracer, timeout=120)
        assert tracer.stdin is not None
        tracer.stdin.write(b"go\n")
        tracer.stdin.close()
        assert tracer.wait(timeout=120) == 0, err.read_text()
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]
    return rows, err.read_text()


def test_an_allocator_built_into_the_program_under_prefixed_names_is_traced(
    tmp_path: Path,
) -> None:
    # GIVEN a program with jemalloc's prefixed names built in (je_malloc,
    # je_mallocx, je_free: tests/workloads/builtin_alloc.c), run by mtrace-live
    rows, stderr = run_released(tmp_path, [str(built("builtin_alloc")), "2000"])
    # THEN the built-in copy is attached in the program itself
    assert "of jemalloc in " + str(built("builtin_alloc")) in stderr
    # and main's calls of it are counted exactly: je_mallocx's call of
    # je_malloc inside it once, as the outer call
    facts = next(r for r in rows if "malloc_calls" in r)
    found = by_site([r for r in rows if r.get("table") == "alloc_stacks"])
    got = found[("main", "malloc")]
    assert got["calls"] == facts["malloc_calls"] + facts["mallocx_calls"]
    assert got["bytes"] == facts["malloc_bytes"] + facts["mallocx_bytes"]
    assert got["live_objects"] == facts["leaked"] + facts["mallocx_calls"]


def pprof_tags(profile: Path, index: str) -> dict[str, dict[str, int]]:
    """``go tool pprof -tags``: each string label's values and their totals of
    sample type ``index``."""
    done = subprocess.run(["go", "tool", "pprof", "-tags", f"-sample_index={index}",
                           str(profile)], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    tags: dict[str, dict[str, int]] = defaultdict(dict)
    label = ""
    for line in done.stdout.splitlines():
        head, _, rest = line.strip().partition(": ")
        if rest.startswith("Total "):
            label = head
        elif "(" in head and rest and label:
            tags[label][rest] = round(float(head.split()[0]))
    return tags


def test_two_providers_in_one_process_are_kept_apart(tmp_path: Path) -> None:
    # GIVEN a program whose malloc is jemalloc's, which also calls the libc's
    # own malloc found by dlsym, and jemalloc's xallocx
    # (tests/workloads/two_providers.c), run by mtrace-live
    profile = tmp_path / "heap.pb.gz"
    rows, _ = run_released(tmp_path, [str(built("two_providers")), "3000", "700"],
                           ("--pprof", str(profile)))  # fmt: skip
    facts = next(r for r in rows if "jemalloc_calls" in r)
    stacks = [r for r in rows if r.get("table") == "alloc_stacks"]
    # THEN each call site's row names the provider its calls went to, with
    # exactly the calls, bytes and leaks the program made through it
    mine = {(r["frames"][0]["function"], r["provider"], r["provider_lib"]): r for r in stacks
            if r["frames"][0]["function"] in ("via_jemalloc", "via_libc")}  # fmt: skip
    jemalloc = mine[("via_jemalloc", "jemalloc", "libjemalloc.so.2")]
    libc = mine[("via_libc", "glibc", "libc.so.6")]
    assert len(mine) == 2
    assert (jemalloc["calls"], jemalloc["bytes"], jemalloc["live_objects"]) == (
        facts["jemalloc_calls"], facts["jemalloc_bytes"], facts["jemalloc_leaked"])  # fmt: skip
    assert (libc["calls"], libc["bytes"], libc["live_objects"]) == (
        facts["libc_calls"], facts["libc_bytes"], facts["libc_calls"])  # fmt: skip
    # AND jemalloc's xallocx, which resized each block in place, is a realloc
    # of it there: the malloc's block released, the realloc's then freed
    resized = by_site([r for r in stacks if r["frames"][0]["function"] == "in_place"])
    assert (resized[("in_place", "malloc")]["calls"], resized[("in_place", "malloc")]["bytes"],
            resized[("in_place", "malloc")]["live_objects"]) == (
        facts["in_place_mallocs"], 64 * facts["in_place_mallocs"], 0)  # fmt: skip
    assert (resized[("in_place", "realloc")]["calls"], resized[("in_place", "realloc")]["bytes"],
            resized[("in_place", "realloc")]["live_objects"]) == (
        facts["in_place_resized"], 60 * facts["in_place_resized"], 0)  # fmt: skip
    # AND the process's row sums its calls by provider
    (process,) = [r for r in rows if r.get("table") == "alloc_processes"]
    assert process["allocator"] == "jemalloc"
    called = {p["allocator"]: p["calls"] for p in process["providers"]}
    assert called["jemalloc"] >= facts["jemalloc_calls"]
    assert called["glibc"] >= facts["libc_calls"]
    # AND go tool pprof reads each sample's provider label
    tags = pprof_tags(profile, "alloc_objects")
    assert tags["provider"]["jemalloc"] >= facts["jemalloc_calls"]
    assert tags["provider"]["glibc"] >= facts["libc_calls"]
    assert tags["provider_lib"]["libjemalloc.so.2"] == tags["provider"]["jemalloc"]
