"""The Prometheus exporter without BPF: metric families from snapshots, label
caps, the web configuration, and the HTTP(S) endpoint under bad clients."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import gzip
import re
import socket
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from mtrace_live.exporters.data.kmem import CallSite, KmemTotals
from mtrace_live.exporters.data.lock_waits import WaitTimes
from mtrace_live.exporters.prometheus import MtraceCollector, ProcessFigures, Snapshot
from mtrace_live.exporters.web import (
    MAX_CONNECTIONS,
    MetricsEndpoint,
    load_web_config,
    parse_address,
)
from mtrace_live.probes.errors import ListenError, WebConfigError
from mtrace_live.probes.records import KmemType
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from .cli_runs import assert_one_line, mtrace

DEPLOY = Path(__file__).resolve().parents[2] / "exporters" / "deploy"


def snapshot(processes: dict[str, dict[str, int]], functions: dict[str, int]) -> Snapshot:
    """A scrape's numbers: hits by process name and probe; bytes by kernel function."""
    figures = {}
    for name, hits in processes.items():
        figures[name] = ProcessFigures(hits=Counter(hits), arena_lock_waits=3, live=1, arenas=2,
                                       heap_bytes=135168, sbrk_bytes=4096)  # fmt: skip
    total: Counter[str] = Counter()
    for hits in processes.values():
        total.update(hits)
    sites = [
        CallSite(0xFFFFFFFF81000000 + i, KmemType.CACHE, allocs=n // 64, bytes_req=n // 2,
                 bytes_alloc=n, frees=n // 128, bytes_freed=n // 2, symbol=name)
        for i, (name, n) in enumerate(functions.items())
    ]  # fmt: skip
    sites.append(CallSite(0, KmemType.PAGES, allocs=10, bytes_req=40960, bytes_alloc=40960))
    kmem = KmemTotals(sites=sites, page_orders={0: (9, 4), 3: (1, 0)},
                      hits={"kmalloc": 5, "kmem_cache_alloc": 7})  # fmt: skip
    return Snapshot(
        libc=True,
        probe_hits=dict(total),
        probe_lost={name: 0 for name in total},
        processes=figures,
        process_hits_dropped=0,
        kmem=kmem,
        events_processed={"libc": sum(total.values()), "kmem": 12},
        events_lost={"libc": 0, "kmem": 0},
        probes_attached={"usdt_probe": 30, "usdt_site": 38, "tracepoint": 7},
        bpf_runs={"usdt:memory_sbrk_more": (1500, 3)},
        bpf_misses={"usdt:memory_sbrk_more": 0},
        started=1.7e9,
        build={"version": "0.1.0", "bcc": "0.26.0", "kernel": "6.18"},
    )


HITS = {"memory_sbrk_more": 6, "memory_malloc_retry": 2, "memory_tcache_double_free": 1,
        "memory_arena_reuse_wait": 4, "memory_mallopt": 10,
        "memory_mallopt_arena_max": 2}  # fmt: skip


def scrape(collector: MtraceCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_every_family_has_help_counters_end_in_total_and_no_label_is_an_address(
    tmp_path: Path,
) -> None:
    # GIVEN a collector over a snapshot with libc, kmem and self figures
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        MtraceCollector(lambda: snapshot({"nginx": HITS}, {"sock_alloc_inode": 8192}))
    )
    # WHEN it is scraped
    text = generate_latest(registry).decode()
    families = list(text_string_to_metric_families(text))
    # THEN every family has HELP text, counters' samples end in _total, and
    # no label value is a raw address
    assert len(families) > 30
    for family in families:
        assert family.documentation.strip(), family.name
        assert family.name.startswith("mtrace_")
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name.endswith(("_total", "_created")), sample.name
            for value in sample.labels.values():
                assert not re.fullmatch(r"(0x)?[0-9a-f]{8,}", value), (sample.name, value)
    # AND promtool, Prometheus's own linter, accepts the exposition
    lint = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    # AND derived series carry the snapshot's numbers
    values = scrape(MtraceCollector(lambda: snapshot({"nginx": HITS}, {"sock_alloc_inode": 8192})))
    assert (
        values[("mtrace_libc_allocation_retries_total", (("kind", "malloc"), ("process", "nginx")))]
        == 2
    )
    assert values[("mtrace_libc_tcache_double_free_checks_total", (("process", "nginx"),))] == 1
    assert values[("mtrace_libc_mallopt_calls_total", (("process", "nginx"),))] == 10
    assert (
        values[("mtrace_libc_arena_waits_total", (("kind", "reuse_wait"), ("process", "nginx")))]
        == 4
    )
    assert (
        values[("mtrace_kmem_function_allocated_bytes_total", (("function", "sock_alloc_inode"),))]
        == 8192
    )
    assert values[("mtrace_kmem_fragmentation_ratio", (("kind", "cache"),))] == 0.5
    assert values[("mtrace_kmem_page_allocations_total", (("order", "3"),))] == 1


def test_capped_labels_send_newcomers_to_other_and_no_counter_goes_down() -> None:
    # GIVEN a collector with room for two process names and two functions
    state = {"snap": snapshot({"a": {"memory_mallopt": 10}, "b": {"memory_mallopt": 5}},
                              {"f1": 4096, "f2": 2048, "f3": 1024})}  # fmt: skip
    collector = MtraceCollector(lambda: state["snap"], max_processes=2, top_sites=2)
    first = scrape(collector)
    # WHEN new names appear, one of them larger than all before
    state["snap"] = snapshot(
        {"a": {"memory_mallopt": 11}, "b": {"memory_mallopt": 5}, "c": {"memory_mallopt": 100},
         "d": {"memory_mallopt": 1}},
        {"f1": 4096, "f2": 4096, "f3": 2048, "f4": 1 << 20},
    )  # fmt: skip
    second = scrape(collector)
    # THEN the first two keep their labels and the rest is counted as other
    calls = "mtrace_libc_mallopt_calls_total"
    assert second[(calls, (("process", "a"),))] == 11
    assert second[(calls, (("process", "other"),))] == 101
    assert (calls, (("process", "c"),)) not in second
    fbytes = "mtrace_kmem_function_allocated_bytes_total"
    assert first[(fbytes, (("function", "other"),))] == 1024
    assert second[(fbytes, (("function", "other"),))] == 2048 + (1 << 20)
    # AND no counter that both scrapes have went down
    for key, value in first.items():
        if key[0].endswith("_total") and key in second:
            assert second[key] >= value, key


def test_the_shipped_alert_rules_pass_promtool() -> None:
    done = subprocess.run(["promtool", "check", "rules", str(DEPLOY / "alerts.yml")],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 7 rules found" in done.stdout


# ---- the web configuration --------------------------------------------------


def test_a_web_config_with_tls_and_users_loads(web_tls: Any) -> None:
    config = load_web_config(web_tls.config)
    assert config.tls is not None and config.tls.minimum_version == ssl.TLSVersion.TLSv1_2
    assert list(config.users) == [web_tls.user]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("basic_auth_users: a: b\n", "line 1 is not valid YAML"),
        ("tls_server_config:\n  cert_file: server.crt\n", "needs both cert_file and key_file"),
        ("tls_server_config:\n  cert_file: nope.crt\n  key_file: nope.key\n",
         "cert_file: cannot read "),
        ("tls_server_config:\n  cert_file: server.crt\n  key_file: nope.key\n",
         "key_file: cannot read "),
        ("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
         "  cipher_suites: [TLS_AES_128_GCM_SHA256]\n", "cipher_suites not supported"),
        ("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
         "  min_version: TLS9\n", "min_version TLS9 is not one of"),
        ("tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n"
         "  client_auth_type: RequireAndVerifyClientCert\n", "needs client_ca_file"),
        ("tls_server_config:\n  cert_file: server.key\n  key_file: server.crt\n",
         "not a usable certificate and key"),
        ("basic_auth_users:\n  alice: plaintext\n", "alice is not a bcrypt hash"),
        ("basic_auth_userz: {}\n", "basic_auth_userz not supported"),
        ("- a list\n", "must be a mapping"),
        # keys of mixed types, as the fuzzer found (a TypeError in sorting them)
        ("~: 1\n5: 2\nbasic_auth_users: {}\n", "5, None not supported"),
        ("basic_auth_users:\n  ~: $2b$04$abcdefghijklmnopqrstuu0123456789ABCDEFGHIJKLMNOPQRSTU\n",
         "basic_auth_users must be a string"),
        ("basic_auth_users:\n  bob: [1, 2]\n", "bob is not a bcrypt hash"),
        ("tls_server_config:\n  cert_file: /dev/zero\n  key_file: server.key\n",
         "/dev/zero is not a regular file"),
    ],
)  # fmt: skip
def test_a_bad_web_config_is_one_clear_error(
    web_tls: Any, tmp_path: Path, text: str, words: str
) -> None:
    config = web_tls.config.parent / f"bad-{abs(hash(text))}.yml"
    config.write_text(text)
    with pytest.raises(WebConfigError, match=re.escape(words)):
        load_web_config(config)


def test_serve_with_a_bad_web_config_exits_17_at_start(web_tls: Any) -> None:
    bad = web_tls.config.parent / "bad-cli.yml"
    bad.write_text("tls_server_config:\n  cert_file: missing.crt\n  key_file: missing.key\n")
    missing = web_tls.config.parent / "missing.crt"
    assert_one_line(mtrace("serve", "--web.config.file", str(bad)), 17, f"cannot read {missing}")
    latin = web_tls.config.parent / "latin1.yml"
    latin.write_bytes(b"basic_auth_users:\n  j\xf6rg: x\n")
    assert_one_line(mtrace("serve", "--web.config.file", str(latin)), 17, "is not UTF-8 text")


@pytest.mark.parametrize(
    "address",
    ["[::1:9477", "::1]:9477", "[::1]]:9477", "::1:9477", "[127.0.0.1]:9477", "[]:9477",
     "127.0.0.1:\u00b2", "127.0.0.1:99999", "127.0.0.1:-1", "[::1]:0x10"],
)  # fmt: skip
def test_malformed_listen_addresses_are_refused(address: str) -> None:
    with pytest.raises(ListenError):
        parse_address(address)


def test_listen_addresses_as_the_go_exporters_read_them() -> None:
    assert parse_address("[::1]:9477") == ("::1", 9477)
    assert parse_address(":9477") == ("", 9477)
    assert parse_address("127.0.0.1:0") == ("127.0.0.1", 0)
    assert parse_address("localhost:80") == ("localhost", 80)


def test_serve_on_a_busy_port_exits_16_at_start() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = mtrace("serve", "--web.listen-address", f"127.0.0.1:{port}")
    assert_one_line(done, 16, "Address already in use")


def test_serve_on_a_malformed_address_exits_16() -> None:
    assert_one_line(mtrace("serve", "--web.listen-address", "localhost"), 16, "is not host:port")


# ---- the endpoint -----------------------------------------------------------


@pytest.fixture
def endpoint(web_tls: Any):  # type: ignore[no-untyped-def]
    state = {"fail": False}

    def snap() -> Snapshot:
        if state["fail"]:
            raise RuntimeError("map read failed")
        return snapshot({"nginx": HITS}, {"sock_alloc_inode": 8192})

    registry = CollectorRegistry(auto_describe=False)
    registry.register(MtraceCollector(snap))
    server = MetricsEndpoint("127.0.0.1:0", registry, load_web_config(web_tls.config))
    server.start()
    server.state = state  # type: ignore[attr-defined]
    yield server
    server.close()


def get(endpoint: MetricsEndpoint, web_tls: Any, password: str | None = "",
        path: str = "/metrics", method: str = "GET",
        headers: dict[str, str] | None = None) -> Any:  # fmt: skip
    request = urllib.request.Request(f"https://127.0.0.1:{endpoint.port}{path}", method=method,
                                     headers=headers or {})  # fmt: skip
    if password == "":
        password = web_tls.password
    if password is not None:
        token = base64.b64encode(f"{web_tls.user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    context = ssl.create_default_context(cafile=str(web_tls.cert))
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def test_tls_scrape_with_the_right_password_works_and_a_wrong_one_is_refused(
    endpoint: MetricsEndpoint, web_tls: Any
) -> None:
    status, body, headers = get(endpoint, web_tls)
    assert status == 200 and b"mtrace_libc_probe_hits_total" in body
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert get(endpoint, web_tls, password="wrong")[0] == 401
    # AND a password over bcrypt's 72 bytes is a 401, never a dropped connection
    assert get(endpoint, web_tls, password="x" * 100)[0] == 401
    assert get(endpoint, web_tls, password=web_tls.password + "y" * 80)[0] == 401
    status, _, headers = get(endpoint, web_tls, password=None)
    assert status == 401 and headers["WWW-Authenticate"].startswith("Basic")
    # AND plain HTTP on the TLS port gets no metrics
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=5).read()


def test_paths_methods_encodings_and_openmetrics(endpoint: MetricsEndpoint, web_tls: Any) -> None:
    assert get(endpoint, web_tls, path="/nope")[0] == 404
    assert get(endpoint, web_tls, method="POST")[0] == 405
    status, body, headers = get(endpoint, web_tls, headers={"Accept-Encoding": "gzip"})
    assert status == 200 and headers["Content-Encoding"] == "gzip"
    assert b"mtrace_build_info" in gzip.decompress(body)
    status, body, headers = get(
        endpoint, web_tls, headers={"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert headers["Content-Type"].startswith("application/openmetrics-text") and body.endswith(
        b"# EOF\n"
    )


def test_a_failed_collection_is_a_500_for_that_scrape_only(
    endpoint: MetricsEndpoint, web_tls: Any
) -> None:
    endpoint.state["fail"] = True  # type: ignore[attr-defined]
    status, body, _ = get(endpoint, web_tls)
    assert status == 500 and b"map read failed" in body
    endpoint.state["fail"] = False  # type: ignore[attr-defined]
    assert get(endpoint, web_tls)[0] == 200


def test_garbage_and_more_idle_clients_than_places_do_not_stop_scrapes(
    endpoint: MetricsEndpoint, web_tls: Any
) -> None:
    port = endpoint.port
    # GIVEN a client that sends garbage, and more silent clients than there are places
    with socket.create_connection(("127.0.0.1", port)) as garbage:
        garbage.sendall(b"\x16\x03\x01\x00\x05hello\r\n\r\n" * 3)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CONNECTIONS + 8)]
    # WHEN scrapes come meanwhile, several at once
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda: results.append(get(endpoint, web_tls)[0])) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # THEN every one is answered: the oldest silent clients made room
    assert results == [200] * 8
    # AND the clients that were cut got no plain-text reply on the TLS port
    for sock in idle:
        sock.settimeout(0.5)
        with contextlib.suppress(OSError):
            assert not sock.recv(64).startswith(b"HTTP/")
        sock.close()


def test_the_collector_publishes_exactly_the_families_of_the_table() -> None:
    # GIVEN a scrape with libc probes, kmem, the allocation functions and BPF run times
    from mtrace_live.exporters.prometheus import AllocFigures, LockFigures
    from mtrace_live.exporters.prometheus_families import FAMILIES

    allocs = AllocFigures(processes={"app": {"calls": 5, "bytes": 100}},
                          stacks=[("app", "malloc", "main;f", "glibc", "libc.so.6", 40)],
                          dropped={"stacks": 0},
                          sampled=True,
                          walks={"stacks": 3, "complete": 2, "vma_lookups": 1})  # fmt: skip
    locks = {"app": LockFigures({"main": WaitTimes(2, 3000, 2000, (0,) * 11 + (2,))}, 10**9)}
    snap = dataclasses.replace(snapshot({"app": HITS}, {"alloc_skb": 100}), allocs=allocs,
                               locks=locks)  # fmt: skip
    registry = CollectorRegistry()
    registry.register(MtraceCollector(lambda: snap))
    page = generate_latest(registry).decode()
    # THEN every family of the table is there, with its type and help, and no other
    published = {f.name: f for f in text_string_to_metric_families(page)}
    assert set(published) == {f"mtrace_{name}" for name in FAMILIES} | {"mtrace_build_info"}
    for name, spec in FAMILIES.items():
        assert published[f"mtrace_{name}"].type == spec.type, name
        assert published[f"mtrace_{name}"].documentation == spec.help.format(
            estimated=" (estimated from samples)"
        ), name


def test_the_stack_walks_are_published_as_the_kernel_counted_them() -> None:
    # GIVEN a scrape whose walks' counts are unwind_misc's (by its names)
    from mtrace_live.exporters.prometheus import AllocFigures

    walks = {"stacks": 10, "complete": 7, "no_cfi": 2, "bounds": 1, "cfi_frames": 50,
             "fp_frames": 4, "no_tables": 6, "inherited": 1, "vma_lookups": 5, "vma_busy": 1,
             "unwritten": 3}  # fmt: skip
    allocs = AllocFigures(processes={}, stacks=[], dropped={}, sampled=False, walks=walks)
    snap = dataclasses.replace(snapshot({}, {}), allocs=allocs)
    got = scrape(MtraceCollector(lambda: snap))
    # THEN each ending, each way of finding frames, each start and lookup is its sample
    assert got[("mtrace_stack_walks_total", (("ended", "complete"),))] == 7
    assert got[("mtrace_stack_walks_total", (("ended", "no_cfi"),))] == 2
    assert got[("mtrace_stack_walks_total", (("ended", "bounds"),))] == 1
    assert got[("mtrace_stack_walks_total", (("ended", "depth"),))] == 0
    assert got[("mtrace_stack_frames_total", (("by", "cfi"),))] == 50
    assert got[("mtrace_stack_frames_total", (("by", "frame_pointers"),))] == 4
    assert got[("mtrace_stack_walk_starts_total", (("tables", "no_tables"),))] == 6
    assert got[("mtrace_stack_walk_starts_total", (("tables", "inherited"),))] == 1
    assert got[("mtrace_stack_mapping_lookups_total", (("result", "found"),))] == 4
    assert got[("mtrace_stack_mapping_lookups_total", (("result", "busy"),))] == 1
    assert got[("mtrace_stack_frames_unwritten_total", ())] == 3
    # AND a program that walks by frame pointers only publishes none of them
    bare = dataclasses.replace(snap, allocs=dataclasses.replace(allocs, walks={}))
    assert not [name for name, _ in scrape(MtraceCollector(lambda: bare))
                if name.startswith("mtrace_stack_")]  # fmt: skip
