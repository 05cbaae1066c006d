"""Event lines on standard output: ``--output text`` (columns, as
bcc's trace prints them) and ``--output json`` (one JSON object a line)."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator
from typing import TextIO

from .data.sink import EventBatch, Sink, TraceInfo, TraceResult
from .summary import print_summary


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends. A write to a full pipe
    that a signal interrupts returns short, and Python 3.11's text layer then
    drops the rest of the batch (seen as megabytes of event lines missing
    after Ctrl-C); held, the signal only sets the stop flag once the batch is
    out."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class LineSink(Sink):
    """One line per event on stdout: text columns, or JSON objects."""

    def __init__(self, as_json: bool, stream: TextIO | None = None) -> None:
        self.as_json = as_json
        self.stream = stream or sys.stdout
        self.written = 0
        self._t0 = 0

    def start(self, info: TraceInfo) -> None:
        if not self.as_json:
            self.stream.write(f"{'TIME(s)':>12} {'PID':>7} {'TID':>7} {'CPU':>3} PROBE ARGS\n")
            self.stream.flush()

    def consume(self, batch: EventBatch) -> None:
        events = batch.events()
        if not events:
            return
        if not self._t0:
            self._t0 = events[0].ts_ns
        if self.as_json:
            lines = [event.as_json() for event in events]
        else:
            lines = [event.text(self._t0) for event in events]
        with signals_held():
            self.stream.write("\n".join(lines) + "\n")
            self.stream.flush()
        self.written += len(events)

    def finish(self, result: TraceResult) -> None:
        print_summary(result, sys.stderr)


class TextLines(LineSink):
    """``--output text``."""

    def __init__(self) -> None:
        super().__init__(as_json=False)


class JsonLines(LineSink):
    """``--output json``."""

    def __init__(self) -> None:
        super().__init__(as_json=True)
