"""``mtrace-live count``: attach the counters, run or watch the target, report."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import target, usdt
from .counting import CountReport, HitCounter
from .launch import GatedCommand


@dataclass(frozen=True)
class CountRequest:
    pid: int | None
    command: list[str]
    lib: Path | None
    sdt_glibc: bool
    patterns: list[str]
    kmem: bool
    usdt: bool
    follow_forks: bool
    duration: float | None
    derived: bool = False
    debug_file: Path | None = None


class _Stopped(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is: the counts are reported."""


def _terminate(signum: int, frame: object) -> None:
    raise _Stopped


def run_count(request: CountRequest) -> CountReport:
    old = signal.signal(signal.SIGTERM, _terminate)
    try:
        if request.pid is not None:
            return _count_pid(request, request.pid)
        return _count_command(request)
    finally:
        signal.signal(signal.SIGTERM, old)


def _count_pid(request: CountRequest, pid: int) -> CountReport:
    target.require_process(pid)
    libc: Path | None = None  # kmem-only counting needs no libc at all
    if request.usdt:
        libc, _ = usdt.resolve_libc(pid, (), request.lib, sdt=False)
    counter = _counter(request, libc)
    try:
        counter.follow([pid])
        _announce(counter, pid)
        _watch(pid, request.duration)
        return counter.report(pid, exit_code=None)
    finally:
        counter.close()


def _count_command(request: CountRequest) -> CountReport:
    libc, argv = usdt.resolve_libc(None, request.command, request.lib, request.sdt_glibc)
    assert argv is not None
    child = GatedCommand(argv)
    try:
        counter = _counter(request, libc)
    except BaseException:
        child.abandon()
        raise
    try:
        counter.follow([child.pid])
        _announce(counter, child.pid)
        child.release()
        try:
            exit_code = child.wait()
        except KeyboardInterrupt as stop:  # passed on to the command
            child.interrupt(signal.SIGTERM if isinstance(stop, _Stopped) else signal.SIGINT)
            exit_code = child.wait()
        return counter.report(child.pid, exit_code)
    finally:
        counter.close()


def _announce(counter: HitCounter, pid: int) -> None:
    """Say that counting has begun, as bpftrace says "Attaching N probes"."""
    for note in counter.start_up_notes():
        print(f"mtrace-live: {note}", file=sys.stderr, flush=True)
    what = [f"{len(counter.probes)} libc probes"] if counter.probes else []
    if counter.kmem:
        what.append("the kmem tracepoints")
    print(
        f"mtrace-live: counting {' and '.join(what)} for pid {pid}; Ctrl-C to stop",
        file=sys.stderr,
        flush=True,
    )


def _counter(request: CountRequest, libc: Path | None) -> HitCounter:
    return HitCounter(
        libc if request.usdt else None, request.patterns, request.follow_forks, request.kmem,
        request.derived, request.debug_file,
    )  # fmt: skip


def _watch(pid: int, duration: float | None) -> None:
    """Return when the process exits, the duration passes, or on Ctrl-C."""
    deadline = None if duration is None else time.monotonic() + duration
    with contextlib.suppress(KeyboardInterrupt):
        while deadline is None or time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
