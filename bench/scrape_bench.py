"""Section 5: scrape latency of `mtrace-live serve` with about 1,100 series,
while tracing (200 scrapes per case with QUICK=1 instead of 1,000).

serve traces system-wide (the SDT glibc's probes and the kmem tracepoints)
at its default read interval (0.5 s). The probe exerciser, and short runs
of arena_contention under distinct names, give it per-process series; the
kernel's own activity gives it per-function ones.
One client then scrapes a hundred times a second over a kept-alive
connection: first with only that background, then while a kernel-allocation
loop runs, then while arena_contention saturates both CPUs and floods the
event path (every lock wait is an event the tracing loop decodes). Each
scrape's latency, and the age of the figures it got (the page says when it
was rendered), are recorded.
"""

from __future__ import annotations

import http.client
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path

from common import BUILD, MTRACE, QUICK, say, verdict
from mtrace_live.tracer.processes import sdt_glibc
from prometheus_client.parser import text_string_to_metric_families

SCRAPES = 200 if QUICK else 1000
NAMES = 4 if QUICK else 16  # arena_contention copies: each adds its per-process series
PORT = 9499
PACE_S = 0.01  # a scrape every 10 ms (back to back if one takes longer): 100 a second


def scrape(connection: http.client.HTTPConnection) -> tuple[float, float, bytes]:
    """Seconds from request to last byte; the Unix time of the request; the page."""
    asked = time.time()
    started = time.perf_counter()
    connection.request("GET", "/metrics")
    response = connection.getresponse()
    body = response.read()
    elapsed = time.perf_counter() - started
    if response.status != 200:
        raise RuntimeError(f"scrape failed: {response.status} {body[:200]!r}")
    return elapsed, asked, body


def page_age(asked: float, body: bytes) -> float:
    """How old the page's figures were when it was asked for."""
    marker = b"\nmtrace_metrics_rendered_time_seconds "
    at = body.index(marker) + len(marker)
    return asked - float(body[at : body.index(b"\n", at)])


def series(body: bytes) -> int:
    return sum(len(f.samples) for f in text_string_to_metric_families(body.decode()))


def latencies(count: int) -> dict[str, float]:
    connection = http.client.HTTPConnection("127.0.0.1", PORT, timeout=30)
    times, ages = [], []
    body = b""
    began = time.monotonic()
    for index in range(count):
        wait = began + index * PACE_S - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        elapsed, asked, body = scrape(connection)
        times.append(elapsed)
        ages.append(page_age(asked, body))
    took = time.monotonic() - began
    connection.close()
    times.sort()
    return {
        "scrapes": count,
        "p50_ms": statistics.median(times) * 1e3,
        "p99_ms": times[int(0.99 * (count - 1))] * 1e3,
        "max_ms": times[-1] * 1e3,
        "series": series(body),
        "seconds": took,
        "age_median_s": statistics.median(ages),
        "age_max_s": max(ages),
    }


def run(tmp: Path) -> dict[str, object]:
    say("5. scrape latency ...")
    sdt = sdt_glibc.locate()
    err = tmp / "serve.err"
    with open(err, "wb") as sink:
        serve = subprocess.Popen(
            [*MTRACE, "serve", "--sdt-glibc", "--top-functions", "100",
             "--web.listen-address", f"127.0.0.1:{PORT}"],
            stdout=sink, stderr=sink,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while b"serving metrics at" not in err.read_bytes():
            if serve.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"serve did not start: {err.read_text()}")
            time.sleep(0.2)
        subprocess.run(sdt.wrap([str(BUILD / "probe_exerciser"), "--out", str(tmp / "t.json")]),
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        for index in range(NAMES):
            copy = tmp / f"contention_{index:02d}"
            shutil.copy(BUILD / "arena_contention", copy)
            subprocess.run(sdt.wrap([str(copy), "0.2"]), check=True, stdout=subprocess.DEVNULL)
        if not QUICK:
            time.sleep(12)  # the copies are retired into per-name totals
        say("  while tracing ...")
        idle = latencies(SCRAPES)
        say("  while tracing a kernel-allocation loop ...")
        kernel = subprocess.Popen(
            ["/bin/sh", "-c", f"while :; do {BUILD / 'kmem_exerciser'} --sockets 20000 "
             f"--pipes 20000 --out {tmp / 'k.json'}; done"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(2)
        busy = latencies(SCRAPES)
        kernel.send_signal(signal.SIGKILL)
        kernel.wait()
        say("  while tracing arena_contention ...")
        load = subprocess.Popen(sdt.wrap([str(BUILD / "arena_contention"), "600"]),
                                stdout=subprocess.DEVNULL)  # fmt: skip
        time.sleep(2)
        loaded = latencies(SCRAPES)
        load.send_signal(signal.SIGKILL)
        load.wait()
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)
    return {"idle": idle, "busy": busy, "loaded": loaded}


def render(data: dict) -> tuple[list[str], dict[str, bool | None]]:
    rows = (
        ("background activity only", data["idle"]),
        ("a socket()/pipe() loop on one CPU (kernel events, aggregated in the kernel)",
         data["busy"]),
        ("arena_contention: 8 threads on both CPUs, every lock wait an event decoded",
         data["loaded"]),
    )  # fmt: skip
    p99 = max(data[key]["p99_ms"] for key in ("idle", "busy"))
    lines = [
        "## 5. Scrape latency",
        "",
        "`mtrace-live serve` traced the whole system (the SDT glibc's allocator probes and the "
        "kmem tracepoints) at its default read interval (0.5 s). The tracing process renders "
        "the page (every BPF map read in one batched read each, every series) on a thread of "
        "its own every read interval while scrapes come, into shared memory; a process of its "
        "own, forked before anything is attached, answers each scrape from the last page. One "
        "client scraped 100 times a second over one kept-alive HTTP connection; times are from "
        "request to last byte. The page's age is the request's time less the time the page "
        "says its figures were read (`mtrace_metrics_rendered_time_seconds`).",
        "",
        "| while | scrapes | series | p50 (ms) | p99 (ms) | max (ms) | page age, median (s) "
        "| page age, max (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {name} | {row['scrapes']} | {row['series']} | {row['p50_ms']:.2f} | "
        f"{row['p99_ms']:.2f} | {row['max_ms']:.2f} | {row.get('age_median_s', 0):.2f} | "
        f"{row.get('age_max_s', 0):.2f} |"
        for name, row in rows
    ]
    lines += [
        "",
        f"p99 {p99:.2f} ms at worst with a CPU to spare: {verdict(p99 < 10)}; "
        f"{data['loaded']['p99_ms']:.2f} ms when the traced program saturates both CPUs and "
        f"floods the event path: {verdict(data['loaded']['p99_ms'] < 10)}.",
        "",
        "A scrape never waits for the tracing process: while eight threads fill both CPUs and "
        "the tracing loop decodes every lock wait, the serving process only copies the last "
        "page out of shared memory (and runs at nice -10, set while it is still root, so the "
        "busy threads do not delay its wake-up). The price is the page's age: at most the read "
        "interval plus one render, as the last columns show. Before this design, the scrape "
        "was collected in the tracing process itself, and its p99 under the same load was "
        "105 ms.",
        "",
    ]
    return lines, {
        "scrape p99 < 10 ms, a CPU to spare": p99 < 10,
        "scrape p99 < 10 ms, both CPUs saturated": data["loaded"]["p99_ms"] < 10,
    }
