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

from .data.alloc_snapshot import AllocSnapshot, FrameNames, kind_name, unknown_free_origins
from .data.allocator_state import Allocators
from .data.lock_waits import LockWaits
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
        if self.as_json:
            tables = list(arena_table_json(result.model))
            if result.lock_waits is not None:
                tables += lock_table_json(result.lock_waits, result.frame_names)
            if result.allocations is not None:
                tables += stack_table_json(result.allocations, result.frame_names)
            with signals_held():
                for line in tables:
                    self.stream.write(line + "\n")
                self.stream.flush()
        print_summary(result, sys.stderr)


def _json(doc: dict[str, object]) -> str:
    return json.dumps(doc, separators=(",", ":"))


def arena_table_json(model: Allocators) -> Iterator[str]:
    """One object per arena seen ({"table": "arenas", ...}), with its
    process's arena limit."""
    with model.lock:
        states = sorted(model.processes.values(), key=lambda state: state.pid)
        for state in states:
            for arena in sorted(state.arenas.values(), key=lambda a: (not a.main, a.address)):
                yield _json({"table": "arenas", "pid": state.pid, "address": hex(arena.address),
                             "main": arena.main, "found_at_attach": arena.found_at_attach,
                             "attached_threads": arena.attached_threads,
                             "system_mem": arena.system_mem,
                             "heaps": [[hex(heap), size] for heap, size in arena.heaps],
                             "created": arena.created_ns is not None,
                             "lock_waits_counted": state.arena_lock_waits(arena),
                             "arena_limit": state.arena_limit,
                             "arena_limit_source": state.arena_limit_source or None})  # fmt: skip


def lock_table_json(waits: LockWaits, names: FrameNames) -> Iterator[str]:
    """The lock waits in time at the end of ``-o json``: one object per
    process's threads' time ({"table": "thread_time", ...}), per (process,
    lock) ({"table": "lock_waits", ...}, with the histogram's buckets by
    their bound in ns) and per (process, lock, stack) ({"table": "lock_stacks", ...})."""
    for time in waits.threads.values():
        yield _json({"table": "thread_time", "pid": time.pid, "wall_ns": time.wall_ns,
                     "thread_ns": time.thread_ns, "threads": time.threads, "live": time.live,
                     "arena_wait_ns": waits.of(time.pid).total_ns,
                     "arena_wait_share": waits.share(time.pid)})  # fmt: skip
    for row in waits.rows:
        hist = {str(1 << bucket): n for bucket, n in enumerate(row.times.hist) if n}
        yield _json({"table": "lock_waits", "pid": row.pid, "futex": hex(row.futex),
                     "lock": row.kind, "waits": row.times.count, "total_ns": row.times.total_ns,
                     "max_ns": row.times.max_ns, "histogram_le_ns": hist})  # fmt: skip
    for stack in waits.stacks:
        yield _json({"table": "lock_stacks", "pid": stack.pid, "futex": hex(stack.futex),
                     "lock": stack.kind, "waits": stack.times.count,
                     "total_ns": stack.times.total_ns, "max_ns": stack.times.max_ns,
                     "frames": [names.frame(stack.pid, a) for a in stack.frames]})  # fmt: skip
    yield _json({"table": "lock_misc", "function": waits.function, **dict(waits.misc)})


def stack_table_json(snapshot: AllocSnapshot, names: FrameNames) -> Iterator[str]:
    """The tables at the end of ``-o json``: one object per process
    ({"table": "alloc_processes", ...}), one of the calls of each function
    ({"table": "alloc_functions", ...}: every hit, nested ones included),
    one of the stack walks' counts ({"table": "stack_walks", ...}) when they
    are unwound by CFI, then one per stack ({"table": "alloc_stacks", ...}),
    each frame named."""
    called = snapshot.by_provider()
    for proc in snapshot.processes:
        providers = [{"allocator": name, "allocator_lib": lib, "calls": calls, "bytes": nbytes}
                     for name, lib, calls, nbytes in called.get(proc.tgid, [])]  # fmt: skip
        yield json.dumps({"table": "alloc_processes", "pid": proc.tgid, "calls": proc.calls,
                          "bytes": proc.bytes, "frees": proc.frees,
                          "unknown_frees": proc.unknown_frees,
                          "unknown_frees_of": list(unknown_free_origins(proc, snapshot)),
                          "untracked": proc.untracked, "failed": proc.failed,
                          "allocator": proc.allocator or None,
                          "allocator_lib": proc.allocator_lib or None,
                          "providers": providers,
                          "syscalls": dict(snapshot.vm.get(proc.tgid, {}))},
                         separators=(",", ":"))  # fmt: skip
    yield json.dumps({"table": "alloc_functions", "calls": dict(snapshot.calls),
                      **dict(snapshot.misc)}, separators=(",", ":"))  # fmt: skip
    if snapshot.unwind:  # how the stacks were walked: by CFI, whole or cut and why
        yield json.dumps({"table": "stack_walks", "by": "cfi", **dict(snapshot.unwind)},
                         separators=(",", ":"))  # fmt: skip
    for row in sorted(snapshot.stacks, key=lambda r: (-r.live_bytes, -r.bytes)):
        frames = []
        for address in row.frames:
            symbol = names.resolve(row.tgid, address)
            frames.append({
                "kind": kind_name(address, symbol),
                "address": hex(address),
                "function": symbol.function if symbol else None,
                "offset": symbol.offset if symbol and symbol.function else None,
                "location": symbol.location if symbol else None,
                "module": symbol.module if symbol else None,
            })  # fmt: skip
        yield json.dumps(
            {"table": "alloc_stacks", "pid": row.tgid, "allocator": row.function,
             "provider": row.provider or None, "provider_lib": row.provider_lib or None,
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
