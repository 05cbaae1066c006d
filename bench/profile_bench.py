"""Section 10: heap profiles on serve (/debug/pprof/heap and /allocs).

1. Building a profile: ``stack_fan N --churn`` (tests/workloads/stack_fan.c)
   holds N blocks under N distinct stacks of 35 frames and makes each again,
   round after round, so that every stack's counts change between two
   profiles; ``serve --pid --exact`` traces it. The profile is fetched over
   HTTP: the first fetch (every frame named for the first time) and then
   ``FETCHES`` more (the median and the slowest), for 1,000 and 30,000
   stacks. Memory: the tracing process's
   resident set before the first fetch and after the last. The metrics
   page's own render time (the same tables read) is taken from the page.
2. ``/metrics`` while profiles are scraped: 100 scrapes a second for
   ``SCRAPE_S`` seconds with the 30,000 stacks held, first alone, then with
   a profile fetched every second beside them; p50, p99 and the slowest.
3. serve's cost per call: alloc_bench's malloc(32)/free loop traced by
   ``serve --pid`` at its default (one allocation kept per 512 KiB) and
   with ``--exact``, against the empty-probe floor and untraced, in
   alternating order; and a real multithreaded program, Debian's sqlite3
   building an index with two sorter threads (``PRAGMA threads``), traced by
   ``serve --comm sqlite3`` each way: the program's own time.
"""

from __future__ import annotations

import http.client
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import alloc_bench
import stacks_bench
from common import BUILD, MTRACE, QUICK, REPS, Background, Sample, alternate, say, summarise
from mtrace_live.exporters.heap_profiles import MAX_SAMPLES

STACKS = (1000, 30000)
FETCHES = 10 if QUICK else 30
SCRAPE_S = 5 if QUICK else 20
PORT = 9498
SQLITE_SCRIPT = "PRAGMA threads=2;\n" + stacks_bench.SCRIPT


def _fetch(path: str) -> tuple[float, int]:
    """Seconds for one GET of ``path``, and the body's size."""
    connection = http.client.HTTPConnection("127.0.0.1", PORT, timeout=120)
    started = time.perf_counter()
    connection.request("GET", path)
    response = connection.getresponse()
    body = response.read()
    elapsed = time.perf_counter() - started
    connection.close()
    if response.status != 200:
        raise RuntimeError(f"{path}: {response.status} {body[:200]!r}")
    return elapsed, len(body)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Fan:
    """stack_fan N, waiting; its blocks made once told."""

    def __init__(self, stacks: int) -> None:
        self.process = subprocess.Popen([str(BUILD / "stack_fan"), str(stacks), "--churn"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)  # fmt: skip
        assert self.process.stdout is not None and self.process.stdout.readline() == "ready\n"

    def tell(self, expect: str | None) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        if expect is not None and self.process.stdout.readline() != expect:
            raise RuntimeError("stack_fan did not finish its work")


def _serve(argv: list[str], log: Path) -> Background:
    return Background([*MTRACE, "serve", "--no-kmem", "--web.listen-address",
                       f"127.0.0.1:{PORT}", *argv], "serving metrics at", log)  # fmt: skip


def _page() -> dict[str, float]:
    connection = http.client.HTTPConnection("127.0.0.1", PORT, timeout=60)
    connection.request("GET", "/metrics")
    body = connection.getresponse().read().decode()
    connection.close()
    return {line.split()[0]: float(line.split()[1]) for line in body.splitlines()
            if line.startswith("mtrace_metrics_render")}  # fmt: skip


def _render_s() -> float:
    """How long a render of the metrics page took (the page gives the render
    before its own): the page after the one served now."""
    served = _page()["mtrace_metrics_rendered_time_seconds"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.1)
        page = _page()
        if page["mtrace_metrics_rendered_time_seconds"] > served:
            return page["mtrace_metrics_render_duration_seconds"]
    raise RuntimeError("the metrics page was not rendered again")


def building(stacks: int, tmp: Path) -> tuple[dict[str, float], dict[str, float] | None]:
    """The profile of ``stacks`` stacks: its times and memory; with 30,000,
    the /metrics latencies too."""
    fan = Fan(stacks)
    serve = _serve(["--pid", str(fan.process.pid), "--exact", "--alloc-stacks", "65536"],
                   tmp / f"profile-serve-{stacks}.log")  # fmt: skip
    try:
        fan.tell("done\n")
        path = "/debug/pprof/heap?max_samples=0"  # every stack: no sample bound
        rss_before = _rss_mib(serve.process.pid)
        first, size = _fetch(path)
        times = sorted(_fetch(path)[0] for _ in range(FETCHES))
        row = {"stacks": stacks, "first_s": first, "median_s": statistics.median(times),
               "max_s": times[-1], "bytes": size, "rss_before_mib": rss_before,
               "rss_after_mib": _rss_mib(serve.process.pid)}  # fmt: skip
        if stacks > MAX_SAMPLES:  # past serve's default bound: the profile as Pyroscope takes it
            bounded = [_fetch("/debug/pprof/heap") for _ in range(FETCHES)]
            row["bounded_median_s"] = statistics.median(t for t, _ in bounded)
            row["bounded_bytes"] = bounded[0][1]
        row["metrics_render_s"] = _render_s()
        scrapes = _scrapes_with_profiles() if stacks == max(STACKS) else None
    finally:
        fan.tell(None)
        fan.process.wait(timeout=60)
        serve.stop()
    return row, scrapes


def _scrape_times(stop: threading.Event) -> list[float]:
    connection = http.client.HTTPConnection("127.0.0.1", PORT, timeout=30)
    times = []
    began = time.monotonic()
    while not stop.is_set():
        wait = began + len(times) * 0.01 - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        started = time.perf_counter()
        connection.request("GET", "/metrics")
        connection.getresponse().read()
        times.append(time.perf_counter() - started)
    connection.close()
    return sorted(times)


def _percentiles(times: list[float]) -> dict[str, float]:
    return {"scrapes": len(times), "p50_ms": statistics.median(times) * 1e3,
            "p99_ms": times[int(0.99 * (len(times) - 1))] * 1e3,
            "max_ms": times[-1] * 1e3}  # fmt: skip


def _fetch_each_second(stop: threading.Event, fetched: list[float]) -> None:
    while not stop.wait(1.0):
        fetched.append(_fetch("/debug/pprof/heap")[0])


def _scrapes_with_profiles() -> dict[str, float]:
    """/metrics at 100 a second for SCRAPE_S, alone, then beside a profile a second."""
    results: dict[str, float] = {}
    for label, profiles in (("alone", False), ("with_profiles", True)):
        stop = threading.Event()
        threading.Timer(SCRAPE_S, stop.set).start()
        fetched: list[float] = []
        fetcher = threading.Thread(target=_fetch_each_second, args=(stop, fetched))
        if profiles:
            fetcher.start()
        found = _percentiles(_scrape_times(stop))
        if profiles:
            fetcher.join()
            found["profiles"] = len(fetched)
        results.update({f"{label}_{key}": value for key, value in found.items()})
    return results


def _loop_configs(tmp: Path) -> dict[str, Callable[[], Sample]]:
    def serve(*extra: str) -> Callable[[], Sample]:
        return lambda: alloc_bench.traced(
            lambda pid: [*MTRACE, "serve", "--pid", str(pid), "--no-kmem",
                         "--web.listen-address", "127.0.0.1:0", *extra],
            "serving metrics at", False, tmp)  # fmt: skip

    return {
        "untraced": lambda: alloc_bench.traced(None, "", False, tmp),
        "mtrace-live serve (default: one per 512 KiB)": serve(),
        "mtrace-live serve --exact": serve("--exact"),
        "floor: empty programs on mtrace-live's sites": lambda: alloc_bench.traced(
            lambda pid: [sys.executable, str(alloc_bench.FLOOR), str(pid)], "ready", False, tmp),
    }  # fmt: skip


def _sqlite_under(extra: list[str] | None, tmp: Path) -> Sample:
    """The threaded sqlite3 script's own time, traced by serve --comm sqlite3
    (``extra``: its options; None: untraced)."""
    serve = None
    if extra is not None:
        serve = Background([*MTRACE, "serve", "--comm", "sqlite3", "--no-kmem",
                            "--web.listen-address", "127.0.0.1:0", *extra],
                           "serving metrics at", tmp / "sqlite-serve.log")  # fmt: skip
    try:
        database = tmp / "threads.sqlite"
        database.unlink(missing_ok=True)
        began = time.monotonic()
        subprocess.run(["sqlite3", str(database)], input=SQLITE_SCRIPT, text=True, check=True,
                       stdout=subprocess.DEVNULL, timeout=900)  # fmt: skip
        return Sample(time.monotonic() - began)
    finally:
        if serve is not None:
            serve.stop()


def run(tmp: Path) -> dict[str, object]:
    say("10. heap profiles on serve ...")
    built: list[dict[str, float]] = []
    scrapes: dict[str, float] = {}
    for stacks in STACKS:
        say(f"  a profile of {stacks:,} stacks ...")
        row, during = building(stacks, tmp)
        built.append(row)
        scrapes = during or scrapes
    say("  serve's cost per call ...")
    loop = summarise(alternate(_loop_configs(tmp), REPS, ours=("mtrace-live", "untraced",
                                                                "floor")))  # fmt: skip
    say("  a threaded sqlite3 under serve ...")
    sqlite = summarise(alternate({
        "untraced": lambda: _sqlite_under(None, tmp),
        "mtrace-live serve (default)": lambda: _sqlite_under([], tmp),
        "mtrace-live serve --exact": lambda: _sqlite_under(["--exact"], tmp),
    }, REPS, ours=("mtrace-live", "untraced")))  # fmt: skip
    return {"build": built, "scrapes": scrapes, "loop": loop, "sqlite": sqlite}


def render(data: dict) -> tuple[list[str], dict[str, bool | None]]:
    lines = ["## 10. Heap profiles on serve", "",
             "**Building a profile.** `stack_fan N --churn` holds N blocks under N distinct "
             "stacks of 35 frames and makes each again, round after round (every stack's counts "
             "change between two profiles), traced by `serve --pid --exact`; "
             "`/debug/pprof/heap?max_samples=0` (every stack) fetched over HTTP: "
             f"the first fetch (every frame named for the first time), then {FETCHES} more. "
             "The tracing process's resident memory before the first fetch and after the "
             "last; the metrics page's render time over the same tables.", "",
             "| stacks | first fetch (ms) | median (ms) | slowest (ms) | profile (KiB) | "
             "RSS before (MiB) | RSS after (MiB) | metrics render (ms) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for row in data["build"]:
        lines.append(f"| {row['stacks']:,} | {row['first_s'] * 1e3:.0f} | "
                     f"{row['median_s'] * 1e3:.1f} | {row['max_s'] * 1e3:.1f} | "
                     f"{row['bytes'] / 1024:.0f} | {row['rss_before_mib']:.0f} | "
                     f"{row['rss_after_mib']:.0f} | "
                     f"{row['metrics_render_s'] * 1e3:.1f} |")  # fmt: skip
    lines += [f"\nWith serve's default bound of {MAX_SAMPLES:,} samples (`/debug/pprof/heap`, no "
              f"`max_samples`), the {row['stacks']:,} stacks' profile: "
              f"{row['bounded_median_s'] * 1e3:.1f} ms (median), "
              f"{row['bounded_bytes'] / 1024:.0f} KiB, its other stacks summed per process"
              for row in data["build"] if "bounded_median_s" in row]  # fmt: skip
    s = data["scrapes"]
    lines += ["", f"**`/metrics` while profiles are scraped** (30,000 stacks held; 100 scrapes "
              f"a second for {SCRAPE_S} s):", "",
              "| | scrapes | p50 (ms) | p99 (ms) | slowest (ms) |", "|---|---:|---:|---:|---:|",
              f"| alone | {s['alone_scrapes']:.0f} | {s['alone_p50_ms']:.2f} | "
              f"{s['alone_p99_ms']:.2f} | {s['alone_max_ms']:.2f} |",
              f"| a profile fetched every second ({s['with_profiles_profiles']:.0f}) | "
              f"{s['with_profiles_scrapes']:.0f} | {s['with_profiles_p50_ms']:.2f} | "
              f"{s['with_profiles_p99_ms']:.2f} | {s['with_profiles_max_ms']:.2f} |",
              ""]  # fmt: skip
    lines += ["**serve's cost per call** (alloc_bench's malloc(32)/free loop, ns per call; a "
              "pair is two calls), and a real multithreaded program: Debian's sqlite3 "
              "building an index with two sorter threads, traced by `serve --comm sqlite3` "
              "(its own wall time, s):", "", "| configuration | ns per call |", "|---|---:|",
              *(f"| {name} | {row['median_s']:.0f} |" for name, row in data["loop"].items()),
              "", "| configuration | sqlite3 (s) |", "|---|---:|",
              *(f"| {name} | {row['median_s']:.2f} |" for name, row in data["sqlite"].items()),
              ""]  # fmt: skip
    largest = max(data["build"], key=lambda r: r["stacks"])
    floor = data["loop"]["floor: empty programs on mtrace-live's sites"]["median_s"]
    default = data["loop"]["mtrace-live serve (default: one per 512 KiB)"]["median_s"]
    verdicts = {
        "Profiles: 30,000 stacks served in 100 ms or less": largest["median_s"] <= 0.1,
        "Profiles: /metrics p99 < 10 ms with a profile scrape every second":
            s["with_profiles_p99_ms"] < 10,
        "Profiles: serve's default sampling at most 1.1x the empty-probe floor per call":
            default <= 1.1 * floor,
    }  # fmt: skip
    return lines, verdicts
