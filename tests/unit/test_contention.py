"""Contention in time without a kernel: the arena walk over memory laid out
as glibc lays it, the advice rules where each is true and where it is not,
the live view's panel, and the Prometheus histogram, each from numbers the
test sets."""

from __future__ import annotations

import io
import json
import os
import re
import struct
import subprocess

import pytest
from mtrace_live.exporters.contention import (
    ADVICE_MIN_SHARE,
    ADVICE_MIN_WAITS,
    advice,
    histogram_lines,
)
from mtrace_live.exporters.contention_view import ContentionPanel
from mtrace_live.exporters.data.alloc_snapshot import FrameNames
from mtrace_live.exporters.data.allocator_state import ArenaState, ProcessState
from mtrace_live.exporters.data.events import EventDecoder
from mtrace_live.exporters.data.lock_waits import (
    ARENA,
    MAIN,
    OTHER,
    LockRow,
    LockWaits,
    ThreadTime,
    WaitTimes,
)
from mtrace_live.exporters.prometheus import LockFigures, MtraceCollector
from mtrace_live.probes.malloc_state import X86_64, ArenaLayoutError, walk_arenas
from mtrace_live.tracer.loop.model import AllocatorModel
from mtrace_live.tracer.processes import target
from mtrace_live.tracer.processes.arena_walk import ArenaScan
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from .cli_runs import mtrace
from .test_prometheus_export import snapshot

PID = 4242
MAIN_ARENA = 0x7F00_0000_1C60
HEAP = 0x7EFF_F400_0000  # 64 MiB-aligned
ARENA_AT = HEAP + 0x30  # after heap_info


class Memory:
    """A process's memory as words a test writes; unwritten is unreadable."""

    def __init__(self) -> None:
        self.words: dict[int, int] = {}

    def put(self, address: int, value: int) -> None:
        self.words[address] = value

    def read(self, address: int, size: int) -> bytes:
        if address not in self.words:
            raise OSError(f"unmapped {address:#x}")
        return struct.pack("<Q", self.words[address])


def two_arenas() -> Memory:
    """main_arena and one arena of two heaps (the older one below), as
    glibc 2.27+ lays them out on x86-64."""
    memory, layout = Memory(), X86_64
    older = HEAP - layout.heap_max
    memory.put(MAIN_ARENA + layout.next, ARENA_AT)
    memory.put(MAIN_ARENA + layout.attached_threads, 3)
    memory.put(MAIN_ARENA + layout.system_mem, 135168)
    memory.put(ARENA_AT + layout.next, MAIN_ARENA)
    memory.put(ARENA_AT + layout.attached_threads, 2)
    memory.put(ARENA_AT + layout.system_mem, 200704)
    memory.put(ARENA_AT + layout.top, older + 0x1000)  # the top chunk is in the older heap
    memory.put(HEAP + layout.heap_ar_ptr, ARENA_AT)
    memory.put(HEAP + layout.heap_size, 135168)
    memory.put(HEAP + layout.heap_prev, 0)
    memory.put(older + layout.heap_ar_ptr, ARENA_AT)
    memory.put(older + layout.heap_size, 65536)
    memory.put(older + layout.heap_prev, HEAP)
    return memory


def test_the_arena_walk_finds_each_arena_its_threads_and_heaps() -> None:
    found = walk_arenas(two_arenas().read, MAIN_ARENA)
    assert [(a.address, a.main, a.attached_threads, a.system_mem) for a in found] == [
        (MAIN_ARENA, True, 3, 135168),
        (ARENA_AT, False, 2, 200704),
    ]
    assert found[1].heaps == ((HEAP - X86_64.heap_max, 65536), (HEAP, 135168))


@pytest.mark.parametrize(
    ("word", "value", "why"),
    [
        (HEAP + X86_64.heap_ar_ptr, 0x1234, "does not name it"),  # not an arena's heap
        (ARENA_AT + X86_64.next, ARENA_AT, "does not come back"),  # a list that loops
        (ARENA_AT + X86_64.next, 0, "does not come back"),  # a list that ends
    ],
)
def test_an_arena_list_that_does_not_check_out_is_refused(word: int, value: int, why: str) -> None:
    memory = two_arenas()
    memory.put(word, value)
    with pytest.raises(ArenaLayoutError, match=why):
        walk_arenas(memory.read, MAIN_ARENA)


def test_unreadable_memory_is_an_os_error_not_a_guess() -> None:
    memory = two_arenas()
    del memory.words[ARENA_AT + X86_64.attached_threads]
    with pytest.raises(OSError):
        walk_arenas(memory.read, MAIN_ARENA)


def process(arenas: int, limit: int, threads: int) -> ProcessState:
    state = ProcessState(PID, comm="server", arena_limit=limit,
                         arena_limit_source="mallopt M_ARENA_MAX")  # fmt: skip
    for i in range(arenas):
        state.arenas[0x1000 * (i + 1)] = ArenaState(0x1000 * (i + 1), main=i == 0,
                                                    attached_threads=threads // arenas)  # fmt: skip
    state.most_attached = threads
    return state


def waits(count: int, wait_ns: int, thread_ns: int, live: int, kind: str = MAIN) -> LockWaits:
    row = LockRow(PID, 0x1000, kind, WaitTimes(count, wait_ns, wait_ns // max(count, 1)))
    time = ThreadTime(PID, thread_ns // live, thread_ns, live, live)
    return LockWaits((row,), threads={PID: time})


def test_the_arena_limit_advice_where_threads_share_arenas_at_the_limit() -> None:
    # 8 threads on 2 arenas at a limit of 2, waiting 30% of their time
    found = advice(waits(1000, 300, 1000, 8), process(2, 2, 8))
    assert [item.rule for item in found] == ["arena-limit"]
    assert found[0].text.startswith("8 threads share 2 arenas (arena_max 2, set by mallopt")
    assert "mallopt(M_ARENA_MAX, 8)" in found[0].text


@pytest.mark.parametrize(
    ("state", "numbers"),
    [
        (process(2, 8, 8), (1000, 300, 1000, 8)),  # below the limit: glibc makes more arenas
        (process(8, 8, 8), (1000, 300, 1000, 8)),  # a thread per arena: sharing is not why
        (process(2, 2, 8), (1000, 10, 1000, 8)),  # waits are 1% of the time: thin
        (process(2, 2, 8), (ADVICE_MIN_WAITS - 1, 300, 1000, 8)),  # too few waits: thin
    ],
)
def test_no_arena_limit_advice_where_it_is_not_true_or_the_evidence_is_thin(
    state: ProcessState, numbers: tuple[int, int, int, int]
) -> None:
    assert ADVICE_MIN_SHARE > 0.01
    assert advice(waits(*numbers), state) == []


def test_the_advice_counts_the_most_threads_its_arenas_held_at_once() -> None:
    # GIVEN a process read at the attach with 3 + 2 threads on its two arenas
    # and an arena limit of 2, then read again once all but one had exited
    model = AllocatorModel(EventDecoder([]), [])
    memory = two_arenas()
    model.seed_arenas(os.getpid(), ArenaScan(os.getpid(), walk_arenas(memory.read, MAIN_ARENA), 2),
                      at_attach=True)  # fmt: skip
    memory.put(MAIN_ARENA + X86_64.attached_threads, 1)
    memory.put(ARENA_AT + X86_64.attached_threads, 0)
    model.seed_arenas(os.getpid(), ArenaScan(os.getpid(), walk_arenas(memory.read, MAIN_ARENA), 2))
    state = model.processes[os.getpid()]
    state.pid = PID
    # WHEN the waits are a third of the thread time of the one thread left
    found = advice(waits(1000, 300, 1000, 1), state)
    # THEN the advice is for the 5 threads the arenas held at the attach
    assert [item.rule for item in found] == ["arena-limit"]
    assert found[0].text.startswith("5 threads share 2 arenas (arena_max 2"), found[0].text


def test_waits_on_other_locks_are_pointed_at_not_blamed_on_arenas() -> None:
    found = advice(waits(500, 200, 1000, 8, kind=OTHER), process(2, 2, 8))
    assert [item.rule for item in found] == ["other-locks"]


def test_the_histogram_lines_run_from_the_first_to_the_last_bucket_with_waits() -> None:
    hist = [0] * 40
    hist[11], hist[14] = 3, 1  # at most 2.05 us; at most 16.4 us
    lines = histogram_lines(WaitTimes(4, 20000, 15000, tuple(hist)))
    assert [line.split(":")[0].strip() for line in lines[1:]] == [
        "<= 2.05us", "<= 4.1us", "<= 8.19us", "<= 16.4us"
    ]  # fmt: skip
    assert [int(line.split(":")[1].split()[0]) for line in lines[1:]] == [3, 0, 0, 1]


def test_the_panel_shows_each_interval_s_wait_time_and_share() -> None:
    # GIVEN two readings one second apart: the arena's waits grew by 0.25 s
    # while the process's threads lived 2 s more
    panel = ContentionPanel(FrameNames(live=False), inflated=True)
    state = process(2, 2, 4)
    first = LockWaits((LockRow(PID, 0x2000, ARENA, WaitTimes(10, 10**8, 10**7)),),
                      threads={PID: ThreadTime(PID, 10**9, 4 * 10**9, 4, 4)})  # fmt: skip
    second = LockWaits((LockRow(PID, 0x2000, ARENA, WaitTimes(30, 35 * 10**7, 10**7)),),
                       threads={PID: ThreadTime(PID, 2 * 10**9, 6 * 10**9, 4, 4)})  # fmt: skip
    panel.update(first, 1.0)
    panel.update(second, 1.0)
    console = Console(file=io.StringIO(), width=200, record=True)
    console.print(*panel.render([state]))
    text = console.export_text()
    # THEN the arena's row says 250 ms a second, 12.5% of thread time, and its history
    row = next(line for line in text.splitlines() if "0x2000" in line)
    assert "250.00 ms/s" in row and "12.5%" in row
    assert "▁▂" in row  # 2.5% and 12.5% of a 0-100% scale of 8 bars
    assert f"pid {PID}: 12.5% of thread time waiting on malloc arenas" in text
    assert "note: the allocation probes are on" in text


def test_the_prometheus_histogram_is_cumulative_in_seconds() -> None:
    # GIVEN one process's waits: two of at most 1.024 us, one of at most
    # 4.096 us, one of more than 1.07 s
    hist = [0] * 40
    hist[5], hist[10], hist[12], hist[39] = 1, 1, 1, 1
    times = WaitTimes(4, 2 * 10**9, 2 * 10**9 - 10, tuple(hist))
    snap = snapshot({}, {})
    snap.locks = {"server": LockFigures({"main": times}, 4 * 10**9)}
    registry = CollectorRegistry()
    registry.register(MtraceCollector(lambda: snap))
    page = generate_latest(registry).decode()
    families = {f.name: f for f in text_string_to_metric_families(page)}
    samples = families["mtrace_libc_arena_lock_wait_seconds"].samples
    buckets = {s.labels["le"]: s.value for s in samples
               if s.name.endswith("_bucket") and s.labels["arena"] == "main"}  # fmt: skip
    # THEN each bucket counts every wait at most its bound, +Inf all of them
    assert buckets["1.024e-06"] == 2 and buckets["4.096e-06"] == 3
    assert buckets["1.073741824"] == 3 and buckets["+Inf"] == 4
    assert len(buckets) == 12
    sums = {s.labels["arena"]: s.value for s in samples if s.name.endswith("_sum")}
    total = sums["main"]
    assert total == 2.0
    share = families["mtrace_libc_arena_lock_wait_share"].samples[0]
    assert (share.labels["process"], share.value) == ("server", 0.5)


@pytest.mark.parametrize(("debug", "told"), [((), True), (("--debug-file", "none"), False)])
def test_probes_says_whether_lock_waits_are_timed_and_told_apart(
    debug: tuple[str, ...], told: bool
) -> None:
    # GIVEN Debian's libc, with its debug file (libc6-dbg) or told to use none
    libc = target.mapped_libc(os.getpid())
    run = mtrace("probes", "--lib", str(libc), "--json", *debug)
    assert run.returncode == 0, run.stderr
    (document,) = [doc for doc in json.loads(run.stdout) if doc["path"] == str(libc)]
    report = document["lock_wait_times"]
    # THEN the slow path is timed at an instruction of the function readelf
    # finds, which objdump shows to be a jump (emulated), with nothing
    # before it writing the futex's register or the stack pointer
    readelf = subprocess.run(["readelf", "-sW", "--dyn-syms", str(libc)], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    entry = next(int(line.split()[1], 16) for line in readelf.splitlines()
                 if line.split()[-1:] == ["__lll_lock_wait_private@@GLIBC_PRIVATE"])  # fmt: skip
    found = re.search(
        r"__lll_lock_wait_private\+(0x[0-9a-f]+) .*emulated; file offset", report["why"]
    )
    assert report["timed"] is True and found is not None, report
    site = entry + int(found.group(1), 16)
    dump = subprocess.run(["objdump", "-d", f"--start-address={entry:#x}",
                           f"--stop-address={site + 16:#x}", str(libc)], capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    code = {
        int(m.group(1), 16): m.group(2)
        for m in re.finditer(r"(?m)^\s+([0-9a-f]+):\t[^\t]*\t(.*)$", dump)
    }
    assert code[site].startswith("j")
    assert not any(
        re.search(r",%(rdi|edi|rsp)$", text.strip()) for at, text in code.items() if at < site
    )
    # AND its waits are told to be on arenas only with the debug file's main_arena
    assert report["arenas_told_apart"] is told
    assert ("libc6-dbg" in report["why"]) is not told


def test_a_futex_is_told_main_other_or_unknown_from_real_memory() -> None:
    # GIVEN this process's libc, with its debug file (libc6-dbg), and a finder
    import ctypes
    import os
    import subprocess

    from mtrace_live.exporters.data.lock_waits import MAIN, OTHER, UNKNOWN
    from mtrace_live.tracer.processes.arena_walk import ArenaFinder, arena_symbols
    from mtrace_live.tracer.processes.target import default_libc

    from .needs import needs

    libc = default_libc()
    symbols = arena_symbols(libc)
    needs(symbols.main_arena is not None, f"main_arena of {libc} (libc6-dbg) is missing")
    finder = ArenaFinder(libc, symbols)
    # WHEN the main arena's lock, another word of this process, and a word of
    # a process that is gone are asked about
    (main,) = [a.address for a in finder.scan(os.getpid()).arenas if a.main]
    word = ctypes.c_int(0)
    gone = subprocess.Popen(["true"])
    gone.wait()
    # THEN the first is the main arena, the second no arena (checked in memory),
    # the third unknown: its memory cannot be read
    assert finder.kind(os.getpid(), main) == MAIN
    assert finder.kind(os.getpid(), ctypes.addressof(word)) == OTHER
    assert finder.kind(gone.pid, main) == UNKNOWN


@pytest.mark.parametrize(
    ("env", "cpus", "limit"),
    [({"GLIBC_TUNABLES": "glibc.malloc.arena_max=3"}, None, "3 (tunable glibc.malloc.arena_max)"),
     ({"MALLOC_ARENA_MAX": "5"}, None, "5 (environment MALLOC_ARENA_MAX)"),
     ({}, {0}, "8 (default (8 x 1 cores))")],
    ids=["tunable", "environment", "default"],
)  # fmt: skip
def test_the_arena_limit_and_where_it_was_set_are_read_from_the_process(
    env: dict[str, str], cpus: set[int] | None, limit: str
) -> None:
    # GIVEN a process started with the limit in its tunables, in its
    # environment, or neither, on the CPUs given
    import os
    import subprocess
    import sys

    from mtrace_live.tracer.processes.arena_walk import ArenaFinder, arena_limit, arena_symbols
    from mtrace_live.tracer.processes.target import default_libc

    from .needs import needs

    libc = default_libc()
    symbols = arena_symbols(libc)
    needs(symbols.mp is not None, f"mp_ of {libc} (libc6-dbg) is missing")
    pinned = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    script = "import sys; print('ready', flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, **env},
                             preexec_fn=pinned)  # fmt: skip
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    try:
        # WHEN its arenas are read from its memory
        scan = ArenaFinder(libc, symbols).scan(child.pid)
        assert not scan.problem, scan.problem
        # THEN the limit and its source are the ones it was started with
        number, source = arena_limit(child.pid, scan.arena_max)
        assert f"{number} ({source})" == limit
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
        child.stdout.close()
