"""What every benchmark section shares: paths, the machine's description, the
peers' presence, tracers run in the background, and configurations run in
alternating order."""

from __future__ import annotations

import os
import platform
import re
import select
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from mtrace_live.probes.program import ProgramSource

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build"
FLOORS = REPO / "bench" / "bpf"  # the floors' programs: the bench's own, never shipped


def floor_source(name: str, defines: dict[str, int] | None = None) -> ProgramSource:
    """The floor program ``bench/bpf/<name>.bpf.c`` as BpfProgram compiles it."""
    return ProgramSource(name, (FLOORS / f"{name}.bpf.c",), dict(defines or {}))


MTRACE = [str(REPO / ".venv" / "bin" / "mtrace-live")]
QUICK = os.environ.get("QUICK") == "1"
REPS = 1 if QUICK else 5
START_TIMEOUT_S = 120


def interruptible() -> None:
    """In a child before exec: SIGINT back to its default. A shell starts
    background jobs with SIGINT ignored, and a Python tracer (bcc's tools)
    that inherits that never sees Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def sdt():  # type: ignore[no-untyped-def]
    from mtrace_live.tracer.processes import sdt_glibc

    return sdt_glibc.locate()


def last_seconds(output: str) -> float:
    """The workloads print their own elapsed seconds as the last number line."""
    for line in reversed(output.splitlines()):
        if re.fullmatch(r"\d+\.\d+", line.strip()):
            return float(line)
    raise RuntimeError(f"no elapsed time in: {output[-500:]}")


def check(argv: list[str], timeout: float = 900) -> str:
    """Run a command to its end; its stdout."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv[:4])} ... exited {done.returncode}: {done.stderr[-800:]}"
        )
    return str(done.stdout)


def event_counts(summary: str) -> tuple[int, int, int]:
    """(in the kernel, delivered, lost) from a live trace's summary."""
    match = re.search(r"events: (\d+) in the kernel, (\d+) delivered, (\d+) lost", summary)
    if not match:
        raise RuntimeError(f"no event counts in: {summary[-800:]}")
    kernel, delivered, lost = (int(x) for x in match.groups())
    return kernel, delivered, lost


# ---- peers ---------------------------------------------------------------------


@dataclass(frozen=True)
class Peer:
    name: str
    command: str
    version: list[str]
    package: str


PEERS = (
    Peer("bpftrace", "bpftrace", ["bpftrace", "--version"], "bpftrace"),
    Peer("bcc trace", "trace-bpfcc", ["dpkg-query", "-W", "-f", "${Version}", "bpfcc-tools"],
         "bpfcc-tools"),
    Peer("perf", "perf", ["perf", "--version"], "linux-perf"),
    Peer("bcc memleak", "memleak-bpfcc", ["dpkg-query", "-W", "-f", "${Version}", "bpfcc-tools"],
         "bpfcc-tools"),
    Peer("heaptrack", "heaptrack", ["dpkg-query", "-W", "-f", "${Version}", "heaptrack"],
         "heaptrack"),
)  # fmt: skip


def peer_versions() -> dict[str, str | None]:
    """Each peer's version, or None when it is not installed."""
    found: dict[str, str | None] = {}
    for peer in PEERS:
        if shutil.which(peer.command) is None:
            found[peer.name] = None
            continue
        done = subprocess.run(peer.version, capture_output=True, text=True)
        found[peer.name] = (done.stdout.strip() or done.stderr.strip()) or "unknown version"
    return found


def machine() -> dict[str, str]:
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    vm = subprocess.run(["systemd-detect-virt", "--vm"], capture_output=True, text=True)
    virt = vm.stdout.strip() if vm.returncode == 0 else "none"
    if virt == "none" and " hypervisor" in Path("/proc/cpuinfo").read_text():
        virt = "a VM (the CPU flags say a hypervisor)"
    container = subprocess.run(["systemd-detect-virt", "--container"], capture_output=True,
                               text=True).stdout.strip()  # fmt: skip
    if container and container != "none":
        virt += f", in a {container} container"
    bcc = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "python3-bpfcc"],
                         capture_output=True, text=True).stdout  # fmt: skip
    memory_kb = int(Path("/proc/meminfo").read_text().split()[1])
    glibc = sdt().libc.parent.parent.name.split("_")[0]
    return {
        "cpu": f"{cpu}, {os.cpu_count()} CPUs",
        "memory": f"{memory_kb / 2**20:.0f} GiB",
        "virtualisation": virt,
        "kernel": f"Linux {platform.release()}",
        "glibc": f"glibc {glibc} built with --enable-systemtap (the SDT build)",
        "bcc": f"bcc {bcc or 'not installed'}",
        "python": f"Python {platform.python_version()}",
    }


# ---- tracers in the background ---------------------------------------------------


class Background:
    """A tracer started before the workload and stopped (SIGINT) after it."""

    def __init__(self, argv: list[str], ready: str, log: Path):
        self.log = log
        self._sink: IO[bytes] = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(argv, stdout=self._sink, stderr=subprocess.STDOUT,
                                        preexec_fn=interruptible)  # fmt: skip
        self._wait(ready)

    def _wait(self, ready: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while ready not in self.text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.log.stem} did not start: {self.text()[-800:]}")
            time.sleep(0.02)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self, grace: float = 60) -> str:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._sink.close()
        return self.text()


class Gated:
    """A workload started waiting for a byte on stdin (GATE=1), so that a
    tracer needing its pid can attach before it does anything."""

    def __init__(self, argv: list[str]):
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True,
                                        env={**os.environ, "GATE": "1"})  # fmt: skip

    @property
    def pid(self) -> int:
        return self.process.pid

    def start(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("g")
        self.process.stdin.flush()

    def line(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline()

    def finish(self) -> str:
        out, err = self.process.communicate(input="g", timeout=900)
        if self.process.returncode != 0:
            raise RuntimeError(f"workload exited {self.process.returncode}: {err[-500:]}")
        return out


def time_to_line(argv: list[str], wanted: Callable[[str], bool], stream: str,
                 env: dict[str, str] | None = None) -> float:  # fmt: skip
    """Seconds from starting ``argv`` to its first line on ``stream``
    ("stdout" or "stderr") that ``wanted`` accepts; then it is stopped."""
    started = time.monotonic()
    pipe = subprocess.PIPE
    tracer = subprocess.Popen(argv, stdout=pipe if stream == "stdout" else subprocess.DEVNULL,
                              stderr=pipe if stream == "stderr" else subprocess.DEVNULL,
                              preexec_fn=interruptible,
                              env={**os.environ, **(env or {})})  # fmt: skip
    out = tracer.stdout if stream == "stdout" else tracer.stderr
    assert out is not None
    pending = b""
    try:
        while time.monotonic() < started + 120:
            ready, _, _ = select.select([out], [], [], 1.0)
            if not ready:
                continue
            chunk = os.read(out.fileno(), 65536)  # what is there: no line waits in a buffer
            if not chunk:
                raise RuntimeError(f"{argv[0]} ended before its line")
            *lines, pending = (pending + chunk).split(b"\n")
            if any(wanted(line.decode(errors="replace")) for line in lines):
                return time.monotonic() - started
        raise RuntimeError(f"{argv[0]}: no line in 120 s")
    finally:
        tracer.send_signal(signal.SIGINT)
        try:
            tracer.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            tracer.kill()
            tracer.communicate()


# ---- configurations in alternating order -----------------------------------------


@dataclass
class Sample:
    """One run of one configuration: the workload's own time, and whatever
    the tracer said about it (hits, lost events)."""

    seconds: float
    extra: dict[str, float] = field(default_factory=dict)


# Configurations of a peer that failed, with why: left out of the rest of the
# run and listed on the page, so that one broken peer costs no other figure.
FAILED: dict[str, str] = {}


def detached() -> None:
    """Wait until the last mtrace-live's perf events are closed: its
    detacher would otherwise still hold kmem tracepoints (perf then records
    none of their events) and use CPU during the next measurement."""

    def running() -> bool:
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                name, _, rest = stat.read_bytes().partition(b") ")
            except OSError:
                continue  # gone meanwhile
            if name.endswith(b"(mtrace-detach") and not rest.startswith(b"Z"):
                return True  # a zombie has closed everything already
        return False

    while running():
        time.sleep(0.05)


def alternate(
    configs: dict[str, Callable[[], Sample]],
    reps: int,
    ours: tuple[str, ...] = ("mtrace-live", "untraced"),
) -> dict[str, list[Sample]]:
    """Each configuration reps times: forward order, then backward, and so on.
    A peer's configuration that fails is dropped (FAILED says why); one of
    ours (names starting with `ours`) failing stops the run."""
    samples: dict[str, list[Sample]] = {name: [] for name in configs}
    for rep in range(reps):
        order = list(configs) if rep % 2 == 0 else list(reversed(configs))
        for name in order:
            if name in FAILED:
                continue
            detached()
            begun = time.monotonic()
            try:
                sample = configs[name]()
            except Exception as exc:
                if name.startswith(ours):
                    raise
                FAILED[name] = (
                    str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else repr(exc)
                )
                say(f"  {name} failed, left out: {FAILED[name]}")
                del samples[name]
                continue
            samples[name].append(sample)
            extra = ", ".join(f"{k} {v:g}" for k, v in sample.extra.items())
            took = time.monotonic() - begun
            say(f"  [{rep + 1}/{reps}] {name}: {sample.seconds:.3f} {extra} ({took:.0f} s)")
    return samples


def summarise(samples: dict[str, list[Sample]]) -> dict[str, dict[str, object]]:
    """Medians of the time and of every extra figure, and the raw times."""
    rows: dict[str, dict[str, object]] = {}
    for name, runs in samples.items():
        row: dict[str, object] = {
            "median_s": statistics.median(s.seconds for s in runs),
            "samples": [s.seconds for s in runs],
        }
        for key in sorted({k for s in runs for k in s.extra}):
            row[key] = statistics.median(s.extra[key] for s in runs if key in s.extra)
        rows[name] = row
    return rows


def verdict(met: bool) -> str:
    return "**met**" if met else "**NOT met**"
