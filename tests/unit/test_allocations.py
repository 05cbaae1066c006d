"""The allocation outputs on plain data (no root): the tables, stacks cut at
garbage frames, the pprof profile read back, the Prometheus families, the
JSON tables and events, the sampling intervals, the live view's panel, and
the tail-call detection that decides which functions get a probe."""

from __future__ import annotations

import dataclasses
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
from mtrace_live.exporters import alloc_table
from mtrace_live.exporters.alloc_view import AllocPanel, sparkline
from mtrace_live.exporters.data.alloc_snapshot import (
    AllocSnapshot,
    FrameNames,
    Outstanding,
    ProcessAllocs,
    StackRow,
    trimmed,
)
from mtrace_live.exporters.data.events import EventDecoder
from mtrace_live.exporters.data.symbolize import Symbol
from mtrace_live.exporters.lines import stack_table_json
from mtrace_live.exporters.pprof import build_profile
from mtrace_live.exporters.prometheus import AllocFigures, MtraceCollector
from mtrace_live.probes.alloc_sites import alloc_sites, tail_call
from mtrace_live.probes.records import (
    ALLOC_PROC_DTYPE,
    ALLOC_STACK_ROW_DTYPE,
    EVENT_DTYPE,
    VM_PROC_DTYPE,
    AllocArg,
    AllocFn,
    EventKind,
)
from mtrace_live.tracer.loop.alloc_probes import (
    StackReader,
    plan_sites,
    read_snapshot,
    sample_intervals,
)
from prometheus_client import CollectorRegistry
from rich.console import Console

from .needs import needs
from .profile_proto import parsed

PID = 4242
MAIN, LEAKER, CHURN, GARBAGE = 0x401000, 0x401100, 0x401200, 0xDEAD0000BEEF


class KnownNames(FrameNames):
    """Names from a table: addresses below 0x500000 are in the program."""

    def resolve(self, tgid: int, address: int) -> Symbol | None:
        if address >= 0x500000:
            return None
        function = {MAIN: "main", LEAKER: "leaker", CHURN: "churn"}.get(address & ~0xFF)
        return Symbol("/usr/bin/prog", function, address & 0xFF, "prog.c:7", (0x400000, 0x500000))


def row(site: int, frames: tuple[int, ...], calls: int, size: int, frees: int) -> StackRow:
    return StackRow(PID, "malloc", site, (site, *frames), calls, calls * size, calls * size,
                    frees, frees * size, frees * size, 0)  # fmt: skip


def snapshot(**changes: object) -> AllocSnapshot:
    rows = (
        row(LEAKER + 0x10, (MAIN + 0x20,), 100, 64, 40),
        row(LEAKER + 0x10, (MAIN + 0x20, GARBAGE), 50, 64, 10),  # the same site, garbage after
        row(CHURN + 0x8, (MAIN + 0x30,), 1000, 32, 1000),
    )
    frames = (LEAKER + 0x10, MAIN + 0x20)
    held = tuple(Outstanding(PID, 0x10000 + i, 64, 64, 1_000_000_000 * i, PID, "malloc",
                             LEAKER + 0x10, frames) for i in range(3))  # fmt: skip
    snap = AllocSnapshot(
        stacks=rows,
        processes=(ProcessAllocs(PID, 1150, 1150 * 64, 1050, 7, 0),),
        calls={"malloc": 1150, "free": 1057},
        misc={"outstanding_full": 0, "stacks_full": 0, "lost_events": 0, "nested": 0},
        sample_bytes=0,
        now_ns=10_000_000_000,
        started_ns=0,
        outstanding=held,
        outstanding_read=True,
    )
    for key, value in changes.items():
        object.__setattr__(snap, key, value)
    return snap


def test_stacks_are_cut_at_their_first_frame_outside_the_program_and_merged() -> None:
    # GIVEN two rows of one call site, one with a garbage frame after main
    merged = trimmed(snapshot(), KnownNames())
    # THEN they become one row, their counts summed
    leaker = [r for r in merged.stacks if r.call_site == LEAKER + 0x10]
    assert len(leaker) == 1
    assert leaker[0].frames == (LEAKER + 0x10, MAIN + 0x20)
    assert (leaker[0].calls, leaker[0].frees, leaker[0].live_bytes) == (150, 50, 100 * 64)


def test_the_summary_lists_top_stacks_and_what_was_never_freed() -> None:
    snap = trimmed(snapshot(), KnownNames())
    lines = alloc_table.alloc_summary_lines(snap, KnownNames(), command_ended=True)
    text = "\n".join(lines)
    assert "allocations: pid 4242: 1150 calls" in text and "7 of memory allocated before" in text
    top = lines[lines.index("top call stacks by live bytes:") + 2]
    assert top.split()[:3] == ["6.2KiB", "100", "150"] and "leaker+0x10 (prog.c:7) < main" in top
    never = text.split("never freed, by stack (the command has ended):")[1].splitlines()
    # three outstanding blocks of 64 bytes, the oldest allocated at 0 s, now 10 s
    assert never[2].split()[:3] == ["192B", "3", "10.0s"]


def test_leaks_older_than_keeps_only_the_old_ones() -> None:
    snap = snapshot()
    groups = alloc_table.leak_groups(snap.outstanding, snap.now_ns, older_than_s=8.5)
    assert [(g.blocks, g.bytes) for g in groups] == [(2, 128)]


def test_the_pprof_profile_reads_back_with_the_four_sample_types(tmp_path: Path) -> None:
    # GIVEN the profile of the snapshot, written gzipped
    snap = trimmed(snapshot(), KnownNames())
    path = tmp_path / "heap.pb.gz"
    path.write_bytes(build_profile(snap, KnownNames(), 5_000_000_000))
    # WHEN it is parsed back as a profile.proto Profile
    profile = parsed(path.read_bytes())
    strings = list(profile.string_table)
    types = [(strings[t.type], strings[t.unit]) for t in profile.sample_type]
    # THEN its types are a heap profile's, inuse_space the default
    assert types == [("alloc_objects", "count"), ("alloc_space", "bytes"),
                     ("inuse_objects", "count"), ("inuse_space", "bytes")]  # fmt: skip
    assert strings[profile.default_sample_type] == "inuse_space"
    # AND each sample's leaf is the call site's function, its values the row's
    functions = {f.id: strings[f.name] for f in profile.function}
    locations = {loc.id: loc for loc in profile.location}
    by_leaf = {}
    for sample in profile.sample:
        leaf = locations[sample.location_id[0]]
        by_leaf[functions[leaf.line[0].function_id]] = list(sample.value)
    assert by_leaf["leaker"] == [150, 150 * 64, 100, 100 * 64]
    assert by_leaf["churn"] == [1000, 32000, 0, 0]
    assert profile.duration_nanos == 5_000_000_000


def test_prometheus_families_by_process_and_top_stacks() -> None:
    figures = AllocFigures(
        processes={"prog": {"calls": 10, "bytes": 640, "frees": 4, "unknown_frees": 1,
                            "failed": 0, "live_bytes": 384, "live_objects": 6}},
        stacks=[("prog", "malloc", f"f{i} < main", "jemalloc", "libjemalloc.so.2", 100 - i)
                for i in range(5)],
        dropped={"outstanding": 2, "stacks": 0},
        sampled=False,
        allocators={"prog": ("jemalloc", "libjemalloc.so.2")},
    )  # fmt: skip
    registry = CollectorRegistry()
    collector = MtraceCollector(lambda: None, top_stacks=3)  # type: ignore[arg-type]
    registry.register(collector)
    collector.collect = lambda: collector._allocs(figures)  # type: ignore[method-assign]
    value = registry.get_sample_value
    # each process's families carry its allocator and the allocator's file
    prog = {"process": "prog", "allocator": "jemalloc", "allocator_lib": "libjemalloc.so.2"}
    assert value("mtrace_alloc_calls_total", prog) == 10
    assert value("mtrace_alloc_live_bytes", prog) == 384
    assert value("mtrace_alloc_table_dropped_total", {"table": "outstanding"}) == 2
    # each stack carries the provider its calls went to
    stack = {
        "process": "prog",
        "alloc_function": "malloc",
        "stack": "f0 < main",
        "allocator": "jemalloc",
        "allocator_lib": "libjemalloc.so.2",
    }
    assert value("mtrace_alloc_stack_live_bytes", stack) == 100
    # beyond --top-stacks, the rest are summed under "other"
    other = {
        "process": "prog",
        "alloc_function": "other",
        "stack": "other",
        "allocator": "",
        "allocator_lib": "",
    }
    assert value("mtrace_alloc_stack_live_bytes", other) == 97 + 96


@pytest.mark.parametrize(
    ("from_start", "sample_bytes", "untracked", "said", "origins"),
    [
        (False, 0, 0, "(7 of memory allocated before the trace)", ["before_trace"]),
        (True, 0, 9, "(7 of blocks not tracked: the tables were full for 9 allocations, "
                     "see --max-outstanding)", ["untracked"]),
        (False, 0, 9, "(7 of blocks not tracked: allocated before the trace, or the tables "
                      "were full for 9 allocations, see --max-outstanding)",
         ["before_trace", "untracked"]),
        (True, 0, 0, "(7 of blocks not seen allocated)", []),
        (True, 4096, 0, "(7 of blocks not tracked: not sampled)", ["not_sampled"]),
    ],
    ids=["pid", "run, tables full", "pid, tables full", "run", "run, sampled"],
)  # fmt: skip
def test_frees_of_blocks_not_seen_allocated_say_what_they_can_be(
    from_start: bool, sample_bytes: int, untracked: int, said: str, origins: list[str]
) -> None:
    # GIVEN 7 frees of blocks not seen allocated, the process traced from its
    # start (run) or attached to, sampled or not, with allocations the tables
    # had no room for or none
    proc = ProcessAllocs(PID, 1150, 1150 * 64, 1050, 7, 0, untracked=untracked)
    snap = snapshot(processes=(proc,), traced_from_start=from_start, sample_bytes=sample_bytes)
    # WHEN the summary and the JSON tables are written
    (line,) = [x for x in alloc_table.alloc_process_lines(snap) if x.startswith("allocations:")]
    (table,) = [json.loads(x) for x in stack_table_json(snap, KnownNames())
                if '"alloc_processes"' in x]  # fmt: skip
    # THEN each says what those frees can be: before the trace only when the
    # process ran before it, a full table only when one was
    assert f"1050 frees {said};" in line
    assert (table["unknown_frees_of"], table["untracked"]) == (origins, untracked)


def test_json_tables_name_every_frame() -> None:
    snap = trimmed(snapshot(), KnownNames())
    lines = [json.loads(x) for x in stack_table_json(snap, KnownNames())]
    assert lines[0] == {"table": "alloc_processes", "pid": PID, "calls": 1150, "bytes": 73600,
                        "frees": 1050, "unknown_frees": 7,
                        "unknown_frees_of": ["before_trace"], "untracked": 0, "failed": 0,
                        "allocator": None, "allocator_lib": None,  # not known here
                        "providers": [],  # no stack says which provider it called
                        "syscalls": {}}  # fmt: skip
    assert lines[1]["table"] == "alloc_functions" and lines[1]["calls"]["malloc"] == 1150
    stacks = lines[2:]
    assert stacks[0]["live_bytes"] == 6400 and stacks[0]["frames"][0]["function"] == "leaker"
    assert stacks[0]["frames"][1]["location"] == "prog.c:7"


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mapped"])
def test_each_stack_row_names_the_provider_its_calls_went_to(mapped: bool) -> None:
    # GIVEN one process's malloc rows: one through jemalloc (provider 1, as
    # its sites' cookies say), two through the libc (provider 0), read
    # through the kernel or copied from the array's memory
    program = pid_100_tables(b"server", 1, [(1, 1, 1200), (0, 1, 3), (0, 1, 2)], mapped)
    reader = StackReader()
    reader.providers = [("glibc", "libc.so.6"), ("jemalloc", "libjemalloc.so.2")]
    # WHEN the tables are read, the process's malloc bound to jemalloc
    snapshot = read_snapshot(program, 0, 0, reader=reader)  # type: ignore[arg-type]
    snapshot = dataclasses.replace(snapshot, processes=tuple(
        dataclasses.replace(p, allocator="jemalloc", allocator_lib="libjemalloc.so.2")
        for p in snapshot.processes))  # fmt: skip
    # THEN each row says which provider its calls went to
    named = sorted((row.calls, row.provider, row.provider_lib) for row in snapshot.stacks)
    assert named == [(2, "glibc", "libc.so.6"), (3, "glibc", "libc.so.6"),
                     (1200, "jemalloc", "libjemalloc.so.2")]  # fmt: skip
    # AND the summary and JSON keep the providers apart, calls and bytes each
    (line,) = [x for x in alloc_table.alloc_process_lines(snapshot) if x.startswith("allocations:")]
    assert line.endswith(
        "; allocator: jemalloc (libjemalloc.so.2); by provider: jemalloc "
        "(libjemalloc.so.2) 1200 calls, 37.5KiB; glibc (libc.so.6) 5 calls, 160B"
    )
    (processes,) = [json.loads(x) for x in stack_table_json(snapshot, KnownNames())
                    if '"alloc_processes"' in x]  # fmt: skip
    assert processes["providers"] == [
        {"allocator": "jemalloc", "allocator_lib": "libjemalloc.so.2", "calls": 1200,
         "bytes": 38400},
        {"allocator": "glibc", "allocator_lib": "libc.so.6", "calls": 5, "bytes": 160}]  # fmt: skip


def test_alloc_and_free_records_decode_with_their_arguments() -> None:
    batch = np.zeros(3, dtype=EVENT_DTYPE)
    batch["kind"] = [EventKind.ALLOC, EventKind.FREE, EventKind.ALLOC]
    batch["probe"] = [AllocFn.REALLOC, AllocFn.FREE, AllocFn.MEMALIGN]
    batch["tgid"] = PID
    batch["ip"] = LEAKER
    allocated = [AllocArg.PTR, AllocArg.SIZE, AllocArg.AUX, AllocArg.WEIGHT]
    batch["args"][0, allocated] = [16, 48, 8, 48]
    batch["args"][1, [AllocArg.PTR, AllocArg.SIZE, AllocArg.SITE]] = [16, 48, CHURN]
    batch["args"][2, allocated] = [64, 100, 64, 100]
    realloc, free, memalign = EventDecoder(()).decode(batch)
    assert realloc.probe == "realloc" and realloc.args["old_ptr"] == 8
    assert realloc.args["size"] == 48 and realloc.args["call_site"] == LEAKER
    assert free.probe == "free" and free.args["allocated_at"] == CHURN
    assert memalign.args["alignment"] == 64


def test_sampling_intervals_are_exponential_with_the_asked_mean() -> None:
    intervals = sample_intervals(524288)
    assert len(intervals) == 1024
    mean = sum(intervals) / len(intervals)
    # the midpoints of 1024 quantiles: the mean within 0.1%, the median ln 2 of it
    assert abs(mean - 524288) / 524288 < 0.001
    assert abs(sorted(intervals)[512] / 524288 - math.log(2)) < 0.01


def test_the_live_panel_shows_processes_stacks_and_sparklines() -> None:
    panel = AllocPanel(KnownNames(), leaks_older_than=5)
    first = trimmed(snapshot(), KnownNames())
    panel.update(first, 1.0)
    panel.update(first, 1.0)
    console = Console(file=io.StringIO(), width=200, record=True)
    for part in panel.render():
        console.print(part)
    text = console.export_text()
    assert "top stacks by live bytes" in text and "leaker+0x10" in text
    assert "outstanding for over 5s" in text
    assert sparkline([0, 1, 2, 3]) == "▁▃▆█" and sparkline([5, 5]) == "▄▄"


DEBIAN_LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")


def test_reallocarray_jumps_to_realloc_through_the_plt_and_gets_no_probe() -> None:
    # GIVEN Debian's glibc 2.36
    needs(DEBIAN_LIBC.exists(), f"Debian's glibc ({DEBIAN_LIBC}) is missing")
    sites = alloc_sites(DEBIAN_LIBC)
    # THEN reallocarray is found to end in a jump to realloc's PLT stub
    assert sites["reallocarray"].tail_calls == "realloc"
    assert sites["malloc"].tail_calls is None
    chosen = plan_sites(DEBIAN_LIBC)
    # AND the plan probes neither it nor aligned_alloc (memalign's address)
    assert chosen.seen_as == {"reallocarray": "realloc", "aligned_alloc": "memalign"}
    assert "reallocarray" not in chosen.sites and chosen.exit_offset is not None


def test_a_jump_elsewhere_is_not_a_tail_call() -> None:
    # mov rax,rsi ; jmp +0x10 (to 0x1017, not an allocation function)
    code = bytes.fromhex("4889f0" + "eb10")
    assert tail_call(code, 0x1000, {0x2000: "realloc"}) is None
    # the same jump to realloc's address is one
    code = bytes.fromhex("4889f0" + "e9" + (0x2000 - 0x1008).to_bytes(4, "little").hex())
    assert tail_call(code, 0x1000, {0x2000: "realloc"}) == "realloc"


def test_a_process_root_that_cannot_be_read_leaves_the_frame_to_the_host_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # GIVEN a process whose /proc/PID/root refuses us (serve after giving up root)
    from mtrace_live.exporters.data import symbolize

    libc = Path("/lib/x86_64-linux-gnu/libc.so.6").resolve()
    mapping = symbolize.Mapping(0x7F0000000000, 0x7F0000200000, 0x28000, str(libc))
    symbols = symbolize.ProcessSymbols(PID, saved=[mapping])
    real_exists = Path.exists

    def refused(self: Path) -> bool:
        if str(self).startswith("/proc/"):
            raise PermissionError(13, "Permission denied", str(self))
        return real_exists(self)

    monkeypatch.setattr(Path, "exists", refused)
    # WHEN an address in it is named, THEN the host's file is read instead
    found = symbols.resolve(0x7F0000000000 + 0x1000)
    assert found is not None and found.module == str(libc)


class TablesOnly:
    """The allocation tables as a trace program would hand them over."""

    def __init__(self, tables: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        self.tables = tables

    def read_table(self, table: str, key_dtype: object, value_dtype: object) -> object:
        return self.tables[table]

    def array_copy(self, table: str, dtype: object) -> None:
        return None  # (as a map that cannot be mapped: read_table's rows)

    def percpu_array_totals(self, table: str) -> list[int]:
        return [0] * 16

    def has_table(self, table: str) -> bool:
        return False


class TablesMapped(TablesOnly):
    """The same, its arrays copied from their memory (BPF_F_MMAPABLE) as a
    program whose maps can be mapped hands them over: every row, no keys."""

    def array_copy(self, table: str, dtype: object) -> np.ndarray:
        return self.tables[table][1].copy()


def pid_100_tables(comm: bytes, incarnation: int, rows: list[tuple[int, int, int]],
                   mapped: bool = False) -> TablesOnly:  # fmt: skip
    """Process 100's alloc_procs row (of ``incarnation``) and its malloc
    rows, each (provider, incarnation, calls) of 32 bytes a call, at a
    call site of its own."""
    procs = np.zeros(1, ALLOC_PROC_DTYPE)
    procs[0]["incarnation"], procs[0]["comm"] = incarnation, comm
    stacks = np.zeros(len(rows), ALLOC_STACK_ROW_DTYPE)
    for row, (provider, made_by, calls) in enumerate(rows):
        stacks[row]["tag"] = row + 1
        stacks[row]["key"] = (0x401000 + row, 100, -1, 0, provider, made_by)
        stacks[row]["stats"]["calls"] = calls
        stacks[row]["stats"]["bytes"] = stacks[row]["stats"]["sizes"] = 32 * calls
    return (TablesMapped if mapped else TablesOnly)({
        "alloc_procs": (np.array([100], "<u4"), procs),
        "alloc_stacks": (np.arange(len(rows), dtype="<u4"), stacks),
        "vm_procs": (np.zeros(0, "<u4"), np.zeros(0, VM_PROC_DTYPE)),
    })  # fmt: skip


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "mapped"])
def test_a_reused_pid_s_old_stack_rows_are_not_its_new_process_s(mapped: bool) -> None:
    # GIVEN pid 100's stack rows of two incarnations: the first process,
    # retired by serve (its alloc_procs row taken out), and the process that
    # reused its pid (whose row is incarnation 2)
    program = pid_100_tables(b"new", 2, [(0, 1, 500), (0, 2, 7), (0, 2, 3)], mapped)
    # WHEN the tables are read
    snapshot = read_snapshot(program, 0, 0)  # type: ignore[arg-type]
    # THEN the new process has its own calls only, and the old rows are not read
    (proc,) = snapshot.processes
    assert (proc.tgid, proc.calls, proc.comm) == (100, 10, "new")
    assert sorted(row.calls for row in snapshot.stacks) == [3, 7]
