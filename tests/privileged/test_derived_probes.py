"""The derived memory_* probes (probes/derived.py), checked against the SDT
probes of the same libc in the same run, against the exerciser's ground
truth on Debian's stock libc, and in the arena table under load."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
from collections import Counter
from pathlib import Path

from mtrace_live.probes import derived
from mtrace_live.probes.sdt_notes import read_sites
from mtrace_live.tracer.processes.sdt_glibc import SdtGlibc
from mtrace_live.tracer.processes.target import default_libc

from .conftest import MTRACE, built, mtrace_count
from .tracing import (
    BPFTRACE_READY,
    GatedWorkload,
    Reaper,
    bpftrace_counts,
    stop_bpftrace,
    wait_for_line,
)

Events = dict[str, Counter[tuple[int, tuple[tuple[str, int | None], ...]]]]


def direct(sdt: SdtGlibc, argv: list[str], libc_dir: Path | None = None) -> list[str]:
    """``argv`` under the SDT build's loader, as testrun.sh runs it, but with
    no shell in between: a shell would allocate with the stock libc in the
    same process, which the syscall-derived probes see and the SDT ones not.
    ``libc_dir``: a directory whose libc.so.6 comes before the build's."""
    build = sdt.libc.parent
    dirs = [build / d for d in ("", "math", "elf", "dlfcn", "nss", "nptl", "rt")]
    paths = ":".join(str(d) for d in ([libc_dir] if libc_dir else []) + dirs)
    return [str(build / "elf" / "ld-linux-x86-64.so.2"), "--library-path", paths, *argv]


def side_by_side(
    sdt: SdtGlibc, argv: list[str], tmp: Path, *derived_options: str, bpftrace: tuple[str, ...] = ()
) -> tuple[Events, Events, dict[str, int]]:
    """The events of the SDT probes and of the derived ones, from two traces
    of the same run of ``argv`` under the SDT build; with ``bpftrace``,
    bpftrace counts those SDT probes in the same run (its counts, third).
    The run has a copy of the SDT libc of its own, which the traces (--all)
    are given: another process on the SDT libc meanwhile (a glibc test, a
    make soak) is not in them, nor, as it started or ended between the
    two traces' starts or ends, in one and not the other."""
    peer_counts: dict[str, int] = {}
    (tmp / "lib").mkdir()
    libc = Path(shutil.copy2(sdt.libc, tmp / "lib" / sdt.libc.name))
    with Reaper() as reaper:
        workload = GatedWorkload(direct(sdt, argv, libc.parent), tmp, reaper)
        tracers = {}
        for tag, extra in (("sdt", []), ("derived", ["--derived", *derived_options])):
            with open(tmp / f"{tag}.json", "wb") as out, open(tmp / f"{tag}.err", "wb") as err:
                tracers[tag] = reaper.add(
                    subprocess.Popen(
                        [
                            *MTRACE,
                            "--all",
                            "--lib",
                            str(libc),
                            "--no-allocs",
                            "-o",
                            "json",
                            "--probes",
                            "memory_*",
                            "--probes",
                            "lll_lock_wait_private",
                            *extra,
                        ],
                        stdout=out,
                        stderr=err,
                    )
                )
        for tag, proc in tracers.items():
            wait_for_line(tmp / f"{tag}.err", "tracing", proc, timeout=120)
        if bpftrace:
            peer, peer_out = bpftrace_counts(libc, list(bpftrace), workload.pid, tmp)
            reaper.add(peer)
            wait_for_line(peer_out, BPFTRACE_READY, peer, timeout=120)
        workload.release()
        assert workload.wait() == 0
        for tag, proc in tracers.items():
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 0, (tmp / f"{tag}.err").read_text()
        if bpftrace:
            peer_counts = stop_bpftrace(peer, peer_out)
    sdt_events = _events(tmp / "sdt.json")
    pids = {pid for counter in sdt_events.values() for pid, _ in counter}
    return sdt_events, _events(tmp / "derived.json", pids), peer_counts


def _events(path: Path, pids: set[int] | None = None) -> Events:
    """(pid, arguments) of each probe event; for the derived trace, of the
    workload's processes only (--all sees every process's system calls)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    found: Events = {}
    for row in rows:
        if row.get("probe") in (None, "exec", "exit"):
            continue
        if pids is not None and row["pid"] not in pids:
            continue
        args = tuple(sorted(row["args"].items()))
        found.setdefault(row["probe"], Counter())[(row["pid"], args)] += 1
    return found


def _without(events: Events, name: str, missing: set[str]) -> Counter[object]:
    return Counter(
        {
            (pid, tuple(a for a in args if a[0] not in missing)): n
            for (pid, args), n in events.get(name, Counter()).items()
        }
    )


def check_against_sdt(plan: derived.DerivedPlan, ours: Events, theirs: Events) -> list[str]:
    """Each exact probe: the same events with the same arguments; each
    approximate one: the same, less the arguments it says it cannot read."""
    checked = []
    for name, probe in plan.probes.items():
        if probe.status == derived.EXACT:
            assert ours.get(name, Counter()) == theirs.get(name, Counter()), name
            checked.append(name)
        elif probe.status == derived.APPROXIMATE and probe.source == derived.DEBUG:
            missing = {a.name for s in probe.sites for a in s.args if not a.location.readable}
            assert missing, f"{name}: approximate, yet every argument is readable"
            assert _without(ours, name, missing) == _without(theirs, name, missing), name
            assert all(
                dict(args)[m] is None for _, args in ours.get(name, Counter()) for m in missing
            )
            checked.append(name)
        elif probe.status == derived.APPROXIMATE:  # events missed, never invented
            assert ours.get(name, Counter()) <= theirs.get(name, Counter()), name
            checked.append(name)
    return checked


def test_derived_probes_equal_the_sdt_probes_on_the_exerciser(
    sdt: SdtGlibc, probe_exerciser: Path, tmp_path: Path
) -> None:
    # GIVEN the SDT build's probe exerciser, traced three times at once: by
    # its SDT notes, by the probes derived for the same libc, and by
    # bpftrace counting the SDT probes the derived ones stand for
    plan = derived.plan(sdt.libc)
    exact = [name for name, p in plan.probes.items() if p.status == derived.EXACT]
    argv = [str(probe_exerciser), "--out", str(tmp_path / "t.json")]
    theirs, ours, peer = side_by_side(sdt, argv, tmp_path, bpftrace=tuple(exact))
    # THEN every exact probe has the same events, arguments included, and
    # every approximate one the same events less its unreadable arguments
    checked = check_against_sdt(plan, ours, theirs)
    # AND the exerciser fired each of them (lll_lock_wait_private: at the arena limit)
    assert all(sum(theirs.get(name, Counter()).values()) >= 1 for name in checked), theirs.keys()
    assert len(checked) >= 15, checked
    # AND bpftrace counted as many of each in the same run
    counted = {name: sum(ours.get(name, Counter()).values()) for name in exact}
    assert {name: peer.get(name, 0) for name in exact} == counted


def test_derived_probes_equal_the_sdt_probes_under_arena_contention(
    sdt: SdtGlibc, tmp_path: Path
) -> None:
    # GIVEN 8 threads on 2 arenas, 1000 bursts each, traced both ways at once
    # (lock waits depend on the scheduler: 100 bursts have been seen to
    # finish in 12 ms with none; 1000 give hundreds in every run seen)
    plan = derived.plan(sdt.libc)
    theirs, ours, _ = side_by_side(
        sdt, [str(built("arena_contention")), "1", "8", "2", "1000"], tmp_path
    )
    # THEN the heaps, the sbrk calls, the arenas and each lock wait agree
    check_against_sdt(plan, ours, theirs)
    for name in (
        "memory_heap_more",
        "memory_heap_less",
        "memory_sbrk_more",
        "lll_lock_wait_private",
        "memory_arena_new",
    ):
        assert sum(theirs.get(name, Counter()).values()) >= 1, name


def test_without_the_debug_file_heap_growth_is_seen_when_it_maps_pages(
    sdt: SdtGlibc, tmp_path: Path
) -> None:
    # GIVEN arena_contention, traced by the SDT notes and by the probes
    # derived without the debug file (--debug-file none): system calls and
    # exported symbols only
    plan = derived.plan(sdt.libc, derived.NO_DEBUG_FILE)
    assert plan.probes["memory_heap_more"].status == derived.APPROXIMATE
    theirs, ours, _ = side_by_side(
        sdt, [str(built("arena_contention")), "1", "8", "2", "100"], tmp_path,
        "--debug-file", "none",
    )  # fmt: skip
    # THEN the exact ones agree event for event, and heap_more misses the
    # growths into pages an earlier shrink left mapped, inventing none
    checked = check_against_sdt(plan, ours, theirs)
    assert {"memory_sbrk_more", "memory_heap_less", "memory_heap_more"} <= set(checked)
    seen = sum(ours.get("memory_heap_more", Counter()).values())
    assert 1 <= seen <= sum(theirs["memory_heap_more"].values())


def test_derived_sites_are_the_sdt_sites_where_the_code_allows(sdt: SdtGlibc) -> None:
    # The SDT build's notes say where each probe is. Derived from its debug
    # info instead, the lock-wait and heap sites land on the same nop.
    notes = {(s.name, s.address) for s in read_sites(sdt.libc)}
    plan = derived.plan(sdt.libc)
    for name in ("lll_lock_wait_private", "memory_heap_more", "memory_heap_less"):
        for site in plan.probes[name].sites:
            assert (name, site.address) in notes, (name, hex(site.address))
            assert site.emulated


def test_stock_libc_exerciser_counts_equal_its_ground_truth(
    probe_exerciser: Path, tmp_path: Path
) -> None:
    # GIVEN Debian's stock libc, which has no SDT notes
    libc = default_libc()
    assert not read_sites(libc)
    plan = derived.plan(libc)
    assert plan.debug_file is not None, plan.debug_problem
    # WHEN the exerciser runs under it, counted by the derived probes
    truth_file = tmp_path / "truth.json"
    done = mtrace_count("--json", "--", str(probe_exerciser), "--out", str(truth_file))
    assert done.returncode == 0, done.stderr
    counted = json.loads(done.stdout)["usdt"]
    truth = {n: e["count"] for n, e in json.loads(truth_file.read_text())["probes"].items()}
    # THEN each probe derived exactly counts what the exerciser caused
    exact = [n for n, p in plan.probes.items() if p.status == derived.EXACT and n in truth]
    assert len(exact) >= 12, exact
    assert {n: counted.get(n, 0) for n in exact} == {n: truth[n] for n in exact}
    # AND the approximate ones too, here (the exerciser reuses no shrunk heap space)
    approximate = [n for n, p in plan.probes.items() if p.status == derived.APPROXIMATE]
    assert {n: counted.get(n, 0) for n in approximate} == {n: truth[n] for n in approximate}


def test_arena_table_under_the_stock_libc() -> None:
    # GIVEN arena_contention (8 threads, 2 arenas, 1000 bursts each: enough
    # that the threads overlap and wait) under Debian's stock libc
    done = subprocess.run(
        [
            *MTRACE,
            "run",
            "--no-allocs",
            "-o",
            "summary",
            "--",
            str(built("arena_contention")),
            "1",
            "8",
            "2",
            "1000",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    # THEN the arena table has its 2 arenas, the main one among them
    arenas = re.search(r"arenas: (\d+) seen, (\d+) created", out)
    assert arenas is not None, out
    assert (int(arenas[1]), int(arenas[2])) == (2, 1), out
    rows = re.findall(
        # arena, reused, free-list, reuse-waits, lock-waits, retries; then
        # threads, wait time and the waits timed
        r"^\s+0x[0-9a-f]+ (main)?\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)"
        r"\s+\S+\s+\S+( ms| us| s| ns)?\s+\d+$",
        out,
        re.M,
    )
    assert len(rows) == 2 and rows[0][0] == "main", out
    # AND waits per arena (lock waits, and reuse waits at the arena limit),
    # summing to the contention total
    waits = [int(row[3]) + int(row[4]) for row in rows]
    total = re.search(r"contention waits (\d+)", out)
    assert total is not None and sum(waits) == int(total[1]) > 0, out
    # AND heap growth: 8 threads x 100 bursts each grow and shrink their arena
    heaps = re.search(r"grown (\d+), released (\d+)", out)
    assert heaps is not None and int(heaps[1]) > 0 and int(heaps[2]) > 0, out


def test_a_debug_file_of_another_build_is_refused(sdt: SdtGlibc) -> None:
    done = mtrace_count("--debug-file", str(sdt.libc), "--", "/bin/true")
    assert done.returncode != 0
    assert "build-id" in done.stderr and "refused" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_kmemtrace_records_carry_the_derived_events(tmp_path: Path) -> None:
    # GIVEN arena_contention under Debian's stock libc, recorded as kmemtrace
    records = tmp_path / "records"
    done = subprocess.run(
        [*MTRACE, "run", "--no-allocs", "--kmemtrace", str(records), "-o", "summary", "--",
         str(built("arena_contention")), "1", "8", "2", "100"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    counted = re.findall(r"^(memory_sbrk_more|memory_heap_new)\s+(\d+)", done.stdout, re.M)
    # WHEN report reads them back
    report = subprocess.run([*MTRACE, "report", str(records)], capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert report.returncode == 0, report.stderr
    # THEN the sbrk growths and the new heap are libc records, as many as were traced
    hits = dict((name, int(n)) for name, n in counted)
    sbrk = re.search(r"^libc sbrk: (\d+) allocations", report.stdout, re.M)
    heap = re.search(r"^libc heap: (\d+) allocations", report.stdout, re.M)
    assert sbrk is not None and heap is not None, report.stdout
    assert int(sbrk[1]) == hits["memory_sbrk_more"] > 0
    assert int(heap[1]) == hits["memory_heap_new"] >= 1
