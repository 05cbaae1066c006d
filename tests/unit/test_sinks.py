"""Each output of a live trace, fed plain data through the sink interface
(exporters/data/sink.py): no BPF program, no root."""

from __future__ import annotations

import io
import json
import os
import re
import urllib.request
from dataclasses import replace
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner
from mtrace_live.exporters import registry
from mtrace_live.exporters.data.alloc_snapshot import ProcessAllocs
from mtrace_live.exporters.data.kallsyms import KernelSymbols
from mtrace_live.exporters.data.kmem import KmemTotals
from mtrace_live.exporters.data.lock_waits import LockWaits, ThreadTime
from mtrace_live.exporters.data.sink import KmemResult, ProcessHits, Sink
from mtrace_live.exporters.kmemtrace.reader import read_record_set
from mtrace_live.exporters.kmemtrace.sink import KmemtraceSink
from mtrace_live.exporters.lines import JsonLines, TextLines
from mtrace_live.exporters.live_view import LiveView
from mtrace_live.exporters.prometheus_sink import (
    ExportOptions,
    MetricsSource,
    PrometheusSink,
    new_registry,
)
from mtrace_live.exporters.sprtrace.sink import SpRtraceSink
from mtrace_live.exporters.sprtrace.text import parse
from mtrace_live.exporters.summary import SummarySink
from mtrace_live.exporters.web import MetricsEndpoint, WebConfig
from mtrace_live.probes.errors import OutputClosedError
from mtrace_live.tracer.commands import options
from mtrace_live.tracer.loop.live import Fanout
from mtrace_live.tracer.loop.model import AllocatorModel
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from .sink_fixtures import (
    PID,
    PROBES,
    PlainCounters,
    alloc_snapshot,
    batch,
    kmem_records,
    probe_records,
    result,
    trace_info,
)

ARENA = 0x7F1234000030
MAIN = 0x7F12389FEC60

# A short session of one process: an arena made, waited for, contended;
# sbrk growth, a retry, a setting, a double-free check, mallopt.
SESSION = [
    ("memory_arena_new", (ARENA, 1024)),
    ("memory_arena_reuse_wait", (ARENA, ARENA, 0)),
    ("lll_lock_wait_private", (ARENA,)),
    ("lll_lock_wait_private", (ARENA,)),
    ("lll_lock_wait_private", (MAIN,)),
    ("memory_sbrk_more", (0x55550000, 135168)),
    ("memory_malloc_retry", (4096,)),
    ("memory_mallopt_arena_max", (2, 0)),
    ("memory_tcache_double_free", (0x5555AAAA, 3)),
    ("memory_mallopt", (-8, 2)),
]


def model_for(info: object) -> AllocatorModel:
    from mtrace_live.exporters.data.events import EventDecoder

    model = AllocatorModel(EventDecoder(info.sites), PROBES)  # type: ignore[attr-defined]
    return model


def test_the_model_applies_each_probes_effect_by_argument_name() -> None:
    # GIVEN the model as the first sink of a trace
    info = trace_info()
    model = model_for(info)
    # WHEN a session's events arrive, kmem events among them
    records = np.concatenate([probe_records(SESSION), kmem_records(3)])
    model.consume(batch(records, info))
    # THEN each probe changed what its catalog effect says
    state = model.processes[PID]
    assert state.arenas[ARENA].created_for == 1024
    assert state.arenas[ARENA].reuse_waits == 1
    assert state.lock_waits == {ARENA: 2, MAIN: 1}
    assert state.sbrk_grown == 135168
    assert dict(state.retries) == {"malloc": 1}
    assert [(c.setting, c.old, c.new) for c in state.settings] == [
        ("M_ARENA_MAX", 0, 2), ("mallopt(M_ARENA_MAX)", None, 2)]  # fmt: skip
    # mallopt's M_ARENA_MAX is the limit in force until the memory is read
    assert (state.arena_limit, state.arena_limit_source) == (2, "mallopt M_ARENA_MAX")
    assert [(c.pointer, c.tcache_bin) for c in state.double_frees] == [(0x5555AAAA, 3)]
    assert state.double_free_checks == 1
    # AND the kmem events were not counted as probe hits
    assert model.events == len(SESSION)
    assert sum(state.counts.values()) == len(SESSION)


def test_text_and_json_lines_show_every_libc_event() -> None:
    info = trace_info()
    records = np.concatenate([probe_records(SESSION), kmem_records(2)])
    text, as_json = TextLines(), JsonLines()
    text.stream, as_json.stream = io.StringIO(), io.StringIO()
    for sink in (text, as_json):
        sink.start(info)
        sink.consume(batch(records, info))
    # THEN one line per libc event, and a header for the text
    lines = text.stream.getvalue().splitlines()  # type: ignore[attr-defined]
    assert lines[0].split()[:4] == ["TIME(s)", "PID", "TID", "CPU"]
    assert [line.split()[4] for line in lines[1:]] == [probe for probe, _ in SESSION]
    assert "size=135168" in lines[6] and "brk=0x55550000" in lines[6]
    documents = [json.loads(line) for line in as_json.stream.getvalue().splitlines()]  # type: ignore[attr-defined]
    assert [d["probe"] for d in documents] == [probe for probe, _ in SESSION]
    assert documents[-1]["args"] == {"param_number": -8, "value": 2}
    assert text.written == as_json.written == len(SESSION)


def test_the_summary_prints_the_probes_and_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    info = trace_info()
    model = model_for(info)
    model.consume(batch(probe_records(SESSION), info))
    info = trace_info(allocators=model.state)
    SummarySink().finish(result(info, {"lll_lock_wait_private": 3, "memory_sbrk_more": 1}))
    out = capsys.readouterr().out
    assert "events: 4 in the kernel, 4 delivered, 0 lost" in out
    assert f"pid {PID}" in out and f"{ARENA:#x}" in out
    assert "sbrk: grown 135168 bytes" in out
    assert "retries: malloc 1" in out


def last_frame(written: str) -> str:
    """The text of the last screen drawn on a terminal: what follows the last
    move of the cursor home, less the escape sequences."""
    frame = written.rsplit("\x1b[H", 1)[-1]
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", frame)


def screen_rows(text: str, first: str) -> list[list[str]]:
    """The cells of each table row on ``text`` whose first cell is ``first``."""
    rows = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in re.split(r"[│┃]", line)[1:-1]]
        if cells and cells[0] == first:
            rows.append(cells)
    return rows


def test_the_live_view_draws_lock_waits_per_arena_and_the_allocations() -> None:
    # GIVEN counters and allocations held in memory, and a model with one arena
    counters = PlainCounters(hits={"lll_lock_wait_private": 3, "memory_arena_new": 1},
                             snapshot=alloc_snapshot(0x401234))  # fmt: skip
    info = trace_info(counters, interval=1e-9, allocs=True)
    model = model_for(info)
    model.consume(batch(probe_records(SESSION), info))
    info = trace_info(counters, interval=1e-9, allocators=model.state, allocs=True)
    terminal = io.StringIO()
    view = LiveView(Console(file=terminal, width=160, height=100, force_terminal=True))
    # WHEN it starts, and ticks once the events have come
    view.start(info)
    view.consume(batch(probe_records(SESSION), info))
    view.tick()
    screen = last_frame(terminal.getvalue())
    view.finish(result(info, counters.hits))
    # THEN the screen tick() drew holds the arena with its two lock waits
    # (and a rate: they came since the start) and its reuse wait; MAIN's
    # wait went to no arena (no arena_new named it, and this trace has no
    # main arena's address)
    arenas = {row[1]: row for row in screen_rows(screen, str(PID)) if row[1].startswith("0x")}
    assert list(arenas) == [f"{ARENA:#x}"]
    assert arenas[f"{ARENA:#x}"][2:6] == ["0", "0", "1", "2"]
    assert float(arenas[f"{ARENA:#x}"][6]) > 0
    # AND the probes' totals, as the counters read
    (waits,) = screen_rows(screen, "lll_lock_wait_private")
    assert waits[2:] == ["3", "0"]
    # AND the process's allocations: 25,600 bytes live, 607 frees, 7 unknown,
    # none past a full table
    (process,) = [row for row in screen_rows(screen, str(PID)) if len(row) == 10]
    assert (process[2], process[5], process[6], process[7]) == ("25.0KiB", "607", "7", "0")
    # AND the stack holding them, in both stack tables: 25,600 bytes live in
    # 400 blocks, of 1,000 calls, allocating (64,000 bytes since the start)
    stacks = [[c.strip() for c in re.split(r"[│┃]", line)[1:-1]]
              for line in screen.splitlines() if "0x401234" in line]  # fmt: skip
    assert len(stacks) == 2
    for live, blocks, _, rate, calls, pid, function, frames in stacks:
        assert (live, blocks, calls, pid, function, frames) == (
            "25.0KiB", "400", "1000", str(PID), "malloc", "0x401234")  # fmt: skip
        assert rate.endswith("/s") and rate != "0B/s"
    assert view.written == len(SESSION)


def test_kmemtrace_records_read_back(tmp_path: Path) -> None:
    # GIVEN the kmemtrace output of a trace with libc and kmem events
    info = trace_info(kmem=True, kmem_records=True)
    sink = KmemtraceSink(tmp_path / "set")
    sink.start(info)
    records = np.concatenate([probe_records(SESSION[:6]), kmem_records(4)])
    sink.consume(batch(records, info))
    totals = KmemTotals(sites=[], lost_allocs=1)
    done = result(info, {"memory_sbrk_more": 2}, {"memory_sbrk_more": 1},
                  kmem=KmemResult(totals, delivered=4, lost=1))  # fmt: skip
    sink.finish(done)
    # THEN the set holds every record, and the losses as bytes
    read = read_record_set(tmp_path / "set")
    assert len(read.unordered) == len(records)
    assert read.libc_probes == list(PROBES)
    assert done.kmem is not None and done.kmem.records_written == len(records)
    assert read.total_overruns == done.kmem.overrun_bytes == 2 * 72  # one alloc lost twice over


def test_kmemtrace_refuses_a_directory_holding_a_set(tmp_path: Path) -> None:
    (tmp_path / "cpu0").write_bytes(b"")
    from mtrace_live.probes.errors import RecordSetError

    with pytest.raises(RecordSetError, match="already holds a record set"):
        KmemtraceSink(tmp_path)


def test_sp_rtrace_report_parses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(KernelSymbols, "load", classmethod(lambda cls, path=None: KernelSymbols(
        "ffffffff81234500 T some_function\n")))  # fmt: skip
    info = trace_info(kmem=True, kmem_records=True, libc=None, probes=())
    sink = SpRtraceSink(tmp_path / "report.txt")
    sink.start(info)
    sink.consume(batch(kmem_records(3), info))
    sink.finish(result(info, {}, kmem=KmemResult(KmemTotals(sites=[]), 3, 2)))
    trace = parse((tmp_path / "report.txt").read_text().splitlines())
    assert trace.header["pid"] == str(PID)
    assert [(c.function, c.size) for c in trace.calls] == [("kmalloc", 40)] * 3
    assert "## 2 events lost" in (tmp_path / "report.txt").read_text()


def test_prometheus_metrics_are_served_from_plain_counters() -> None:
    # GIVEN counters and a model held in memory, and an endpoint on a free port
    counters = PlainCounters(
        hits={"lll_lock_wait_private": 3, "memory_malloc_retry": 1},
        processes=[ProcessHits(PID, PROBES.index("lll_lock_wait_private"), 3, "worker")],
    )
    info = trace_info(counters)
    model = model_for(info)
    model.consume(batch(probe_records(SESSION), info))
    info = trace_info(counters, allocators=model.state)
    endpoint = MetricsEndpoint("127.0.0.1:0", new_registry(), WebConfig())
    sink = PrometheusSink(endpoint, ExportOptions("127.0.0.1:0"), KernelSymbols(""))
    # WHEN the sink starts and Prometheus scrapes
    sink.start(info)
    try:
        with urllib.request.urlopen(endpoint.url, timeout=10) as reply:
            text = reply.read().decode()
        only = endpoint.url + "?name[]=mtrace_libc_probe_hits_total"
        with urllib.request.urlopen(only, timeout=10) as reply:
            filtered = reply.read().decode()
    finally:
        sink.finish(result(info, counters.hits))
    # THEN the figures are the counters' and the model's
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("mtrace_libc_probe_hits_total", (("probe", "lll_lock_wait_private"),))] == 3
    assert samples[("mtrace_libc_arenas", (("process", "worker"),))] >= 1
    # AND a name[] query still gets the whole page: every family and series
    # of the first scrape, with the same values
    again = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(filtered)
        for s in family.samples
    }
    assert again == samples and len(samples) > 20


def test_a_sink_whose_reader_is_gone_stops_getting_batches() -> None:
    class Broken(Sink):
        written = 7

        def consume(self, batch: object) -> None:
            raise BrokenPipeError

    class Counting(Sink):
        batches = 0

        def consume(self, batch: object) -> None:
            self.batches += 1

    info = trace_info()
    counting, broken = Counting(), Broken()
    fanout = Fanout([counting, broken])
    for _ in range(3):
        fanout.consume(batch(probe_records(SESSION[:1]), info))
    assert counting.batches == 3
    assert fanout.open == [counting]
    assert fanout.closed is not None and "after 7 events" in str(fanout.closed)


def test_a_reader_gone_before_the_last_lines_is_a_closed_output_not_a_fault() -> None:
    # GIVEN an output whose reader goes away as the trace writes its last
    # lines (`run -o json -- true | head -1`: the tables at the end)
    class LastLinesBroken(Sink):
        written = 1

        def finish(self, result: object) -> None:
            raise BrokenPipeError

    class Finishing(Sink):
        finished = False

        def finish(self, result: object) -> None:
            self.finished = True

    broken, finishing = LastLinesBroken(), Finishing()
    fanout = Fanout([broken, finishing])
    # WHEN the trace ends
    fanout.finish(result(trace_info(), {}))
    # THEN it ends as a closed output (exit code 12), not as a fault of its
    # own, and the outputs after it still finish
    assert isinstance(fanout.closed, OutputClosedError) and fanout.failed is None
    assert fanout.closed.exit_code == 12 and "after 1 events" in str(fanout.closed)
    assert finishing.finished


class ToySink(Sink):
    """An output a user adds: hits per probe, written at the end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: dict[str, int] = {}

    def consume(self, batch: object) -> None:
        for event in batch.events():  # type: ignore[attr-defined]
            self.seen[event.probe] = self.seen.get(event.probe, 0) + 1

    def finish(self, result: object) -> None:
        self.path.write_text(json.dumps(self.seen))


def test_a_new_output_is_one_module_and_one_registration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN one more entry in the registry
    toy = registry.FileOutput("toy", "FILE", "Hits per probe, as JSON.", f"{__name__}:ToySink")
    monkeypatch.setattr(registry, "FILE_OUTPUTS", (*registry.FILE_OUTPUTS, toy))

    # WHEN a trace command declares the outputs' options
    @click.command()
    @options.output_options
    def command(**params: object) -> None:
        for name, path in options.file_outputs(params):
            sink = registry.file_sink(name, path)
            info = trace_info()
            sink.start(info)
            sink.consume(batch(probe_records(SESSION), info))
            sink.finish(result(info, {}))

    done = CliRunner().invoke(command, ["--toy", str(tmp_path / "toy.json")])
    # THEN the option exists, and the sink wrote what it saw
    assert done.exit_code == 0, done.output
    assert json.loads((tmp_path / "toy.json").read_text())["lll_lock_wait_private"] == 3


@pytest.mark.parametrize("entry", [*registry.STREAMS, *registry.FILE_OUTPUTS], ids=lambda e: e.name)
def test_every_registered_output_is_a_sink(entry: object) -> None:
    cls = registry._load(entry.sink)  # type: ignore[attr-defined]
    assert issubclass(cls, Sink)


def test_event_times_are_exact_exactly_when_an_output_writes_them(tmp_path: Path) -> None:
    from mtrace_live.tracer.loop.plan import TraceRequest

    # outputs that print or write each event's time ask for the exact clock
    for output in ("text", "json"):
        assert TraceRequest(output=output).exact_times
    for name in ("kmemtrace", "sp-rtrace"):
        assert TraceRequest(output="summary", files=((name, tmp_path / name),)).exact_times
    # the views, the summary, serve and the pprof file get the tick clock
    for output in ("live", "summary"):
        assert not TraceRequest(output=output).exact_times
    assert not TraceRequest(output="summary", files=(("pprof", tmp_path / "p"),)).exact_times


def test_serve_retires_the_kernel_rows_of_processes_gone_and_keeps_their_counts() -> None:
    # GIVEN the kernel's rows of a process still here and of one gone (PID,
    # beyond any pid_max), which only the kernel named ("child")
    here = os.getpid()
    gone = ProcessAllocs(PID, 100, 6_400, 90, 2, 1, comm="child")
    alive = ProcessAllocs(here, 10, 640, 5, 0, 0, comm="pytest")
    snapshot = replace(alloc_snapshot(0x401234), processes=(gone, alive),
                       vm={PID: {"mmap_calls": 3}})  # fmt: skip
    waits = LockWaits(threads={PID: ThreadTime(PID, 5_000, 7_000, 2, 0),
                               here: ThreadTime(here, 5_000, 9_000, 1, 1)})  # fmt: skip
    counters = PlainCounters(snapshot=snapshot, waits=waits)
    source = MetricsSource(trace_info(counters, allocs=True), KernelSymbols(""), read_interval=0)
    before = source.snapshot()
    assert before.allocs is not None and before.allocs.processes["child"]["calls"] == 100
    # WHEN housekeeping sees it gone twice (its last events drained between)
    source.housekeep()
    assert counters.forgotten == []
    source.housekeep()
    # THEN its rows are taken out of the kernel's tables, the live one's kept
    assert counters.forgotten == [{PID}]
    assert [p.tgid for p in counters.snapshot.processes] == [here]
    # AND every count stays under its name: none goes down, none is counted twice
    after = source.snapshot()
    assert after.allocs is not None and after.locks is not None
    for key in ("calls", "bytes", "frees", "unknown_frees", "failed", "vm_mmap_calls"):
        assert after.allocs.processes["child"][key] == before.allocs.processes["child"][key], key
    assert after.allocs.processes["child"]["calls"] == 100
    assert after.locks["child"].thread_ns == 7_000
    assert "unknown" not in after.allocs.processes


def test_a_pid_retired_while_scraped_is_not_named_after_its_old_process() -> None:
    # GIVEN the kernel's row of a process gone, seen gone once already
    gone = ProcessAllocs(PID, 100, 6_400, 90, 2, 1, comm="child")
    counters = PlainCounters(snapshot=replace(alloc_snapshot(0x401234), processes=(gone,)))
    source = MetricsSource(trace_info(counters, allocs=True), KernelSymbols(""), read_interval=0)
    source.housekeep()
    # WHEN a scrape reads the tables between housekeeping's two steps (the
    # process retired, its kernel rows not yet taken out)
    retiring = source._retire()
    assert retiring == {PID: "child"}
    scraped = source.snapshot()
    assert scraped.allocs is not None and scraped.allocs.processes["child"]["calls"] == 100
    source._retire_kernel_rows(retiring)
    # AND another program is given the pid later
    newcomer = ProcessAllocs(PID, 7, 70, 0, 0, 0, comm="other")
    counters.snapshot = replace(counters.snapshot, processes=(newcomer,))
    after = source.snapshot()
    # THEN its calls are its own, and the old process's stay as they were
    assert after.allocs is not None
    assert after.allocs.processes["other"]["calls"] == 7
    assert after.allocs.processes["child"]["calls"] == 100
