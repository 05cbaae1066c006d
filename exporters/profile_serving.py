"""The heap profiles' endpoints: ``/debug/pprof/`` (an index, as Go's),
``/debug/pprof/heap`` and ``/debug/pprof/allocs`` on the metrics listener,
behind the same TLS and basic auth.

The serving process (exporters/exposition.py) holds no BPF table, so it
asks the tracing process for each profile over a socket pair made before
the fork (``ProfileChannel``): one request at a time, each a frame with an
id, so that an answer that came too late is told from the next one's. The
tracing process answers on a thread of its own (``answer_forever``,
exporters/heap_profiles.py's ``HeapProfiles``); the metrics pages go on
being rendered and served meanwhile.

Each ask ends within ``ASK_TIMEOUT_S`` (30 s), its wait behind other
requests included, in the answer or a 503 that says why. A whole profile's
connection deadline is moved on to cover one ask; a delta profile
(``?seconds=N``) asks twice, N seconds apart, holding no lock while it
waits, and its deadline covers N seconds and both asks. So every profile
request ends in a complete reply, never a cut connection.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Any

from .heap_profiles import PREFIX, PROFILES, QueryError, parse_query

ASK_TIMEOUT_S = 30.0  # the tracing process's answer to one request, at most
Answer = tuple[int, bytes]
_FRAME = struct.Struct("=QIQ")  # request id, status (0 in a request), body length
_MAX_BODY = 1 << 30
INDEX = b"""<html><head><title>/debug/pprof/</title></head><body>
<h1>/debug/pprof/</h1>
<p>Profiles of the processes mtrace-live traces (read them with go tool pprof):</p>
<table>
<tr><td><a href="heap">heap</a></td><td>allocations by call stack: live now (inuse_space,
the default; inuse_objects) and since the trace began (alloc_space, alloc_objects).
?seconds=N: the change over N seconds.</td></tr>
<tr><td><a href="allocs">allocs</a></td><td>the same profile, alloc_space by default.</td></tr>
</table>
<p>?pid=N, ?comm=NAME and ?cgroup=/PATH select processes; samples are labelled pid, comm,
cgroup and container. ?max_samples=N bounds the samples (16000 by default; 0: none), each
process's other stacks summed into one.</p>
</body></html>
"""


class ChannelBroken(OSError):
    pass


def _send(sock: socket.socket, ident: int, status: int, body: bytes) -> None:
    sock.sendall(_FRAME.pack(ident, status, len(body)) + body)


def _read_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise ChannelBroken("the other end closed the channel")
        data += chunk
    return bytes(data)


def _receive(sock: socket.socket) -> tuple[int, int, bytes]:
    ident, status, length = _FRAME.unpack(_read_exactly(sock, _FRAME.size))
    if length > _MAX_BODY:
        raise ChannelBroken(f"a frame of {length} bytes")
    return ident, status, _read_exactly(sock, length)


class ProfileChannel:
    """A socket pair between the serving process (``ask``) and the tracing
    process (``answer_forever``), made before the fork; each side closes the
    other's end after it (``serving_side``, ``tracing_side``)."""

    def __init__(self) -> None:
        self._tracing, self._serving = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._lock = threading.Lock()
        self._asked = 0
        self._broken = False

    def serving_side(self) -> None:
        self._tracing.close()

    def tracing_side(self) -> None:
        self._serving.close()

    def ask(self, request: Mapping[str, Any]) -> Answer:
        """The tracing process's answer, or a 503 when it gives none within
        ASK_TIMEOUT_S, the wait for the requests before it included."""
        deadline = time.monotonic() + ASK_TIMEOUT_S
        if not self._lock.acquire(timeout=ASK_TIMEOUT_S):
            said = f"the tracing process did not answer in {ASK_TIMEOUT_S:.0f} s"
            return 503, f"{said} (behind another request)\n".encode()
        try:
            if self._broken:
                return 503, b"the tracing process no longer answers\n"
            self._asked += 1
            ident = self._asked
            try:
                _send(self._serving, ident, 0, json.dumps(request).encode())
                return self._answer_to(ident, deadline)
            except (OSError, ValueError):
                self._broken = True
                return 503, b"the tracing process no longer answers\n"
        finally:
            self._lock.release()

    def _answer_to(self, ident: int, deadline: float) -> Answer:
        """Answers to earlier requests, given up on, are read and dropped.
        A frame is waited for until ``deadline``, then read whole."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._serving], [], [], left)[0]:
                said = f"the tracing process did not answer in {ASK_TIMEOUT_S:.0f} s\n"
                return 503, said.encode()
            self._serving.settimeout(max(deadline - time.monotonic(), 1.0))  # a frame begun
            answered, status, body = _receive(self._serving)
            if answered == ident:
                return status, body

    def answer_forever(self, handle: Callable[[Mapping[str, Any]], Answer],
                       report: Callable[[str], None]) -> None:  # fmt: skip
        """Answer each request with ``handle`` until the serving process is
        gone (or ``close``); a failure is that request's 500."""
        with contextlib.suppress(OSError):
            while True:
                ident, _, body = _receive(self._tracing)
                try:
                    status, answer = handle(json.loads(body))
                except Exception as exc:  # one profile failed, not the trace
                    reason = f"building the profile failed: {exc.__class__.__name__}: {exc}"
                    report(reason)
                    status, answer = 500, f"{reason}\n".encode()
                _send(self._tracing, ident, status, answer)

    def close(self) -> None:
        for end in (self._tracing, self._serving):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()


class ProfilesApp:
    """The WSGI application of ``/debug/pprof/...``; ``ask`` reaches the
    tracing process. ``environ["mtrace.hold"]``, where the server gives it,
    moves the connection's deadline on by a number of seconds."""

    def __init__(self, ask: Callable[[Mapping[str, Any]], Answer]) -> None:
        self.ask = ask

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        path = environ["PATH_INFO"]
        if path in (PREFIX, PREFIX.rstrip("/")):
            start_response("200 OK", [("Content-Type", "text/html; charset=utf-8")])
            return [INDEX]
        name = path[len(PREFIX) :]
        if name == "symbol":
            return self._symbol(environ, start_response)
        if name not in PROFILES:
            served = ", ".join(PROFILES)
            return _text(start_response, 404, f"no profile {name!r} here (served: {served})")
        try:
            query = parse_query(name, environ.get("QUERY_STRING", ""))
        except QueryError as exc:
            return _text(start_response, 400, str(exc))
        request: dict[str, Any] = query.request()
        # The connection's deadline covers every wait (each ask ends by
        # ASK_TIMEOUT_S): the reply is a profile or a 503, never a cut.
        hold = environ.get("mtrace.hold")
        if hold is not None:
            hold(query.seconds + 2 * ASK_TIMEOUT_S if query.seconds else ASK_TIMEOUT_S)
        if query.seconds:
            status, token = self.ask({"op": "mark"})
            if status != 200:
                return _text(start_response, status, token.decode(errors="replace").strip())
            # the window from the first reading, as Go's (serveDeltaProfile
            # waits its seconds once the first profile is collected)
            time.sleep(query.seconds)
            request["since"] = token.decode()
        status, body = self.ask(request)
        if status != 200:
            return _text(start_response, status, body.decode(errors="replace").strip())
        start_response("200 OK", [("Content-Type", "application/octet-stream"),
                                  ("Content-Disposition", f'attachment; filename="{name}"'),
                                  ("X-Content-Type-Options", "nosniff")])  # fmt: skip
        return [body]

    @staticmethod
    def _symbol(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        """go tool pprof's symbol lookup (net/http/pprof's Symbol): a GET
        says how many symbols are known, a POST of addresses gets a line per
        address named. Every frame mtrace-live can name is named in the
        profile itself, and an address alone does not say its process, so
        none is known here; go tool pprof then shows the addresses as they
        are."""
        start_response("200 OK", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"num_symbols: 0\n" if environ.get("REQUEST_METHOD") != "POST" else b""]


def _text(start_response: Any, status: int, line: str) -> list[bytes]:
    start_response(f"{status} {HTTPStatus(status).phrase}",
                   [("Content-Type", "text/plain; charset=utf-8")])  # fmt: skip
    return [f"{line}\n".encode()]
