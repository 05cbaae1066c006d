"""Real servers from Debian's archive, traced while they serve: MariaDB
(glibc's malloc; linked with libsystemd, hence libgcrypt, whose CFI defines
its CFA by expressions) and Redis (jemalloc; libsystemd too), each under
its own load generator, each traced by ``--pid`` in the default mode and by
``serve``.

For each: the server is never stopped (its state polled every 10 ms, and
bpftrace counts every SIGSTOP sent to it: none), the trace exits 0 without
a traceback, its clients see no error, and the counts equal bpftrace's over
the same window (bpftrace attached first and stopped last, each end on a
server idle for a second; MariaDB's own background work frees now and then,
also while a tracer starts, so the tracer's count of frees lies between
bpftrace's from the tracer's attach to the quiet after the load, and
bpftrace's from before the attach to its end)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from mtrace_live.tracer.target import default_libc
from prometheus_client.parser import text_string_to_metric_families

from .conftest import MTRACE
from .test_serve import SERVE_READY, free_port, settled
from .tracing import BPFTRACE_READY, Reaper, start_bpftrace, wait_for_line, wait_until

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
    load = ["redis-benchmark", "-s", str(sock), "-n", "50000", "-c", "16", "-q",
            "-t", "set,get,lpush,lpop,hset"]  # fmt: skip
    return Server("redis-server", server.pid, load, f"jemalloc ({JEMALLOC.name})",
                  [default_libc(), JEMALLOC])  # fmt: skip


SERVERS = {"mariadb": mariadb, "redis": redis}


class StatePoll:
    """Polls a process's state every 10 ms, on a thread: the states seen."""

    def __init__(self, pid: int) -> None:
        self.pid, self.seen, self.done = pid, set(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        status = Path(f"/proc/{self.pid}/status")
        while not self.done.wait(0.01):
            for line in status.read_text().splitlines():
                if line.startswith("State:"):
                    self.seen.add(line.split()[1])

    def stop(self) -> set[str]:
        self.done.set()
        self.thread.join()
        return self.seen


# Each allocator's calls, in each library the server allocates from: its
# malloc, and its frees (free, and jemalloc's dallocx and sdallocx; a realloc
# that moved or kept a block frees the old one as mtrace-live counts it).
CALLS = (
    "uprobe:{lib}:malloc /pid == $1/ {{ @mallocs = count(); }}\n"
    "{frees} /pid == $1 && arg0 != 0/ {{ @frees = count(); }}\n"
    "uprobe:{lib}:realloc /pid == $1/ {{ @old[tid] = arg0; }}\n"
    "uretprobe:{lib}:realloc /pid == $1/ {{\n"
    "  if (@old[tid] != 0 && retval != 0) {{ @frees = count(); }} delete(@old[tid]);\n"
    "}}\n"
)
WATCH = (
    "tracepoint:signal:signal_generate /args->sig == 19 && args->pid == $1/ "
    "{ @sigstops = count(); }\n"
    "interval:ms:200 { print(@mallocs); print(@frees); }\n"
    "END { clear(@old); }\n"
)
JEMALLOC = Path("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")


def bpftrace_body(libs: list[Path]) -> str:
    """bpftrace's script: the calls of each of ``libs``, and the SIGSTOPs."""
    calls = []
    for lib in libs:
        frees = ["free", *(("dallocx", "sdallocx") if lib == JEMALLOC else ())]
        calls.append(CALLS.format(lib=lib, frees=",".join(f"uprobe:{lib}:{f}" for f in frees)))
    return "".join(calls) + WATCH


def printed(out: Path) -> list[tuple[str, int]]:
    """Every (map, value) bpftrace printed, in order."""
    found = []
    for line in out.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("type") == "map":
                found.extend((name, int(value)) for name, value in record["data"].items())
    return found


def frees_printed(out: Path) -> int:
    """The last count of frees bpftrace printed."""
    return next((value for name, value in reversed(printed(out)) if name == "@frees"), 0)


def attached_frees(out: Path) -> int:
    """bpftrace's count of frees once the tracer has said it is ready: its
    next print (the tracer attached before it said so)."""
    seen = len(printed(out))
    wait_until(lambda: len(printed(out)) >= seen + 2, "bpftrace prints again")
    return frees_printed(out)


def wait_quiet(out: Path) -> None:
    """Until the server has made no malloc or free for a second (five of
    bpftrace's prints in a row): a connection's resources are freed after
    its client has gone."""

    def quiet() -> bool:
        values = [value for name, value in printed(out) if name in ("@mallocs", "@frees")]
        return len(values) >= 10 and len(set(values[-10::2])) == len(set(values[-9::2])) == 1

    wait_until(quiet, "the server is idle")


def bpftrace_maps(proc: subprocess.Popen[bytes], out: Path) -> dict[str, int]:
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    found = {"mallocs": 0, "frees": 0, "sigstops": 0}
    found.update((name.lstrip("@"), value) for name, value in printed(out))  # the last of each
    return found


def watched(target: Server, reaper: Reaper,
            tmp: Path) -> tuple[subprocess.Popen[bytes], Path, StatePoll]:  # fmt: skip
    """bpftrace counting the server's calls and SIGSTOPs, once it is idle,
    and its state polled."""
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
    assert "T" not in states and counts["sigstops"] == 0, (states, counts)
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
    bpftrace, out, poll = watched(target, reaper, tmp_path)
    err, summary_out = tmp_path / "trace.err", tmp_path / "summary"
    # the frees before the tracer starts: the server may free of its own accord
    # while it attaches, and the tracer's start line comes after its attach
    before = frees_printed(out)
    with open(err, "wb") as errors, open(summary_out, "wb") as lines:
        tracer = reaper.add(subprocess.Popen(
            [*MTRACE, "--pid", str(target.pid), "-o", "summary", "--pprof",
             str(tmp_path / "heap.pb.gz")], stdout=lines, stderr=errors))  # fmt: skip
    wait_for_line(err, READY, tracer, timeout=120)
    attached = attached_frees(out)
    # WHEN its clients load it, and the trace then ends
    load = subprocess.run(target.load, capture_output=True, text=True, timeout=600)
    wait_quiet(out)
    quiet = frees_printed(out)  # the server may free more of its own accord later
    tracer.send_signal(signal.SIGINT)
    code = tracer.wait(timeout=120)
    counts = bpftrace_maps(bpftrace, out)
    states = poll.stop()
    # THEN its clients saw no error, it was never stopped, and the trace
    # exited 0 without a traceback
    unharmed(load, states, counts, code, err)
    # AND its malloc calls and frees are those bpftrace counted
    summary = summary_out.read_text()
    lines = [line for line in summary.splitlines() if line.startswith("allocations: pid")]
    frees = int(lines[0].split("; ")[1].split()[0]) if lines else 0  # none: it never called
    assert quiet - attached <= frees <= counts["frees"] - before, (lines, quiet, counts)
    # and each server is on its allocator, as the trace says; its stacks
    # are unwound by CFI
    assert f"pid {target.pid}: allocator: {target.allocator}" in err.read_text()
    assert counts["mallocs"] > 10_000 and "0 files without CFI" in summary
    assert "stacks unwound by CFI" in summary


def metric(text: str, name: str, process: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("process") == process:
                return float(sample.value)
    return 0.0


def test_a_server_traced_by_serve_is_never_stopped_and_counted_as_bpftrace_counts(
    server: tuple[Server, Reaper], tmp_path: Path
) -> None:
    target, reaper = server
    bpftrace, out, poll = watched(target, reaper, tmp_path)
    port = free_port()
    err = tmp_path / "serve.err"
    before = frees_printed(out)  # before serve starts, as for --pid above
    with open(err, "wb") as errors:
        serve = reaper.add(subprocess.Popen(
            [*MTRACE, "serve", "--pid", str(target.pid), "--web.listen-address",
             f"127.0.0.1:{port}"], stdout=errors, stderr=errors))  # fmt: skip
    wait_for_line(err, SERVE_READY, serve, timeout=120)
    attached = attached_frees(out)
    # WHEN its clients load it, and its metrics are scraped after
    load = subprocess.run(target.load, capture_output=True, text=True, timeout=600)
    wait_quiet(out)
    quiet = frees_printed(out)  # the server may free more of its own accord later
    page = settled(f"http://127.0.0.1:{port}/metrics")
    counts = bpftrace_maps(bpftrace, out)  # stopped before serve: serve's window is inside
    serve.send_signal(signal.SIGTERM)
    code = serve.wait(timeout=120)
    states = poll.stop()
    # THEN as by pid: no error, never stopped, exit 0, no traceback
    unharmed(load, states, counts, code, err)
    # AND its frees (exact, whatever serve samples) are those bpftrace counted
    frees = metric(page, "mtrace_free_calls_total", target.name)
    assert quiet - attached <= frees <= counts["frees"] - before, (frees, quiet, counts)
