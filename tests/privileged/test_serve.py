"""`mtrace-live serve` for real: a Prometheus server (Debian's package)
scrapes it over TLS with basic auth while the probe exerciser runs under the
SDT glibc, and the series Prometheus stored are checked against the
exerciser's ground truth. Then the filters (--comm, --cgroup) against the
kmem exerciser's, with a decoy beside it, under 1,000 scrapes and bad clients.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from mtrace_live.tracer.processes import sdt_glibc
from mtrace_live.tracer.processes.target import cgroup2_root
from prometheus_client.parser import text_string_to_metric_families

from .conftest import MTRACE, REPO
from .tracing import Reaper, finish, gate, wait_for_line

DEPLOY = REPO / "exporters" / "deploy"
SERVE_READY = "serving metrics at"
FILE_SERVER = "mtrace-live-fs\n"  # the file server's comm (tracer/unwind/file_server.py)
SOCKETS = 3000
RETRY_KINDS = {"memory_malloc_retry": "malloc", "memory_realloc_retry": "realloc",
               "memory_memalign_retry": "memalign", "memory_calloc_retry": "calloc",
               "memory_arena_retry": "arena"}  # fmt: skip


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_serve(args: list[str], tmp: Path, reaper: Reaper) -> tuple[subprocess.Popen[bytes], Path]:
    err = tmp / "serve.err"
    with open(err, "wb") as sink:
        proc = reaper.add(subprocess.Popen([*MTRACE, "serve", *args], stdout=sink, stderr=sink))
    wait_for_line(err, SERVE_READY, proc, timeout=120)
    return proc, err


def stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=60)


def fetch(url: str, tls: Any = None, password: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url)
    if password is not None:
        token = base64.b64encode(f"{tls.user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    context = ssl.create_default_context(cafile=str(tls.cert)) if tls is not None else None
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


class Prometheus:
    """A Prometheus server on loopback, scraping one target every second."""

    def __init__(self, target: str, tls: Any, tmp: Path, reaper: Reaper) -> None:
        self.port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n  - job_name: mtrace\n    scheme: https\n"
            f"    tls_config:\n      ca_file: {tls.cert}\n"
            f"    basic_auth:\n      username: {tls.user}\n      password: {tls.password}\n"
            f"    static_configs:\n      - targets: ['{target}']\n"
        )
        log = tmp / "prometheus.log"
        with open(log, "wb") as sink:
            self.proc = reaper.add(subprocess.Popen(
                ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}"],
                stdout=sink, stderr=sink,
            ))  # fmt: skip
        deadline = time.monotonic() + 60
        while not (self._up() and fetch(f"http://127.0.0.1:{self.port}/-/ready")[0] == 200):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"prometheus did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)

    def _up(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr}
        )
        status, body = fetch(url)
        document = json.loads(body)
        assert status == 200 and document["status"] == "success", (expr, body)
        return list(document["data"]["result"])

    def label_values(self, label: str, match: str) -> list[str]:
        """The values ``label`` takes in the series ``match`` selects, as
        Grafana's label_values() asks for them."""
        url = f"http://127.0.0.1:{self.port}/api/v1/label/{label}/values?" + urllib.parse.urlencode(
            {"match[]": match}
        )
        status, body = fetch(url)
        document = json.loads(body)
        assert status == 200 and document["status"] == "success", (match, body)
        return list(document["data"])

    def values(self, expr: str, label: str) -> dict[str, int]:
        return {
            item["metric"].get(label, ""): int(float(item["value"][1])) for item in self.query(expr)
        }

    def scalar(self, expr: str) -> float:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else float("nan")


@dataclass
class Served:
    prometheus: Prometheus
    truth: dict[str, Any]
    url: str
    serve_pid: int
    status: str  # /proc/PID/status of serve while it ran
    server_status: str  # ... of its serving process (its one child)
    scrape: str
    tls: Any


@pytest.fixture(scope="module")
def served(sdt: sdt_glibc.SdtGlibc, probe_exerciser: Path, web_tls: Any,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:  # fmt: skip
    tmp = tmp_path_factory.mktemp("serve")
    port = free_port()
    with Reaper() as reaper:
        serve, _ = start_serve(
            ["--sdt-glibc", "--web.listen-address", f"127.0.0.1:{port}",
             "--web.config.file", str(web_tls.config), "--bpf-stats"],
            tmp, reaper,
        )  # fmt: skip
        prometheus = Prometheus(f"127.0.0.1:{port}", web_tls, tmp, reaper)
        truth_file = tmp / "truth.json"
        subprocess.run(sdt.wrap([str(probe_exerciser), "--out", str(truth_file)]),
                       check=True, stdout=subprocess.DEVNULL, timeout=120)  # fmt: skip
        truth = json.loads(truth_file.read_text())
        expected = sum(
            p["count"] for name, p in truth["probes"].items() if name.startswith("memory_")
        )
        # Wait until Prometheus holds the final count, and the exerciser's
        # processes have been retired (their counts kept under their name).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            hits = prometheus.scalar("sum(mtrace_libc_probe_hits_total)")
            skipped = prometheus.scalar('sum(mtrace_events_lost_total{source="libc_missed"})')
            retired = prometheus.scalar("sum(mtrace_libc_processes)") == 0
            by_process = prometheus.scalar("sum(mtrace_libc_process_probe_hits_total)") == hits
            if hits + skipped >= expected and retired and by_process:
                break
            time.sleep(0.5)
        url = f"https://127.0.0.1:{port}/metrics"
        status = Path(f"/proc/{serve.pid}/status").read_text()
        children = Path(f"/proc/{serve.pid}/task/{serve.pid}/children").read_text().split()
        # its serving process (its file server, tracer/unwind/file_server.py, is the other)
        (child,) = [p for p in children if Path(f"/proc/{p}/comm").read_text() != FILE_SERVER]
        server_status = Path(f"/proc/{child}/status").read_text()
        code, scrape = fetch(url, web_tls, web_tls.password)
        assert code == 200
        yield Served(prometheus, truth, url, serve.pid, status, server_status, scrape, web_tls)
        assert stop(serve) == 0


def test_prometheus_stores_the_exercisers_probe_counts(served: Served) -> None:
    # GIVEN Prometheus scraping serve while the exerciser ran
    truth = {
        name: p["count"] for name, p in served.truth["probes"].items() if name.startswith("memory_")
    }
    prom = served.prometheus
    assert prom.values('up{job="mtrace"}', "job") == {"mtrace": 1}
    # WHEN its API is asked for the hits by probe
    hits = prom.values("mtrace_libc_probe_hits_total", "probe")
    skipped = prom.values("mtrace_bpf_program_missed_runs_total", "program")
    # THEN they are the ground truth's, probe by probe (or short by exactly
    # the runs the kernel reports it skipped, when a map read got in the way)
    for name, count in truth.items():
        missed = skipped.get(f"usdt:{name}", 0)
        assert count - missed <= hits.get(name, 0) <= count, (name, hits.get(name), count, missed)
    if not any(skipped.get(f"usdt:{name}", 0) for name in truth):
        assert {name: hits.get(name, 0) for name in truth} == truth
    # AND the same hits by process, summed, once the processes were retired
    by_process = prom.values("sum by (probe) (mtrace_libc_process_probe_hits_total)", "probe")
    assert by_process == {name: n for name, n in hits.items() if n}
    assert prom.scalar("sum(mtrace_libc_processes)") == 0
    # AND the series derived from them say the same
    retries = prom.values("sum by (kind) (mtrace_libc_allocation_retries_total)", "kind")
    assert retries == {kind: hits[probe] for probe, kind in RETRY_KINDS.items()}
    assert (
        prom.scalar("sum(mtrace_libc_tcache_double_free_checks_total)")
        == hits["memory_tcache_double_free"]
    )
    assert prom.scalar("sum(mtrace_libc_mallopt_calls_total)") == hits["memory_mallopt"]
    settings = prom.values("sum by (setting) (mtrace_libc_setting_changes_total)", "setting")
    assert settings["M_ARENA_MAX"] == hits["memory_mallopt_arena_max"]
    assert settings["glibc.malloc.tcache_count"] == hits["memory_tunable_tcache_count"]
    reuse = prom.scalar('sum(mtrace_libc_arena_waits_total{kind="reuse_wait"})')
    assert reuse == hits["memory_arena_reuse_wait"]
    assert prom.scalar('sum(mtrace_events_lost_total{source="libc"})') == 0
    assert prom.scalar('mtrace_events_processed_total{source="libc"}') >= sum(hits.values())


def test_a_scrape_passes_promtool_and_names_every_metric_the_dashboard_and_rules_use(
    served: Served,
) -> None:
    # GIVEN a real scrape of serve (libc, kmem and BPF run-time metrics)
    lint = subprocess.run(
        ["promtool", "check", "metrics"], input=served.scrape, capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    exported = {name for name, _ in samples(served.scrape)}
    assert "mtrace_bpf_program_run_seconds_total" in exported
    # WHEN the metric names in the Grafana dashboard and the alert rules are listed
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [
        v["query"]["query"]
        for v in dashboard["templating"]["list"]
        if "query" in v and isinstance(v["query"], dict)
    ]
    rules = (DEPLOY / "alerts.yml").read_text()
    used = set(re.findall(r"\b(?:mtrace|process)_[a-z_]+", "\n".join(queries) + rules))
    # THEN the exporter exports every one
    assert used and used <= exported, used - exported
    # AND every dashboard query returns data from this trace in Prometheus:
    # a series at least for each panel's query, values for each variable
    empty = []
    for query in queries:
        expr = query.replace("$__rate_interval", "1m").replace("$instance", ".*")
        expr = expr.replace("$process", ".*").replace("$job", ".*")
        variable = re.fullmatch(r"label_values\((.+), (\w+)\)", expr)
        if variable:
            found = served.prometheus.label_values(variable[2], variable[1])
        else:
            found = [item["metric"] for item in served.prometheus.query(expr)]
        if not found:
            empty.append(query)
    assert not empty, empty


def status_field(status: str, name: str) -> list[str]:
    return next(line.split()[1:] for line in status.splitlines() if line.startswith(f"{name}:"))


def test_serve_runs_as_nobody_and_refuses_a_wrong_password(served: Served) -> None:
    # the process answering the network: nobody, with no capability
    assert status_field(served.server_status, "Uid") == ["65534"] * 4
    assert int(status_field(served.server_status, "CapEff")[0], 16) == 0
    assert int(status_field(served.server_status, "CapPrm")[0], 16) == 0
    # the tracing process: nobody, with CAP_SYS_PTRACE alone (19: to read
    # the traced processes' maps and files; it stops and signals none)
    assert status_field(served.status, "Uid") == ["65534"] * 4
    for kind in ("CapEff", "CapPrm"):
        assert int(status_field(served.status, kind)[0], 16) == 1 << 19, kind
    assert int(status_field(served.status, "CapInh")[0], 16) == 0
    assert fetch(served.url, served.tls, "not-the-password")[0] == 401
    assert fetch(served.url, served.tls, None)[0] == 401
    assert fetch(served.url, served.tls, served.tls.password)[0] == 200


# ---- filters, load, bad clients --------------------------------------------


def kmem_work(binary: Path, sockets: int, out: Path, gated: bool) -> subprocess.Popen[bytes]:
    argv = [str(binary), "--sockets", str(sockets), "--pipes", "0", "--out", str(out)]
    if not gated:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    return subprocess.Popen([*argv, "--gated"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def settled(url: str) -> str:
    """A scrape of a page rendered from now on (a scrape is served the last
    page rendered, at most a read interval old), once every socket inode
    counted is freed too, or its free is among the runs of the free
    handler the kernel skipped (reported as missed, as
    ``assert_socket_inodes_counted`` allows): the RCU callbacks that free
    them run after grace periods, later under load."""
    since = time.time()
    deadline = time.monotonic() + 30
    while True:
        text = fetch(url)[1]
        rendered = samples(text)[("mtrace_metrics_rendered_time_seconds", ())]
        allocs, frees = sock_inodes(text)
        freed = frees + missed(text, "kmem_cache_free") >= allocs
        if (rendered >= since and freed) or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def sock_inodes(text: str) -> tuple[float, float]:
    values = samples(text)
    key = (("function", "sock_alloc_inode"),)
    return (values.get(("mtrace_kmem_function_allocations_total", key), 0.0),
            values.get(("mtrace_kmem_function_frees_total", key), 0.0))  # fmt: skip


def missed(text: str, tracepoint: str) -> float:
    return samples(text).get(
        ("mtrace_bpf_program_missed_runs_total", (("program", f"tracepoint:kmem:{tracepoint}"),)),
        0.0,
    )


def assert_socket_inodes_counted(text: str) -> None:
    """Exactly the target's socket inodes, allocated and freed, unless the
    kernel skipped runs of the handlers (reported as missed), which then
    account for every one short."""
    allocs, frees = sock_inodes(text)
    skipped_allocs, skipped_frees = (
        missed(text, "kmem_cache_alloc"),
        missed(text, "kmem_cache_free"),
    )
    assert SOCKETS - skipped_allocs <= allocs <= SOCKETS, (allocs, skipped_allocs)
    assert allocs - skipped_frees <= frees <= allocs, (frees, skipped_frees)
    if skipped_allocs == skipped_frees == 0:
        assert (allocs, frees) == (SOCKETS, SOCKETS)


def hammer(url: str, count: int, results: list[int]) -> None:
    for _ in range(count):
        status, body = fetch(url)
        results.append(status if "mtrace_kmem_tracepoint_hits_total" in body else -status)


def bad_clients(port: int) -> list[socket.socket]:
    """A garbage request, a half-sent one left hanging, and an idle connection."""
    with socket.create_connection(("127.0.0.1", port)) as garbage:
        garbage.sendall(b"\x00\xff GARBAGE /../../etc/passwd HTTP/9.9\r\n\r\n")
    half = socket.create_connection(("127.0.0.1", port))
    half.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
    return [half, socket.create_connection(("127.0.0.1", port))]


def test_comm_filter_is_exact_under_1000_scrapes_and_bad_clients(
    kmem_exerciser: Path, tmp_path: Path
) -> None:
    # GIVEN serve following the processes named like a copy of the kmem
    # exerciser, started after serve, and a decoy under the usual name
    named = tmp_path / "mtl_kmem_target"
    shutil.copy(kmem_exerciser, named)
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    with Reaper() as reaper:
        args = ["--comm", named.name, "--no-libc", "--top-functions", "200",
                "--web.listen-address", f"127.0.0.1:{port}"]  # fmt: skip
        serve, err = start_serve(args, tmp_path, reaper)
        work = reaper.add(kmem_work(named, SOCKETS, tmp_path / "truth.json", gated=True))
        gate(work, b"", b"ready\n")
        # WHEN 1,000 scrapes run back to back while it works, with bad clients about
        results: list[int] = []
        scraper = threading.Thread(target=hammer, args=(url, 1000, results))
        scraper.start()
        held = bad_clients(port)
        try:
            decoy = reaper.add(
                kmem_work(kmem_exerciser, 5 * SOCKETS, tmp_path / "decoy.json", gated=False)
            )
            gate(work, b"go\n", b"done\n")
            assert decoy.wait(timeout=120) == 0
            scraper.join(timeout=300)
        finally:
            for sock in held:
                sock.close()
        final = settled(url)
        assert finish(work) == 0
        assert stop(serve) == 0, err.read_text()
    # THEN every scrape succeeded with the metrics in it
    assert results == [200] * 1000
    # AND the kernel counted exactly the target's socket inodes, none of the decoy's
    assert_socket_inodes_counted(final)
    assert samples(final)[("mtrace_events_lost_total", (("source", "kmem"),))] == 0
    assert "Traceback" not in err.read_text()


@pytest.fixture
def cgroup() -> Iterator[Path]:
    path = cgroup2_root() / f"mtrace-live-test-{os.getpid()}"
    path.mkdir()
    yield path
    for _ in range(50):
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def test_cgroup_filter_counts_only_the_tasks_in_the_cgroup(
    kmem_exerciser: Path, tmp_path: Path, cgroup: Path
) -> None:
    # GIVEN a gated exerciser moved into a new cgroup, and serve filtering on it
    port = free_port()
    with Reaper() as reaper:
        work = reaper.add(kmem_work(kmem_exerciser, SOCKETS, tmp_path / "truth.json", gated=True))
        gate(work, b"", b"ready\n")
        (cgroup / "cgroup.procs").write_text(f"{work.pid}\n")
        relative = "/" + str(cgroup.relative_to(cgroup2_root()))
        args = ["--cgroup", relative, "--no-libc", "--top-functions", "200",
                "--web.listen-address", f"127.0.0.1:{port}"]  # fmt: skip
        serve, err = start_serve(args, tmp_path, reaper)
        # WHEN it works beside a decoy outside the cgroup
        decoy = reaper.add(
            kmem_work(kmem_exerciser, 5 * SOCKETS, tmp_path / "decoy.json", gated=False)
        )
        gate(work, b"go\n", b"done\n")
        assert decoy.wait(timeout=120) == 0
        final = settled(f"http://127.0.0.1:{port}/metrics")
        assert finish(work) == 0
        assert stop(serve) == 0, err.read_text()
    # THEN only the cgroup's socket inodes were counted
    assert_socket_inodes_counted(final)


def test_prometheus_option_serves_a_live_trace_while_it_runs(kmem_exerciser: Path) -> None:
    # GIVEN `run --prometheus` starting the gated kmem exerciser
    port = free_port()
    argv = [*MTRACE, "run", "--kmem-only", "-o", "summary", "--prometheus", f"127.0.0.1:{port}",
            "--", str(kmem_exerciser), "--sockets", str(SOCKETS), "--pipes", "0",
            "--out", os.devnull, "--gated"]  # fmt: skip
    with Reaper() as reaper:
        run = reaper.add(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        gate(run, b"", b"ready\n")  # the exerciser's lines come through mtrace-live's stdout
        # WHEN it has done its work and waits, and the endpoint is scraped
        gate(run, b"go\n", b"done\n")
        text = settled(f"http://127.0.0.1:{port}/metrics")
        # THEN the scrape has the trace's numbers while the trace goes on
        assert_socket_inodes_counted(text)
        assert run.poll() is None
        # AND the trace ends with the command, as without --prometheus
        assert run.stdin is not None and run.stdout is not None
        run.stdin.write(b"end\n")
        run.stdin.close()
        summary = run.stdout.read().decode()
        run.stdout.close()
        assert run.wait(timeout=60) == 0, summary
        assert "ended by exit, command exit code 0" in summary
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
