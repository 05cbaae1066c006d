"""serve's heap profiles for real: the allocation workload traced by
``serve``, its profiles fetched by the real ``go tool pprof`` over HTTPS with
basic auth (a delta profile, the workload in a cgroup shaped as Docker
names a container's) and over plain HTTP (serve's default sampling), and
checked against what the workload says it did."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import threading
import urllib.parse
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from mtrace_live.tracer.processes.target import cgroup2_root

from .conftest import built
from .test_serve import fetch, free_port, start_serve, stop
from .tracing import Reaper, pprof_mappings, readelf_build_id, wait_until

CONTAINER = "5ca1ab1e" * 8  # a 64-digit id
SAMPLE_BYTES = 524288  # serve's default


@dataclass
class Sample:
    values: list[int]  # alloc_objects, alloc_space, inuse_objects, inuse_space
    frames: list[str]  # the locations' functions, the allocation's caller first
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def leaf(self) -> str:
        return self.frames[0] if self.frames else ""


@dataclass
class RawProfile:
    samples: list[Sample]
    period: int
    mappings: dict[str, str]  # file -> build-id


def go_raw(source: str, tmp: Path, *flags: str, ca: Path | None = None) -> RawProfile:
    """The profile at ``source`` (a file or a URL) as ``go tool pprof -raw``
    prints it; ``ca``: the certificate to trust (go tool pprof fetches with
    Go's HTTP client, which reads SSL_CERT_FILE; its -tls_ca is for symbols)."""
    env = dict(os.environ, PPROF_TMPDIR=str(tmp))  # where it keeps what it fetched
    if ca is not None:
        env["SSL_CERT_FILE"] = str(ca)
    done = subprocess.run(["go", "tool", "pprof", "-raw", *flags, source], capture_output=True,
                          text=True, timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    head, _, rest = done.stdout.partition("\nSamples:\n")
    samples_text, _, rest = rest.partition("\nLocations\n")
    locations_text = rest.partition("\nMappings\n")[0]
    leaves = {}
    for line in locations_text.splitlines():
        found = re.match(r"\s*(\d+): 0x[0-9a-f]+ (?:M=\d+ )?(\S+)", line)
        if found:
            leaves[found[1]] = found[2]
    samples: list[Sample] = []
    for line in samples_text.splitlines()[1:]:
        values, colon, ids = line.partition(":")
        if colon and re.fullmatch(r"[\s\d-]+", values):
            frames = [leaves.get(i, "") for i in ids.split()]
            samples.append(Sample([int(v) for v in values.split()], frames))
        else:
            for key, value in re.findall(r"(\w+):\[([^\]]*)\]", line):
                samples[-1].labels[key] = value
    period = re.search(r"^Period: (\d+)", head, re.MULTILINE)
    return RawProfile(samples, int(period[1]) if period else 0, pprof_mappings(done.stdout))


def by_function(samples: list[Sample]) -> dict[str, list[int]]:
    """The four values summed per leaf function."""
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for sample in samples:
        sums[sample.leaf] = [a + b for a, b in zip(sums[sample.leaf], sample.values, strict=True)]
    return dict(sums)


def truth_by_function(truth: dict[str, Any]) -> dict[str, list[int]]:
    """The workload's own (calls, bytes, leaked calls, leaked bytes) per function."""
    sums: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for site in truth["sites"]:
        values = [site["calls"], site["bytes"], site["leaked_calls"], site["leaked_bytes"]]
        sums[site["function"]] = [
            a + b for a, b in zip(sums[site["function"]], values, strict=True)
        ]
    return dict(sums)


class Workload:
    """alloc_workload --wait --hold: ready, then its work on "go", then done."""

    def __init__(self, reaper: Reaper, truth: Path, scale: int = 1) -> None:
        argv = [str(built("alloc_workload")), "--wait", "--hold", "--out", str(truth),
                "--scale", str(scale)]  # fmt: skip
        self.proc = reaper.add(subprocess.Popen(argv, stdin=subprocess.PIPE,
                                                stdout=subprocess.PIPE))  # fmt: skip
        self.truth_file = truth
        assert self.line() == b"ready\n"

    def line(self) -> bytes:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline()

    def work(self) -> dict[str, Any]:
        """Let it work; its truth once it says it is done (it holds its leaks)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()
        assert self.line() == b"done\n"
        return dict(json.loads(self.truth_file.read_text()))

    def drop(self) -> None:
        """End one that never worked (its work is not wanted)."""
        self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()

    def end(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"end\n")
        self.proc.stdin.close()
        assert self.proc.wait(timeout=120) == 0
        assert self.proc.stdout is not None
        self.proc.stdout.close()


@pytest.fixture
def container_cgroup() -> Iterator[Path]:
    """A cgroup shaped as Docker's systemd driver names a container's."""
    parent = cgroup2_root() / f"mtrace-live-test-{id(object())}"
    path = parent / f"docker-{CONTAINER}.scope"
    path.mkdir(parents=True)
    yield path
    for directory in (path, parent):
        wait_until(lambda d=directory: _removed(d), f"{directory} removed")


def _removed(directory: Path) -> bool:
    try:
        directory.rmdir()
    except OSError:
        return False
    return True


def deltas_started(url: str, tls: Any) -> int:
    """The delta profiles serve has begun, as its metrics count them."""
    status, text = fetch(url, tls, tls.password)
    found = re.search(r'mtrace_alloc_profiles_total\{kind="delta_started"\} (\d+)', text)
    return int(found[1]) if status == 200 and found else 0


@dataclass
class Delta:
    profile: RawProfile
    during: Workload
    truth: dict[str, Any]


DELTA_WINDOWS = (10, 40, 160)  # seconds: the next is asked when the work outlasted one


def delta_in_windows(
    fetch: Callable[[int], Any], begun: Callable[[], int], work: Callable[[int], dict[str, Any]]
) -> tuple[int, Any, dict[str, Any]]:
    """A delta profile asked with each of DELTA_WINDOWS in turn (``fetch``
    of the window's seconds, in a thread), and the window's work done once
    the server says it has begun it (``begun``: the deltas it has begun;
    ``work`` of the window's number: what the work did), until a window
    outlasts its work (the fetch still waiting when the work was done):
    that window's number, its delta, and its work's truth."""
    for started, seconds in enumerate(DELTA_WINDOWS):
        delta: list[Any] = []
        fetcher = threading.Thread(target=lambda s=seconds, d=delta: d.append(fetch(s)))  # type: ignore[misc]
        fetcher.start()
        wait_until(lambda n=started: begun() > n, "the delta profile begun")  # type: ignore[misc]
        truth = work(started)
        inside = fetcher.is_alive()
        fetcher.join(timeout=seconds + 300)
        if inside:
            return started, delta[0], truth
    raise AssertionError(f"the work outlasted every window {DELTA_WINDOWS}")


def assert_holds(profile: RawProfile, work: Workload, truth: dict[str, Any]) -> None:
    """The profile holds ``work``'s samples alone, with exactly what each of
    its functions did, each stack whole (down to main or a thread's start)."""
    assert {s.labels["pid"] for s in profile.samples} == {str(work.proc.pid)}
    found = by_function(profile.samples)
    functions = truth_by_function(truth)
    for function, values in functions.items():
        assert found.get(function) == values, (function, found.get(function), values)
    for sample in profile.samples:
        if sample.leaf in functions:
            # called straight from main (or, for the threads' site, from the
            # thread's start in libc), and walked on through libc's start
            caller = "start_thread" if sample.leaf == "threaded" else "main"
            assert sample.frames[1:2] == [caller], sample.frames
            assert caller == "start_thread" or sample.frames[-1] == "_start", sample.frames


def first_delta(pairs: list[tuple[Workload, Workload]], base: str, metrics: str, tls: Any,
                tmp: Path) -> tuple[int, Delta]:  # fmt: skip
    """go tool pprof's delta, while a workload in the traced cgroup and a
    decoy outside it (a pair for each window) work once it has begun: the
    first whose window the work did not outlast, and its number."""

    def work(started: int) -> dict[str, Any]:
        during, decoy = pairs[started]
        truth = during.work()
        decoy.work()
        return truth

    started, raw, truth = delta_in_windows(
        lambda seconds: go_raw(f"{base}/allocs", tmp, "-seconds", str(seconds), ca=tls.cert),
        lambda: deltas_started(metrics, tls), work,
    )  # fmt: skip
    return started, Delta(raw, pairs[started][0], truth)


def test_go_tool_pprof_reads_a_container_s_delta_profile_over_https_with_basic_auth(
    web_tls: Any, tmp_path: Path, container_cgroup: Path
) -> None:
    # GIVEN two workloads in a container's cgroup and a decoy outside it,
    # serve tracing the cgroup exactly, over HTTPS with basic auth
    port = free_port()
    cgroup = "/" + str(container_cgroup.relative_to(cgroup2_root()))
    user = urllib.parse.quote(web_tls.user) + ":" + urllib.parse.quote(web_tls.password)
    base = f"https://{user}@127.0.0.1:{port}/debug/pprof"
    with Reaper() as reaper:
        # (the second and the decoy thrice: a pair for each window that may be
        # asked; all started before serve, which writes their tables first)
        before = Workload(reaper, tmp_path / "before.json")
        pairs = [(Workload(reaper, tmp_path / f"during{n}.json"),
                  Workload(reaper, tmp_path / f"decoy{n}.json"))
                 for n in range(len(DELTA_WINDOWS))]  # fmt: skip
        for work in (before, *(during for during, _ in pairs)):
            (container_cgroup / "cgroup.procs").write_text(f"{work.proc.pid}\n")
        serve, err = start_serve(
            ["--cgroup", cgroup, "--exact", "--no-kmem", "--web.listen-address",
             f"127.0.0.1:{port}", "--web.config.file", str(web_tls.config)], tmp_path, reaper,
        )  # fmt: skip
        truth_before = before.work()
        # WHEN go tool pprof asks for a 10-second delta, and a second
        # workload and a decoy work once it has begun (and, should they
        # outlast it, the same again with new ones in a longer window)
        started, found = first_delta(pairs, base, f"https://127.0.0.1:{port}/metrics", web_tls,
                                     tmp_path)  # fmt: skip
        # AND the whole profile of the first workload, and of another cgroup
        whole = go_raw(f"{base}/heap?pid={before.proc.pid}", tmp_path, ca=web_tls.cert)
        other = go_raw(f"{base}/heap?cgroup=/system.slice", tmp_path, ca=web_tls.cert)
        refused = fetch(f"https://127.0.0.1:{port}/debug/pprof/heap?pid=0", web_tls,
                        web_tls.password)  # fmt: skip
        unauthorised = fetch(f"https://127.0.0.1:{port}/debug/pprof/heap", web_tls, "wrong")
        used = pairs[: started + 1]
        for work in (before, *(w for pair in used for w in pair)):
            work.end()
        for work in (w for pair in pairs[started + 1 :] for w in pair):
            work.drop()
        assert stop(serve) == 0, err.read_text()
    # THEN the delta holds exactly what the second workload did, function by
    # function, and nothing of the first (done before it) or of the decoy;
    # each stack is whole, down to main or the thread's start (serve unwinds
    # by CFI after giving up root)
    window = found.profile
    assert_holds(window, found.during, found.truth)
    # AND every sample is labelled with its process, cgroup and container
    for sample in window.samples + whole.samples:
        assert sample.labels["container"] == CONTAINER[:12], sample.labels
        assert sample.labels["cgroup"] == cgroup and sample.labels["comm"] == "alloc_workload"
    # AND the whole profile of the first holds all it did; another cgroup's, nothing
    assert_holds(whole, before, truth_before)
    assert other.samples == []
    # AND a bad query and a wrong password are refused in one line
    assert refused == (400, "pid must be a whole number from 1 to 4194304\n")
    assert unauthorised[0] == 401
    assert "Traceback" not in err.read_text()


def test_serve_samples_by_default_and_go_tool_pprof_reads_it_over_http(tmp_path: Path) -> None:
    # GIVEN the workload at 100 times its size, traced by serve at its defaults
    port = free_port()
    base = f"http://127.0.0.1:{port}/debug/pprof"
    with Reaper() as reaper:
        work = Workload(reaper, tmp_path / "truth.json", scale=100)
        serve, err = start_serve(["--pid", str(work.proc.pid), "--no-kmem",
                                  "--web.listen-address", f"127.0.0.1:{port}"],
                                 tmp_path, reaper)  # fmt: skip
        truth = work.work()
        # WHEN go tool pprof reads the allocs profile over HTTP
        profile = go_raw(f"{base}/allocs", tmp_path)
        top = subprocess.run(["go", "tool", "pprof", "-top", f"{base}/heap"], capture_output=True,
                             text=True, timeout=300,
                             env=dict(os.environ, PPROF_TMPDIR=str(tmp_path)))  # fmt: skip
        work.end()
        assert stop(serve) == 0, err.read_text()
    # THEN it is sampled once per 512 KiB on average
    assert profile.period == SAMPLE_BYTES
    # AND its mappings are the workload's files, each with the build-id readelf
    # reads in it, as run --pprof's are
    assert str(built("alloc_workload")) in profile.mappings, profile.mappings
    assert any("/libc.so" in path for path in profile.mappings), profile.mappings
    for path, build_id in profile.mappings.items():
        assert build_id == readelf_build_id(path), (path, profile.mappings)
    kept = len(profile.samples)
    calls = sum(site["calls"] for site in truth["sites"])
    assert 0 < kept < calls / 100
    # AND its bytes are an unbiased estimate: the sample points in B bytes
    # are Poisson(B / period), so within 5 standard deviations of the truth
    functions = truth_by_function(truth)
    found = by_function(profile.samples)
    allocated = sum(values[1] for values in functions.values())
    estimated = sum(found.get(function, [0, 0])[1] for function in functions)
    sigma = math.sqrt(SAMPLE_BYTES * allocated)
    assert abs(estimated - allocated) <= 5 * sigma, (estimated, allocated)
    live = sum(values[3] for values in functions.values())
    live_estimated = sum(found.get(function, [0, 0, 0, 0])[3] for function in functions)
    assert abs(live_estimated - live) <= 5 * math.sqrt(SAMPLE_BYTES * live) + SAMPLE_BYTES
    # AND the heap profile reads over plain HTTP too
    assert top.returncode == 0 and "Showing nodes" in top.stdout, top.stderr
    assert "Traceback" not in err.read_text()
