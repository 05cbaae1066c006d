"""Kernel kmem tracing under --pid, recorded as kmemtrace records: counted
against bpftrace in the same run, aggregated per call site in the kernel and
again by `report` from the records, and reported offline."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from mtrace_live.exporters.data.kallsyms import KernelSymbols
from mtrace_live.exporters.kmemtrace.abi import EventId, TypeId
from mtrace_live.exporters.kmemtrace.analysis import analyse, stream_report
from mtrace_live.exporters.kmemtrace.reader import RecordSet, open_record_set, read_record_set

from .conftest import MTRACE
from .tracing import (
    BPFTRACE_READY,
    Reaper,
    bpftrace_kmem_counts,
    skipped_runs_of,
    stop_bpftrace,
    wait_for_line,
    wait_freed,
    watch_frees,
)

SOCKETS = 400
PIPES = 300

# (event id, type id) of each tracepoint's records; the two page-free
# tracepoints both become page free records.
RECORD_OF = {
    "kmalloc": (EventId.ALLOC, TypeId.KMALLOC),
    "kfree": (EventId.FREE, TypeId.KMALLOC),
    "kmem_cache_alloc": (EventId.ALLOC, TypeId.CACHE),
    "kmem_cache_free": (EventId.FREE, TypeId.CACHE),
    "mm_page_alloc": (EventId.ALLOC, TypeId.PAGES),
    "mm_page_free": (EventId.FREE, TypeId.PAGES),
}


@dataclass
class Recorded:
    pid: int
    directory: Path
    records: RecordSet
    bpftrace: dict[str, int]
    bpftrace_skipped: int  # its programs' runs the kernel skipped
    summary: str
    exit_code: int


@pytest.fixture(scope="module")
def recorded(kmem_exerciser: Path, tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    """One gated exerciser, with bpftrace and `mtrace-live record --pid`
    attached while it sleeps, released, and both stopped while it sleeps again;
    a decoy makes 10x the sockets meanwhile."""
    tmp = tmp_path_factory.mktemp("kmemtrace")
    directory = tmp / "records"
    with Reaper() as reaper:
        work = reaper.add(subprocess.Popen(
            [str(kmem_exerciser), "--sockets", str(SOCKETS), "--pipes", str(PIPES),
             "--out", str(tmp / "truth.json"), "--gated"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE))  # fmt: skip
        assert work.stdin is not None and work.stdout is not None
        assert work.stdout.readline() == b"ready\n"
        bpftrace, bpftrace_out = bpftrace_kmem_counts(work.pid, tmp)
        reaper.add(bpftrace)
        wait_for_line(bpftrace_out, BPFTRACE_READY, bpftrace, timeout=120)
        watcher, watcher_out = watch_frees(work.pid, "sock_inode_cache", tmp)
        reaper.add(watcher)
        wait_for_line(watcher_out, BPFTRACE_READY, watcher, timeout=120)
        err = tmp / "record.err"
        with open(err, "wb") as err_sink, open(tmp / "record.out", "wb") as out_sink:
            record = reaper.add(
                subprocess.Popen(
                    [*MTRACE, "record", "-o", str(directory), "--pid", str(work.pid)],
                    stdout=out_sink,
                    stderr=err_sink,
                )
            )
        wait_for_line(err, "Ctrl-C to stop", record, timeout=120)
        decoy = reaper.add(subprocess.Popen(
            [str(kmem_exerciser), "--sockets", str(10 * SOCKETS), "--pipes", "0",
             "--out", str(tmp / "decoy.json")]))  # fmt: skip
        work.stdin.write(b"go\n")
        work.stdin.flush()
        assert work.stdout.readline() == b"done\n"
        assert decoy.wait(timeout=120) == 0
        # closed sockets' inodes are freed by RCU callbacks, after grace periods
        wait_freed(watcher, watcher_out, SOCKETS)
        record.send_signal(signal.SIGINT)
        exit_code = record.wait(timeout=120)
        skipped = skipped_runs_of(bpftrace.pid)
        theirs = stop_bpftrace(bpftrace, bpftrace_out)
        work.stdin.write(b"end\n")
        work.stdin.close()
        work.stdout.close()
        assert work.wait(timeout=60) == 0
    return Recorded(
        pid=work.pid,
        directory=directory,
        records=read_record_set(directory),
        bpftrace=theirs,
        bpftrace_skipped=skipped,
        summary=(tmp / "record.out").read_text() + err.read_text(),
        exit_code=exit_code,
    )


def skipped_runs(summary: str) -> dict[str, int]:
    """The summary's count of handler runs the kernel skipped, by handler."""
    for line in summary.splitlines():
        if line.startswith("runs the kernel skipped"):
            pairs = line.split(": ", 1)[1].split(", ")
            return {name: int(count) for name, count in (pair.rsplit(" ", 1) for pair in pairs)}
    return {}


def test_records_in_the_pids_context_equal_bpftrace_counts_per_tracepoint(
    recorded: Recorded,
) -> None:
    # GIVEN the records of the exerciser's pid, and bpftrace's counts for it
    assert recorded.exit_code == 0, recorded.summary
    recs = recorded.records.records
    mine = recs[recs["pid"] == recorded.pid]
    assert len(mine) and mine["has_task"].all()
    # WHEN records are counted per tracepoint
    ours = {
        name: int(((mine["event_id"] == eid) & (mine["type_id"] == tid)).sum())
        for name, (eid, tid) in RECORD_OF.items()
    }
    theirs = {name: recorded.bpftrace.get(name, 0) for name in RECORD_OF}
    theirs["mm_page_free"] += recorded.bpftrace.get("mm_page_free_batched", 0)
    # THEN they are equal, tracepoint by tracepoint, but for the runs the
    # kernel skipped of either tracer's programs (an interrupt freeing in the
    # exerciser's context while a handler runs on its CPU; each says how
    # many, over every process)
    skipped = skipped_runs(recorded.summary)
    ours_skipped = {name: skipped.get(f"tracepoint:kmem:{name}", 0) for name in RECORD_OF}
    ours_skipped["mm_page_free"] += skipped.get("tracepoint:kmem:mm_page_free_batched", 0)
    for name in RECORD_OF:
        assert theirs[name] - ours_skipped[name] <= ours[name], (name, ours, theirs, skipped)
    assert sum(ours.values()) - sum(theirs.values()) <= recorded.bpftrace_skipped, (
        ours,
        theirs,
        recorded.bpftrace_skipped,
    )
    if not recorded.bpftrace_skipped and not skipped:
        assert ours == theirs
    assert ours["kmem_cache_alloc"] >= SOCKETS and ours["kmalloc"] >= PIPES


def test_socket_inodes_are_counted_per_call_site_and_their_rcu_frees_follow_the_pointer(
    recorded: Recorded,
) -> None:
    # GIVEN the record set, named with the kallsyms saved beside it
    rs = recorded.records
    assert rs.kallsyms
    report = analyse(rs, KernelSymbols(rs.kallsyms))
    # (the streaming pass that `report` runs says the same)
    assert stream_report(
        open_record_set(recorded.directory), KernelSymbols(rs.kallsyms)
    ).as_json() == (report.as_json())
    # WHEN the call site allocating socket inodes is looked up
    sites = [s for s in report.kernel.sites if s.symbol.startswith("sock_alloc_inode+")]
    # THEN it made exactly one inode per socket() of the traced pid (none of
    # the decoy's), and each was freed, whoever ran the RCU callback
    assert len(sites) == 1
    assert sites[0].allocs == SOCKETS
    # (an RCU callback freeing in an interrupt while a BPF program - ours or
    # bpftrace's - runs on that CPU is skipped by the kernel, which counts it)
    skipped = skipped_runs(recorded.summary).get("tracepoint:kmem:kmem_cache_free", 0)
    assert SOCKETS - skipped <= sites[0].frees <= SOCKETS, (sites[0].frees, skipped)
    if not skipped:
        assert (sites[0].frees, sites[0].outstanding) == (SOCKETS, 0)
    # AND the in-kernel aggregation that `record` printed says the same (the
    # same program counted and recorded each free, so a skipped run is
    # missing from both)
    row = next(line for line in recorded.summary.splitlines() if line.startswith(sites[0].symbol))
    cells = row.split()
    assert (cells[1], int(cells[2]), int(cells[3])) == ("cache", SOCKETS, sites[0].frees)


def test_report_on_a_copy_with_proc_kallsyms_unreadable_names_call_sites(
    recorded: Recorded, tmp_path: Path
) -> None:
    # GIVEN a copy of the record set, and a mount namespace where
    # /proc/kallsyms reads empty
    copy = tmp_path / "copy"
    shutil.copytree(recorded.directory, copy)
    script = 'mount --bind /dev/null /proc/kallsyms && exec "$@"'
    # WHEN report runs there
    done = subprocess.run(
        [
            "unshare",
            "--mount",
            "sh",
            "-c",
            script,
            "sh",
            *MTRACE,
            "report",
            str(copy),
            "--format",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    # THEN it still names the kernel call sites, from the saved copy
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    symbols = {site["symbol"] for site in doc["kernel"]["call_sites"]}
    assert any(s.startswith("sock_alloc_inode+") for s in symbols)
    assert doc["records"] == len(recorded.records.records)


ALLOCINFO_LINE = re.compile(r"^ *\d+ +\d+ \S+(?: \[\w+\])? func:\S+$")


def test_allocinfo_lines_carry_bytes_calls_location_and_function(recorded: Recorded) -> None:
    # WHEN the record set is reported as /proc/allocinfo lines
    done = subprocess.run(
        [*MTRACE, "report", str(recorded.directory), "--format", "allocinfo"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    # THEN the header is allocinfo's and every line parses as allocinfo does
    assert done.returncode == 0, done.stderr
    header, columns, *lines = done.stdout.splitlines()
    assert (header, columns) == ("allocinfo - version: 1.0", "#     <size>  <calls> <tag info>")
    assert lines and all(ALLOCINFO_LINE.match(line) for line in lines), lines[:5]
    # AND the socket inodes, all freed, hold nothing (unless the kernel
    # skipped the handler for some frees, and says how many)
    inode = next(line for line in lines if "func:sock_alloc_inode" in line)
    live_bytes, live_calls = map(int, inode.split()[:2])
    skipped = skipped_runs(recorded.summary).get("tracepoint:kmem:kmem_cache_free", 0)
    assert live_calls <= skipped and (live_calls == 0) == (live_bytes == 0)


def test_kmemtrace_while_tracing_libc_writes_the_probes_events_as_records(
    probe_exerciser: Path, tmp_path: Path
) -> None:
    # GIVEN the probe exerciser run under the SDT glibc with --kmemtrace
    directory = tmp_path / "records"
    truth_file = tmp_path / "truth.json"
    done = subprocess.run(
        [
            *MTRACE,
            "run",
            "--sdt-glibc",
            "--probes",
            "memory_*",
            "--kmemtrace",
            str(directory),
            "-o",
            "summary",
            "--",
            str(probe_exerciser),
            "--out",
            str(truth_file),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    ground = json.loads(truth_file.read_text())
    truth = {name: e["count"] for name, e in ground["probes"].items()}
    # WHEN the record set is read back
    rs = read_record_set(directory)
    recs = rs.records

    def count(event_id: int, type_id: int) -> int:
        return int(((recs["event_id"] == event_id) & (recs["type_id"] == type_id)).sum())

    # THEN sbrk, heap and arena events are allocation and free records, one per hit
    assert count(EventId.ALLOC, TypeId.SBRK) == truth["memory_sbrk_more"]
    assert count(EventId.FREE, TypeId.SBRK) == truth["memory_sbrk_less"]
    assert count(EventId.ALLOC, TypeId.HEAP) == truth["memory_heap_new"]
    assert count(EventId.FREE, TypeId.HEAP) == truth["memory_heap_free"]
    assert count(EventId.ALLOC, TypeId.ARENA) == truth["memory_arena_new"]
    # AND every other probe is an event id 2 record, numbered by libc_probes
    probes = recs[recs["event_id"] == EventId.PROBE]
    mallopt = rs.libc_probes.index("memory_mallopt")
    assert int((probes["probe"] == mallopt).sum()) == truth["memory_mallopt"]
    # AND the exerciser's kernel events of the same run are there too, in one sequence
    mine = recs[recs["pid"] == ground["pid"]]
    assert (mine["type_id"] <= TypeId.PAGES).any() and (mine["type_id"] > TypeId.PAGES).any()
    assert recs["seq"].tolist() == list(range(len(recs)))
    assert rs.total_overruns == 0


def test_a_system_wide_record_with_room_for_every_event_loses_none(
    kmem_exerciser: Path, tmp_path: Path
) -> None:
    # GIVEN `record --all` with room in the kernel for every record of the
    # run: 512 MiB, where 50,000 socket and pipe pairs make about 1.6 M
    # records of 96 bytes, many in bursts (RCU callbacks freeing in softirq)
    pairs = 50_000
    with Reaper() as reaper:
        err = tmp_path / "record.err"
        with open(err, "wb") as sink:
            record = reaper.add(subprocess.Popen(
                [*MTRACE, "record", "--all", "--buffer-pages", "131072", "-o",
                 str(tmp_path / "records")], stdout=sink, stderr=subprocess.STDOUT,
            ))  # fmt: skip
        wait_for_line(err, "Ctrl-C to stop", record, timeout=120)
        # WHEN the workload runs to its end and the record stops
        done = subprocess.run([str(kmem_exerciser), "--sockets", str(pairs), "--pipes",
                               str(pairs), "--out", str(tmp_path / "truth.json")],
                              capture_output=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr
        record.send_signal(signal.SIGINT)
        assert record.wait(timeout=120) == 0
    said = err.read_text()
    found = re.search(
        r"kmemtrace: (\d+) records in .* \((\d+) kmem events delivered, (\d+) lost", said
    )
    assert found, said
    records, delivered, lost = (int(x) for x in found.groups())
    # THEN every event reached the files: none lost, and at least the
    # workload's sockets and pipes are there
    assert lost == 0, said
    assert records >= delivered >= 4 * pairs, said
    assert open_record_set(tmp_path / "records").total_overruns == 0
