"""The benchmark harness's own logic: alternating order, medians, the
search for missing peers, and the page it writes. (The measurements
themselves are made by `make bench`, never asserted on in tests.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import common  # noqa: E402
import run as bench_run  # noqa: E402


def test_configurations_alternate_forward_then_backward() -> None:
    order: list[str] = []

    def config(name: str, seconds: float) -> common.Sample:
        order.append(name)
        return common.Sample(seconds, {"hits": len(order)})

    samples = common.alternate(
        {
            "a": lambda: config("a", 1.0),
            "b": lambda: config("b", 2.0),
            "c": lambda: config("c", 3.0),
        },
        reps=3,
    )
    assert order == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert [s.seconds for s in samples["b"]] == [2.0, 2.0, 2.0]
    rows = common.summarise(samples)
    assert rows["a"]["median_s"] == 1.0
    assert rows["a"]["hits"] == 6  # hits 1, 6, 7: the median
    assert rows["c"]["samples"] == [3.0, 3.0, 3.0]


def test_workload_times_are_read_from_their_last_number_line() -> None:
    assert common.last_seconds("wall 0.750000\n1.186599\n") == 1.186599
    assert common.last_seconds('0.5\n{\n  "exit_code": 0\n') == 0.5
    with pytest.raises(RuntimeError, match="no elapsed time"):
        common.last_seconds("nothing here\n")


def test_missing_peers_are_named_not_fatal(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no peer here
    found = common.peer_versions()
    assert found == {"bpftrace": None, "bcc trace": None, "perf": None, "bcc memleak": None,
                     "heaptrack": None}  # fmt: skip


def minimal_results(peers: dict[str, str | None]) -> dict[str, object]:
    """What a run with only untraced and mtrace-live configurations leaves."""

    def row(seconds: float, **extra: float) -> dict[str, object]:
        return {"median_s": seconds, "samples": [seconds], "ratio": seconds / 0.5, **extra}

    return {
        "machine": {"cpu": "a CPU, 2 CPUs", "memory": "1 GiB", "virtualisation": "none",
                    "kernel": "Linux 6.18", "glibc": "glibc 2.36", "bcc": "bcc 0.26",
                    "python": "Python 3.11"},
        "peers": peers,
        "quick": True,
        "reps": 1,
        "seconds": 60.0,
        "durations": {"usdt": 30.0, "kmem": 30.0},
        "usdt": {
            "jmp_loop": {
                "title": "`jmp_loop 100`",
                "rows": {
                    "untraced": row(0.5),
                    "mtrace-live counters only": row(0.8, hits=300, ns_per_hit=1e6),
                    "mtrace-live event stream": row(0.9, hits=300, lost=0, ns_per_hit=1.3e6),
                },
            }
        },
        "kmem": {
            "slowdown": {"pairs": 10, "rows": {
                "untraced": row(0.5),
                "mtrace-live aggregation, pid filter": row(1.0),
            }},
            "report": {"records": 10, "bytes": 600, "seconds": 1.0, "records_per_s": 10.0,
                       "peak_rss_mib": 100.0},
            "perf": None,
            "window_pairs": 10,
        },
    }  # fmt: skip


def test_a_run_without_peers_says_so_and_judges_nothing_against_them() -> None:
    page = bench_run.render(minimal_results({"bpftrace": None, "bcc trace": None, "perf": None}))
    assert "bpftrace NOT INSTALLED" in page
    assert "| USDT per-hit cost, jmp_loop, event stream | not measured |" in page
    assert "| kmem aggregation with pid filter below perf stat's overhead | not measured |" in page
    assert "| report >= 20 M records/s (on >= 1 GB) | not measured |" in page  # 600 bytes
    assert "| mtrace-live counters only | 0.800 | 1.60x | 300 |" in page
    assert "## 5." not in page  # sections not run are not on the page


def test_unknown_sections_and_arguments_are_refused() -> None:
    def bench(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(BENCH / "run.py"), *args],
            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(BENCH)},
        )  # fmt: skip

    unknown = bench("--only", "usdt,nonsense")
    assert unknown.returncode == 2
    assert unknown.stderr.strip().splitlines() == [
        "mtrace-live bench: unknown section 'nonsense'; sections: usdt, kmem, events, scrape, "
        "cost, rates, allocs, stacks, python, contention, profiles, servers, startup"
    ]
    bogus = bench("--bogus")
    assert bogus.returncode == 2
    assert "make bench" in bogus.stderr and "Traceback" not in bogus.stderr


def test_a_failing_peer_is_left_out_and_ours_stops_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "FAILED", {})
    calls: list[str] = []

    def broken() -> common.Sample:
        calls.append("peer")
        raise RuntimeError("trace did not start:\ncan't generate USDT probe arguments")

    samples = common.alternate(
        {"untraced": lambda: common.Sample(1.0), "bcc trace": broken}, reps=3
    )
    assert calls == ["peer"]  # tried once, then left out
    assert list(samples) == ["untraced"] and len(samples["untraced"]) == 3
    assert common.FAILED == {"bcc trace": "can't generate USDT probe arguments"}

    def ours_broken() -> common.Sample:
        raise RuntimeError("mtrace-live exited 1")

    with pytest.raises(RuntimeError, match="exited 1"):
        common.alternate({"mtrace-live event stream": ours_broken}, reps=1)


def test_the_floors_set_the_targets_that_replace_unreachable_ones() -> None:
    # GIVEN a run whose floors already cost what perf stat and count() do
    import kmem_bench
    import usdt_bench

    results = minimal_results({"bpftrace": "v0.17", "perf": "6.1"})
    events = 1_000_000

    def kmem_row(seconds: float, **extra: float) -> dict[str, object]:
        return {"median_s": seconds, "samples": [seconds], "ratio": seconds / 1.0, **extra}

    results["kmem"]["slowdown"]["rows"] = {  # type: ignore[index]
        "untraced": kmem_row(1.0),
        kmem_bench.PID_FLOOR: kmem_row(1.25, events=events),
        kmem_bench.MATCH_FLOOR: kmem_row(1.30, frees_found=10),
        kmem_bench.OURS: kmem_row(1.31),  # 10 ns an event over the live-object floor
        kmem_bench.PERF_STAT: kmem_row(1.28),
    }
    usdt_rows = results["usdt"]["jmp_loop"]["rows"]  # type: ignore[index]
    for name, ns in ((usdt_bench.EMPTY_FLOOR, 380.0), (usdt_bench.LEAST_RECORD, 400.0),
                     (usdt_bench.HIT_RECORD, 409.0), (usdt_bench.RECORD_FLOOR, 411.0),
                     ("bpftrace count()", 407.0)):  # fmt: skip
        usdt_rows[name] = {"median_s": 1.0, "samples": [1.0], "ratio": 2.0, "ns_per_hit": ns}
    usdt_rows["mtrace-live counters only"]["ns_per_hit"] = 402.0
    usdt_rows["mtrace-live event stream"]["ns_per_hit"] = 409.0 + usdt_bench.EVENT_BUDGET_NS + 1

    # WHEN the page is written
    page = bench_run.render(results)

    # THEN the original targets stay unmet, each with the floor that proves it
    assert "| kmem aggregation with pid filter below perf stat's overhead | **NOT met** |" in page
    assert "no aggregation that matches frees to allocations can meet the target here" in page
    assert "| USDT per-hit cost, jmp_loop, event stream | **NOT met** |" in page
    assert "the least record that holds a hit (40 bytes" in page
    # AND the targets the floors set are judged by what is over them
    kmem_target = f"kmem aggregation at most {kmem_bench.SITE_BUDGET_NS} ns an event"
    assert f"| {kmem_target} over the live-object floor | met |" in page
    assert "mtrace-live's aggregation takes 10 ns an event" in page
    name = f"at most {usdt_bench.EVENT_BUDGET_NS} ns over the least record that holds a hit"
    assert f"| USDT event stream: {name}, jmp_loop | **NOT met** |" in page


def test_sections_measured_again_on_another_machine_say_so() -> None:
    # GIVEN figures kept from one machine, and usdt measured again on another
    results = minimal_results({"bpftrace": None, "bcc trace": None, "perf": None})
    here = dict(results["machine"])  # type: ignore[call-overload]
    there = {**here, "cpu": "another CPU, 2 CPUs"}
    results["measured_on"] = {"usdt": there, "kmem": here}

    # WHEN the page is written
    page = bench_run.render(results)

    # THEN the page names the other machine and the sections measured there
    assert "- CPU: a CPU, 2 CPUs;" in page
    assert "Sections measured on another machine (usdt)" in page
    assert "- CPU: another CPU, 2 CPUs;" in page
    # AND one machine throughout says nothing more
    results["measured_on"] = {"usdt": here, "kmem": here}
    assert "another machine" not in bench_run.render(results)


def test_the_page_says_how_far_repeated_runs_spread() -> None:
    # GIVEN runs of one configuration at 1.0, 1.1 and 1.2 s
    results = minimal_results({"bpftrace": None, "bcc trace": None, "perf": None})
    rows = results["kmem"]["slowdown"]["rows"]  # type: ignore[index]
    rows["untraced"].update(samples=[1.0, 1.1, 1.2], median_s=1.1)

    # WHEN the page is written
    page = bench_run.render(results)

    # THEN it gives their spread, (1.2 - 1.0) / 1.1
    assert "by 18% for the typical configuration here, 18% at most" in page


def test_an_only_run_replaces_its_sections_failures_and_machine() -> None:
    # GIVEN a full run whose cost and usdt sections each had a peer fail
    # (kept by section), and an older failure kept by configuration alone
    machine = {"cpu": "a CPU"}
    kept = {
        "machine": machine,
        "cost": {"startup": {"bpftrace printf()": {}}},
        "usdt": {"rows": {}},
        "failed": {
            "cost": {"bpftrace count()": "mount ns"},
            "usdt": {"bcc trace": "no USDT"},
            "perf kmem record": "an older run's",
        },
    }
    # WHEN cost is measured again on another machine, bpftrace count() working this time
    again = {"machine": {"cpu": "another CPU"}, "failed": {"cost": {}},
             "cost": {"load": {"bpftrace count()": {"median_s": 1.0}}},
             "measured_on": {"cost": {"cpu": "another CPU"}}}  # fmt: skip
    data = bench_run.merged(kept, again, {"cost"})

    # THEN the cost section and its failures are the new run's, the rest are kept
    assert data["cost"] == again["cost"]
    assert data["failed"] == {"cost": {}, "usdt": {"bcc trace": "no USDT"},
                              "perf kmem record": "an older run's"}  # fmt: skip
    assert data["machine"] == machine
    assert data["measured_on"] == {"cost": {"cpu": "another CPU"}, "usdt": machine}
    assert data["rerun"] == ["cost"]
    # AND a failure kept by configuration alone goes once a run measured it
    older = {**kept, "failed": {"bpftrace count()": "mount ns"}}
    assert bench_run.merged(older, again, {"cost"})["failed"] == {"cost": {}}
