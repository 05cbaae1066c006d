"""The metrics endpoint: HTTP or HTTPS, optional basic auth, configured by
a web configuration file in the format of the Prometheus exporters'
``--web.config.file`` (exporter-toolkit):

    tls_server_config:
      cert_file: server.crt
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # optional
      client_ca_file: clients.crt                     # with the Verify types
      min_version: TLS12                              # TLS10..TLS13
      max_version: TLS13
    http_server_config:
      headers: {X-Frame-Options: deny}
    basic_auth_users:
      alice: $2y$10$...   # bcrypt hashes, as htpasswd -B makes them

Paths are relative to the file's directory. Keys mtrace-live does not
implement (cipher_suites, curve_preferences, ...) are refused, never
ignored: a security setting that silently does nothing is worse than an
error at start.

The server must keep answering its scraper whatever other clients do, and
never disturb the tracing it serves:
- every connection has its own thread (the TLS handshake happens there too);
- each request has a deadline for the whole of it, handshake, request line,
  headers and reply together (``REQUEST_DEADLINE_S``), not only per read:
  a client that sends a header line a second is cut off at the deadline;
- at most ``MAX_CONNECTIONS`` are open at once; a new connection past that
  closes the oldest one that is still sending its request, so slow clients
  can never take every place; only when every connection is being answered
  is the new one refused (a 503 on plain HTTP; on a TLS port it is closed,
  never answered in plain text);
- collecting the metrics is serialised, and any failure in a request
  becomes an HTTP error for that request only.

What is served is a WSGI application (``MetricsEndpoint.wsgi``): /metrics is
client_python's own (``make_wsgi_app``: text or OpenMetrics by the Accept
header, gzip), behind a small basic-auth check (bcrypt,
which client_python lacks). client_python's ``start_http_server`` also
serves TLS with client certificates, but has no request deadline and no cap
on connections, and its TLS settings are not the web config's (no
min/max_version, no VerifyClientCertIfGiven): the server here keeps those.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import ipaddress
import re
import socket
import socketserver
import ssl
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import bcrypt
import yaml
from mtrace_live.probes.errors import ListenError, WebConfigError
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import make_wsgi_app

StartResponse = Callable[[str, list[tuple[str, str]]], Any]

DEFAULT_ADDRESS = "127.0.0.1:9477"
CONNECTION_TIMEOUT_S = 10.0  # one read or write
REQUEST_DEADLINE_S = 10.0  # one whole request, from its first byte (or the accept) to the reply
MAX_CONNECTIONS = 64
_REAP_INTERVAL_S = 0.25
MAX_CONFIG_BYTES = 1 << 20
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
_TLS_KEYS = {
    "cert_file",
    "key_file",
    "client_auth_type",
    "client_ca_file",
    "min_version",
    "max_version",
}
_TOP_KEYS = {"tls_server_config", "http_server_config", "basic_auth_users"}
_HTTP_KEYS = {"headers", "http2"}
# A valid hash of a random password: unknown users cost one bcrypt check
# too, so that response times do not tell which user names exist.
_DUMMY_HASH = bcrypt.hashpw(b"mtrace-live: no such user", bcrypt.gensalt(rounds=10))


@dataclass
class WebConfig:
    tls: ssl.SSLContext | None = None
    users: Mapping[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash
    headers: Mapping[str, str] = field(default_factory=dict)


def load_web_config(path: Path | None) -> WebConfig:
    """Parse and check a web configuration file; WebConfigError on any problem."""
    if path is None:
        return WebConfig()
    _readable_file(path, "the web config")
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise WebConfigError(f"the web config {path} is over {MAX_CONFIG_BYTES} bytes")
        document = yaml.safe_load(raw.decode("utf-8"))
    except OSError as exc:
        raise WebConfigError(f"cannot read the web config {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise WebConfigError(
            f"the web config {path} is not UTF-8 text (byte {exc.start})"
        ) from None
    except RecursionError:
        raise WebConfigError(f"the web config {path} is nested too deeply") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise WebConfigError(f"the web config {path}{where} is not valid YAML") from None
    if document is None:
        return WebConfig()
    where = str(path)
    top = _mapping(document, where)
    _known_keys(top, _TOP_KEYS, where)
    config = WebConfig()
    if top.get("tls_server_config") is not None:
        config.tls = _tls_context(
            _mapping(top["tls_server_config"], f"{where}: tls_server_config"), path.parent, where
        )
    if top.get("http_server_config") is not None:
        http = _mapping(top["http_server_config"], f"{where}: http_server_config")
        _known_keys(http, _HTTP_KEYS, f"{where}: http_server_config")
        if http.get("http2"):
            raise WebConfigError(
                f"{where}: http_server_config.http2 is not supported (HTTP/1.1 only)"
            )
        headers = _mapping(http.get("headers") or {}, f"{where}: http_server_config.headers")
        config.headers = {
            _config_text(k, f"{where}: http_server_config.headers"): _config_text(
                v, f"{where}: http_server_config.headers.{k}"
            )
            for k, v in headers.items()
        }
    if top.get("basic_auth_users") is not None:
        users = _mapping(top["basic_auth_users"], f"{where}: basic_auth_users")
        checked = {}
        for user, hashed in users.items():
            if not isinstance(hashed, str):
                raise WebConfigError(f"{where}: basic_auth_users.{user} is not a bcrypt hash")
            raw = hashed.encode()
            if not raw.startswith((b"$2a$", b"$2b$", b"$2y$")) or len(raw) != 60:
                raise WebConfigError(f"{where}: basic_auth_users.{user} is not a bcrypt hash")
            checked[_config_text(user, f"{where}: basic_auth_users")] = raw
        config.users = checked
    return config


def _config_text(value: Any, where: str) -> str:
    """A setting that must be a string (or a plain number): never str() of a
    list or mapping, which YAML aliases can make exponentially large."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise WebConfigError(f"{where} must be a string")
    return str(value)


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise WebConfigError(f"{where} must be a mapping")
    return value


def _known_keys(section: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(str(key) for key in set(section) - known)  # keys may be null or numbers
    if unknown:
        raise WebConfigError(f"{where}: {', '.join(unknown)} not supported by mtrace-live")


def _tls_context(tls: Mapping[str, Any], base: Path, where: str) -> ssl.SSLContext:
    where = f"{where}: tls_server_config"
    _known_keys(tls, _TLS_KEYS, where)
    if not tls.get("cert_file") or not tls.get("key_file"):
        raise WebConfigError(f"{where} needs both cert_file and key_file")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = _tls_version(tls.get("min_version", "TLS12"), f"{where}.min_version")
    if "max_version" in tls:
        context.maximum_version = _tls_version(tls["max_version"], f"{where}.max_version")
    cert = base / _config_text(tls["cert_file"], f"{where}.cert_file")
    key = base / _config_text(tls["key_file"], f"{where}.key_file")
    for name, file in (("cert_file", cert), ("key_file", key)):
        _readable_file(file, f"{where}.{name}")
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise WebConfigError(
            f"{where}: {cert} and {key} are not a usable certificate and key "
            f"({exc.__class__.__name__}: {exc})"
        ) from None
    auth = _config_text(tls.get("client_auth_type", "NoClientCert"), f"{where}.client_auth_type")
    if auth not in CLIENT_AUTH:
        raise WebConfigError(
            f"{where}.client_auth_type {auth} is not one of {', '.join(CLIENT_AUTH)}"
        )
    context.verify_mode = CLIENT_AUTH[auth]
    if auth != "NoClientCert":
        if not tls.get("client_ca_file"):
            raise WebConfigError(f"{where}.client_auth_type {auth} needs client_ca_file")
        ca = base / _config_text(tls["client_ca_file"], f"{where}.client_ca_file")
        _readable_file(ca, f"{where}.client_ca_file")
        try:
            context.load_verify_locations(ca)
        except OSError as exc:
            raise WebConfigError(
                f"{where}.client_ca_file: cannot read {ca}: {exc.strerror}"
            ) from None
        except ssl.SSLError as exc:
            raise WebConfigError(f"{where}.client_ca_file {ca}: {exc}") from None
    return context


def _readable_file(path: Path, where: str) -> None:
    """A regular file this process can open: never a device or a FIFO,
    which OpenSSL would read forever."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # stat first: opening a FIFO blocks
            raise WebConfigError(f"{where}: {path} is not a regular file")
        path.open("rb").close()
    except OSError as exc:
        raise WebConfigError(f"{where}: cannot read {path}: {exc.strerror}") from None


def _tls_version(value: Any, where: str) -> ssl.TLSVersion:
    version = TLS_VERSIONS.get(_config_text(value, where))
    if version is None:
        raise WebConfigError(f"{where} {value} is not one of {', '.join(TLS_VERSIONS)}")
    return version


def parse_address(address: str) -> tuple[str, int]:
    """host:port, [v6]:port or :port (every address, as the Go exporters read it:
    an IPv6 host needs its brackets, and only around the whole host)."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not re.fullmatch(r"[0-9]{1,5}", port_text) or int(port_text) > 65535:
        raise ListenError(f"listen address {address!r} is not host:port")
    if host.startswith("["):
        if not host.endswith("]") or ":" not in host[1:-1]:
            raise ListenError(f"listen address {address!r} is not host:port or [ipv6]:port")
        host = host[1:-1]
    elif "[" in host or "]" in host or ":" in host:
        raise ListenError(f"listen address {address!r} is not host:port or [ipv6]:port")
    if "[" in host or "]" in host:
        raise ListenError(f"listen address {address!r} is not host:port or [ipv6]:port")
    if host:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if host != "localhost":
                raise ListenError(
                    f"listen address {address!r}: {host} is not an IP address"
                ) from None
    return host, int(port_text)


@dataclass
class _Connection:
    sock: socket.socket  # the TLS socket once wrapped
    accepted: float
    deadline: float
    answering: bool = False  # a whole request was read and is being answered


class _Server(socketserver.ThreadingMixIn, HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False

    def __init__(self, address: tuple[str, int], family: int, app: MetricsEndpoint) -> None:
        self.address_family = family
        self.app = app
        self.connections: dict[int, _Connection] = {}  # by thread-independent key: id(request)
        self.lock = threading.Lock()
        self.closing = threading.Event()
        super().__init__(address, _Handler, bind_and_activate=True)
        # Started with the serving (MetricsEndpoint.start), in the process
        # that serves: a thread does not cross a fork.
        self.reaper = threading.Thread(target=self._reap, name="metrics-reaper", daemon=True)

    def process_request(self, request: Any, client_address: Any) -> None:
        now = time.monotonic()
        with self.lock:
            if len(self.connections) >= MAX_CONNECTIONS and not self._evict_one():
                refused = True
            else:
                refused = False
                self.connections[id(request)] = _Connection(request, now, now + REQUEST_DEADLINE_S)
        if refused:
            if self.app.config.tls is None:  # never plain text on a TLS port
                with contextlib.suppress(OSError):
                    request.sendall(_BUSY)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread for it (the server then closes the socket)
            with self.lock:
                self.connections.pop(id(request), None)
            raise

    def _evict_one(self) -> bool:
        """Close the oldest connection still sending its request (lock held)."""
        waiting = [c for c in self.connections.values() if not c.answering]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c.accepted)
        _cut(oldest.sock)
        oldest.answering = True  # cut: not chosen again while its thread winds down
        return True

    def _reap(self) -> None:
        """Cut every connection past its deadline, a few times a second."""
        while not self.closing.wait(_REAP_INTERVAL_S):
            now = time.monotonic()
            with self.lock:
                late = [c for c in self.connections.values() if c.deadline <= now]
                for connection in late:
                    connection.deadline = float("inf")  # cut once
                    _cut(connection.sock)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        key = id(request)
        try:
            request.settimeout(CONNECTION_TIMEOUT_S)
            # Headers and body go out in two writes: without this, Nagle's
            # algorithm holds the body until the client's delayed ACK (40 ms).
            with contextlib.suppress(OSError):
                request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.app.config.tls is not None:
                try:  # the handshake runs here, on the connection's own thread
                    wrapped = self.app.config.tls.wrap_socket(request, server_side=True)
                except (ssl.SSLError, OSError):
                    self.shutdown_request(request)
                    return
                with self.lock:
                    connection = self.connections.get(key)
                    if connection is not None:
                        connection.sock = wrapped
                request = wrapped
            super().process_request_thread(request, client_address)
        finally:
            with self.lock:
                self.connections.pop(key, None)

    def answering(self, request: Any, answering: bool) -> None:
        """A request was read (True), or its reply went out (False: the
        deadline starts again for the next request on this connection)."""
        with self.lock:
            for connection in self.connections.values():
                if connection.sock is request:
                    connection.answering = answering
                    if not answering:
                        connection.deadline = time.monotonic() + REQUEST_DEADLINE_S
                    break

    def hold(self, request: Any, seconds: float) -> None:
        """The request being answered on ``request`` may take ``seconds``
        more (a delta profile): its deadline moves on by that much."""
        with self.lock:
            for connection in self.connections.values():
                if connection.sock is request:
                    connection.deadline = time.monotonic() + seconds + REQUEST_DEADLINE_S
                    break

    def server_close(self) -> None:
        self.closing.set()
        super().server_close()
        with self.lock:
            for connection in self.connections.values():
                _cut(connection.sock)

    def handle_error(self, request: Any, client_address: Any) -> None:
        self.app.errors += 1  # a broken connection; never a traceback


def _cut(sock: socket.socket) -> None:
    """Shut a connection down from another thread: its blocked read returns."""
    with contextlib.suppress(OSError):
        # The plain socket's shutdown, also for a TLS socket (whose own
        # shutdown would drop its TLS state under the thread still using it).
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "mtrace-live"
    sys_version = ""
    timeout = CONNECTION_TIMEOUT_S

    def do_GET(self) -> None:
        self.server.answering(self.connection, True)
        try:
            self._get()
        finally:
            self.server.answering(self.connection, False)

    def do_POST(self) -> None:
        """POST is taken at SYMBOL_PATH only, where go tool pprof sends the
        addresses it found unnamed (its body, at most MAX_POST_BYTES, is read
        and answered there); anywhere else it is a 405."""
        if self.path.partition("?")[0] != SYMBOL_PATH:
            self._reply(405, b"")
            return
        length = self.headers.get("Content-Length") or ""
        if not length.isdigit() or int(length) > MAX_POST_BYTES:
            self.close_connection = True
            self._reply(411 if not length.isdigit() else 413, b"")
            return
        self.server.answering(self.connection, True)
        try:
            self.rfile.read(int(length))
            self._get("POST")
        finally:
            self.server.answering(self.connection, False)

    def _get(self, method: str = "GET") -> None:
        app = self.server.app
        # The query goes to the profiles only: client_python filters
        # /metrics by name[] through the collectors' descriptions, and
        # mtrace-live's collector has none (it reads the maps only when
        # collected), so a filter would give nothing where the whole page is
        # wanted.
        path, _, query = self.path.partition("?")
        environ = {
            "REQUEST_METHOD": method,
            "PATH_INFO": path,
            "QUERY_STRING": query if path.startswith(PROFILES_PATH) else "",
            "mtrace.hold": lambda seconds: self.server.hold(self.connection, seconds),
            **{
                f"HTTP_{name.upper().replace('-', '_')}": value
                for name in ("Accept", "Accept-Encoding", "Authorization")
                if (value := self.headers.get(name)) is not None
            },
        }
        answer: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]]) -> None:
            answer[:] = [int(status.split(" ", 1)[0]), dict(headers)]

        try:
            body = b"".join(app.wsgi(environ, start_response))
        except Exception as exc:  # a failed scrape is reported, and tracing goes on
            app.errors += 1
            app.report(f"scrape of {path[:200]!r} failed: {exc.__class__.__name__}: {exc}")
            self._reply(500, f"answering {path[:200]!r} failed: {exc}\n".encode())
            return
        self._reply(answer[0], body, answer[1])

    def do_HEAD(self) -> None:
        self._reply(405, b"")

    do_PUT = do_DELETE = do_HEAD

    def _reply(self, code: int, body: bytes, headers: Mapping[str, str] | None = None) -> None:
        self.send_response(code)
        for name, value in {**self.server.app.config.headers, **(headers or {})}.items():
            self.send_header(name, value)
        if code == 405:
            self.send_header("Allow", "GET")
        if code >= 400 and self.path.startswith(PROFILES_PATH):
            # as Go's net/http/pprof marks its errors (serveError): go tool
            # pprof prints an error's body only where this header is
            self.send_header("X-Go-Pprof", "1")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # no access log on the tracer's stderr


_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
_LANDING = (
    b"<html><head><title>mtrace-live</title></head><body><h1>mtrace-live</h1>"
    b'<p><a href="/metrics">Metrics</a></p>'
    b'<p><a href="/debug/pprof/">Heap profiles</a></p></body></html>\n'
)
PROFILES_PATH = "/debug/pprof"
SYMBOL_PATH = PROFILES_PATH + "/symbol"
MAX_POST_BYTES = 1 << 20


class MetricsEndpoint:
    """Bound at construction (so that a busy port is an error at start),
    served from ``start()`` on a background thread."""

    def __init__(self, address: str, registry: CollectorRegistry, config: WebConfig) -> None:
        self.registry = registry
        self.config = config
        # Format negotiation (text or OpenMetrics) and gzip: client_python's
        # application, as its start_http_server serves it.
        self._metrics = make_wsgi_app(registry)
        self._profiles: Callable[[dict[str, Any], StartResponse], Iterable[bytes]] | None = None
        self.errors = 0
        self._render_lock = threading.Lock()
        self._verified: set[bytes] = set()
        self._last_report = 0.0
        host, port = parse_address(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        if not host:
            host, family = "::", socket.AF_INET6
        try:
            self._server = _Server((host, port), family, self)
        except OSError as exc:
            raise ListenError(f"cannot listen on {address}: {exc.strerror or exc}") from None
        self.port = self._server.server_address[1]
        self.scheme = "https" if config.tls is not None else "http"
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = str(self._server.server_address[0])
        shown = f"[{host}]" if ":" in host else host
        return f"{self.scheme}://{shown}:{self.port}/metrics"

    def serve_pages(self, app: Callable[[dict[str, Any], StartResponse], Iterable[bytes]]) -> None:
        """Serve /metrics from ``app`` (pages rendered elsewhere,
        exporters/exposition.py) instead of collecting the registry here."""
        self._metrics = app
        self._render_lock = contextlib.nullcontext()  # type: ignore[assignment]

    def serve_profiles(
        self, app: Callable[[dict[str, Any], StartResponse], Iterable[bytes]]
    ) -> None:
        """Serve /debug/pprof/... from ``app`` (exporters/profile_serving.py)."""
        self._profiles = app

    def start(self) -> None:
        self._server.reaper.start()
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics", daemon=True
        )
        self._thread.start()

    def serve_forever(self) -> None:
        """Serve on this thread until ``close`` is called from another."""
        self._server.reaper.start()
        self._thread = threading.current_thread()
        self._server.serve_forever()

    def close(self) -> None:
        if self._thread is not None:
            if self._thread is not threading.current_thread():
                self._server.shutdown()
            self._thread = None
        self._server.server_close()

    def release(self) -> None:
        """Close this process's copy of the listening socket (another
        process serves it)."""
        self._server.socket.close()

    def wsgi(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        """The endpoint as a WSGI application: basic auth in front of the
        routes, /metrics served by client_python's own application."""
        if not self.authorised(environ.get("HTTP_AUTHORIZATION")):
            start_response("401 Unauthorized", [("WWW-Authenticate", 'Basic realm="mtrace-live"')])
            return [b"Unauthorized\n"]
        path = environ["PATH_INFO"]
        if path == "/metrics":
            with self._render_lock:  # one collection at a time, however many scrapers
                return list(self._metrics(environ, start_response))
        if path == "/":
            start_response("200 OK", [("Content-Type", "text/html; charset=utf-8")])
            return [_LANDING]
        if path == PROFILES_PATH or path.startswith(PROFILES_PATH + "/"):
            if self._profiles is not None:
                return list(self._profiles(environ, start_response))
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [
                b"no heap profiles: the allocation functions are not traced "
                b"(--no-allocs or --no-libc)\n"
            ]
        start_response("404 Not Found", [])
        return [b"Not Found\n"]

    def authorised(self, header: str | None) -> bool:
        if not self.config.users:
            return True
        if not header or not header.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        hashed = self.config.users.get(user)
        key = hashlib.sha256(f"{user}\0{password}".encode()).digest()
        if hashed is not None and any(hmac.compare_digest(key, seen) for seen in self._verified):
            return True
        try:
            ok = bcrypt.checkpw(password.encode(), hashed or _DUMMY_HASH) and hashed is not None
        except ValueError:  # bcrypt 5 refuses passwords over 72 bytes: no such password
            return False
        if ok:
            self._verified.add(key)  # bcrypt costs ~50 ms: checked once per password
        return ok

    def report(self, line: str) -> None:
        """One line on stderr, at most every 10 s."""
        now = time.monotonic()
        if now - self._last_report >= 10.0:
            self._last_report = now
            print(f"mtrace-live: warning: {line}", file=sys.stderr, flush=True)
