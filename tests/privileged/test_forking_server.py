"""A server that forks a process per connection, traced while it serves:
PostgreSQL 15 (Debian's, built without frame pointers) under ``pgbench -C``
(a new connection, so a new backend forked by the postmaster, for every
transaction), traced by ``--pid POSTMASTER --follow-forks`` and by
``serve --comm postgres``.

A forked backend has its parent's mappings, so the kernel gives it its
parent's unwind tables at its fork (unwind.bpf.c's ``unwind_fork``): its
stacks are whole from its first allocation, though user space writes its
own tables later, and it is named by its parent's maps if it is gone by then.
Checked: at least 95% of the backends' malloc calls have a stack that
reaches the frame that called ``main`` (``__libc_start_call_main``), read
from the trace's pprof profile by protobuf; their count equals bpftrace's in
the same run; the postmaster and every backend are never stopped (bpftrace
counts SIGSTOPs delivered to any postgres process, on any thread). Under
serve, which keeps no stack of a process gone, at least 95% of the walks
made during the load are complete (from /metrics)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from mtrace_live.tracer.processes.target import default_libc

from .conftest import MTRACE
from .test_serve import SERVE_READY, free_port
from .test_short_processes import rendered, scrape, walks
from .tracing import (
    BPFTRACE_READY,
    Reaper,
    interrupt_bpftrace,
    malloc_samples,
    start_bpftrace,
    wait_for_line,
    wait_until,
)

PG_BIN = Path("/usr/lib/postgresql/15/bin")
READY = "Ctrl-C to stop"
ABOVE_MAIN = "__libc_start_call_main"  # glibc's caller of main (named from libc6-dbg)


def as_postgres(*argv: str | Path, **kwargs: object) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["runuser", "-u", "postgres", "--", *map(str, argv)],
                          capture_output=True, **kwargs)  # type: ignore[call-overload]  # fmt: skip


@pytest.fixture
def postmaster() -> Iterator[tuple[int, Path]]:
    """A PostgreSQL cluster of its own, with pgbench's tables, autovacuum off
    (no worker is forked but for the load's connections): the postmaster's
    pid and the socket's directory (outside pytest's own, which only root
    may enter)."""
    assert (PG_BIN / "postgres").exists(), "make setup installs Debian's postgresql-15"
    home = Path(tempfile.mkdtemp(prefix="mtrace-live-pg-"))
    shutil.chown(home, "postgres")
    try:
        yield from _served(home)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _served(home: Path) -> Iterator[tuple[int, Path]]:
    done = as_postgres(PG_BIN / "initdb", "-D", home / "data", "-A", "trust", timeout=300)
    assert done.returncode == 0, done.stderr
    with Reaper() as reaper:
        server = reaper.add(subprocess.Popen(
            ["runuser", "-u", "postgres", "--", str(PG_BIN / "postgres"), "-D", str(home / "data"),
             "-k", str(home), "-c", "listen_addresses=", "-c", "autovacuum=off"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
        wait_until(lambda: as_postgres(PG_BIN / "pg_isready", "-h", home, "-q").returncode == 0,
                   "postgres up")  # fmt: skip
        init = as_postgres(PG_BIN / "pgbench", "-h", home, "-i", "-s", "1", "postgres", timeout=300)
        assert init.returncode == 0, init.stderr
        pid = int((home / "data" / "postmaster.pid").read_text().split()[0])
        yield pid, home
        as_postgres(PG_BIN / "pg_ctl", "-D", home / "data", "-m", "fast", "stop", timeout=120)
        server.wait(timeout=120)


def whole_by_pid(profile: Path) -> tuple[Counter[int], Counter[int]]:
    """Per process, its malloc calls (alloc_objects), and those whose stack
    reaches the frame that called main."""
    calls: Counter[int] = Counter()
    whole: Counter[int] = Counter()
    for pid, n, stack in malloc_samples(profile):
        calls[pid] += n
        if any(name.startswith(ABOVE_MAIN) for name in stack):
            whole[pid] += n
    return calls, whole


# bpftrace: malloc's calls per postgres process, and every SIGSTOP delivered
# to one (signal_deliver runs in the receiving thread, whichever it is).
WATCH = (
    'uprobe:{libc}:malloc /comm == "postgres"/ {{ @mallocs[pid] = count(); }}\n'
    'tracepoint:signal:signal_deliver /args->sig == 19 && comm == "postgres"/ '
    "{{ @sigstops = count(); }}\n"
)


def backends_left(postmaster: int, before: set[int]) -> list[int]:
    """The postmaster's children that were not there before the load."""
    left = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in before:
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rpartition(")")[2].split()[1]) == postmaster:
                    left.append(int(entry))
    return left


def watching(reaper: Reaper, pid: int, tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """bpftrace counting the server's mallocs and stops, ready."""
    bpftrace, counted = start_bpftrace(WATCH.format(libc=default_libc()), pid, tmp_path)
    reaper.add(bpftrace)
    wait_for_line(counted, BPFTRACE_READY, bpftrace, timeout=120)
    return bpftrace, counted


def connections(home: Path) -> subprocess.CompletedProcess[bytes]:
    """pgbench connecting anew for every transaction: 200 backends forked."""
    return as_postgres(PG_BIN / "pgbench", "-h", home, "-S", "-C", "-c", "4", "-t", "50",
                       "postgres", timeout=300)  # fmt: skip


def ended(bpftrace: subprocess.Popen[bytes], load: subprocess.CompletedProcess[bytes],
          err: Path) -> str:  # fmt: skip
    """bpftrace ended, the load and the tracer checked: the tracer's stderr."""
    interrupt_bpftrace(bpftrace)
    assert load.returncode == 0, load.stderr
    stderr = err.read_text()
    assert "Traceback" not in stderr and "error:" not in stderr, stderr
    return stderr


def bpftrace_maps(out: Path) -> tuple[dict[int, int], int]:
    mallocs: dict[int, int] = {}
    stops = 0
    for line in out.read_text(errors="replace").splitlines():
        record = json.loads(line) if line.startswith("{") else {}
        if record.get("type") != "map":
            continue
        data = record["data"]
        mallocs.update({int(k): int(v) for k, v in data.get("@mallocs", {}).items()})
        stops = int(data.get("@sigstops", stops))
    return mallocs, stops


def test_a_backend_forked_per_connection_is_unwound_whole_from_its_first_allocation(
    postmaster: tuple[int, Path], tmp_path: Path
) -> None:
    pid, home = postmaster
    before = {int(p) for p in os.listdir("/proc") if p.isdigit()}
    with Reaper() as reaper:
        # GIVEN bpftrace counting the server's mallocs and stops, then the tracer
        bpftrace, counted = watching(reaper, pid, tmp_path)
        profile, err = tmp_path / "heap.pb.gz", tmp_path / "trace.err"
        with open(err, "wb") as sink:
            tracer = reaper.add(subprocess.Popen(
                [*MTRACE, "--pid", str(pid), "--follow-forks", "-o", "summary",
                 "--alloc-stacks", "131072",  # each backend's stacks are rows of their own
                 "--pprof", str(profile)], stdout=sink, stderr=sink))  # fmt: skip
        wait_for_line(err, READY, tracer, timeout=120)
        # WHEN pgbench connects anew for every transaction (a backend each)
        load = connections(home)
        # (a backend makes its last calls after pgbench closed its connection)
        wait_until(lambda: not backends_left(pid, before), "the backends gone")
        tracer.send_signal(signal.SIGINT)
        assert tracer.wait(timeout=300) == 0, err.read_text()
        stderr = ended(bpftrace, load, err)
    calls, whole = whole_by_pid(profile)
    mallocs, stops = bpftrace_maps(counted)
    # the backends: the processes the load made (none was there before it)
    backends = {p for p in mallocs if p not in before}
    assert len(backends) >= 200, len(backends)  # 4 clients x 50 connections
    # THEN every backend malloc is counted, as bpftrace counts them
    assert sum(calls[p] for p in backends) == sum(mallocs[p] for p in backends)
    # AND at least 95% of them have a stack down to main
    share = sum(whole[p] for p in backends) / sum(calls[p] for p in backends)
    assert share >= 0.95, (share, stderr)
    # AND the backends were walked by the tables inherited at their fork,
    # none without tables
    walks = re.search(r"stacks of processes whose tables were not written yet: (\d+),.*?; "
                      r"(\d+) by the tables their process inherited at its fork",
                      stderr)  # fmt: skip
    assert walks is not None, stderr
    assert int(walks[1]) == 0 and int(walks[2]) >= sum(calls[p] for p in backends) // 2
    # AND no postgres process was ever stopped
    assert stops == 0


@pytest.mark.soak  # (make soak: slower than make test's budget)
def test_serve_walks_a_backend_forked_per_connection_whole(
    postmaster: tuple[int, Path], tmp_path: Path
) -> None:
    pid, home = postmaster
    port, err = free_port(), tmp_path / "serve.err"
    with Reaper() as reaper:
        # GIVEN bpftrace counting the server's mallocs and stops, then serve
        # of the postgres processes, every allocation kept
        bpftrace, counted = watching(reaper, pid, tmp_path)
        with open(err, "wb") as sink:
            tracer = reaper.add(subprocess.Popen(
                [*MTRACE, "serve", "--exact", "--comm", "postgres", "--listen",
                 f"127.0.0.1:{port}"], stdout=sink, stderr=sink))  # fmt: skip
        wait_for_line(err, SERVE_READY, tracer, timeout=120)
        begun = time.time()
        wait_until(lambda: rendered(scrape(port)) > begun, "a page read after the start")
        before = walks(scrape(port))
        # WHEN pgbench connects anew for every transaction (a backend each)
        load = connections(home)
        loaded = time.time()
        wait_until(lambda: rendered(scrape(port)) > loaded, "a page read after the load")
        during = walks(scrape(port)) - before
        tracer.send_signal(signal.SIGTERM)
        assert tracer.wait(timeout=120) == 0, err.read_text()
        stderr = ended(bpftrace, load, err)
    mallocs, stops = bpftrace_maps(counted)
    # THEN the load's mallocs were walked (each a walk; the other functions' too)
    assert during.total() >= sum(mallocs.values()) // 2, (during, sum(mallocs.values()))
    # AND at least 95% of the walks during the load were complete
    share = during["complete"] / during.total()
    print(f"complete walks: {share:.2%} of {during.total()}")  # (pytest -s, the docs' figure)
    assert share >= 0.95, (during, stderr[-3000:])
    # AND no postgres process was ever stopped
    assert stops == 0
