"""The chain probe -> BPF -> map -> user space, checked against what the
exerciser knows it did, and against bpftrace on the same run."""

import json
import subprocess
from pathlib import Path

from mtrace_live.tracer.processes.sdt_glibc import SdtGlibc

from .conftest import MTRACE, mtrace_count
from .tracing import (
    BPFTRACE_READY,
    GatedWorkload,
    Reaper,
    bpftrace_counts,
    stop_bpftrace,
    wait_for_line,
)

# The 32 probes of the glibc manual's "Internal probes" chapter.
DOCUMENTED_PROBES = [
    "memory_sbrk_more",
    "memory_sbrk_less",
    "memory_heap_new",
    "memory_heap_free",
    "memory_heap_more",
    "memory_heap_less",
    "memory_malloc_retry",
    "memory_realloc_retry",
    "memory_memalign_retry",
    "memory_calloc_retry",
    "memory_arena_retry",
    "memory_arena_new",
    "memory_arena_reuse",
    "memory_arena_reuse_wait",
    "memory_arena_reuse_free_list",
    "memory_mallopt",
    "memory_mallopt_mxfast",
    "memory_mallopt_trim_threshold",
    "memory_mallopt_top_pad",
    "memory_mallopt_mmap_threshold",
    "memory_mallopt_mmap_max",
    "memory_mallopt_perturb",
    "memory_mallopt_arena_test",
    "memory_mallopt_arena_max",
    "memory_mallopt_free_dyn_thresholds",
    "memory_tunable_tcache_max_bytes",
    "memory_tunable_tcache_count",
    "memory_tunable_tcache_unsorted_limit",
    "memory_tcache_double_free",
    "setjmp",
    "longjmp",
    "longjmp_target",
]


def ground_truth(path: Path) -> dict[str, int]:
    probes = json.loads(path.read_text())["probes"]
    return {name: entry["count"] for name, entry in probes.items()}


def test_one_probe_counted_exactly_from_the_first_instruction(
    sdt: SdtGlibc, probe_exerciser: Path, tmp_path: Path
) -> None:
    # GIVEN the exerciser, started by mtrace-live under the SDT glibc
    truth_file = tmp_path / "truth.json"
    # WHEN only memory_mallopt is counted
    done = mtrace_count(
        "--sdt-glibc",
        "--probes",
        "memory_mallopt",
        "--json",
        "--",
        str(probe_exerciser),
        "--out",
        str(truth_file),
    )
    # THEN the kernel's count is exactly the number of mallopt calls it made
    assert done.returncode == 0, done.stderr
    counted = json.loads(done.stdout)["usdt"]
    assert counted == {"memory_mallopt": ground_truth(truth_file)["memory_mallopt"]}
    assert counted["memory_mallopt"] >= 1


def test_all_documented_probes_agree_with_ground_truth_and_bpftrace(
    sdt: SdtGlibc, probe_exerciser: Path, tmp_path: Path
) -> None:
    # GIVEN the exerciser held at a gate under the SDT glibc, with two tracers
    # attached to its pid: mtrace-live and bpftrace
    truth_file = tmp_path / "truth.json"
    ours_out, ours_err = tmp_path / "mtrace.json", tmp_path / "mtrace.err"
    probe_args = [arg for name in DOCUMENTED_PROBES for arg in ("--probes", name)]
    with Reaper() as reaper:
        argv = sdt.wrap([str(probe_exerciser), "--out", str(truth_file)])
        workload = GatedWorkload(argv, tmp_path, reaper)
        with open(ours_out, "wb") as out, open(ours_err, "wb") as err:
            ours = reaper.add(
                subprocess.Popen(
                    [
                        *MTRACE,
                        "count",
                        "--lib",
                        str(sdt.libc),
                        "--pid",
                        str(workload.pid),
                        "--json",
                        *probe_args,
                    ],
                    stdout=out,
                    stderr=err,
                )
            )
        wait_for_line(ours_err, "counting", ours, timeout=120)
        bpftrace, bpftrace_out = bpftrace_counts(
            sdt.libc, DOCUMENTED_PROBES, workload.pid, tmp_path
        )
        reaper.add(bpftrace)
        wait_for_line(bpftrace_out, BPFTRACE_READY, bpftrace, timeout=120)

        # WHEN the exerciser runs to its end
        workload.release()
        assert workload.wait() == 0
        assert ours.wait(timeout=60) == 0, ours_err.read_text()
        theirs = stop_bpftrace(bpftrace, bpftrace_out)
    truth = ground_truth(truth_file)
    counted = json.loads(ours_out.read_text())["usdt"]

    # THEN the ground truth lists every documented probe, each caused at least once
    assert sorted(truth) == sorted(DOCUMENTED_PROBES)
    assert all(count >= 1 for count in truth.values()), truth
    # AND mtrace-live and bpftrace each counted exactly that, probe by probe
    assert {name: counted.get(name, 0) for name in truth} == truth
    assert {name: theirs.get(name, 0) for name in truth} == truth


def test_run_passes_the_command_exit_code_through(sdt: SdtGlibc) -> None:
    done = mtrace_count("--sdt-glibc", "--probes", "setjmp", "--", "/bin/sh", "-c", "exit 7")
    assert done.returncode == 7, done.stderr
