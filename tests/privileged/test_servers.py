"""Real servers from Debian's archive, traced while they serve: MariaDB
(glibc's malloc; linked with libsystemd, hence libgcrypt, whose CFI defines
its CFA by expressions) and Redis (jemalloc; libsystemd too), each under
its own load generator, each traced by ``--pid`` in the default mode and by
``serve``.

For each: the server is never stopped (its state polled every 10 ms, and
bpftrace counts every SIGSTOP delivered to any of its threads: none), the
trace exits 0 without a traceback, its clients see no error, and its counts
of allocating calls and of frees equal bpftrace's over the same window
(bpftrace attached first and stopped last, each end on a server idle for a
second; MariaDB's own background work allocates and frees now and then,
also while a tracer starts, so each count of the tracer's lies between
bpftrace's from the tracer's attach to the quiet after the load, and
bpftrace's from before the attach to its end). bpftrace counts the
outermost calls of every allocating entry point the tracer accounts, in
each library the server allocates from."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mtrace_live.tracer.processes.target import default_libc
from prometheus_client.parser import text_string_to_metric_families

from .conftest import MTRACE
from .test_allocators import outer_calls_script
from .test_serve import SERVE_READY, fetch, free_port, samples
from .tracing import (
    BPFTRACE_READY,
    Reaper,
    interrupt_bpftrace,
    nm_symbols,
    start_bpftrace,
    wait_for_line,
    wait_until,
)

READY = "Ctrl-C to stop"


@dataclass
class Server:
    name: str
    pid: int
    load: list[str]  # the load generator's command line
    allocator: str  # as the trace names it
    libs: list[Path]  # the libraries it allocates from


def mariadb(tmp: Path, reaper: Reaper) -> Server:
    data, sock = tmp / "data", tmp / "mariadb.sock"
    subprocess.run(["mariadb-install-db", "--no-defaults", "--user=root", f"--datadir={data}",
                    "--auth-root-authentication-method=normal", "--skip-test-db"],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    server = reaper.add(subprocess.Popen(
        ["mariadbd", "--no-defaults", "--user=root", f"--datadir={data}", f"--socket={sock}",
         "--skip-networking", f"--log-error={tmp / 'mariadb.err'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
    ping = ["mariadb-admin", "--no-defaults", f"--socket={sock}", "-uroot", "ping"]
    wait_until(
        lambda: bool(subprocess.run(ping, capture_output=True).returncode == 0), "mariadbd up"
    )
    load = ["mariadb-slap", "--no-defaults", f"--socket={sock}", "-uroot", "--concurrency=16",
            "--iterations=1", "--number-of-queries=4000", "--auto-generate-sql"]  # fmt: skip
    return Server("mariadbd", server.pid, load, "glibc (libc.so.6)", [default_libc()])


def redis(tmp: Path, reaper: Reaper) -> Server:
    sock = tmp / "redis.sock"
    server = reaper.add(subprocess.Popen(
        ["redis-server", "--port", "0", "--unixsocket", str(sock), "--save", "",
         "--appendonly", "no", "--dir", str(tmp)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
    ping = ["redis-cli", "-s", str(sock), "ping"]
    wait_until(
        lambda: bool(subprocess.run(ping, capture_output=True).stdout == b"PONG\n"), "redis up"
    )
    load = ["redis-benchmark", "-s", str(sock), "-n", "10000", "-c", "16", "-q",
            "-t", "set,get,lpush,lpop,hset"]  # fmt: skip
    return Server("redis-server", server.pid, load, f"jemalloc ({JEMALLOC.name})",
                  [default_libc(), JEMALLOC])  # fmt: skip


SERVERS = {"mariadb": mariadb, "redis": redis}


class StatePoll:
    """Polls a process's state every 10 ms, on a thread: the states seen."""

    def __init__(self, pid: int) -> None:
        self.pid, self.done = pid, threading.Event()
        self.seen: set[str] = set()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        status = Path(f"/proc/{self.pid}/status")
        while not self.done.wait(0.01):
            try:
                text = status.read_text()
            except OSError:
                return  # gone: the test fails on its own account
            for line in text.splitlines():
                if line.startswith("State:"):
                    self.seen.add(line.split()[1])

    def stop(self) -> set[str]:
        self.done.set()
        self.thread.join()
        return self.seen


# The allocating entry points mtrace-live accounts in each library (its
# tables in probes/allocators.py, written out here as `nm -D` lists them
# defined in Debian's files): glibc's standard ones; jemalloc's standard
# ones, its own and C++'s operator new. (jemalloc's xallocx, a resize in
# place that the tracer counts only when it resized, and its operator
# delete, which jumps to free, are left out: redis-server calls neither.)
GLIBC_ALLOCATING = ("malloc", "calloc", "realloc", "reallocarray", "memalign", "aligned_alloc",
                    "posix_memalign", "valloc", "pvalloc")  # fmt: skip
JEMALLOC_ALLOCATING = (
    "malloc", "calloc", "realloc", "memalign", "aligned_alloc", "posix_memalign", "valloc",
    "mallocx", "rallocx", "_Znwm", "_Znam", "_ZnwmRKSt9nothrow_t", "_ZnamRKSt9nothrow_t",
    "_ZnwmSt11align_val_t", "_ZnamSt11align_val_t", "_ZnwmSt11align_val_tRKSt9nothrow_t",
    "_ZnamSt11align_val_tRKSt9nothrow_t")  # fmt: skip
# The frees beside free's outermost calls (outer_calls_script counts those):
# jemalloc's dallocx and sdallocx, and a reallocation that returned a block
# (moved or not) or was of 0 bytes releases the old one, as C says and as
# mtrace-live counts it. bpftrace 0.17 runs one block's program for every
# block that names the same probe, so the reallocations' entries are named
# here by an offset and their returns by the address nm gives.
OTHER_FREES = "{probes} /pid == $1 && @depth[tid] == 0 && arg0 != 0/ {{ @frees = count(); }}\n"
RELEASES = (
    "uprobe:{lib}:{name}+0 /pid == $1/ {{ @old[tid] = arg0; @size[tid] = arg1; }}\n"
    "uretprobe:{lib}:0x{address:x} /pid == $1/ {{\n"
    "  if (@old[tid] != 0 && (retval != 0 || @size[tid] == 0)) {{ @frees = count(); }}\n"
    "  delete(@old[tid]); delete(@size[tid]);\n"
    "}}\n"
)
# A SIGSTOP stops a process when one of its threads takes it (signal_deliver,
# in the receiving thread: bpftrace's pid is its process's), whichever thread
# raised it: a hold is raised by the allocating thread (bpf_send_signal).
WATCH = (
    "tracepoint:signal:signal_deliver /args->sig == 19 && pid == $1/ { @sigstops = count(); }\n"
    "interval:ms:200 { print(@hits); print(@frees); }\n"
    "END { clear(@old); clear(@size); clear(@depth); }\n"
)
JEMALLOC = Path("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")


def address(lib: Path, name: str) -> int:
    """Where ``nm -D`` says ``lib`` defines ``name``."""
    return nm_symbols(lib, dynamic=True)[name][0]


def bpftrace_body(libs: list[Path]) -> str:
    """bpftrace's script: the outermost allocating calls and the frees of
    each of ``libs``, and the SIGSTOPs."""
    parts = []
    for lib in libs:
        jemalloc = lib == JEMALLOC
        parts.append(outer_calls_script(
            lib, allocating=JEMALLOC_ALLOCATING if jemalloc else GLIBC_ALLOCATING))  # fmt: skip
        if jemalloc:
            probes = ",".join(f"uprobe:{lib}:{name}" for name in ("dallocx", "sdallocx"))
            parts.append(OTHER_FREES.format(probes=probes))
        for name in ("realloc", "rallocx") if jemalloc else ("realloc",):
            parts.append(RELEASES.format(lib=lib, name=name, address=address(lib, name)))
    return "".join(parts) + WATCH


def printed(out: Path) -> list[dict[str, int]]:
    """bpftrace's counts after each map it printed, in order: the outermost
    allocating calls ("allocs"), the frees ("frees") and the SIGSTOPs
    delivered ("sigstops")."""
    hits: dict[str, int] = {}
    others = {"frees": 0, "sigstops": 0}
    found = []
    for line in out.read_text(errors="replace").splitlines():
        record = json.loads(line) if line.startswith("{") else {}
        if record.get("type") != "map":
            continue
        for name, value in record["data"].items():
            if name == "@hits":
                hits = {probe: int(n) for probe, n in value.items()}
            elif name[1:] in others:
                others[name[1:]] = int(value)
        free = sum(n for probe, n in hits.items() if probe.endswith(":free"))
        found.append({"allocs": sum(hits.values()) - free, "frees": free + others["frees"],
                      "sigstops": others["sigstops"]})  # fmt: skip
    return found


def last_printed(out: Path) -> dict[str, int]:
    """bpftrace's counts as it last printed them."""
    found = printed(out)
    return found[-1] if found else {"allocs": 0, "frees": 0, "sigstops": 0}


def attached_counts(out: Path) -> dict[str, int]:
    """bpftrace's counts once the tracer has said it is ready: its next
    print (the tracer attached before it said so)."""
    seen = len(printed(out))
    wait_until(lambda: len(printed(out)) >= seen + 2, "bpftrace prints again")
    return last_printed(out)


def wait_quiet(out: Path) -> None:
    """Until the server has made no allocating call or free for a second
    (five of bpftrace's prints in a row): a connection's resources are
    freed after its client has gone."""

    def quiet() -> bool:
        counts = printed(out)[-10:]
        return len(counts) == 10 and all(c == counts[0] for c in counts)

    wait_until(quiet, "the server is idle")


def bpftrace_maps(proc: subprocess.Popen[bytes], out: Path) -> dict[str, int]:
    """bpftrace's counts at its end (it is interrupted, and its exit awaited)."""
    interrupt_bpftrace(proc)
    return last_printed(out)


def within(ours: float, name: str, window: dict[str, dict[str, int]]) -> None:
    """The tracer's count ``ours`` of ``name`` ("allocs", "frees") lies
    between bpftrace's from the tracer's attach to the quiet after the load
    and bpftrace's from before the attach to its end."""
    low = window["quiet"][name] - window["attached"][name]
    high = window["end"][name] - window["before"][name]
    assert low <= ours <= high, (name, ours, low, high, window)


def built_first(argv: list[str], ready: str, stop: signal.Signals, tmp: Path,
                reaper: Reaper) -> None:  # fmt: skip
    """The trace ``argv`` run until it says ``ready``, then stopped with
    ``stop``: its BPF program is compiled now and kept in the tracer's
    cache (tracer/bpf/bpf_cache.py), so the trace that is measured loads it.
    Compiled under bpftrace, clang's every malloc would stop at bpftrace's
    uprobes in the libc (bpftrace 0.17 places them in every process, the
    pid a test in its programs, -p or not): a minute or more of a test's
    time on a cold cache (101 s against 33 s here, under load)."""
    err = tmp / "first-trace.err"
    with open(err, "wb") as errors:
        first = reaper.add(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=errors))
    wait_for_line(err, ready, first, timeout=300)
    first.send_signal(stop)
    assert first.wait(timeout=120) == 0, err.read_text()


def watched(target: Server, reaper: Reaper, tmp: Path,
            trace: tuple[list[str], str, signal.Signals],
            ) -> tuple[subprocess.Popen[bytes], Path, StatePoll]:  # fmt: skip
    """bpftrace counting the server's calls and SIGSTOPs, once it is idle
    and the program of ``trace`` (its command, its ready line and its stop
    signal) is built, and the server's state polled."""
    built_first(*trace, tmp, reaper)
    bpftrace, out = start_bpftrace(bpftrace_body(target.libs), target.pid, tmp)
    reaper.add(bpftrace)
    wait_for_line(out, BPFTRACE_READY, bpftrace, timeout=120)
    wait_quiet(out)
    return bpftrace, out, StatePoll(target.pid)


def unharmed(load: subprocess.CompletedProcess[str], states: set[str], counts: dict[str, int],
             code: int, err: Path) -> None:  # fmt: skip
    """The clients saw no error, the server was never stopped, and the
    trace exited 0 without a traceback or an error."""
    assert load.returncode == 0 and "error" not in (load.stdout + load.stderr).lower(), load
    assert counts["sigstops"] == 0, counts
    assert "T" not in states, states
    stderr = err.read_text()
    assert code == 0 and "Traceback" not in stderr and "error:" not in stderr, stderr


@pytest.fixture(params=sorted(SERVERS))
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Server, Reaper]]:
    if shutil.which("mariadbd") is None or shutil.which("redis-server") is None:
        pytest.fail("the servers are not installed: run scripts/setup.sh")
    with Reaper() as reaper:
        yield SERVERS[request.param](tmp_path, reaper), reaper


def test_a_server_traced_by_pid_is_never_stopped_and_counted_as_bpftrace_counts(
    server: tuple[Server, Reaper], tmp_path: Path
) -> None:
    target, reaper = server
    # GIVEN the server idle: bpftrace attached to it first, then the tracer
    argv = [*MTRACE, "--pid", str(target.pid), "-o", "summary", "--pprof",
            str(tmp_path / "heap.pb.gz")]  # fmt: skip
    bpftrace, out, poll = watched(target, reaper, tmp_path, (argv, READY, signal.SIGINT))
    err, summary_out = tmp_path / "trace.err", tmp_path / "summary"
    # the counts before the tracer starts: the server may allocate and free
    # of its own accord while it attaches, and its start line comes after
    window = {"before": last_printed(out)}
    with open(err, "wb") as errors, open(summary_out, "wb") as lines:
        tracer = reaper.add(subprocess.Popen(argv, stdout=lines, stderr=errors))
    wait_for_line(err, READY, tracer, timeout=120)
    window["attached"] = attached_counts(out)
    # WHEN its clients load it, and the trace then ends
    load = subprocess.run(target.load, capture_output=True, text=True, timeout=600)
    wait_quiet(out)
    window["quiet"] = last_printed(out)  # the server may do more of its own accord later
    tracer.send_signal(signal.SIGINT)
    code = tracer.wait(timeout=120)
    window["end"] = counts = bpftrace_maps(bpftrace, out)
    states = poll.stop()
    # THEN its clients saw no error, it was never stopped, and the trace
    # exited 0 without a traceback
    unharmed(load, states, counts, code, err)
    # AND its allocating calls (those that returned a block, and those that
    # failed) and its frees are those bpftrace counted
    summary = summary_out.read_text()
    line = re.search(rf"^allocations: pid {target.pid}: (\d+) calls, [^;]*; (\d+) frees[^;]*; "
                     r"(\d+) failed;", summary, re.M)  # fmt: skip
    assert line is not None, summary
    within(int(line[1]) + int(line[3]), "allocs", window)
    within(int(line[2]), "frees", window)
    # and each server is on its allocator, as the trace says; its stacks
    # are unwound by CFI
    assert f"pid {target.pid}: allocator: {target.allocator}" in err.read_text()
    assert counts["allocs"] > 10_000 and "0 files without CFI" in summary
    assert "stacks unwound by CFI" in summary


def metric(text: str, name: str, process: str) -> float:
    """The sum of ``name``'s samples of ``process``."""
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and sample.labels.get("process") == process)  # fmt: skip


def rendered_from_now(url: str) -> str:
    """A scrape of a page rendered from now on (a scrape is served the last
    page rendered, at most a read interval old)."""
    since, pages = time.time(), []

    def rendered() -> bool:
        pages.append(fetch(url)[1])
        return samples(pages[-1])[("mtrace_metrics_rendered_time_seconds", ())] >= since

    wait_until(rendered, "a page rendered after the load")
    return pages[-1]


# (Redis under serve in make soak: slower than make test's budget, which keeps MariaDB's)
@pytest.mark.parametrize("server", ["mariadb", pytest.param("redis", marks=pytest.mark.soak)],
                         indirect=True)  # fmt: skip
def test_a_server_traced_by_serve_is_never_stopped_and_counted_as_bpftrace_counts(
    server: tuple[Server, Reaper], tmp_path: Path
) -> None:
    target, reaper = server
    port = free_port()
    argv = [*MTRACE, "serve", "--pid", str(target.pid), "--web.listen-address",
            f"127.0.0.1:{port}"]  # fmt: skip
    bpftrace, out, poll = watched(target, reaper, tmp_path, (argv, SERVE_READY, signal.SIGTERM))
    err = tmp_path / "serve.err"
    window = {"before": last_printed(out)}  # before serve starts, as for --pid above
    with open(err, "wb") as errors:
        serve = reaper.add(subprocess.Popen(argv, stdout=errors, stderr=errors))
    wait_for_line(err, SERVE_READY, serve, timeout=120)
    window["attached"] = attached_counts(out)
    # WHEN its clients load it, and its metrics are scraped after
    load = subprocess.run(target.load, capture_output=True, text=True, timeout=600)
    wait_quiet(out)
    window["quiet"] = last_printed(out)  # the server may do more of its own accord later
    page = rendered_from_now(f"http://127.0.0.1:{port}/metrics")
    # bpftrace stopped before serve: serve's window is inside
    window["end"] = counts = bpftrace_maps(bpftrace, out)
    serve.send_signal(signal.SIGTERM)
    code = serve.wait(timeout=120)
    states = poll.stop()
    # THEN as by pid: no error, never stopped, exit 0, no traceback
    unharmed(load, states, counts, code, err)
    # AND its allocating calls and its frees (exact, whatever serve samples)
    # are those bpftrace counted
    allocs = (metric(page, "mtrace_alloc_calls_total", target.name)
              + metric(page, "mtrace_alloc_failed_calls_total", target.name))  # fmt: skip
    within(allocs, "allocs", window)
    within(metric(page, "mtrace_free_calls_total", target.name), "frees", window)
    assert counts["allocs"] > 10_000
