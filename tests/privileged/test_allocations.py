"""The allocation functions traced for real, on Debian's stock glibc (no SDT
notes) and on the SDT build, against a workload that writes down what it
did (tests/workloads/alloc_workload.c) and against bpftrace counting the
same functions in the same run.

The workload starts first and allocates some blocks, then waits; mtrace-live
attaches by --pid (and bpftrace beside it); then the workload runs its call
sites and frees the early blocks, which the trace must see as frees of
memory allocated before it attached.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mtrace_live.tracer.processes import sdt_glibc
from mtrace_live.tracer.processes.target import default_libc

from .conftest import MTRACE, built
from .test_serve import Prometheus, fetch, free_port, start_serve, stop
from .tracing import (
    BPFTRACE_READY,
    Reaper,
    end_held_workload,
    finish,
    gate,
    start_bpftrace,
    stop_bpftrace,
    wait_for_line,
)

READY = "Ctrl-C to stop"
LOADER = "/lib64/ld-linux-x86-64.so.2"
# The functions bpftrace counts at their entry (aligned_alloc is memalign's
# address in glibc 2.36, reallocarray jumps to realloc: neither is attached).
COUNTED = ("malloc", "calloc", "realloc", "free", "memalign", "posix_memalign", "valloc")


@dataclass
class Traced:
    truth: dict[str, Any]
    tables: dict[str, list[dict[str, Any]]]  # the JSON tables at the end, by name
    events: list[dict[str, Any]]
    bpftrace: dict[str, int]
    pprof: Path
    stderr: str


def start_workload(argv: list[str], reaper: Reaper) -> subprocess.Popen[bytes]:
    proc = reaper.add(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    proc.stdout.close()
    return proc


def trace_workload(libc_kind: str, sdt: sdt_glibc.SdtGlibc, tmp: Path,
                   extra: tuple[str, ...] = (), scale: int = 1) -> Traced:  # fmt: skip
    workload = built("alloc_workload")
    truth_file = tmp / "truth.json"
    argv = [str(workload), "--wait", "--out", str(truth_file), "--scale", str(scale)]
    if libc_kind == "sdt":
        return trace_launched(sdt.wrap(argv), lambda _: sdt.libc, truth_file, tmp, extra)
    return trace_launched(argv, lambda _: default_libc(), truth_file, tmp, extra)


# bpftrace's own counts beside each function's calls (@extra): frees of NULL,
# by the argument, and the calls made inside another allocation function
# (glibc's realloc(NULL) calls malloc), by each thread's depth in them.
NULL_FREES, NESTED = "free(NULL)", "nested"


def bpftrace_script(libc: Path) -> str:
    lines = [f"uprobe:{libc}:{name} /pid == $1/ {{ @hits[probe] = count(); "
             f"if (@depth[tid] > 0) {{ @extra[\"{NESTED}\"] = count(); }} @depth[tid]++; }}\n"
             f"uretprobe:{libc}:{name} /pid == $1 && @depth[tid] > 0/ {{ @depth[tid]--; }}"
             for name in COUNTED if name != "free"]  # fmt: skip
    lines.append(f"uprobe:{libc}:free /pid == $1/ {{ @hits[probe] = count(); "
                 f"if (arg0 == 0) {{ @extra[\"{NULL_FREES}\"] = count(); }} }}")  # fmt: skip
    return "\n".join(lines)


def trace_launched(argv: list[str], libc_of: Callable[[int], Path], truth_file: Path, tmp: Path,
                   extra: tuple[str, ...] = (), lib_option: bool = True,
                   script: Callable[[Path], str] = bpftrace_script) -> Traced:  # fmt: skip
    """The workload started by ``argv``, bpftrace (``script`` of the library)
    on ``libc_of(pid)`` and mtrace-live (given that libc with --lib when
    ``lib_option``) on its pid."""
    pprof = tmp / "allocs.pb.gz"
    with Reaper() as reaper:
        proc = start_workload(argv, reaper)
        libc = libc_of(proc.pid)
        err = tmp / "trace.err"
        out = tmp / "trace.out"
        with open(err, "wb") as errors, open(out, "wb") as lines:
            tracer = reaper.add(subprocess.Popen(
                [*MTRACE, "--pid", str(proc.pid), *(("--lib", str(libc)) if lib_option else ()),
                 "-o", "json", "--pprof", str(pprof), *extra],
                stdout=lines, stderr=errors,
            ))  # fmt: skip
        wait_for_line(err, READY, tracer, timeout=120)
        # (bpftrace only now, and stopped at the workload's end: its libc
        # uprobes trap in every process, the tracer's start and end included,
        # 61 s of this fixture here against 5 s)
        bpftrace, bpftrace_out = start_bpftrace(script(libc), proc.pid, tmp)
        reaper.add(bpftrace)
        wait_for_line(bpftrace_out, BPFTRACE_READY, bpftrace, timeout=120)
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0
        counts = stop_bpftrace(bpftrace, bpftrace_out)
        assert tracer.wait(timeout=120) == 0, err.read_text()
    tables: dict[str, list[dict[str, Any]]] = defaultdict(list)
    events = []
    for line in out.read_text().splitlines():
        record = json.loads(line)
        if "table" in record:
            tables[record["table"]].append(record)
        else:
            events.append(record)
    return Traced(
        json.loads(truth_file.read_text()), tables, events, counts, pprof, err.read_text()
    )


@pytest.fixture(scope="module", params=["stock", "sdt"])
def traced(request: pytest.FixtureRequest, sdt: sdt_glibc.SdtGlibc,
           tmp_path_factory: pytest.TempPathFactory) -> Traced:  # fmt: skip
    return trace_workload(request.param, sdt, tmp_path_factory.mktemp(f"allocs-{request.param}"))


def by_site(stacks: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, int]]:
    """The per-stack rows summed by (calling function, allocation function)."""
    sums: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for row in stacks:
        function = row["frames"][0]["function"]
        site = sums[(function, row["allocator"])]
        for key in ("calls", "bytes", "live_objects", "live_bytes"):
            site[key] += row[key]
    return sums


def test_every_call_site_counts_exactly_what_the_workload_did(traced: Traced) -> None:
    # GIVEN what the workload says each of its call sites did
    found = by_site(traced.tables["alloc_stacks"])
    for site in traced.truth["sites"]:
        key = (site["function"], site["fn"])
        # THEN its calls, bytes and leaks equal the trace's, exactly
        assert key in found, (key, sorted(found))
        got = found[key]
        assert got["calls"] == site["calls"], key
        assert got["bytes"] == site["bytes"], key
        assert got["live_objects"] == site["leaked_calls"], key
        assert got["live_bytes"] == site["leaked_bytes"], key
    # and above each call site made from main (the threads' start in libc,
    # built without frame pointers, ends their walk) the walk found main
    from_main = {site["function"] for site in traced.truth["sites"]} - {"threaded"}
    rows = [row for row in traced.tables["alloc_stacks"]
            if row["frames"][0]["function"] in from_main]  # fmt: skip
    assert rows
    for row in rows:
        assert [f["function"] for f in row["frames"][1:2]] == ["main"], row["frames"]


def test_a_process_in_another_mount_namespace_is_traced_through_its_root(tmp_path: Path) -> None:
    # GIVEN the workload in a new mount namespace, running on a copy of the
    # libc in a tmpfs that only that namespace sees (as in a container): the
    # host's libc at the same path would be another file, whose probes never
    # fire in this process
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    truth_file = tmp_path / "truth.json"
    workload = built("alloc_workload")
    script = (
        f"mount -t tmpfs none {hidden} && cp {default_libc()} {hidden}/libc.so.6 && "
        f"exec env LD_PRELOAD={hidden}/libc.so.6 {workload} --wait --out {truth_file}"
    )
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
    # WHEN mtrace-live attaches by pid alone, finding the libc itself
    traced = trace_launched(argv, lambda pid: Path(f"/proc/{pid}/root{hidden}/libc.so.6"),
                            truth_file, tmp_path, lib_option=False)  # fmt: skip
    assert not (hidden / "libc.so.6").exists()
    # THEN every call site is counted exactly, and bpftrace, told the path
    # through /proc/PID/root, saw the same calls
    found = by_site(traced.tables["alloc_stacks"])
    for site in traced.truth["sites"]:
        got = found[(site["function"], site["fn"])]
        assert (got["calls"], got["bytes"], got["live_bytes"]) == (
            site["calls"], site["bytes"], site["leaked_bytes"]), site  # fmt: skip
    (functions,) = traced.tables["alloc_functions"]
    for name in COUNTED:
        assert functions["calls"][name] == traced.bpftrace.get(name, 0), name


def test_frees_of_memory_allocated_before_attaching_are_counted_apart(traced: Traced) -> None:
    # GIVEN the workload's early blocks, allocated before the trace attached
    (proc,) = traced.tables["alloc_processes"]
    assert proc["pid"] == traced.truth["pid"]
    # THEN their frees are unknown frees (glibc's own frees of blocks it
    # allocated earlier, e.g. stdio's, come on top), never matched to a site
    assert proc["unknown_frees"] >= traced.truth["unknown_frees"]
    assert ("early_blocks", "malloc") not in by_site(traced.tables["alloc_stacks"])


def test_calls_per_function_equal_bpftraces_in_the_same_run(traced: Traced) -> None:
    # GIVEN bpftrace's count of each function's entries, nested calls included
    (functions,) = traced.tables["alloc_functions"]
    for name in COUNTED:
        # THEN mtrace-live's kernel count of the same hits is the same
        assert functions["calls"][name] == traced.bpftrace.get(name, 0), name
    # and the nested calls (each chain's realloc(NULL) calls malloc) were
    # not counted twice: the trace's malloc calls are fewer than its hits
    chain = next(s for s in traced.truth["sites"] if s["function"] == "realloc_chain")
    assert functions["nested"] >= chain["calls"] // 10


def test_every_allocation_and_free_reaches_the_json_stream(traced: Traced) -> None:
    # GIVEN the trace's events by function, none lost, and the kernel's count
    # of each function's calls (equal to bpftrace's: the test above)
    (functions,) = traced.tables["alloc_functions"]
    assert functions["lost_events"] == 0
    events: dict[str, int] = defaultdict(int)
    for event in traced.events:
        events[event["probe"]] += 1
    # THEN each function's calls are its events, exactly: less, for malloc,
    # the calls nested in another allocation function (realloc(NULL): the
    # realloc's event stands for them) and, for free, free(NULL), which frees
    # nothing; both counted by bpftrace in the same run
    nested, null = traced.bpftrace.get(NESTED, 0), traced.bpftrace.get(NULL_FREES, 0)
    assert nested > 0 and null > 0, traced.bpftrace
    assert (functions["nested"], functions["null_frees"]) == (nested, null)
    for name, calls in functions["calls"].items():
        expected = calls - (nested if name == "malloc" else 0) - (null if name == "free" else 0)
        assert events[name] == expected, (name, events[name], calls)
    assert events["malloc"] and events["free"] and events["realloc"]
    # AND each realloc of a block releases it: nine of each chain's ten (the
    # first starts from NULL), the only reallocs of a block in the run
    realloc = next(s for s in traced.truth["sites"] if s["function"] == "realloc_chain")
    chains = realloc["leaked_calls"]  # each chain's last block is never freed
    assert events["realloc:free"] == realloc["calls"] - chains


def pprof_top(path: Path, sample_index: str) -> dict[str, int]:
    """``go tool pprof -top``'s flat bytes per function."""
    done = subprocess.run(
        ["go", "tool", "pprof", "-top", "-nodecount=1000", "-nodefraction=0",
         f"-sample_index={sample_index}",
         "-unit=B", str(path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    flat = {}
    for line in done.stdout.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[0].endswith("B") and fields[-1] != "total":
            flat[fields[5]] = int(float(fields[0][:-1]))
    return flat


def test_go_tool_pprof_names_each_leaking_function_with_its_bytes(traced: Traced) -> None:
    # GIVEN the profile written by --pprof, read by the real go tool pprof
    flat = pprof_top(traced.pprof, "inuse_space")
    leaked: dict[str, int] = defaultdict(int)
    for site in traced.truth["sites"]:
        leaked[site["function"]] += site["leaked_bytes"]
    # THEN each leaking function holds exactly the bytes it leaked
    for function, nbytes in leaked.items():
        if nbytes:
            assert flat.get(function) == nbytes, (function, flat)
    # and the biggest leak is at the top
    assert max(flat, key=lambda f: flat[f]) == "realloc_chain"
    allocated = pprof_top(traced.pprof, "alloc_space")
    churn = next(s for s in traced.truth["sites"] if s["function"] == "churn")
    assert allocated["churn"] == churn["bytes"]


@pytest.mark.soak  # (make soak: slower than make test's budget)
def test_sampled_live_bytes_stay_within_the_poisson_bound(sdt: sdt_glibc.SdtGlibc,
                                                          tmp_path: Path) -> None:  # fmt: skip
    # GIVEN a larger run of the workload, sampled once per 4 KiB on average
    interval = 4096
    run = trace_workload("stock", sdt, tmp_path, ("--sample-bytes", str(interval)), scale=20)
    found = by_site(run.tables["alloc_stacks"])
    live_truth = sum(s["leaked_bytes"] for s in run.truth["sites"])
    live_seen = sum(v["live_bytes"] for (f, _), v in found.items()
                    if f in {s["function"] for s in run.truth["sites"]})  # fmt: skip
    # THEN the estimate is within 5 standard deviations of the truth: the
    # sample points in B bytes are Poisson(B / interval), so the estimate
    # interval * count has a standard deviation of sqrt(interval * B)
    sigma = math.sqrt(interval * live_truth)
    assert abs(live_seen - live_truth) <= 5 * sigma + 0.01 * live_truth, (live_seen, live_truth)
    allocated = sum(s["bytes"] for s in run.truth["sites"])
    seen = sum(v["bytes"] for (f, _), v in found.items()
               if f in {s["function"] for s in run.truth["sites"]})  # fmt: skip
    assert abs(seen - allocated) <= 5 * math.sqrt(interval * allocated) + 0.01 * allocated
    # and far fewer allocations were kept than made
    calls = sum(s["calls"] for s in run.truth["sites"])
    kept = sum(row["sampled_calls"] for row in run.tables["alloc_stacks"])
    assert kept < calls / 2


def test_run_lists_what_the_command_never_freed(sdt: sdt_glibc.SdtGlibc, tmp_path: Path) -> None:
    # GIVEN the workload run by mtrace-live from its first instruction
    truth_file = tmp_path / "truth.json"
    done = subprocess.run(
        [*MTRACE, "run", "-o", "summary", "--", str(built("alloc_workload")),
         "--out", str(truth_file)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # THEN the summary lists each leaking site by stack, after the command ended
    summary = done.stdout
    assert "never freed, by stack (the command has ended):" in summary
    leaks = summary.split("never freed, by stack")[1]
    truth = json.loads(truth_file.read_text())
    for site in truth["sites"]:
        if site["leaked_calls"]:
            line = next((x for x in leaks.splitlines() if f" {site['function']}+" in x), None)
            assert line is not None, (site["function"], leaks)
            assert int(line.split()[1]) == site["leaked_calls"], line
    # and the libc without SDT probes was said in one line, not as an error:
    # its memory_* probes are derived
    assert "memory_* probes derived" in done.stderr and "Traceback" not in done.stderr


def test_prometheus_stores_the_live_bytes_of_the_leaking_stacks(
    web_tls: Any, tmp_path: Path
) -> None:
    # GIVEN serve following the workload, scraped by a real Prometheus
    port = free_port()
    truth_file = tmp_path / "truth.json"
    with Reaper() as reaper:
        proc = start_workload([str(built("alloc_workload")), "--wait", "--out", str(truth_file)],
                              reaper)  # fmt: skip
        serve, _ = start_serve(
            ["--pid", str(proc.pid), "--no-kmem", "--exact",
             "--web.listen-address", f"127.0.0.1:{port}",
             "--web.config.file", str(web_tls.config)],
            tmp_path, reaper,
        )  # fmt: skip
        prometheus = Prometheus(f"127.0.0.1:{port}", web_tls, tmp_path, reaper)
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0
        truth = json.loads(truth_file.read_text())
        chain = next(s for s in truth["sites"] if s["function"] == "realloc_chain")
        expr = 'sum(mtrace_alloc_stack_live_bytes{stack=~"realloc_chain.*"})'
        stored = float("nan")
        for _ in range(120):
            stored = prometheus.scalar(expr)
            if stored == chain["leaked_bytes"]:
                break
            subprocess.run(["sleep", "0.5"], check=True)
        # THEN Prometheus holds the chain's live bytes, and the process's calls
        assert stored == chain["leaked_bytes"]
        calls = prometheus.scalar('sum(mtrace_alloc_calls_total{process="alloc_workload"})')
        assert calls >= sum(s["calls"] for s in truth["sites"])
        code, _ = fetch(f"https://127.0.0.1:{port}/metrics", web_tls, web_tls.password)
        assert code == 200
        assert stop(serve) == 0


def leaking_sites(truth: dict[str, Any]) -> dict[str, int]:
    """Blocks the workload never freed, by calling function."""
    leaks: dict[str, int] = defaultdict(int)
    for site in truth["sites"]:
        leaks[site["function"]] += site["leaked_calls"]
    return {function: n for function, n in leaks.items() if n}


def test_record_and_report_match_user_frees_by_pointer(tmp_path: Path) -> None:
    # GIVEN the workload recorded with its allocations as kmemtrace records
    truth_file, out = tmp_path / "truth.json", tmp_path / "rec.d"
    done = subprocess.run(
        [*MTRACE, "record", "-o", str(out), "--libc", "--", str(built("alloc_workload")),
         "--out", str(truth_file)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # WHEN report reads them (ABI 3: user-space records of type 7)
    report = subprocess.run([*MTRACE, "report", str(out), "--format", "json"],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert report.returncode == 0, report.stderr
    document = json.loads(report.stdout)
    assert document["abi_version"] == 3 and document["kernel"]["call_sites"]
    # THEN each call site's allocations, bytes and live blocks equal the truth
    found: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for entry in document["user"]:
        function = entry["name"].split("+", 1)[0]
        site = found[(function, entry["allocator"])]
        for key in ("allocs", "bytes", "live", "live_bytes"):
            site[key] += entry[key]
    truth = json.loads(truth_file.read_text())
    for site in truth["sites"]:
        got = found[(site["function"], site["fn"])]
        assert (got["allocs"], got["bytes"]) == (site["calls"], site["bytes"]), site
        assert (got["live"], got["live_bytes"]) == (site["leaked_calls"], site["leaked_bytes"])
    # AND allocinfo lines name the leaking lines of the workload's source
    allocinfo = subprocess.run([*MTRACE, "report", str(out), "--format", "allocinfo"],
                               capture_output=True, text=True, timeout=300).stdout  # fmt: skip
    chain = next(s for s in truth["sites"] if s["function"] == "realloc_chain")
    line = next(x for x in allocinfo.splitlines() if "func:realloc_chain" in x)
    assert line.split()[:2] == [str(chain["leaked_bytes"]), str(chain["leaked_calls"])]
    assert "alloc_workload.c:" in line


def test_sp_rtrace_leaks_read_back_by_convert_equal_the_workloads(tmp_path: Path) -> None:
    # GIVEN the workload's allocations written as an sp-rtrace report
    truth_file, report = tmp_path / "truth.json", tmp_path / "trace.txt"
    done = subprocess.run(
        [*MTRACE, "run", "-o", "summary", "--sp-rtrace", str(report), "--",
         str(built("alloc_workload")), "--out", str(truth_file)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = report.read_text()
    # (the resource's number follows the derived probes' sbrk, heap and arena resources)
    assert re.search(r"^<\d+> : memory \(memory allocation in bytes\)$", text, re.M), text[:400]
    assert "realloc<memory>(" in text and "posix_memalign<memory>(" in text
    # WHEN convert keeps only what was never freed
    leaks = tmp_path / "leaks.txt"
    converted = subprocess.run([*MTRACE, "convert", str(report), "--leaks", "-o", str(leaks)],
                               capture_output=True, text=True, timeout=300)  # fmt: skip
    assert converted.returncode == 0, converted.stderr
    # THEN the leaked blocks, by the function of their first frame, are the workload's
    counted: dict[str, int] = defaultdict(int)
    lines = leaks.read_text().splitlines()
    for index, line in enumerate(lines):
        if line[:1].isdigit() and ". " in line and index + 1 < len(lines):
            frame = lines[index + 1]
            if " in " in frame:
                counted[frame.split(" in ", 1)[1].split("(", 1)[0]] += 1
    truth = json.loads(truth_file.read_text())
    for function, blocks in leaking_sites(truth).items():
        assert counted[function] == blocks, (function, counted)


def test_all_traces_the_allocations_of_every_process_mapping_the_libc(
    sdt: sdt_glibc.SdtGlibc, tmp_path: Path
) -> None:
    # GIVEN a system-wide trace of the SDT libc's allocation functions
    err = tmp_path / "all.err"
    out = tmp_path / "all.out"
    with Reaper() as reaper, open(err, "wb") as errors, open(out, "wb") as lines:
        tracer = reaper.add(subprocess.Popen(
            [*MTRACE, "--all", "--lib", str(sdt.libc), "-o", "json", "--duration", "120"],
            stdout=lines, stderr=errors,
        ))  # fmt: skip
        wait_for_line(err, READY, tracer, timeout=120)
        # WHEN the workload runs under that libc, not followed by pid
        truth_file = tmp_path / "truth.json"
        argv = sdt.wrap([str(built("alloc_workload")), "--hold", "--out", str(truth_file)])
        proc = reaper.add(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        # and ends once the trace has delivered its calls
        truth = end_held_workload(proc, truth_file, out, tracer)
        tracer.send_signal(2)
        assert tracer.wait(timeout=120) == 0, err.read_text()
    stacks = [json.loads(x) for x in out.read_text().splitlines() if '"alloc_stacks"' in x]
    mine = [row for row in stacks if row["pid"] == truth["pid"]]
    # THEN its call sites are there, exactly
    found = by_site(mine)
    for site in truth["sites"]:
        got = found[(site["function"], site["fn"])]
        assert (got["calls"], got["live_bytes"]) == (site["calls"], site["leaked_bytes"]), site


# Waits for a line, allocates 64 KiB blocks with the libc's malloc (below the
# mmap threshold, above pymalloc's), says so, and waits again.
ALLOCATING_PYTHON = (
    "import sys\n"
    "sys.stdin.readline()\n"
    "blocks = [bytearray(1 << 16) for _ in range(64)]\n"
    "print('allocated', flush=True)\n"
    "sys.stdin.readline()\n"
)


def uprobe_area(pid: int) -> bool:
    """Whether the kernel gave ``pid`` its uprobe area, which it maps on the
    first return probe that fires in a process."""
    return "[uprobes]" in Path(f"/proc/{pid}/maps").read_text()


def test_pid_alone_places_no_probe_in_other_processes(tmp_path: Path) -> None:
    # GIVEN two processes on the same libc, each about to call malloc: a
    # copy of the system's of their own (another tracer's return probes on
    # the system's, a bpftrace left running once, fired in the bystander)
    (tmp_path / "lib").mkdir()
    shutil.copy2(default_libc(), tmp_path / "lib" / "libc.so.6")
    argv = [LOADER, "--library-path", str(tmp_path / "lib"), "/usr/bin/python3", "-c",
            ALLOCATING_PYTHON]  # fmt: skip
    err = tmp_path / "trace.err"
    with Reaper() as reaper:
        target, bystander = (
            reaper.add(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
            for _ in range(2)
        )  # fmt: skip
        # WHEN mtrace-live traces one of them by --pid, and both allocate
        with open(err, "wb") as errors:
            tracer = reaper.add(subprocess.Popen(
                [*MTRACE, "--pid", str(target.pid), "-o", "json"],
                stdout=subprocess.DEVNULL, stderr=errors,
            ))  # fmt: skip
        wait_for_line(err, READY, tracer, timeout=120)
        for proc in (target, bystander):
            gate(proc, b"go\n", b"allocated\n")
        # THEN the return probes fired in the target (its uprobe area is
        # there) and the kernel never placed them in the other process
        assert uprobe_area(target.pid)
        assert not uprobe_area(bystander.pid)
        assert (finish(target), finish(bystander)) == (0, 0)
        tracer.send_signal(2)
        assert tracer.wait(timeout=120) == 0, err.read_text()
