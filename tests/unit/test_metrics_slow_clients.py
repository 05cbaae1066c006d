"""The metrics endpoint against slow clients: while 50 of them hold
connections open, sending a header line a second or stalling the TLS
handshake, 1,000 scrapes in a row all succeed, on plain HTTP and on TLS,
and so do heap profiles; a client that never finishes its request is cut
off at the request's deadline, not kept alive by trickling bytes, while a
delta profile is held past it for its seconds."""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from mtrace_live.exporters import web
from mtrace_live.exporters.profile_serving import ProfilesApp
from mtrace_live.exporters.prometheus import MtraceCollector
from mtrace_live.exporters.web import MetricsEndpoint, WebConfig, load_web_config
from prometheus_client import CollectorRegistry

from .profile_proto import parsed
from .test_heap_profiles import APP, profiles, stack, tables
from .test_prometheus_export import HITS, snapshot

SLOW_CLIENTS = 50
SCRAPES = 1000


def serve(config: WebConfig) -> MetricsEndpoint:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MtraceCollector(lambda: snapshot({"nginx": HITS}, {"kfree_skb": 4096})))
    endpoint = MetricsEndpoint("127.0.0.1:0", registry, config)
    endpoint.start()
    return endpoint


@pytest.fixture(params=["http", "https"])
def endpoint(request: pytest.FixtureRequest, web_tls: Any) -> Iterator[MetricsEndpoint]:
    config = WebConfig()
    if request.param == "https":
        config = load_web_config(web_tls.config)
        config.users = {}  # the scrapes here test the connections, not the passwords
    server = serve(config)
    yield server
    server.close()


class SlowClients:
    """Connections that each send one header line a second and never end
    their request; on a TLS port half of them never start the handshake."""

    def __init__(self, port: int, count: int, tls: ssl.SSLContext | None) -> None:
        self.stop = threading.Event()
        self.sockets: list[socket.socket] = []
        for n in range(count):
            sock = socket.create_connection(("127.0.0.1", port))
            if tls is not None and n % 2:
                sock = tls.wrap_socket(sock, server_hostname="127.0.0.1")
            self.sockets.append(sock)
        self.thread = threading.Thread(target=self._drip, daemon=True)
        self.thread.start()

    def _drip(self) -> None:
        line = 0
        while not self.stop.wait(1.0):
            for sock in self.sockets:
                with contextlib.suppress(OSError, ValueError):
                    sock.sendall(b"GET /metrics HTTP/1.1\r\n" if line == 0 else b"X-Slow: 1\r\n")
            line += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for sock in self.sockets:
            sock.close()


def scrape(endpoint: MetricsEndpoint, tls: ssl.SSLContext | None, path: str = "/metrics") -> int:
    """The status of one GET of ``path``; -1 if its body is not what the path serves."""
    if tls is None:
        connection = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=30)
    else:
        connection = http.client.HTTPSConnection(
            "127.0.0.1", endpoint.port, timeout=30, context=tls
        )
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        body = response.read()
        if path.startswith("/debug/pprof/"):
            profile = parsed(body)
            return response.status if len(profile.sample) == 1 else -1
        return response.status if b"mtrace_libc_probe_hits_total" in body else -1
    finally:
        connection.close()


def test_a_thousand_scrapes_all_succeed_while_fifty_slow_clients_hold_connections(
    endpoint: MetricsEndpoint, web_tls: Any
) -> None:
    tls = None
    if endpoint.scheme == "https":
        tls = ssl.create_default_context(cafile=str(web_tls.cert))
    # GIVEN 50 slow clients connected
    slow = SlowClients(endpoint.port, SLOW_CLIENTS, tls)
    try:
        # WHEN 1,000 scrapes come one after the other
        statuses = [scrape(endpoint, tls) for _ in range(SCRAPES)]
    finally:
        slow.close()
    # THEN every one was answered with the metrics
    assert statuses == [200] * SCRAPES


def test_a_request_that_trickles_in_is_cut_at_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # GIVEN a request deadline of half a second
    monkeypatch.setattr(web, "REQUEST_DEADLINE_S", 0.5)
    endpoint = serve(WebConfig())
    try:
        sock = socket.create_connection(("127.0.0.1", endpoint.port))
        sock.settimeout(30)
        sock.sendall(b"GET /metrics HTTP/1.1\r\n")
        # WHEN the client sends a header line every 0.1 s, each well within
        # the per-read timeout, for up to 60 s
        cut = False
        for _ in range(600):
            try:
                sock.sendall(b"X-Slow: 1\r\n")
                threading.Event().wait(0.1)
                sock.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    if sock.recv(1) == b"":
                        cut = True
                        break
                sock.setblocking(True)
                sock.settimeout(30)
            except OSError:
                cut = True
                break
        sock.close()
        # THEN the server closed the connection, and still serves others
        assert cut
        assert scrape(endpoint, None) == 200
    finally:
        endpoint.close()


def test_heap_profiles_all_succeed_while_fifty_slow_clients_hold_connections(
    endpoint: MetricsEndpoint, web_tls: Any
) -> None:
    tls = None
    if endpoint.scheme == "https":
        tls = ssl.create_default_context(cafile=str(web_tls.cert))
    heap, _ = profiles(tables(stack(APP, 0x401100, 10, 64, 4)))
    endpoint.serve_profiles(ProfilesApp(heap.answer))
    # GIVEN 50 slow clients connected
    slow = SlowClients(endpoint.port, SLOW_CLIENTS, tls)
    try:
        # WHEN 200 profiles are asked for one after the other
        statuses = [scrape(endpoint, tls, "/debug/pprof/heap") for _ in range(200)]
    finally:
        slow.close()
    # THEN every one was answered with the profile
    assert statuses == [200] * 200


def test_a_delta_profile_is_held_past_the_request_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # GIVEN a request deadline of half a second, and the heap profiles served
    monkeypatch.setattr(web, "REQUEST_DEADLINE_S", 0.5)
    endpoint = serve(WebConfig())
    heap, _ = profiles(tables(stack(APP, 0x401100, 10, 64, 4)))
    endpoint.serve_profiles(ProfilesApp(heap.answer))
    try:
        # WHEN a delta profile of 2 s is asked for
        connection = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=30)
        connection.request("GET", "/debug/pprof/allocs?seconds=2")
        response = connection.getresponse()
        body = response.read()
        connection.close()
    finally:
        endpoint.close()
    # THEN it is answered, 2 s long, not cut at the deadline
    assert response.status == 200
    profile = parsed(body)
    assert profile.duration_nanos >= 2_000_000_000
