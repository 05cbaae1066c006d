"""A trace loaded from the compiled-program cache (tracer/bpf/bpf_cache.py)
sees exactly what a compiled one sees: the same run twice, the first
compiling and storing, the second loading what the first stored, both
checked against what the workloads know they did."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mtrace_live.tracer.processes.sdt_glibc import SdtGlibc

from .conftest import MTRACE, built
from .test_allocations import by_site
from .test_live_trace import events_of, summary_numbers
from .test_usdt_counts import DOCUMENTED_PROBES
from .tracing import wait_for_line

COMPILED = "debug: BPF program trace compiled in"
FROM_CACHE = "debug: BPF program trace loaded from the cache in"
UNUSABLE = "warning: the cached BPF program is unusable, compiled it anew"


def traced(cache: Path, *args: str, plans: Path | None = None) -> subprocess.CompletedProcess[str]:
    """mtrace-live ARGS with ``cache`` as its program cache (and ``plans``
    as its plan cache), saying in its start-up report where its program
    came from."""
    env = {**os.environ, "MTRACE_LIVE_BPF_CACHE": str(cache), "MTRACE_LIVE_DEBUG": "1"}
    if plans is not None:
        env["MTRACE_LIVE_PLAN_CACHE"] = str(plans)
    return subprocess.run([*MTRACE, *args], capture_output=True, text=True, timeout=300, env=env)


def origin(done: subprocess.CompletedProcess[str]) -> str:
    """Where the run's program came from, as its start-up report says."""
    said = [line for line in done.stderr.splitlines() if "debug: BPF program" in line]
    assert len(said) == 1, done.stderr
    return "cache" if FROM_CACHE in said[0] else "compiled" if COMPILED in said[0] else said[0]


def stored(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.json"))


def test_a_live_trace_loaded_from_the_cache_counts_every_probe_and_allocation(
    sdt: SdtGlibc, probe_exerciser: Path, tmp_path: Path
) -> None:
    # GIVEN an empty cache, and the probe exerciser run twice under `run`
    # (its pid known before loading: the followed-pid shortcut; allocation
    # functions and the kmem tracepoints attached too)
    cache = tmp_path / "cache"
    counts, origins = [], []
    for attempt in range(2):
        truth_file = tmp_path / f"truth{attempt}.json"
        done = traced(cache, "run", "--sdt-glibc", "--probes", "*", "--kmem", "-o", "json",
                      "--", str(probe_exerciser), "--out", str(truth_file))  # fmt: skip
        assert done.returncode == 0, done.stderr
        origins.append(origin(done))
        truth = json.loads(truth_file.read_text())
        by_probe: dict[str, int] = {}
        for event in events_of(done.stdout):
            by_probe[event["probe"]] = by_probe.get(event["probe"], 0) + 1
        counts.append(({n: by_probe.get(n, 0) for n in DOCUMENTED_PROBES},
                       {n: truth["probes"][n]["count"] for n in DOCUMENTED_PROBES}))  # fmt: skip
        kernel, delivered, lost = summary_numbers(done.stderr)
        assert (kernel, lost) == (delivered, 0)
    # THEN the first run compiled and stored the program, the second loaded
    # it from the cache (and stored nothing new)
    assert origins == ["compiled", "cache"]
    assert len(stored(cache)) == 1
    # AND both runs counted every probe hit the exerciser made, exactly
    for seen, truth in counts:
        assert seen == truth


def exact_per_call_site(done: subprocess.CompletedProcess[str], truth_file: Path) -> None:
    """Every call site's calls, bytes and leaks, as the workload counted
    them, and no event lost."""
    assert done.returncode == 0, done.stderr
    truth = json.loads(truth_file.read_text())
    tables: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for line in done.stdout.splitlines():
        record = json.loads(line)
        if "table" in record:
            tables[record["table"]].append(record)
    found = by_site(tables["alloc_stacks"])
    for site in truth["sites"]:
        got = found[(site["function"], site["fn"])]
        assert (got["calls"], got["bytes"], got["live_bytes"]) == (
            site["calls"], site["bytes"], site["leaked_bytes"]), site  # fmt: skip
    (functions,) = tables["alloc_functions"]
    assert functions["lost_events"] == 0


EARLY = "its maps and uprobe programs made while the start planned"


def test_allocations_from_the_cache_are_exact_and_a_known_start_takes_what_was_made_early(
    tmp_path: Path,
) -> None:
    cache, plans = tmp_path / "cache", tmp_path / "plans"

    def workload(*options: str) -> tuple[subprocess.CompletedProcess[str], Path]:
        truth_file = tmp_path / "truth.json"
        done = traced(cache, "run", *options, "-o", "json", "--", str(built("alloc_workload")),
                      "--out", str(truth_file), plans=plans)  # fmt: skip
        return done, truth_file

    # GIVEN a start that compiled its program (and counted exactly), its
    # options kept with its key
    first = workload()
    assert origin(first[0]) == "compiled" and EARLY not in first[0].stderr
    exact_per_call_site(*first)
    # WHEN a start with the same options comes
    again = workload()
    # THEN it loaded the program from the cache, took the maps and programs
    # made while it planned, and counted exactly
    assert origin(again[0]) == "cache" and EARLY in again[0].stderr, again[0].stderr
    exact_per_call_site(*again)
    # GIVEN a wrong guess: those options kept with another program's key
    assert origin(workload("--no-lock-times")[0]) == "compiled"
    (document,) = (plans / "files").glob("facts-*.json")
    kept = json.loads(document.read_text())
    starts = {k: v for k, v in kept["files"].items() if k.startswith("start:")}
    keys = {entry["facts"]["program"] for entry in starts.values()}
    # (each program kept under its command line's key and, as the first start
    # with that line found nothing there, under its parsed options' too)
    assert len(keys) == 2 and len(starts) == 4
    for entry in starts.values():  # each other's
        entry["facts"]["program"] = (keys - {entry["facts"]["program"]}).pop()
    document.write_text(json.dumps(kept))
    # WHEN the first options start again
    wrong = workload()
    # THEN what was made is closed, its own program loaded, and it counts exactly
    assert origin(wrong[0]) == "cache" and EARLY not in wrong[0].stderr, wrong[0].stderr
    exact_per_call_site(*wrong)


def test_kmem_counts_for_one_pid_are_exact_from_the_cache(
    kmem_exerciser: Path, tmp_path: Path
) -> None:
    # GIVEN an empty cache, and the kmem exerciser counted twice
    cache = tmp_path / "cache"
    sockets = 300
    reports = []
    for attempt in range(2):
        truth_file = tmp_path / f"truth{attempt}.json"
        done = traced(cache, "count", "--kmem-only", "--json", "--", str(kmem_exerciser),
                      "--sockets", str(sockets), "--pipes", "0",
                      "--out", str(truth_file))  # fmt: skip
        assert done.returncode == 0, done.stderr
        truth = json.loads(truth_file.read_text())
        reports.append((json.loads(done.stdout), truth, origin(done)))
    # THEN the first compiled, and the second loaded the first's program
    assert [said for _, _, said in reports] == ["compiled", "cache"]
    # AND each counted exactly the sockets its exerciser made (the raw
    # tracepoints, attached from the cache as bcc attaches them)
    for report, truth, _ in reports:
        expected = truth["expected"]["kmem_cache_alloc"]["sock_inode_cache"]
        assert report["kmem_cache_allocs"]["sock_inode_cache"] == expected == sockets


def test_a_cache_that_does_not_parse_is_compiled_over(kmem_exerciser: Path, tmp_path: Path) -> None:
    # GIVEN a cache whose stored program was damaged
    cache = tmp_path / "cache"
    argv = ["count", "--kmem-only", "--json", "--", str(kmem_exerciser), "--sockets", "50",
            "--pipes", "0", "--out", str(tmp_path / "t.json")]  # fmt: skip
    assert origin(traced(cache, *argv)) == "compiled"
    damaged = stored(cache)[0]
    damaged.write_text('{"functions": ')
    # WHEN the same trace runs again
    done = traced(cache, *argv)
    # THEN it said the stored program was unusable, compiled it (as without
    # a cache), counted, and stored a good copy, which a third run loads
    assert done.returncode == 0, done.stderr
    (warning,) = [line for line in done.stderr.splitlines() if UNUSABLE in line]
    assert str(damaged) in warning and "does not read as a stored program" in warning
    assert origin(done) == "compiled"
    assert json.loads(done.stdout)["kmem_cache_allocs"]["sock_inode_cache"] == 50
    assert json.loads(damaged.read_text())["functions"]
    again = traced(cache, *argv)
    assert origin(again) == "cache" and UNUSABLE not in again.stderr


def at_a_terminal(cache: Path, *args: str) -> str:
    """What mtrace-live ARGS writes to its stderr when that is a terminal
    (a pseudo-terminal here), with ``cache`` as its program cache."""
    import pty

    master, slave = pty.openpty()
    env = {**os.environ, "MTRACE_LIVE_BPF_CACHE": str(cache)}
    with subprocess.Popen([*MTRACE, *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=slave, env=env) as tracer:  # fmt: skip
        os.close(slave)
        said = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the tracer (the terminal's last writer) is gone
                break
            if not chunk:
                break
            said += chunk
        assert tracer.wait(timeout=300) == 0, said
    os.close(master)
    return said.decode(errors="replace")


def test_a_cold_start_says_at_a_terminal_that_it_compiles_and_for_how_long(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    # GIVEN an empty cache: a first start compiles, and says so with the estimate
    first = at_a_terminal(cache, "run", "-o", "summary", "--", "true")
    assert "compiling the BPF program for these options (about 3 s, once" in first, first
    assert float((cache / "last-compile-seconds").read_text()) > 0  # the next one's estimate
    # WHEN the same start again: loaded from the cache, nothing said
    assert "compiling" not in at_a_terminal(cache, "run", "-o", "summary", "--", "true")


def test_one_compiled_program_serves_every_choice_of_the_run_time_values(tmp_path: Path) -> None:
    cache = tmp_path / "cache"

    def workload(*options: str) -> tuple[subprocess.CompletedProcess[str], Path]:
        truth_file = tmp_path / "truth.json"
        done = traced(cache, "run", *options, "-o", "json", "--", str(built("alloc_workload")),
                      "--out", str(truth_file))  # fmt: skip
        return done, truth_file

    # GIVEN a start that compiled its program: a command's, its forks followed
    first = workload()
    assert origin(first[0]) == "compiled"
    exact_per_call_site(*first)
    # WHEN starts come whose options are other run-time values (probes/bpf/runtime.h):
    # no forks followed; then one process by its pid, and every process
    apart = workload("--no-follow-forks")
    with subprocess.Popen(["sleep", "30"]) as sleeper:
        try:
            one = traced(cache, "--pid", str(sleeper.pid), "--duration", "0.3", "-o", "summary")
            every = traced(cache, "--all", "--duration", "0.3", "-o", "summary")
        finally:
            sleeper.kill()
    # THEN each loaded the one program compiled first, and stored none of its own
    assert [origin(done) for done in (apart[0], one, every)] == ["cache"] * 3, [
        done.stderr for done in (apart[0], one, every)]  # fmt: skip
    assert one.returncode == every.returncode == 0, (one.stderr, every.stderr)
    assert len(stored(cache)) == 1
    # AND the command's calls are counted exactly with its own values
    exact_per_call_site(*apart)


def held_by(pid: int, kind: str = "map") -> list[dict[str, Any]]:
    """The maps (or programs: ``kind`` "prog") process ``pid`` holds, as
    bpftool (the peer) lists them."""
    listed = json.loads(subprocess.run(["bpftool", kind, "list", "-j"], capture_output=True,
                                       text=True, check=True).stdout)  # fmt: skip
    ids = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            info = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
            found = re.search(rf"(?m)^{kind}_id:\s*(\d+)", info)
            if found:
                ids.add(int(found.group(1)))
    return [entry for entry in listed if entry["id"] in ids]


def started_held(cache: Path, tmp_path: Path, *args: str) -> tuple[str, dict[str, Any], list[str]]:
    """A trace with ``args``, stopped once it said its line: what it said,
    the maps it held meanwhile by name, and its programs' names (bpftool's:
    the kernel keeps 15 bytes of a name)."""
    err = tmp_path / "err"
    env = {**os.environ, "MTRACE_LIVE_BPF_CACHE": str(cache), "MTRACE_LIVE_DEBUG": "1"}
    with open(err, "wb") as stderr:
        tracer = subprocess.Popen([*MTRACE, *args], stdout=subprocess.DEVNULL, stderr=stderr,
                                  env=env)  # fmt: skip
    try:
        wait_for_line(err, "Ctrl-C to stop", tracer, timeout=120)
        maps = {entry["name"]: entry for entry in held_by(tracer.pid)}
        progs = [entry["name"] for entry in held_by(tracer.pid, "prog")]
    finally:
        tracer.send_signal(signal.SIGINT)
        assert tracer.wait(timeout=120) == 0, err.read_text()
    return err.read_text(), maps, progs


@contextlib.contextmanager
def compiled_for_a_sleeper(cache: Path) -> Iterator[int]:
    """A sleeping process, and the program a default --pid start of it
    compiled into ``cache`` (traced the allocation functions, at the
    default sizes): the sleeper's pid."""
    with subprocess.Popen(["sleep", "60"]) as sleeper:
        try:
            first = traced(cache, "--pid", str(sleeper.pid), "--duration", "0.2", "-o", "summary")
            assert origin(first) == "compiled", first.stderr
            yield sleeper.pid
        finally:
            sleeper.kill()


def test_the_tables_are_made_at_the_run_s_sizes_from_the_one_program(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    # GIVEN the program compiled by a start with the default sizes
    with compiled_for_a_sleeper(cache) as pid:
        # WHEN a start asks for other sizes of the ring and the allocations' tables
        said, made, _ = started_held(cache, tmp_path, "--pid", str(pid), "--buffer-pages", "64",
                                     "--max-outstanding", "1000", "--alloc-stacks", "300",
                                     "-o", "summary")  # fmt: skip
    # THEN it loaded the one program, and bpftool shows its maps at its own sizes:
    # the ring 64 pages, each open-addressed table twice the entries asked for,
    # rounded up to a power of two
    assert FROM_CACHE in said and len(stored(cache)) == 1, said
    assert made["events"]["max_entries"] == 64 * os.sysconf("SC_PAGE_SIZE")
    assert made["outstanding"]["max_entries"] == 2048
    assert made["alloc_stacks"]["max_entries"] == made["alloc_frames"]["max_entries"] == 1024


def test_a_trace_without_the_allocation_functions_loads_the_program_with_them(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    # GIVEN the program compiled by a start that traces the allocation functions
    with compiled_for_a_sleeper(cache) as pid:
        # WHEN a start that does not (--contention: the lock waits alone)
        # comes, and then one that does again
        said, maps, progs = started_held(cache, tmp_path, "--pid", str(pid), "--contention",
                                         "-o", "summary")  # fmt: skip
        _, _, with_allocs = started_held(cache, tmp_path, "--pid", str(pid), "-o", "summary")
    # THEN it loaded that program, with the lock waits' handlers and none of the
    # allocation functions': no uprobe handler of theirs, and none of the four
    # system calls' handlers they alone use (mmap's and munmap's exits, mremap's
    # entry and exit); those it shares with the derived probes stay (the stock
    # libc's: its heaps seen through mmap, munmap and brk)
    assert FROM_CACHE in said and len(stored(cache)) == 1, said
    assert {"lock_wait_enter", "lock_wait_retur"} <= set(progs), sorted(progs)
    assert not [name for name in progs if name.startswith("alloc_")], progs
    assert "alloc_malloc" in with_allocs

    def syscalls(names: list[str]) -> int:
        return len([name for name in names if name.startswith("syscalls__sys_")])

    assert syscalls(with_allocs) - syscalls(progs) == 4 and syscalls(progs) >= 4, progs
    # AND bpftool shows the allocation functions' tables made with one entry
    assert maps["outstanding"]["max_entries"] == maps["pending"]["max_entries"] == 1
