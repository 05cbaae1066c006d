"""The metrics page rendered in one process and served by another
(exporters/exposition.py): whole pages only, the format asked for, and a
server that answers while the renderer is busy."""

from __future__ import annotations

import gzip
import hashlib
import os
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from mtrace_live.exporters.data.kallsyms import KernelSymbols
from mtrace_live.exporters.exposition import (
    OPENMETRICS,
    STALE_SLACK_S,
    TEXT,
    PublishedApp,
    Renderer,
    ServingProcess,
    SharedPages,
)
from mtrace_live.exporters.prometheus_sink import ExportOptions, PrometheusSink
from mtrace_live.exporters.web import MetricsEndpoint, WebConfig
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.parser import text_string_to_metric_families


def page(number: int) -> bytes:
    """A page that says whether it arrived whole: its number, a filler
    whose length depends on the number, and a digest of both."""
    filler = bytes([65 + number % 26]) * (1000 + (number * 7919) % 300_000)
    head = f"{number}\n".encode() + filler
    return head + b"\n" + hashlib.sha256(head).hexdigest().encode()


def whole(body: bytes) -> bool:
    head, _, digest = body.rpartition(b"\n")
    return hashlib.sha256(head).hexdigest().encode() == digest


def test_a_reader_in_another_process_never_sees_a_torn_page() -> None:
    # GIVEN shared pages, and a child process that reads them as fast as it can
    pages = SharedPages(slot_bytes=1 << 20)
    pages.publish(TEXT, page(0))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the reader: counts whole and torn pages, and the pages it saw
        try:
            os.close(read)
            seen, torn, deadline = set(), 0, time.monotonic() + 3
            while time.monotonic() < deadline:
                # None: the reader gave up, a thousand copies each overtaken by
                # two new pages (published back to back here; in a trace, once
                # a read interval at most). Not a page, so not a torn one.
                got = pages.latest(TEXT)
                if got is not None and whole(got.body):
                    seen.add(int(got.body.split(b"\n", 1)[0]))
                elif got is not None:
                    torn += 1
            os.write(write, f"{len(seen)} {torn}".encode())
        finally:
            os._exit(0)
    os.close(write)
    # WHEN this process publishes 3,000 pages of changing sizes meanwhile
    for number in range(1, 3001):
        pages.publish(TEXT, page(number))
    reply = os.read(read, 100).decode()
    os.waitpid(pid, 0)
    seen, torn = map(int, reply.split())
    # THEN the reader saw many distinct pages, and every one whole
    assert torn == 0, reply
    assert seen > 10


class Counting:
    """A collector whose one counter says how many times it was collected;
    once ``hold`` is called, a collection stays inside until ``release``."""

    def __init__(self) -> None:
        self.collections = 0
        self.held = threading.Event()
        self.held.set()
        self.inside = threading.Event()  # a collection is waiting to be released

    def hold(self) -> None:
        self.held.clear()

    def release(self) -> None:
        self.held.set()

    def collect(self) -> Iterator[CounterMetricFamily]:
        self.collections += 1
        if not self.held.is_set():
            self.inside.set()
            self.held.wait()
        family = CounterMetricFamily("test_collections", "Collections so far.")
        family.add_metric([], self.collections)
        yield family


def value(text: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "test_collections_total":
                return sample.value
    raise AssertionError(f"no counter in {text!r}")


@pytest.fixture
def served() -> Iterator[tuple[MetricsEndpoint, Renderer, Counting]]:
    collector = Counting()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    pages = SharedPages(slot_bytes=1 << 20)
    endpoint = MetricsEndpoint("127.0.0.1:0", CollectorRegistry(), WebConfig())
    renderer = Renderer(registry, pages, 0.1, lambda line: None)
    renderer.start()
    endpoint.serve_pages(PublishedApp(pages, 0.1))
    endpoint.start()
    try:
        yield endpoint, renderer, collector
    finally:
        renderer.close()
        endpoint.close()


def get(url: str, headers: dict[str, str]) -> tuple[str, str, bytes]:
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=10) as reply:
        return (
            reply.headers["Content-Type"],
            reply.headers.get("Content-Encoding", ""),
            reply.read(),
        )


def test_formats_gzip_and_renders_while_scraped(
    served: tuple[MetricsEndpoint, Renderer, Counting],
) -> None:
    endpoint, renderer, _collector = served
    # WHEN a scraper asks for text, then OpenMetrics with gzip, as Prometheus does
    kind, _, body = get(endpoint.url, {})
    first = value(body.decode())
    om_accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    deadline = time.monotonic() + 10
    while True:
        kind_om, encoding, zipped = get(endpoint.url, {"Accept": om_accept,
                                                       "Accept-Encoding": "gzip"})  # fmt: skip
        if kind_om.startswith("application/openmetrics-text") or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    om = gzip.decompress(zipped).decode()
    # THEN text is text 0.0.4, OpenMetrics comes once it was asked for, gzipped
    assert kind.startswith("text/plain; version=0.0.4")
    assert kind_om.startswith("application/openmetrics-text")
    assert encoding == "gzip"
    assert om.endswith("# EOF\n")
    # AND while scrapes come the page is rendered again every interval
    assert value(om.replace("# EOF\n", "")) > first
    assert renderer.renders >= 2


def test_a_scrape_does_not_wait_for_a_slow_render(
    served: tuple[MetricsEndpoint, Renderer, Counting],
) -> None:
    endpoint, renderer, collector = served
    first = value(get(endpoint.url, {})[2].decode())
    # GIVEN a renderer held inside a collection (a tracer too busy to render)
    collector.hold()
    renderer.pages.poke()  # as a scrape that finds the page old does
    try:
        assert collector.inside.wait(60), "the renderer never collected again"
        # WHEN the endpoint is scraped meanwhile, once the last page is old
        # (a scrape then asks for a new one, and waits for it a bounded time)
        last = renderer.pages.latest(TEXT)
        assert last is not None
        old_after = last.built + 0.1 + STALE_SLACK_S  # the fixture's read interval, 0.1 s
        for _ in range(600):  # a guard against a hang, not a measure
            if time.monotonic() > old_after:
                break
            time.sleep(0.01)
        reply = value(get(endpoint.url, {})[2].decode())
        # THEN it was answered from the last whole page, the collection still held
        assert collector.inside.is_set() and not collector.held.is_set()
        assert first <= reply == value(last.body.decode()) < collector.collections
    finally:
        collector.release()


def test_a_forked_server_answers_and_stops_with_the_tracer() -> None:
    # GIVEN an endpoint handed to a process of its own, and pages rendered here
    collector = Counting()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    pages = SharedPages(slot_bytes=1 << 20)
    endpoint = MetricsEndpoint("127.0.0.1:0", CollectorRegistry(), WebConfig())
    server = ServingProcess(endpoint, pages, 0.1)
    previous = signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as the CLI has it
    try:
        server.start(lambda: None)
    finally:
        signal.signal(signal.SIGPIPE, previous)
    renderer = Renderer(registry, pages, 0.1, lambda line: None)
    renderer.start()
    try:
        # WHEN a client hangs up in the middle of a request, and then it is scraped
        port = int(endpoint.url.rsplit(":", 1)[1].split("/")[0])
        with socket.create_connection(("127.0.0.1", port)) as half:
            half.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            time.sleep(0.2)
        time.sleep(0.2)
        kind, _, body = get(endpoint.url, {})
        # THEN the child answered with this process's page
        assert kind.startswith("text/plain")
        assert value(body.decode()) >= 1
        assert server.alive()
    finally:
        renderer.close()
        pid = server.pid
        server.close()
    # AND closing stopped the child (reaped, not left running)
    assert not server.alive()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, 0)


def test_the_tracer_says_once_that_its_server_has_died(capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a forked server and the metrics sink that renders its pages
    pages = SharedPages(slot_bytes=1 << 20)
    endpoint = MetricsEndpoint("127.0.0.1:0", CollectorRegistry(), WebConfig())
    server = ServingProcess(endpoint, pages, 0.1)
    server.start(lambda: None)
    sink = PrometheusSink(endpoint, ExportOptions("127.0.0.1:0"), KernelSymbols(""), pages,
                          server.alive)  # fmt: skip
    try:
        sink.tick()
        assert "warning" not in capsys.readouterr().err  # alive: nothing said
        # WHEN the server is killed and two housekeeping periods pass
        os.kill(server.pid, signal.SIGKILL)
        os.waitid(os.P_PID, server.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped
        for _ in range(2):
            sink._next_server_check = 0.0  # the period is over
            sink.tick()
    finally:
        server.close()
    # THEN the tracer said so, once, naming the address no one answers
    said = [line for line in capsys.readouterr().err.splitlines() if "has exited" in line]
    assert said == [f"mtrace-live: warning: the process serving {endpoint.url} has exited; "
                    "scrapes go unanswered while tracing goes on"]  # fmt: skip


def test_a_page_over_the_slot_is_an_error_page_not_a_cut_one() -> None:
    pages = SharedPages(slot_bytes=4096)
    pages.publish(OPENMETRICS, b"x" * 5000)
    got = pages.latest(OPENMETRICS)
    assert got is not None
    assert got.status == 500
    assert b"over the 4096" in got.body
