"""The metrics page, rendered by the tracing process and served by a process
of its own.

A scrape must not wait for the tracing process: with the traced program on
every CPU and the event path full, the tracer's interpreter is busy decoding
events, and a scrape answered there waits its turn for the interpreter
(issue 20 measured 56 ms at the median, 105 ms at p99). So the page is split:

- the tracing process renders the page (``Renderer``, a thread of its own)
  every ``--read-interval`` while someone scrapes, and publishes each body
  in a shared mapping (``SharedPages``);
- the serving process (forked before anything is attached, tracer/loop/metrics_endpoint.py)
  answers every request from the last body published (``PublishedApp``):
  it copies bytes and never waits for the tracer, so its answer takes the
  same time whatever the tracing does.

A page is therefore at most ``--read-interval`` plus one render old while
scrapes come. After ``IDLE_S`` without a scrape the renderer rests; the
first scrape after that, finding an old page, wakes it and waits (at most
``FIRST_WAIT_S``) for a new one, so no scrape is answered with figures
older than the read interval when the tracer can render in time.

The shared mapping holds, for each format (text 0.0.4 and OpenMetrics),
two slots, each under a sequence number that is odd while the slot is
written (a seqlock): the writer fills the slot not being served, then
names it the current one; a reader copies the current slot and takes the
copy only if its sequence number did not move meanwhile. Neither side ever
blocks the other. OpenMetrics is rendered only while it is asked for.
"""

from __future__ import annotations

import contextlib
import gzip
import mmap
import os
import select
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, openmetrics
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.openmetrics import exposition as openmetrics_exposition
from prometheus_client.registry import Collector

from .profile_serving import ProfileChannel, ProfilesApp

TEXT, OPENMETRICS = 0, 1
FORMATS = (TEXT, OPENMETRICS)
CONTENT_TYPES = {
    TEXT: "text/plain; version=0.0.4; charset=utf-8",
    OPENMETRICS: openmetrics.exposition.CONTENT_TYPE_LATEST,
}
SLOT_BYTES = 8 << 20  # one page at most: far above what the label caps allow
IDLE_S = 120.0  # no scrape for this long: the renderer rests
FIRST_WAIT_S = 2.0  # a scrape that finds an old page waits this long for a new one at most
SERVER_NICE = -10  # the serving process's priority, set while it is root
STALE_SLACK_S = 1.0  # a page older than the read interval by this much is old

_CONTROL = struct.Struct("=dd")  # monotonic time of the last scrape, of the last OpenMetrics one
_CHANNEL = struct.Struct("=Q")  # the generation published: its slot is generation % 2
_SLOT = struct.Struct("=QQQd")  # sequence (odd while written), length, HTTP status, built at
_PAGE = 4096


@dataclass(frozen=True)
class Page:
    status: int  # 200, or 500 with the reason as the body
    body: bytes
    built: float  # time.monotonic() of the render
    generation: int  # pages published in this format so far


class SharedPages:
    """Pages in memory shared by the tracing process and the serving one
    (an anonymous shared mapping, made before the fork)."""

    def __init__(self, slot_bytes: int = SLOT_BYTES) -> None:
        self.slot_bytes = slot_bytes
        self._slot_stride = _PAGE + slot_bytes
        self._channel_stride = _PAGE + 2 * self._slot_stride
        size = _PAGE + len(FORMATS) * self._channel_stride
        # Only the pages written are ever backed by memory.
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_SHARED)
        self._poke_read, self._poke_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    # ---- layout -------------------------------------------------------------
    def _channel(self, fmt: int) -> int:
        return _PAGE + fmt * self._channel_stride

    def _slot(self, fmt: int, slot: int) -> int:
        return self._channel(fmt) + _PAGE + slot * self._slot_stride

    # ---- the tracing process's side ------------------------------------------
    def publish(self, fmt: int, body: bytes, status: int = 200) -> None:
        """The new page of ``fmt``: one that does not fit becomes an error page."""
        if len(body) > self.slot_bytes:
            body = (f"the metrics page is {len(body)} bytes, over the {self.slot_bytes} the "
                    "server holds: lower --max-processes, --top-functions or --top-stacks\n"
                    ).encode()  # fmt: skip
            status = 500
        (generation,) = _CHANNEL.unpack_from(self._map, self._channel(fmt))
        at = self._slot(fmt, (generation + 1) % 2)  # never the slot being served
        sequence = _SLOT.unpack_from(self._map, at)[0]
        _SLOT.pack_into(self._map, at, sequence + 1, 0, 0, 0.0)  # odd: being written
        self._map[at + _PAGE : at + _PAGE + len(body)] = body
        _SLOT.pack_into(self._map, at, sequence + 2, len(body), status, time.monotonic())
        _CHANNEL.pack_into(self._map, self._channel(fmt), generation + 1)

    def scrapes(self) -> tuple[float, float]:
        """When the last scrape came, and the last that asked for OpenMetrics."""
        return _CONTROL.unpack_from(self._map, 0)

    def poke_fd(self) -> int:
        """Readable when a scrape found the page old."""
        return self._poke_read

    def drain_pokes(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._poke_read, 4096):
                pass

    # ---- the serving process's side ------------------------------------------
    def latest(self, fmt: int) -> Page | None:
        """The current page of ``fmt``, or None if none was published."""
        for _ in range(1000):
            (generation,) = _CHANNEL.unpack_from(self._map, self._channel(fmt))
            if generation == 0:
                return None
            at = self._slot(fmt, generation % 2)
            sequence, length, status, built = _SLOT.unpack_from(self._map, at)
            if sequence % 2:
                continue  # two pages were published meanwhile: read the newest
            body = self._map[at + _PAGE : at + _PAGE + length]
            if _SLOT.unpack_from(self._map, at)[0] == sequence:
                return Page(status, body, built, generation)
        return None

    def note_scrape(self, fmt: int) -> None:
        now = time.monotonic()
        _last, openmetrics_at = _CONTROL.unpack_from(self._map, 0)
        _CONTROL.pack_into(self._map, 0, now, now if fmt == OPENMETRICS else openmetrics_at)

    def poke(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._poke_write, b"!")


class _Collected(Collector):
    """One collection of a registry, rendered in more than one format, with
    the page's own time and the previous render's duration."""

    def __init__(self, registry: CollectorRegistry, previous_s: float) -> None:
        started = time.time()
        self.families: list[Metric] = list(registry.collect())
        rendered = GaugeMetricFamily(
            "mtrace_metrics_rendered_time_seconds",
            "Unix time this page's figures were read: a scrape is served the last page rendered.",
        )
        rendered.add_metric([], started)
        duration = GaugeMetricFamily(
            "mtrace_metrics_render_duration_seconds",
            "How long the previous page took to read and render, in the tracing process.",
        )
        duration.add_metric([], previous_s)
        self.families += [rendered, duration]

    def collect(self) -> Iterable[Metric]:
        return self.families


class Renderer:
    """The tracing process's side: renders the registry into the shared
    pages every ``interval`` while scrapes come, on a thread of its own."""

    def __init__(
        self,
        registry: CollectorRegistry,
        pages: SharedPages,
        interval: float,
        report: Callable[[str], None],
    ) -> None:
        self.registry = registry
        self.pages = pages
        self.interval = interval
        self.report = report
        self.renders = 0
        self.last_duration = 0.0
        self._stop_read, self._stop_write = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="metrics-render", daemon=True)

    def start(self) -> None:
        self.render()  # the first scrape has a page, whenever it comes
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            os.write(self._stop_write, b"!")
            self._thread.join(timeout=5)
        for fd in (self._stop_read, self._stop_write):
            with contextlib.suppress(OSError):
                os.close(fd)

    def render(self) -> None:
        """Collect once; publish the text page, and OpenMetrics if asked for lately."""
        _, openmetrics_at = self.pages.scrapes()
        formats = [TEXT]
        if openmetrics_at and time.monotonic() - openmetrics_at < IDLE_S:
            formats.append(OPENMETRICS)
        started = time.monotonic()
        try:
            collected = _Collected(self.registry, self.last_duration)
            bodies = {TEXT: generate_latest(collected)}
            if OPENMETRICS in formats:
                bodies[OPENMETRICS] = openmetrics_exposition.generate_latest(collected)  # type: ignore[no-untyped-call]
        except Exception as exc:  # a failed collection is the scrape's error, not the trace's
            reason = f"collecting the metrics failed: {exc.__class__.__name__}: {exc}"
            self.report(reason)
            for fmt in formats:
                self.pages.publish(fmt, f"{reason}\n".encode(), 500)
            return
        for fmt, body in bodies.items():
            self.pages.publish(fmt, body)
        self.renders += 1
        self.last_duration = time.monotonic() - started

    def _run(self) -> None:
        poke = self.pages.poke_fd()
        while True:
            last, _ = self.pages.scrapes()
            active = bool(last) and time.monotonic() - last < IDLE_S
            ready, _, _ = select.select([poke, self._stop_read], [], [],
                                        self.interval if active else IDLE_S)  # fmt: skip
            if self._stop_read in ready:
                return
            if poke in ready:
                self.pages.drain_pokes()
            if ready or active:
                self.render()


class PublishedApp:
    """The serving process's side: /metrics from the last page published,
    in the format the Accept header asks for, gzipped if accepted."""

    def __init__(self, pages: SharedPages, interval: float) -> None:
        self.pages = pages
        self.stale_s = interval + STALE_SLACK_S
        self._gzipped: dict[tuple[int, int], bytes] = {}
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        _, content_type = choose_encoder(environ.get("HTTP_ACCEPT") or "")
        fmt = OPENMETRICS if content_type.startswith("application/openmetrics-text") else TEXT
        self.pages.note_scrape(fmt)
        page = self._fresh(fmt)
        if page is None and fmt == OPENMETRICS:  # not rendered yet: text is what any scraper takes
            fmt, page = TEXT, self._fresh(TEXT)
        if page is None:
            start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"the metrics are not rendered yet\n"]
        if page.status != 200:
            start_response(f"{page.status} Internal Server Error", [("Content-Type", "text/plain")])
            return [page.body]
        headers = [("Content-Type", CONTENT_TYPES[fmt])]
        body = page.body
        if gzip_accepted(environ.get("HTTP_ACCEPT_ENCODING") or ""):
            body = self._gzip(fmt, page)
            headers.append(("Content-Encoding", "gzip"))
        start_response("200 OK", headers)
        return [body]

    def _fresh(self, fmt: int) -> Page | None:
        """The current page; one that is old (the renderer rested) is
        renewed first, waiting for it at most FIRST_WAIT_S."""
        page = self.pages.latest(fmt)
        if page is not None and time.monotonic() - page.built <= self.stale_s:
            return page
        self.pages.poke()
        deadline = time.monotonic() + FIRST_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.002)
            newer = self.pages.latest(fmt)
            if newer is not None and (page is None or newer.generation != page.generation):
                return newer
        return self.pages.latest(fmt)

    def _gzip(self, fmt: int, page: Page) -> bytes:
        """Each page compressed once, however many scrapes take it."""
        key = (fmt, page.generation)
        with self._lock:
            body = self._gzipped.get(key)
            if body is None:
                body = gzip.compress(page.body, compresslevel=6)
                self._gzipped = {key: body, **{k: v for k, v in self._gzipped.items()
                                               if k[0] != fmt}}  # fmt: skip
            return body


class ServingProcess:
    """The endpoint served by a process of its own, forked from the tracer
    before anything is attached (so that it holds no BPF object, and no
    thread is running to be lost in the fork).

    The child answers from ``pages`` until the tracer closes its end of a
    pipe (or dies: the kernel sends the child SIGKILL then too). It ignores
    SIGINT, so a Ctrl-C on the terminal stops the tracer, which then stops
    the child after its last page.
    """

    def __init__(self, endpoint: Any, pages: SharedPages, interval: float,
                 channel: ProfileChannel | None = None) -> None:  # fmt: skip
        self.endpoint = endpoint
        self.channel = channel
        self.pages = pages
        self.interval = interval
        self.pid = 0
        self._lifeline = -1

    def start(self, prepare: Callable[[], None]) -> None:
        """Fork the server; ``prepare`` runs first in the child (giving up
        root there)."""
        lifeline_read, lifeline_write = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:  # the child never returns into the tracer's code
            code = 1
            try:
                os.close(lifeline_write)
                code = self._serve(prepare, lifeline_read)
            finally:
                os._exit(code)
        os.close(lifeline_read)
        if self.channel is not None:
            self.channel.tracing_side()
        self.pid, self._lifeline = pid, lifeline_write
        self.endpoint.release()

    def _serve(self, prepare: Callable[[], None], lifeline: int) -> int:
        import ctypes
        import gc
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # A client that hangs up mid-reply is an error on its connection
        # (EPIPE), never the server's death, whatever the tracer chose for
        # its own standard output.
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with contextlib.suppress(OSError, AttributeError):  # PR_SET_PDEATHSIG, SIGKILL
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))
        if os.getppid() == 1:
            return 0
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        gc.freeze()  # the tracer's objects: never collected here, never copied by a collection
        # Ahead of the traced program's threads when they fill every CPU: a
        # scrape takes a fraction of a millisecond of CPU. Root only (as
        # serve starts); otherwise it runs at the tracer's own priority.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, SERVER_NICE)
        prepare()
        self.endpoint.serve_pages(PublishedApp(self.pages, self.interval))
        if self.channel is not None:
            self.channel.serving_side()
            self.endpoint.serve_profiles(ProfilesApp(self.channel.ask))

        def watch() -> None:
            with contextlib.suppress(OSError):
                os.read(lifeline, 1)  # EOF: the tracer is done
            self.endpoint.close()

        threading.Thread(target=watch, name="metrics-lifeline", daemon=True).start()
        self.endpoint.serve_forever()
        return 0

    def alive(self) -> bool:
        if not self.pid:
            return False
        with contextlib.suppress(ChildProcessError):
            return os.waitpid(self.pid, os.WNOHANG) == (0, 0)
        return False

    def close(self) -> None:
        """Stop the child and reap it."""
        if self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1
        if not self.pid:
            return
        deadline = time.monotonic() + 2.0
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    os.kill(self.pid, 9)
                    os.waitpid(self.pid, 0)
                    break
                time.sleep(0.01)
        self.pid = 0
