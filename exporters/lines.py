"""Event lines on standard output: ``--output text`` (columns, as
bcc's trace prints them) and ``--output json`` (one JSON object a line:
each event, allocations and frees included, then the table of allocations
by stack when the trace ends)."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
from collections.abc import Iterator
from typing import TextIO

from .data.alloc_snapshot import AllocSnapshot, FrameNames
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
        if self.as_json and result.allocations is not None:
            with signals_held():
                for line in stack_table_json(result.allocations, result.frame_names):
                    self.stream.write(line + "\n")
                self.stream.flush()
        print_summary(result, sys.stderr)


def stack_table_json(snapshot: AllocSnapshot, names: FrameNames) -> Iterator[str]:
    """The tables at the end of ``-o json``: one object per process
    ({"table": "alloc_processes", ...}), one of the calls of each function
    ({"table": "alloc_functions", ...}: every hit, nested ones included),
    then one per stack ({"table": "alloc_stacks", ...}), each frame named."""
    for proc in snapshot.processes:
        yield json.dumps({"table": "alloc_processes", "pid": proc.tgid, "calls": proc.calls,
                          "bytes": proc.bytes, "frees": proc.frees,
                          "unknown_frees": proc.unknown_frees, "failed": proc.failed,
                          "syscalls": dict(snapshot.vm.get(proc.tgid, {}))},
                         separators=(",", ":"))  # fmt: skip
    yield json.dumps({"table": "alloc_functions", "calls": dict(snapshot.calls),
                      **dict(snapshot.misc)}, separators=(",", ":"))  # fmt: skip
    for row in sorted(snapshot.stacks, key=lambda r: (-r.live_bytes, -r.bytes)):
        frames = []
        for address in row.frames:
            symbol = names.resolve(row.tgid, address)
            frames.append({
                "address": hex(address),
                "function": symbol.function if symbol else None,
                "offset": symbol.offset if symbol and symbol.function else None,
                "location": symbol.location if symbol else None,
                "module": symbol.module if symbol else None,
            })  # fmt: skip
        yield json.dumps(
            {"table": "alloc_stacks", "pid": row.tgid, "allocator": row.function,
             "calls": row.objects, "bytes": row.bytes, "frees": round(row.frees * row.scale),
             "bytes_freed": row.bytes_freed, "live_objects": row.live_objects,
             "live_bytes": row.live_bytes, "sampled_calls": row.calls,
             "sample_bytes": snapshot.sample_bytes, "frames": frames},
            separators=(",", ":"),
        )  # fmt: skip


class TextLines(LineSink):
    """``--output text``."""

    def __init__(self) -> None:
        super().__init__(as_json=False)


class JsonLines(LineSink):
    """``--output json``."""

    def __init__(self) -> None:
        super().__init__(as_json=True)
