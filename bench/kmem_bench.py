"""Sections 2 and 4: kernel kmem tracing overhead, and `report` throughput.

Section 2: `kmem_exerciser` times its own loop of socket()/close() and
pipe()/close() pairs (so tracer start-up is not counted) under: untraced;
the floor: empty BPF programs on the tracepoints mtrace-live attaches,
attached as it attaches them (raw for the slab events, classic for the page
events); empty classic programs on the same tracepoints; mtrace-live
aggregation with the pid filter (`run --kmem-only`), with raw and with
classic tracepoints; mtrace-live plus the kmemtrace record stream (`record`);
`perf stat -e 'kmem:*'`; `perf kmem record`; bpftrace `count()` on the six
tracepoints mtrace-live attaches.

Section 4: `mtrace-live report` end to end on synthetic record sets of
1.08 GB and 4.3 GB (written by the tracer's own encoder), time and peak RSS;
and, on one real workload
recorded by both tools over the same window, the time per event of
`mtrace-live report` against `perf kmem stat` on `perf kmem record`'s file.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from common import (
    BUILD,
    FLOORS,
    MTRACE,
    QUICK,
    REPS,
    Background,
    Sample,
    alternate,
    say,
    summarise,
)  # fmt: skip
from mtrace_live.probes.program import bpf_directory

PAIRS = 10_000 if QUICK else 50_000
WINDOW_PAIRS = PAIRS if QUICK else 4 * PAIRS
WINDOW_RING_PAGES = 262144  # 1 GiB: every record of the window's (6.3 M, 96 bytes each)
REPORT_RECORDS = 2_000_000 if QUICK else 18_000_000  # 18 M records: 1.08 GB
BIG_REPORT_RECORDS = 4_000_000 if QUICK else 72_000_000  # 4.32 GB: RSS must not follow
SIX = ("kmalloc", "kfree", "kmem_cache_alloc", "kmem_cache_free", "mm_page_alloc", "mm_page_free")
SLAB = SIX[:4]  # the events mtrace-live attaches raw where BTF allows (tracer/bpf/kmem_attach.py)
FLOOR = "floor: empty programs, raw slab and classic page tracepoints"
CLASSIC_FLOOR = "empty programs, all classic tracepoints"
PID_FLOOR = "floor + a pid filter: empty programs counting the workload's events"
MATCH_FLOOR = "floor + a pid filter + live objects: each free found and taken out by pointer"
PID_FLOOR_SCRIPT = Path(__file__).with_name("kmem_floor.py")
# What aggregating by call site may add to the live-object floor, in ns an
# event: the target that floor sets where it already costs perf stat's
# overhead or more.
SITE_BUDGET_NS = 20
OURS = "mtrace-live aggregation, pid filter"
OURS_CLASSIC = "mtrace-live aggregation, pid filter, --classic-tracepoints"
PERF_STAT = "perf stat -e 'kmem:*'"
PERF_KMEM = ["perf", "kmem", "--slab", "--page"]


def workload(tmp: Path, pairs: int = PAIRS) -> list[str]:
    return [str(BUILD / "kmem_exerciser"), "--sockets", str(pairs), "--pipes", str(pairs),
            "--out", str(tmp / "truth.json")]  # fmt: skip


def run_timed(argv: list[str], tmp: Path) -> Sample:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed: {done.stderr[-800:]}")
    (tmp / "last.out").write_text(done.stdout + done.stderr)
    return Sample(json.loads((tmp / "truth.json").read_text())["work_ns"] / 1e9)


def page_free_batched() -> bool:
    """This kernel has mm_page_free_batched (mtrace-live attaches it too)."""
    roots = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
    return any((root / "events/kmem/mm_page_free_batched").exists() for root in roots)


def empty_programs(raw: bool) -> list[str]:
    """A bcc process holding empty handlers (bench/bpf/kmem_empty.bpf.c) on
    the kmem tracepoints, raw for the slab events if ``raw``; it prints
    "ready" once attached. bcc itself, not mtrace-live's loader, so that
    the floor is compiled as any bcc tool compiles."""
    source = str(FLOORS / "kmem_empty.bpf.c")
    cflags = [
        f"-DRAW_SLAB={int(raw)}",
        f"-DPAGE_FREE_BATCHED={int(page_free_batched())}",
        f"-I{bpf_directory()}",
    ]  # set_table.h, the program's own
    code = (f"import bcc, signal; b = bcc.BPF(src_file={source!r}, cflags={cflags!r}); "
            "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}); "
            "print('ready', flush=True); signal.sigwait({signal.SIGINT})")  # fmt: skip
    return [str(Path(MTRACE[0]).with_name("python")), "-c", code]


def with_background(argv: list[str], ready: str, tmp: Path) -> Sample:
    tracer = Background(argv, ready, tmp / "background.log")
    try:
        return run_timed(workload(tmp), tmp)
    finally:
        tracer.stop()


def with_bpftrace(tmp: Path) -> Sample:
    attach = ",".join(f"tracepoint:kmem:{name}" for name in SIX)
    script = f'BEGIN {{ printf("ready\\n"); }} {attach} {{ @[probe] = count(); }}'
    tracer = Background(["bpftrace", "-e", script], "ready", tmp / "bpftrace.log")
    try:
        return run_timed(workload(tmp), tmp)
    finally:
        tracer.stop()


def pid_floor(tmp: Path, kind: str) -> Sample:
    """bench/kmem_floor.py (``count`` or ``match``) running the workload;
    with the events it matched, and for ``match`` the frees it found live."""
    argv = [str(Path(MTRACE[0]).with_name("python")), str(PID_FLOOR_SCRIPT), kind,
            str(int(page_free_batched())), "--", *workload(tmp)]  # fmt: skip
    sample = run_timed(argv, tmp)
    said = (tmp / "last.out").read_text()
    matched = re.search(r"kmem floor: (\d+) events", said)
    found = re.search(r"(\d+) frees found live", said)
    if matched:
        sample.extra = {"events": int(matched[1])}
    if found:
        sample.extra["frees_found"] = int(found[1])
    return sample


def slowdown(tmp: Path, peers: dict[str, str | None]) -> dict[str, object]:
    records = tmp / "records"

    def record() -> Sample:
        shutil.rmtree(records, ignore_errors=True)
        sample = run_timed([*MTRACE, "record", "-o", str(records), "--", *workload(tmp)], tmp)
        match = re.search(
            r"kmemtrace: (\d+) records .*?, (\d+) lost", (tmp / "last.out").read_text()
        )
        if match:
            sample.extra = {"records": int(match[1]), "lost": int(match[2])}
        return sample

    def perf_record() -> Sample:
        data = tmp / "perf-kmem.data"
        sample = run_timed([*PERF_KMEM, "record", "-o", str(data), "--", *workload(tmp)], tmp)
        data.unlink(missing_ok=True)
        return sample

    def aggregation(*flags: str) -> Sample:
        argv = [*MTRACE, "run", "--kmem-only", "-o", "summary", *flags, "--", *workload(tmp)]
        return run_timed(argv, tmp)

    configs: dict[str, Callable[[], Sample]] = {
        "untraced": lambda: run_timed(workload(tmp), tmp),
        FLOOR: lambda: with_background(empty_programs(raw=True), "ready", tmp),
        CLASSIC_FLOOR: lambda: with_background(empty_programs(raw=False), "ready", tmp),
        PID_FLOOR: lambda: pid_floor(tmp, "count"),
        MATCH_FLOOR: lambda: pid_floor(tmp, "match"),
        OURS: aggregation,
        OURS_CLASSIC: lambda: aggregation("--classic-tracepoints"),
        "mtrace-live aggregation + kmemtrace records": record,
    }
    if peers.get("perf"):
        configs[PERF_STAT] = lambda: run_timed(
            ["perf", "stat", "-e", "kmem:*", "-x,", "--", *workload(tmp)], tmp
        )
        configs["perf kmem record"] = perf_record
    if peers.get("bpftrace"):
        configs["bpftrace count(), six tracepoints"] = lambda: with_bpftrace(tmp)
    rows = summarise(alternate(configs, REPS))
    base = float(rows["untraced"]["median_s"])  # type: ignore[arg-type]
    for row in rows.values():
        row["ratio"] = float(row["median_s"]) / base  # type: ignore[arg-type]
    return {"pairs": PAIRS, "rows": rows}


# ---- section 4 -------------------------------------------------------------------


def synthetic_set(directory: Path, records: int) -> None:
    """kmalloc/kfree and cache alloc/free pairs on two CPUs, through the
    tracer's own encoder."""
    from mtrace_live.exporters.kmemtrace.writer import KmemtraceWriter
    from mtrace_live.probes.records import EVENT_DTYPE, EventKind

    rng = np.random.default_rng(1)
    writer = KmemtraceWriter(directory, ["memory_mallopt"], "")
    batch_size = 500_000
    sites = np.uint64(0xFFFFFFFF81000000) + rng.integers(0, 4096, 512).astype(
        np.uint64
    ) * np.uint64(16)
    done = 0
    while done < records:
        n = min(batch_size, records - done)
        batch = np.zeros(n, dtype=EVENT_DTYPE)
        batch["kind"] = EventKind.KMEM
        kind = np.arange(n) % 4  # alloc, free, cache alloc, cache free
        batch["probe"] = np.array([0, 1, 2, 3])[kind]
        batch["site"] = np.array([0, 0, 1, 1])[kind]
        batch["cpu"] = rng.integers(0, 2, n)
        batch["ip"] = sites[rng.integers(0, len(sites), n)]
        ptr = np.uint64(0xFFFF888000000000) + (
            np.arange(n, dtype=np.uint64) // np.uint64(2) + np.uint64(done)
        ) * np.uint64(64)
        batch["args"][:, 0] = ptr
        batch["args"][:, 1] = 40
        batch["args"][:, 2] = 64
        batch["args"][:, 4] = np.uint64(2**64 - 1)
        batch["tgid"] = 1234
        batch["ts"] = np.arange(n) + done
        writer.write(batch, EventKind.KMEM, EventKind.PROBE)
        done += n
    writer.close(0)


# A process's peak RSS (ru_maxrss) keeps the high-water mark of the memory
# it replaced at exec, so a command started straight from this large process
# would report this process's size. It is started from a small launcher.
_LAUNCH = (
    "import os, sys\n"
    "pid = os.fork()\n"
    "if pid == 0:\n"
    "    os.execvp(sys.argv[2], sys.argv[2:])\n"
    "_, status, usage = os.wait4(pid, 0)\n"
    "open(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
    "sys.exit(os.waitstatus_to_exitcode(status))\n"
)


def timed_child(argv: list[str], stdout: Path) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one command."""
    peak = stdout.with_suffix(".maxrss")
    started = time.perf_counter()
    with open(stdout, "wb") as out:
        child = subprocess.run(["/usr/bin/python3", "-S", "-c", _LAUNCH, str(peak), *argv],
                               stdout=out, stderr=subprocess.PIPE, check=False)  # fmt: skip
    elapsed = time.perf_counter() - started
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:3])} failed: {child.stderr[-800:]!r}")
    return elapsed, int(peak.read_text()) / 1024


def report_throughput(tmp: Path, records: int) -> dict[str, float]:
    directory = tmp / "synthetic"
    shutil.rmtree(directory, ignore_errors=True)
    say(f"  writing a synthetic record set of {records:,} records ...")
    synthetic_set(directory, records)
    size = sum(p.stat().st_size for p in directory.glob("cpu*"))
    report = [*MTRACE, "report", str(directory), "-f", "json"]
    try:
        timed_child(report, tmp / "warm.json")  # the page cache warm
        runs = [timed_child(report, tmp / "report.json") for _ in range(1 if QUICK else 3)]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    seconds = sorted(r[0] for r in runs)[len(runs) // 2]
    found = json.loads((tmp / "report.json").read_text())["records"]
    peak = max(r[1] for r in runs)
    return {"records": found, "bytes": size, "seconds": seconds,
            "records_per_s": found / seconds, "peak_rss_mib": peak}  # fmt: skip


def against_perf(tmp: Path, peers: dict[str, str | None]) -> dict[str, float] | None:
    """One workload recorded system-wide by each tool in turn (never both at
    once: a BPF program attached to a tracepoint that returns 0 keeps the
    event from perf), and each tool's own report on its file."""
    if not peers.get("perf"):
        return None
    ours, theirs = tmp / "window", tmp / "window.data"
    done = subprocess.run([*PERF_KMEM, "record", "-o", str(theirs), "--",
                           *workload(tmp, WINDOW_PAIRS)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    samples = re.search(r"\((\d+) samples\)", done.stderr)
    if done.returncode != 0 or not samples:
        raise RuntimeError(f"perf kmem record failed: {done.stderr[-800:]}")
    shutil.rmtree(ours, ignore_errors=True)
    # Room for the whole window (1 GiB), so that mtrace-live keeps
    # every event, as perf does, and both analyse the same events.
    recorder = Background([*MTRACE, "record", "--all", "--buffer-pages", str(WINDOW_RING_PAGES),
                           "-o", str(ours)], "Ctrl-C to stop", tmp / "record-all.log")  # fmt: skip
    try:
        run_timed(workload(tmp, WINDOW_PAIRS), tmp)
    finally:
        log = recorder.stop()
    lost = re.search(r"kmemtrace: \d+ records .*?, (\d+) lost", log)
    stat = [*PERF_KMEM, "-i", str(theirs), "stat", "--caller", "--alloc"]
    report = [*MTRACE, "report", str(ours), "-f", "json"]
    reps = 1 if QUICK else 3
    perf_s = sorted(timed_child(stat, tmp / "stat.txt")[0] for _ in range(reps))[reps // 2]
    ours_s = sorted(timed_child(report, tmp / "ours.json")[0] for _ in range(reps))[reps // 2]
    records = json.loads((tmp / "ours.json").read_text())["records"]
    return {"perf_events": int(samples[1]), "perf_s": perf_s, "records": records,
            "ours_s": ours_s, "lost": int(lost[1]) if lost else None}  # fmt: skip


def run(tmp: Path, peers: dict[str, str | None]) -> dict[str, object]:
    say("2. kmem overhead ...")
    slow = slowdown(tmp, peers)
    say("4. report throughput ...")
    sets = [report_throughput(tmp, n) for n in (REPORT_RECORDS, BIG_REPORT_RECORDS)]
    return {"slowdown": slow, "report": sets[0], "report_big": sets[1],
            "perf": against_perf(tmp, peers), "window_pairs": WINDOW_PAIRS}  # fmt: skip


def render_slowdown(data: dict[str, object]) -> tuple[list[str], dict[str, bool | None]]:
    slow: dict = data["slowdown"]  # type: ignore[assignment]
    rows = slow["rows"]
    ours = rows[OURS]["ratio"]
    perf = rows.get(PERF_STAT, {}).get("ratio")
    floor = rows.get(FLOOR, {}).get("ratio")
    lines = [
        "## 2. Kernel kmem tracing overhead",
        "",
        f"`kmem_exerciser` makes {slow['pairs']:,} socket()/close() and as many pipe()/close() "
        "pairs and times its own loop. The record stream's figures are per run: records "
        "written and lost.",
        "",
        "| configuration | loop (s) | vs untraced | records | lost |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        records, lost = row.get("records"), row.get("lost")
        lines.append(f"| {name} | {row['median_s']:.3f} | {row['ratio']:.2f}x | "
                     f"{'-' if records is None else f'{records:,.0f}'} | "
                     f"{'-' if lost is None else f'{lost:,.0f}'} |")  # fmt: skip
    lines.append("")
    met = None if perf is None else ours < perf
    over = ours - 1
    lines.append(
        "mtrace-live filters allocations by pid in the kernel and matches every free, "
        "system-wide, to its allocation by pointer (frees are matched whoever frees), in a "
        "set-associative table in a BPF array: a multiply and a scan of one cache line, "
        "where a BPF hash map took a bucket lock and an element from its free list; the "
        "entry is the pointer and one word for size, site slot, CPU and type, and a free "
        "adds to its site's counters by the slot, without looking the call site up again "
        "(by hand, this cut mtrace-live's time over the pid-filter floor from 41 to 30 ms "
        "in 5 alternating runs). Where "
        "the kernel's BTF gives the tracepoints' arguments and `struct kmem_cache`'s "
        "offsets, the slab events are raw tracepoints, so the kernel fills no trace record "
        "for them (`mtrace-live doctor` says which; the page events stay classic: their "
        "pfn needs `vmemmap_base`, which neither BTF nor /proc/kallsyms gives here); "
        "kmem_cache_alloc's is BTF-typed (tp_btf), so it loads the cache's sizes and name "
        "directly where a raw program calls bpf_probe_read_kernel, and a call site's "
        "one-to-one tag finds its slot without comparing the key again (by hand, 8 "
        "alternating runs: 39 ms over the floor before these two, 27 ms after)."
    )
    lines.append("")
    if perf is not None:
        lines.append(f"Aggregation with the pid filter: {ours:.2f}x untraced against perf stat's "
                     f"{perf:.2f}x: **{'met' if met else 'NOT met'}**.")  # fmt: skip
    if floor is not None and floor > 1:
        lines.append(f"Its overhead is {over / (floor - 1):.1f} times the floor's (empty "
                     "programs on the same tracepoints, attached the same way).")  # fmt: skip
    verdict, within = _pid_floor_verdict(rows)
    lines += [*verdict, ""]
    return lines, {
        "kmem aggregation with pid filter below perf stat's overhead": met,
        f"kmem aggregation at most {SITE_BUDGET_NS} ns an event over the live-object floor": within,
    }


def _ns_an_event(rows: dict[str, dict[str, float]], slower: str, faster: str) -> float:
    """What ``slower`` costs more than ``faster``, in ns a pid-floor event."""
    events = rows[PID_FLOOR]["events"]
    return (rows[slower]["median_s"] - rows[faster]["median_s"]) / events * 1e9


def _pid_floor_verdict(rows: dict[str, dict[str, float]]) -> tuple[list[str], bool | None]:
    """How much room the floors leave under perf stat, an event; and
    whether the aggregation meets the target the floors set instead."""
    floor, perf, ours = (rows.get(name, {}) for name in (PID_FLOOR, PERF_STAT, OURS))
    events = floor.get("events")
    if not floor or not perf or not ours or not events:
        return [], None
    base = float(rows["untraced"]["median_s"])
    room = _ns_an_event(rows, PERF_STAT, PID_FLOOR)
    said = (
        f"The least any pid-filtered aggregation does at an event, compare its process with "
        f"the traced one and count it if it matches (the same empty programs with that alone, "
        f"bench/kmem_floor.py count), costs {floor['median_s'] / base:.2f}x untraced, on the "
        f"workload's {events:,.0f} events. "
    )
    if room <= 0:
        said += (f"That is already perf stat's {perf['ratio']:.2f}x or more: no "
                 "pid-filtered aggregation can meet this target on this machine.")  # fmt: skip
    else:
        said += (f"Under perf stat's {perf['ratio']:.2f}x, that leaves {room:.0f} ns an event "
                 "for everything else.")  # fmt: skip
    live = rows.get(MATCH_FLOOR)
    if not live:
        return [said], None
    over_live = _ns_an_event(rows, OURS, MATCH_FLOOR)
    live_cost = _ns_an_event(rows, MATCH_FLOOR, PID_FLOOR)
    said += (
        f" A tracer that shows who holds memory must also know which objects are live: the "
        f"least it does besides (bench/kmem_floor.py match: a traced allocation puts its "
        f"pointer in a bucket of eight in one cache line, and every free, whoever frees, "
        f"looks its pointer up there and takes it out) costs {live['median_s'] / base:.2f}x "
        f"untraced, {live_cost:.0f} ns an event over the pid filter's floor"
    )
    unreachable = live["median_s"] >= perf["median_s"]
    if unreachable:
        said += (f", already perf stat's {perf['ratio']:.2f}x or more: no aggregation that "
                 "matches frees to allocations can meet the target here.")  # fmt: skip
    else:
        said += f", {_ns_an_event(rows, PERF_STAT, MATCH_FLOOR):.0f} ns an event under perf stat's."
    within = over_live <= SITE_BUDGET_NS
    said += (
        f" Over that floor, mtrace-live's aggregation takes {over_live:.0f} ns an event: its "
        "call sites (a tag's slot found in one bucket and per-CPU counters, at each "
        "allocation and each matched free), the entry's size, site, CPU and type, the "
        "spill to a second bucket, and the counts of what did not fit. "
        + ("The target the floors set instead" if unreachable else "The target beside it")
        + f": at most {SITE_BUDGET_NS} ns an event over the live-object floor: "
        f"**{'met' if within else 'NOT met'}**."
    )
    return [said], within


def render_report(data: dict[str, object]) -> tuple[list[str], dict[str, bool | None]]:
    sets: list[dict] = [data["report"], data.get("report_big")]  # type: ignore[list-item]
    sets = [rep for rep in sets if rep]
    lines = [
        "## 4. `report` throughput",
        "",
        f"`mtrace-live report -f json` end to end (start-up included, median of "
        f"{1 if QUICK else 3} runs after one warm-up) on synthetic record sets (kmalloc/kfree "
        "and cache pairs on two CPUs, written by the tracer's own encoder); peak RSS is the "
        "most of the runs (VmHWM):",
        "",
        "| records | GB | seconds | records/s | peak RSS (MiB) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for rep in sets:
        lines.append(f"| {rep['records']:,} | {rep['bytes'] / 1e9:.2f} | {rep['seconds']:.2f} | "
                     f"{rep['records_per_s']:,.0f} | {rep['peak_rss_mib']:,.0f} |")  # fmt: skip
    lines.append("")
    perf_lines, faster = _perf_section(data)
    lines += perf_lines
    first, big = sets[0], sets[-1]
    rate = first["records_per_s"] >= 20e6 if first["bytes"] >= 1e9 else None
    bounded = big["peak_rss_mib"] <= 512 if big["bytes"] >= 4e9 else None
    lines += _REPORT_NOTES
    return lines, {
        "report >= 20 M records/s (on >= 1 GB)": rate,
        "report peak RSS <= 512 MiB (on >= 4 GB)": bounded,
        "report >= 3x faster per event than perf kmem stat": None if faster is None
        else faster >= 3,
    }  # fmt: skip


def _perf_section(data: dict[str, object]) -> tuple[list[str], float | None]:
    """report against perf kmem stat on one workload: the lines, and how
    many times faster per event report was (None: not measured)."""
    perf = data.get("perf")
    if not perf:
        return [], None
    ours_ns = perf["ours_s"] / perf["records"] * 1e9  # type: ignore[index]
    perf_ns = perf["perf_s"] / perf["perf_events"] * 1e9  # type: ignore[index]
    faster = perf_ns / ours_ns
    lines = [
        f"One workload ({data['window_pairs']:,} socket and pipe pairs) recorded "
        "system-wide by `perf kmem --slab --page record -- WORKLOAD`, then, over its "
        f"run again, by `mtrace-live record --all --buffer-pages {WINDOW_RING_PAGES}` (room "
        "for the whole run, so that it keeps every event as perf does: "
        f"{'?' if perf.get('lost') is None else format(perf['lost'], ',')} lost); "
        "each tool's own analysis of its file, start-up included. (Not both at once: "
        "while a BPF program that returns 0 is attached to a tracepoint, perf records "
        "none of its events.)",
        "",
        "| analysis | events | seconds | ns per event |",
        "|---|---:|---:|---:|",
        f"| mtrace-live report -f json | {perf['records']:,} | {perf['ours_s']:.2f} | "  # type: ignore[index]
        f"{ours_ns:,.0f} |",
        f"| perf kmem --slab --page -i FILE stat --caller --alloc | {perf['perf_events']:,} | "  # type: ignore[index]
        f"{perf['perf_s']:.2f} | {perf_ns:,.0f} |",  # type: ignore[index]
        "",
        f"Per event, `report` is {faster:.1f}x faster than `perf kmem stat`.",
        "",
    ]
    return lines, faster


_REPORT_NOTES = [
    "`report` reads the cpuN files in chunks of up to 1 MiB each and merges them by "
    "sequence number in one compiled pass (`exporters/kmemtrace/walker.c`, built at install), "
    "which matches each free to its allocation in an open-addressing table of the "
    "allocations still live. Memory is the chunks (at most 64 MiB for all files), the "
    "call sites and the allocations live at one time, so it does not grow with the "
    "files: a record set whose allocations are never freed holds 64 to 128 bytes per "
    "live allocation. Start-up is the interpreter and numpy, with no compiler to load.",
    "",
]
