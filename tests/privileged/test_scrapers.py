"""serve's heap profiles as the scrapers ask for them: the URLs Parca and
Alloy build from the configurations of docs/heap-profiles.md, go tool
pprof's errors, the sample bound, and a tracing process held busy. Each is
checked by its status, its headers and the profile as go tool pprof parses
it.

No code of Parca's or Alloy's runs here: neither is packaged. What is
theirs is the configuration, as the page gives it (its YAML and Alloy
blocks, read from the page). What is not: ``parca_url`` is this test's own
rewrite of how Parca's pkg/scrape/target.go makes a target's URL (the job's
params, which its targets share, each adding ``seconds`` of the scrape
interval for a delta profile; Go's url.Values.Encode order), checked here
only against the URL the page says Parca asks for; Alloy's URL is the
memory profile's ``path`` from the page's block, as Alloy asks for a whole
profile when the component sets no ``params``
(internal/component/pyroscope/scrape/target.go), which is checked of the
block."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import yaml
from google.protobuf import empty_pb2
from google.protobuf.unknown_fields import UnknownFieldSet

from .test_heap_profiles import (
    DELTA_WINDOWS,
    Workload,
    by_function,
    delta_in_windows,
    go_raw,
    truth_by_function,
)
from .test_serve import free_port, start_serve, stop
from .tracing import Reaper

DOC = Path(__file__).resolve().parents[2] / "docs" / "heap-profiles.md"


class Got:
    """One response as a scraper gets it: status, headers, body."""

    def __init__(self, url: str) -> None:
        try:
            with urllib.request.urlopen(url, timeout=300) as response:
                self.status, self.headers, self.body = response.status, response.headers, b""
                self.body = response.read()
        except urllib.error.HTTPError as exc:
            self.status, self.headers, self.body = exc.code, exc.headers, exc.read()

    def fields(self) -> dict[int, list[Any]]:
        """The profile's top-level fields by number (profile.proto's Profile:
        2 sample, 9 time_nanos, 10 duration_nanos), read by protobuf's
        parser without a schema."""
        message = empty_pb2.Empty.FromString(gzip.decompress(self.body))
        found: dict[int, list[Any]] = {}
        for field in UnknownFieldSet(message):
            found.setdefault(field.field_number, []).append(field.data)
        return found


def parca_url(base: str, job: dict[str, Any], profile: str, comm: str, interval: int) -> str:
    """The URL Parca scrapes for ``profile`` of ``job``, given the scrape
    interval ``interval`` (seconds): the job's params, its comm made
    ``comm``, then, for a delta profile, seconds added once per target to
    the params all its targets share; url.Values.Encode's order (keys
    sorted, values in order). This test's rewrite, not Parca's code."""
    settings = job["profiling_config"]["pprof_config"][profile]
    params = {key: list(values) for key, values in job["params"].items()}
    params["comm"] = [comm]
    if settings.get("delta"):
        targets = sum(len(group["targets"]) for group in job["static_configs"])
        params.setdefault("seconds", []).extend([str(interval)] * targets)
    return f"{base}{settings['path']}?{urlencode(sorted(params.items()), doseq=True)}"


def doc_block(language: str, after: str) -> str:
    """The first fenced block of ``language`` after the heading ``after``."""
    text = DOC.read_text()
    return text[text.index(after) :].split(f"```{language}\n", 1)[1].split("```", 1)[0]


def parca_jobs() -> list[dict[str, Any]]:
    jobs: list[dict[str, Any]] = yaml.safe_load(doc_block("yaml", "### Parca"))["scrape_configs"]
    return jobs


def interval_of(job: dict[str, Any]) -> int:
    """The job's scrape interval, in seconds (Prometheus' durations: 15s, 5m)."""
    number, unit = re.fullmatch(r"(\d+)([smh])", job["scrape_interval"]).groups()  # type: ignore[union-attr]
    return int(number) * {"s": 1, "m": 60, "h": 3600}[unit]


def alloy_memory_path() -> str:
    """The path of the Alloy component's memory profile, from the page's
    block, which must ask for it whole (enabled, no delta) and with no
    params: then Alloy's URL is that path alone."""
    component = doc_block("alloy", "### Grafana Alloy and Pyroscope")
    assert not re.search(r"^\s*params\s*=", component, re.MULTILINE), component
    memory = re.search(r"^\s*profile\.memory\s*\{\n(.*?)^\s*\}", component,
                       re.MULTILINE | re.DOTALL)  # fmt: skip
    assert memory is not None, component
    settings: dict[str, str] = dict(
        re.findall(r"^\s*(\w+)\s*=\s*(.+?)\s*$", memory[1], re.MULTILINE)
    )
    assert settings.get("enabled") == "true" and settings.get("delta", "false") == "false"
    path = settings["path"]
    assert path.startswith('"') and path.endswith('"'), path
    return path[1:-1]


def test_parca_url_is_the_url_the_page_says_parca_asks_for() -> None:
    # the rewrite of Parca's URL building, on the page's own delta job, gives
    # the URL the page says Parca sends (from Parca's source)
    text = " ".join(DOC.read_text().split())
    said = re.search(r"so the URL above is `(/\S+)`", text)
    assert said is not None
    job = parca_jobs()[0]
    comm = job["params"]["comm"][0]
    assert parca_url("", job, "memory", comm, interval_of(job)) == said[1]


def deltas_begun(base: str) -> int:
    """The delta profiles serve has begun, as its metrics count them."""
    got = Got(f"{base}/metrics")
    found = re.search(rb'mtrace_alloc_profiles_total\{kind="delta_started"\} (\d+)', got.body)
    return int(found[1]) if got.status == 200 and found else 0


def served_workload(reaper: Reaper, tmp: Path, *options: str) -> tuple[
        str, Workload, subprocess.Popen[bytes], Path]:  # fmt: skip
    """The allocation workload, done, traced by serve (with ``options``):
    the profiles' base URL, the workload, serve and its stderr's file."""
    port = free_port()
    work = Workload(reaper, tmp / "truth.json")
    argv = ["--no-kmem", *options, "--pid", str(work.proc.pid), "--web.listen-address",
            f"127.0.0.1:{port}"]  # fmt: skip
    serve, err = start_serve(argv, tmp, reaper)
    work.work()
    return f"http://127.0.0.1:{port}/debug/pprof", work, serve, err


def parsed(got: Got, tmp: Path, name: str) -> Any:
    """The body as go tool pprof -raw reads it (from a file: as fetched)."""
    path = tmp / name
    path.write_bytes(got.body)
    return go_raw(str(path), tmp)


@dataclass
class ParcaDelta:
    """Parca's delta profile, scraped while a run worked inside its window."""

    got: Got
    url: str
    seconds: int  # the window
    asked: int  # time.time_ns() before it was asked
    truth: dict[str, Any]  # what the run did


def parca_delta(base: str, job: dict[str, Any], runs: list[Workload]) -> tuple[int, ParcaDelta]:
    """Parca's delta (``job``'s memory profile), its scrape interval each of
    test_heap_profiles' DELTA_WINDOWS in turn, while the next of ``runs``
    works once it has begun: the first whose run was done inside its window
    (its fetch still waiting), and how many were asked before it."""
    asked: dict[int, tuple[str, int]] = {}  # window -> (its URL, time.time_ns() before it)

    def fetch(seconds: int) -> Got:
        url = parca_url(base, job, "memory", "alloc_workload", seconds)
        asked[seconds] = (url, time.time_ns())
        return Got(url)

    started, got, truth = delta_in_windows(fetch, lambda: deltas_begun(base),
                                           lambda n: runs[n].work())  # fmt: skip
    seconds = DELTA_WINDOWS[started]
    return started, ParcaDelta(got, asked[seconds][0], seconds, asked[seconds][1], truth)


def test_parca_s_and_alloy_s_urls_get_whole_profiles(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    delta_job, heap_job = parca_jobs()
    with Reaper() as reaper:
        # GIVEN a run of the allocation workload, and one more for each window
        # a delta may be asked with, serve tracing them all
        first = Workload(reaper, tmp_path / "first.json")
        runs = [Workload(reaper, tmp_path / f"second{n}.json") for n in range(len(DELTA_WINDOWS))]
        serve, err = start_serve(["--no-kmem", "--exact", "--comm", "alloc_workload",
                                  "--web.listen-address", f"127.0.0.1:{port}"],
                                 tmp_path, reaper)  # fmt: skip
        truth_first = first.work()
        # WHEN Parca's delta job scrapes (its URL carries seconds twice: two targets share
        # the job's params) while a second run works inside the window (and, should it
        # outlast it, the same again with a new run in a longer window)
        started, delta = parca_delta(base, delta_job, runs)
        # AND Parca's heap job and Alloy's memory profile scrape
        heap = Got(parca_url(base, heap_job, "memory", "alloc_workload", interval_of(heap_job)))
        alloy = Got(f"{base}{alloy_memory_path()}")
        used = runs[: started + 1]
        for work in (first, *used):
            work.end()
        for work in runs[started + 1 :]:
            work.drop()
        assert stop(serve) == 0, err.read_text()
    seconds = delta.seconds
    assert f"?comm=alloc_workload&seconds={seconds}&seconds={seconds}" in delta.url
    # THEN Parca's delta is a profile of what the run did in the window, dated at the
    # window's end and lasting it, as Go dates a delta
    got = delta.got
    assert got.status == 200 and got.headers["Content-Type"] == "application/octet-stream"
    assert got.headers.get("X-Go-Pprof") is None
    window = got.fields()
    (duration_nanos,), (time_nanos,) = window[10], window[9]
    assert duration_nanos >= seconds * 10**9
    assert time_nanos >= delta.asked + duration_nanos
    found = by_function(parsed(got, tmp_path, "delta.pb.gz").samples)
    for function, values in truth_by_function(delta.truth).items():
        assert found.get(function) == values, (function, found.get(function), values)
    # AND Parca's heap job and Alloy's memory profile hold every run that worked, whole
    truths = [truth_by_function(json.loads(w.truth_file.read_text())) for w in used]
    every = {f: [sum(t) for t in zip(v, *(truth[f] for truth in truths), strict=True)]
             for f, v in truth_by_function(truth_first).items()}  # fmt: skip
    for answer, name in ((heap, "heap.pb.gz"), (alloy, "allocs.pb.gz")):
        assert answer.status == 200, answer.body
        found = by_function(parsed(answer, tmp_path, name).samples)
        for function, values in every.items():
            assert found.get(function) == values, (name, function, found.get(function))


def test_a_bounded_profile_keeps_every_total_and_errors_reach_go_tool_pprof(
    tmp_path: Path,
) -> None:
    with Reaper() as reaper:
        # GIVEN the allocation workload, done, traced by serve
        base, work, serve, err = served_workload(reaper, tmp_path, "--exact")
        # WHEN go tool pprof reads its profile bounded to 3 samples, and unbounded, and asks
        # with a bad query
        bounded = go_raw(f"{base}/allocs?max_samples=3", tmp_path)
        whole = go_raw(f"{base}/allocs?max_samples=0", tmp_path)
        refused = subprocess.run(["go", "tool", "pprof", "-raw", f"{base}/heap?pid=1"],
                                 capture_output=True, text=True, timeout=300,
                                 env=dict(os.environ, PPROF_TMPDIR=str(tmp_path)))  # fmt: skip
        work.end()
        assert stop(serve) == 0, err.read_text()
    # THEN the bounded profile has 3 samples, one of them the rest, every total all there
    assert len(bounded.samples) == 3 < len(whole.samples)
    assert "(other)" in {s.leaf for s in bounded.samples}
    assert [sum(s.values[i] for s in bounded.samples) for i in range(4)] == [
        sum(s.values[i] for s in whole.samples) for i in range(4)]  # fmt: skip
    # AND go tool pprof shows serve's one line for a refused query (X-Go-Pprof: 1)
    assert refused.returncode != 0 and "no traced process has pid 1" in refused.stderr, refused


@pytest.mark.soak  # (make soak: slower than make test's budget)
def test_a_profile_asked_of_a_held_tracing_process_ends_in_a_503_never_a_cut(
    tmp_path: Path,
) -> None:
    with Reaper() as reaper:
        # GIVEN serve tracing the workload, its tracing process then stopped (the serving
        # process, which answers the network, goes on)
        base, work, serve, err = served_workload(reaper, tmp_path)
        os.kill(serve.pid, signal.SIGSTOP)
        try:
            # WHEN a whole profile and a delta are asked for, past the connections' 10 s
            answers: dict[str, Got] = {}
            fetchers = [threading.Thread(target=lambda p=path: answers.update({p: Got(base + p)}))
                        for path in ("/heap", "/allocs?seconds=1")]  # fmt: skip
            for fetcher in fetchers:
                fetcher.start()
            for fetcher in fetchers:
                fetcher.join(timeout=300)
        finally:
            os.kill(serve.pid, signal.SIGCONT)
        # AND once the tracing process goes on, a profile is served again
        again = Got(base + "/heap")
        work.end()
        assert stop(serve) == 0, err.read_text()
    # THEN each ends in a whole 503 that says why, marked for go tool pprof
    for path, got in answers.items():
        assert got.status == 503, (path, got.status, got.body)
        assert got.body.startswith(b"the tracing process did not answer in 30 s"), got.body
        assert got.body.count(b"\n") == 1
        assert got.headers["X-Go-Pprof"] == "1"
    assert again.status == 200 and again.fields()[2]
