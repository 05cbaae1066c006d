"""Stopping: `record`, `serve` and a live trace end on SIGINT or SIGTERM
with every record written, and every BPF program they loaded goes away
afterwards (the perf events are closed by a detached child, since each
close waits for the kernel; docs/live-tracing.md). How long a stop takes is
measured by `make bench` (section 6), never asserted here."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from mtrace_live.exporters.kmemtrace.reader import read_record_set
from mtrace_live.tracer.bpf import bpf_syscalls
from mtrace_live.tracer.processes.sdt_glibc import SdtGlibc

from .conftest import MTRACE, built
from .tracing import Reaper, programs_of, uprobe_links, wait_for_detach, wait_until


def start_when_ready(argv: list[str], reaper: Reaper, needle: str,
                     stdout: Any = subprocess.PIPE) -> subprocess.Popen[str]:  # fmt: skip
    proc = reaper.add(
        subprocess.Popen(argv, stdout=stdout, stderr=subprocess.PIPE, text=True)  # type: ignore[arg-type]
    )
    assert proc.stderr is not None
    said = ""  # notices (derived probes, a cache warning) may come first
    while needle not in said:
        line = proc.stderr.readline()
        assert line, said + proc.stderr.read()
        said += line
    return proc  # type: ignore[return-value]


def programs_unloaded(loaded: set[int]) -> bool:
    """None of the programs a tracer held is left, within a minute (a guard
    against a leak, not a measure): the kernel frees a program once its
    last perf event is gone, which under a busy uprobe load can lag the
    detacher's exit by seconds. Programs other tools load meanwhile are
    theirs: only the tracer's own are asked about."""
    assert loaded, "the tracer held no BPF program"
    for _ in range(600):
        if not loaded & set(bpf_syscalls.program_ids()):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_record_stops_with_every_record_written_and_detaches(
    sdt: SdtGlibc, tmp_path: Path, sig: signal.Signals
) -> None:
    out = tmp_path / "out.d"
    with Reaper() as reaper:
        # GIVEN a busy program under the SDT glibc, recorded with its libc probes and kmem
        load = reaper.add(subprocess.Popen(sdt.wrap([str(built("arena_contention")), "60"]),
                                           stdout=subprocess.DEVNULL))  # fmt: skip
        argv = [*MTRACE, "record", "-o", str(out), "--pid", str(load.pid), "--libc",
                "--lib", str(sdt.libc)]  # fmt: skip
        tracer = start_when_ready(argv, reaper, "records to")
        loaded = programs_of(tracer.pid)
        # (once records reach the files: a stop with records in flight)
        wait_until(lambda: sum(f.stat().st_size for f in out.glob("cpu*")) > 0, "records written")
        # WHEN it is signalled
        tracer.send_signal(sig)
        stdout, stderr = tracer.communicate(timeout=120)
        assert load.poll() is None  # a --pid target is left running
    # THEN it ended by that signal, and the record set holds every record it counted
    assert tracer.returncode == 0, stderr
    assert f"ended by {sig.name}" in stdout + stderr
    written = re.search(r"kmemtrace: (\d+) records in", stdout + stderr)
    assert written is not None, stdout + stderr
    records = read_record_set(out)
    assert len(records.records) == int(written[1]) > 0
    assert not records.damage
    # AND once the detacher is done, none of its programs is left loaded
    wait_for_detach()
    assert programs_unloaded(loaded)


@pytest.mark.soak  # (make soak: slower than make test's budget)
def test_a_live_trace_and_serve_stop_on_sigterm_and_detach(sdt: SdtGlibc, tmp_path: Path) -> None:
    with Reaper() as reaper:
        load = reaper.add(subprocess.Popen(sdt.wrap([str(built("arena_contention")), "60"]),
                                           stdout=subprocess.DEVNULL))  # fmt: skip
        # GIVEN a live trace writing JSON lines, and a metrics server, both on the load
        lines_file = tmp_path / "trace.jsonl"
        with open(lines_file, "w") as lines_out:
            trace = start_when_ready(
                [*MTRACE, "--pid", str(load.pid), "--lib", str(sdt.libc), "--kmem", "-o", "json"],
                reaper, "tracing", stdout=lines_out,
            )  # fmt: skip
        serve = start_when_ready(
            [*MTRACE, "serve", "--lib", str(sdt.libc), "--web.listen-address", "127.0.0.1:0",
             "--pid", str(load.pid)],
            reaper, "tracing",
        )  # fmt: skip
        loaded = programs_of(trace.pid) | programs_of(serve.pid)
        wait_until(lambda: lines_file.stat().st_size > 0, "events written")
        # WHEN both get SIGTERM, events in flight
        trace.send_signal(signal.SIGTERM)
        serve.send_signal(signal.SIGTERM)
        _, trace_err = trace.communicate(timeout=120)
        _, serve_err = serve.communicate(timeout=120)
        lines = lines_file.read_text()
    # THEN both end cleanly, the trace with a line for each event it delivered
    assert trace.returncode == 0, trace_err
    assert serve.returncode == 0, serve_err
    assert "Traceback" not in trace_err + serve_err
    delivered = re.search(r"events: \d+ in the kernel, (\d+) delivered", trace_err)
    allocations = re.search(r"allocation events: (\d+) delivered", trace_err)
    waits = re.search(r"lock wait events: (\d+) delivered", trace_err)
    assert delivered is not None and allocations is not None and waits is not None, trace_err
    tables = sum(1 for line in lines.splitlines() if line.startswith('{"table":'))
    events = int(delivered[1]) + int(allocations[1]) + int(waits[1])
    assert len(lines.splitlines()) == events + tables
    # AND their programs go away
    wait_for_detach()
    assert programs_unloaded(loaded)


def uprobes() -> list[dict[str, object]]:
    """The uprobe perf events the kernel holds with a BPF program on them,
    whichever process holds them (bpftool perf: every process's perf event
    descriptors, as the kernel reports them; mtrace-live attaches its uprobes
    on the uprobe PMU, which tracefs's uprobe_events never lists)."""
    done = subprocess.run(["bpftool", "perf", "-j"], capture_output=True, text=True, check=True)
    return [link for link in json.loads(done.stdout or "[]")
            if "uprobe" in str(link.get("fd_type"))]  # fmt: skip


def test_a_tracer_killed_with_sigkill_leaves_no_probe_and_the_next_one_starts(
    tmp_path: Path,
) -> None:
    with Reaper() as reaper:
        load = reaper.add(subprocess.Popen([str(built("arena_contention")), "60"],
                                           stdout=subprocess.DEVNULL))  # fmt: skip
        # GIVEN a live trace of a process, attached
        trace = start_when_ready([*MTRACE, "--pid", str(load.pid), "-o", "summary"], reaper,
                                 "Ctrl-C to stop", stdout=subprocess.DEVNULL)  # fmt: skip
        loaded = programs_of(trace.pid)
        # (its uprobes are in links on this kernel: tracer/bpf/uprobe_multi.py)
        attached = [link for link in uprobe_links([trace.pid]) if link["prog_id"] in loaded]
        assert any(link["pid"] == load.pid for link in attached), attached
        sites = {(link["path"], offset) for link in attached for offset in link["offsets"]}
        # WHEN it is killed outright: no handler of its own runs
        trace.kill()
        trace.communicate(timeout=120)
        # THEN the kernel drops its programs and its uprobes with its descriptors:
        # no process holds a uprobe at any of its sites, in a link or a perf event
        assert programs_unloaded(loaded)
        held = {(link["path"], offset) for link in uprobe_links() for offset in link["offsets"]}
        held |= {(link["filename"], link["offset"]) for link in uprobes()}
        assert held & sites == set()
        # AND the next trace of the same process attaches and ends cleanly
        again = start_when_ready([*MTRACE, "--pid", str(load.pid), "-o", "summary"], reaper,
                                 "Ctrl-C to stop", stdout=subprocess.DEVNULL)  # fmt: skip
        again.send_signal(signal.SIGINT)
        _, err = again.communicate(timeout=120)
        assert again.returncode == 0, err
    wait_for_detach()
