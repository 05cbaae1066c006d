"""Section 1: the cost of a USDT probe hit, side by side with the peers.

Two workloads under the SDT glibc, each timing its own work (so tracer
start-up and attach are not counted):

- jmp_loop: setjmp/longjmp in one thread, three probe hits per iteration
  (setjmp, longjmp, longjmp_target), a known number of hits;
- arena_contention with fixed work: 8 threads over 2 arenas, traced with
  mtrace-live's default probe set (memory_* and lll_lock_wait_private); the
  hits are whatever the contention makes, as each tracer counts them.

Configurations: untraced; mtrace-live counters only (`count`); mtrace-live
with the event stream (`-o summary --no-allocs`: every hit is a ring record
decoded into the allocator model); the floors (bench/usdt_floor.py: an empty
program, and a ring record a hit read by a bulk reader and nothing else);
bpftrace `count()` on the same probes; bcc's `trace` on the same probes,
attached to the workload's pid (bcc needs the pid for probes with several
sites; its `funccount` cannot attach USDT probes at all in bcc 0.26, see
docs/performance.md).

On jmp_loop the cost of a hit comes from the loop's own time. On
arena_contention, where tracing changes the contention and so the work, the
tracers attach to the gated workload's pid (bpftrace to the library) and the
kernel's run-time statistics give each one's BPF time per run, read between
the workload's two gates while every tracer is still attached.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import re
from collections.abc import Callable
from pathlib import Path

from common import (
    BUILD,
    MTRACE,
    QUICK,
    REPS,
    Background,
    Gated,
    Sample,
    alternate,
    check,
    event_counts,
    last_seconds,
    say,
    sdt,
    summarise,
)  # fmt: skip
from mtrace_live.tracer.bpf import bpf_syscalls

JMP_PROBES = ["setjmp", "longjmp", "longjmp_target"]
DEFAULT_PROBES = ["memory_*", "lll_lock_wait_private"]

# The floors (bench/usdt_floor.py), on the same sites in every process, as
# bpftrace attaches: the trap alone, and the least an event stream pays, one
# ring record a hit, read and nothing else done with it, at the smallest size
# a record can have and at the size of mtrace-live's (struct event).
FLOOR_SCRIPT = Path(__file__).with_name("usdt_floor.py")
PYTHON = str(Path(MTRACE[0]).with_name("python"))
EVENT_BYTES = 88
# The least record that carries a hit of these probes: the thread's ids, the
# site and three arguments (the most any of them has), 8 bytes each.
HIT_BYTES = 40
EMPTY_FLOOR = "floor: empty program"
RECORD_FLOOR = f"floor: {EVENT_BYTES}-byte ring record a hit, read"
LEAST_RECORD = "floor: 8-byte ring record a hit, read"
HIT_RECORD = f"floor: {HIT_BYTES}-byte ring record a hit, read"
# What an event stream may add to the least record that holds a hit, in ns
# a hit (jmp_loop) or of BPF time a run (arena_contention): the target set
# where that record alone costs what bpftrace's count() does.
EVENT_BUDGET_NS = 50
FLOORS = {
    EMPTY_FLOOR: ("empty", 8),
    LEAST_RECORD: ("record", 8),
    HIT_RECORD: ("record", HIT_BYTES),
    RECORD_FLOOR: ("record", EVENT_BYTES),
}


def floor_argv(globs: list[str], handler: str, record_bytes: int) -> list[str]:
    names = sorted({s for g in globs for s in _libc_probe_names() if fnmatch.fnmatch(s, g)})
    return [PYTHON, str(FLOOR_SCRIPT), handler, str(record_bytes), *names]


@functools.cache
def _libc_probe_names() -> frozenset[str]:
    from mtrace_live.probes.sdt_notes import read_sites

    return frozenset(site.name for site in read_sites(sdt().libc) if site.provider == "libc")


def bcc_probe_names(libc: Path, globs: list[str]) -> list[str]:
    """The libc probes the globs name that bcc can attach: bcc 0.26 generates
    no code for rip-relative arguments."""
    from mtrace_live.probes.sdt_notes import read_sites

    sites = [s for s in read_sites(libc) if s.provider == "libc"
             and any(fnmatch.fnmatchcase(s.name, g) for g in globs)]  # fmt: skip
    refused = {s.name for s in sites if any("(%rip)" in a for a in s.arguments)}
    return sorted({s.name for s in sites} - refused)


def workloads() -> dict[str, dict[str, object]]:
    iterations = 100_000 if QUICK else 400_000
    ops = 5_000 if QUICK else 8_000
    return {
        "jmp_loop": {
            "title": f"`jmp_loop {iterations}`: setjmp/longjmp in one thread, "
            f"{3 * iterations:,} probe hits",
            "argv": [str(BUILD / "jmp_loop"), str(iterations)],
            "globs": JMP_PROBES,
            "hits": 3 * iterations,
        },
        "arena_contention": {
            "title": f"`arena_contention 1 8 2 {ops}`: 8 threads over 2 arenas, each making "
            f"{ops:,} bursts of 64 free()/malloc() pairs and one 256 KiB block that grows and "
            "shrinks its arena; probes memory_* and lll_lock_wait_private. Times are the CPU "
            "seconds of all its threads (getrusage), steadier than wall-clock time with 8 "
            "threads on 2 CPUs; the hits are what the contention makes, so they differ "
            "from run to run and from tracer to tracer",
            "argv": [str(BUILD / "arena_contention"), "1", "8", "2", str(ops)],
            "globs": DEFAULT_PROBES,
            "hits": None,
        },
    }


def _probe_args(globs: list[str]) -> list[str]:
    return [arg for g in globs for arg in ("--probes", g)]


def untraced(argv: list[str]) -> Sample:
    return Sample(last_seconds(check(sdt().wrap(argv))))


def mtrace_counters(argv: list[str], globs: list[str]) -> Sample:
    out = check([*MTRACE, "count", "--sdt-glibc", *_probe_args(globs), "--json", "--", *argv])
    head, _, body = out.partition("{")
    hits = sum(json.loads("{" + body)["usdt"].values())
    return Sample(last_seconds(head), {"hits": hits})


def mtrace_events(argv: list[str], globs: list[str]) -> Sample:
    out = check([*MTRACE, "run", "--sdt-glibc", "--no-allocs", *_probe_args(globs), "-o",
                 "summary", "--", *argv])  # fmt: skip
    kernel, _, lost = event_counts(out)
    return Sample(last_seconds(out.split("mtrace-live:", 1)[0]), {"hits": kernel, "lost": lost})


def bpftrace_counting(globs: list[str], tmp: Path) -> Background:
    """bpftrace count() on the SDT libc's probes, attached to the library."""
    attach = ",".join(f"usdt:{sdt().libc}:libc:{g}" for g in globs)
    script = f'BEGIN {{ printf("ready\\n"); }} {attach} {{ @[probe] = count(); }}'
    return Background(["bpftrace", "-e", script], "ready", tmp / "bpftrace.log")


def bpftrace_hits(out: str) -> int:
    return sum(int(n) for n in re.findall(r"^@\[.*\]: (\d+)$", out, re.MULTILINE))


def bpftrace_count(argv: list[str], globs: list[str], tmp: Path) -> Sample:
    tracer = bpftrace_counting(globs, tmp)
    try:
        seconds = last_seconds(check(sdt().wrap(argv)))
    finally:
        out = tracer.stop()
    return Sample(seconds, {"hits": bpftrace_hits(out)})


def floor(argv: list[str], globs: list[str], tmp: Path, handler: str, size: int) -> Sample:
    program = Background(floor_argv(globs, handler, size), "ready", tmp / "floor.log")
    try:
        seconds = last_seconds(check(sdt().wrap(argv)))
    finally:
        out = program.stop()
    return Sample(seconds, _refused(out, handler))


def _refused(out: str, handler: str) -> dict[str, float]:
    """The records a record floor's ring had no room for (the empty one writes none)."""
    found = re.search(r"^refused (\d+)$", out, re.MULTILINE)
    return {"lost": float(found.group(1))} if found and handler == "record" else {}


def bcc_trace(argv: list[str], globs: list[str], tmp: Path) -> Sample:
    """bcc's trace, printing a line per hit into a file, on the gated workload."""
    libc = sdt().libc
    workload = Gated(sdt().wrap(argv))
    try:
        specs = [f"u:{libc}:{name}" for name in bcc_probe_names(libc, globs)]
        tracer = Background(["trace-bpfcc", "-p", str(workload.pid), *specs], "FUNC",
                            tmp / "trace.log")  # fmt: skip
    except Exception:
        workload.process.kill()
        raise
    try:
        seconds = last_seconds(workload.finish())
    finally:
        out = tracer.stop()
    return Sample(seconds, trace_counts(out))


def trace_counts(out: str) -> dict[str, float]:
    """Hits of bcc's trace: the event lines it printed, and the samples it
    says it lost."""
    lines = out.split("FUNC", 1)[1].splitlines()
    delivered = sum(1 for line in lines if re.match(r"\s*\d+\s+\d+\s", line))
    lost = sum(int(n) for n in re.findall(r"Possibly lost (\d+) samples", out))
    return {"hits": delivered + lost, "lost": lost}


# ---- arena_contention: tracers attached to the gated workload ------------------


def programs_run() -> tuple[int, int]:
    """Run time (ns) and runs of every loaded BPF program, summed."""
    from mtrace_live.tracer.bpf import bpf_syscalls

    total_ns = total_runs = 0
    for prog_id in bpf_syscalls.program_ids():
        fd = bpf_syscalls.program_fd(prog_id)
        if fd is None:
            continue
        try:
            stats = bpf_syscalls.run_stats(fd)
        finally:
            bpf_syscalls.close(fd)
        if stats is not None:
            total_ns += stats.run_time_ns
            total_runs += stats.run_cnt
    return total_ns, total_runs


def attached(
    argv: list[str],
    tracer: Callable[[int], list[str]] | None,
    ready: str,
    tmp: Path,
    measured: bool = True,
) -> tuple[Sample, str]:
    """The workload gated, the tracer (if any) attached to its pid; the BPF
    programs' run time read between the workload's two gates, while every
    tracer is still attached."""
    workload = Gated(sdt().wrap(argv))
    background = None
    try:
        if tracer is not None:
            background = Background(tracer(workload.pid), ready, tmp / "tracer.log")
        before = programs_run()
        workload.start()
        times = workload.line() + workload.line()
        after = programs_run()
        workload.finish()
    finally:
        log = background.stop() if background is not None else ""
        if workload.process.poll() is None:
            workload.process.kill()
            workload.process.wait()
    sample = Sample(last_seconds(times))
    runs = after[1] - before[1]
    if measured and runs:
        sample.extra["bpf_ns"] = (after[0] - before[0]) / runs
    return sample, log


def arena_configs(
    argv: list[str], globs: list[str], tmp: Path, peers: dict[str, str | None]
) -> dict[str, Callable[[], Sample]]:
    run = _ArenaRuns(argv, globs, tmp)
    configs: dict[str, Callable[[], Sample]] = {
        "untraced": lambda: attached(argv, None, "", tmp, measured=False)[0],
        "mtrace-live counters only": run.counters,
        "mtrace-live event stream": run.events,
    }
    for name, (handler, size) in FLOORS.items():
        configs[name] = run.floor_of(handler, size)
    if peers.get("bpftrace"):
        configs["bpftrace count()"] = run.bpftrace
    if peers.get("bcc trace"):
        configs["bcc trace"] = run.bcc
    return configs


class _ArenaRuns:
    """One arena_contention run under each tracer, attached to its pid."""

    def __init__(self, argv: list[str], globs: list[str], tmp: Path) -> None:
        self.argv, self.globs, self.tmp = argv, globs, tmp
        self.libc = str(sdt().libc)
        self.probes = _probe_args(globs)

    def counters(self) -> Sample:
        def argv_of(pid: int) -> list[str]:
            return [*MTRACE, "count", "--pid", str(pid), "--lib", self.libc, *self.probes,
                    "--json"]  # fmt: skip

        sample, log = attached(self.argv, argv_of, "Ctrl-C", self.tmp)
        counts, _ = json.JSONDecoder().raw_decode(log[log.index("{") :])
        sample.extra["hits"] = sum(counts["usdt"].values())
        return sample

    def events(self) -> Sample:
        def argv_of(pid: int) -> list[str]:
            return [*MTRACE, "--pid", str(pid), "--lib", self.libc, "--no-allocs", *self.probes,
                    "-o", "summary"]  # fmt: skip

        sample, log = attached(self.argv, argv_of, "Ctrl-C", self.tmp)
        kernel, _, lost = event_counts(log)
        sample.extra.update(hits=kernel, lost=lost)
        return sample

    def bpftrace(self) -> Sample:
        tracer = bpftrace_counting(self.globs, self.tmp)
        try:
            sample, _ = attached(self.argv, None, "", self.tmp)
        finally:
            out = tracer.stop()
        sample.extra["hits"] = bpftrace_hits(out)
        return sample

    def bcc(self) -> Sample:
        specs = [f"u:{self.libc}:{name}" for name in bcc_probe_names(Path(self.libc), self.globs)]
        sample, log = attached(self.argv, lambda pid: ["trace-bpfcc", "-p", str(pid), *specs],
                               "FUNC", self.tmp)  # fmt: skip
        sample.extra.update(trace_counts(log))
        return sample

    def floor_of(self, handler: str, size: int) -> Callable[[], Sample]:
        def measured() -> Sample:
            sample, log = attached(self.argv, lambda _: floor_argv(self.globs, handler, size),
                                   "ready", self.tmp)  # fmt: skip
            sample.extra.update(_refused(log, handler))
            return sample

        return measured


# ---- the derived probes (probes/derived.py) against the SDT ones ---------------

DERIVED_GLOBS = ["memory_*"]


def derived_workload() -> dict[str, object]:
    ops = 3_000 if QUICK else 10_000
    return {
        "title": f"`arena_contention 1 2 2 {ops}`: 2 threads over 2 arenas, each making {ops:,} "
        "bursts of 64 free()/malloc() pairs and one 256 KiB block that grows and shrinks its "
        "arena (sbrk in the main arena, the heap in the other): about two memory_* events a "
        "burst. Under the SDT build, traced by its SDT notes and by the probes derived for "
        "the same libc; and under Debian's stock libc, which has no notes, by the derived "
        "probes. Times are the CPU seconds of the workload's threads (kernel time included: "
        "the uprobe traps and the syscall tracepoints)",
        "argv": [str(BUILD / "arena_contention"), "1", "2", "2", str(ops)],
    }


def derived_configs(
    argv: list[str], tmp: Path, peers: dict[str, str | None]
) -> dict[str, Callable[[], Sample]]:
    probes = _probe_args(DERIVED_GLOBS)

    def counted(*extra: str, stock: bool = False) -> Sample:
        where = [] if stock else ["--sdt-glibc"]
        out = check([*MTRACE, "count", *where, *extra, *probes, "--json", "--", *argv])
        head, _, body = out.partition("{")
        return Sample(last_seconds(head), {"hits": sum(json.loads("{" + body)["usdt"].values())})

    def streamed(*extra: str) -> Sample:
        out = check(
            [
                *MTRACE,
                "run",
                "--sdt-glibc",
                *extra,
                "--no-allocs",
                *probes,
                "-o",
                "summary",
                "--",
                *argv,
            ]
        )
        kernel, _, lost = event_counts(out)
        return Sample(last_seconds(out.split("mtrace-live:", 1)[0]), {"hits": kernel, "lost": lost})

    configs: dict[str, Callable[[], Sample]] = {
        "untraced": lambda: untraced(argv),
        "SDT probes, counted": lambda: counted(),
        "derived probes, counted": lambda: counted("--derived"),
        "SDT probes, event stream": lambda: streamed(),
        "derived probes, event stream": lambda: streamed("--derived"),
        "stock libc untraced": lambda: Sample(last_seconds(check(argv))),
        "stock libc, derived probes, counted": lambda: counted(stock=True),
    }
    if peers.get("bpftrace"):
        configs["bpftrace count() (SDT probes)"] = lambda: bpftrace_count(argv, DERIVED_GLOBS, tmp)
    return configs


def run(tmp: Path, peers: dict[str, str | None]) -> dict[str, object]:
    say("1. USDT per-hit cost ...")
    results: dict[str, object] = {}
    for name, spec in workloads().items():
        argv: list[str] = spec["argv"]  # type: ignore[assignment]
        globs: list[str] = spec["globs"]  # type: ignore[assignment]
        if spec["hits"] is None:  # arena_contention
            stats = bpf_syscalls.enable_run_time_stats()
            try:
                rows = summarise(alternate(arena_configs(argv, globs, tmp, peers), REPS))
            finally:
                bpf_syscalls.close(stats)
        else:
            configs: dict[str, Callable[[], Sample]] = {
                "untraced": lambda a=argv: untraced(a),
                "mtrace-live counters only": lambda a=argv, g=globs: mtrace_counters(a, g),
                "mtrace-live event stream": lambda a=argv, g=globs: mtrace_events(a, g),
            }
            for floor_name, (handler, size) in FLOORS.items():
                configs[floor_name] = lambda a=argv, g=globs, h=handler, n=size: floor(
                    a, g, tmp, h, n
                )
            if peers.get("bpftrace"):
                configs["bpftrace count()"] = lambda a=argv, g=globs: bpftrace_count(a, g, tmp)
            if peers.get("bcc trace"):
                configs["bcc trace"] = lambda a=argv, g=globs: bcc_trace(a, g, tmp)
            rows = summarise(alternate(configs, REPS))
        base = float(rows["untraced"]["median_s"])  # type: ignore[arg-type]
        for config, row in rows.items():
            hits = row.get("hits") or spec["hits"]
            row["ratio"] = float(row["median_s"]) / base  # type: ignore[arg-type]
            if config != "untraced" and hits and spec["hits"] is not None:
                row["ns_per_hit"] = (float(row["median_s"]) - base) / float(hits) * 1e9  # type: ignore[arg-type]
        results[name] = {"title": spec["title"], "rows": rows}
    spec = derived_workload()
    argv = spec["argv"]  # type: ignore[assignment]
    rows = summarise(alternate(derived_configs(argv, tmp, peers), REPS))
    for config, row in rows.items():
        base_name = "stock libc untraced" if config.startswith("stock") else "untraced"
        base = float(rows[base_name]["median_s"])  # type: ignore[arg-type]
        row["ratio"] = float(row["median_s"]) / base  # type: ignore[arg-type]
        hits = row.get("hits")
        if hits and "untraced" not in config:
            row["ns_per_hit"] = (float(row["median_s"]) - base) / float(hits) * 1e9  # type: ignore[arg-type]
    results["derived"] = {"title": spec["title"], "rows": rows}
    return results


_INTRO = [
    "## 1. Cost of a USDT probe hit",
    "",
    "Each workload runs under the SDT glibc and times its own work, so start-up and attach "
    "are not counted.",
    "",
    "- jmp_loop: ns per hit = (median time - untraced median) / hits. Every tracer counts "
    "the same hits, and the whole cost of a hit (the uprobe trap, the program, and for "
    "bcc's trace its output) lands on the loop's one thread.",
    "- arena_contention: the hits are what the contention makes, and tracing changes the "
    "contention (a slower critical section makes more or fewer waits), so the workload's "
    "time says little about a hit. The kernel's own BPF run-time statistics "
    "(`BPF_ENABLE_STATS`) give each tracer's program time per run instead, read while "
    "the tracers are still attached (each attaches to the gated workload's pid; bpftrace "
    "attaches to the library). The uprobe trap, the same for all, is not in it.",
    "",
    "hits are what each tracer counted (for bcc's trace: lines printed plus samples it "
    "reported lost).",
    "",
]
_NOTES = [
    "mtrace-live's event stream runs with `--no-allocs`: the allocation functions, "
    "traced by default, would add their own runs to the BPF time per run. "
    "An event-stream hit costs more than a counted one: besides the counters it reserves "
    "and submits an 88-byte ring record; with several threads on both CPUs, the ring's "
    "reservations also contend for its lock. The arguments are compiled into each "
    "site's handler as constant loads. The kernel counts a process's hits only for the "
    "records the ring had no room for; user space counts the delivered ones itself, so "
    "an event-stream hit makes no hash update. A record's time is read from the clock "
    "only when an output writes it (`-o text`, `-o json`, `--kmemtrace`, `--sp-rtrace`); "
    "otherwise (the live view, the summary, serve: the row above) it is the clock read "
    "once a tick per CPU. By hand, in 7 alternating runs of the two builds of the same "
    "trace, the exact clock cost about 25 ns a hit more here (a paravirtual clock read "
    "under KVM); the outputs that write times cannot keep up with this loop in Python, "
    "and a run that loses records is cheaper per hit, so the bench has no row for them. "
    "What remains above bpftrace's count() is the record itself, as the floors show: on "
    "the same sites in every process (as bpftrace attaches), a program that does nothing "
    "(the uprobe trap alone), and programs that only reserve a ring record, write what "
    "it holds of the hit into it (the thread's ids; then the site; then three argument "
    "registers) and submit it (bench/bpf/ring_floor.bpf.c), at the least size a record "
    f"can have (8 bytes: the thread), the least that holds a hit ({HIT_BYTES}), and the "
    f"size of mtrace-live's ({EVENT_BYTES}). The "
    "least an event stream can pay: a thread on the other CPU copies everything committed"
    " every millisecond (mtrace-live's own bulk reader) and does nothing else, their ring"
    " (1 MiB) fits in the CPU's 4 MiB L2, and a commit wakes no one. A record nobody "
    "reads costs less: by hand, 411 ns a hit for 88 bytes against 390 for the empty "
    "program (3 runs each), so about half of what a read record costs is its cache lines "
    "going to the reader's CPU and coming back for the next write. In a ring larger than "
    "the L2 the trap's return waits longer for those stores: the 88-byte floor with an 8 "
    "MiB ring costs 469 ns a hit against 433 with 1 MiB (by hand, 5 alternating runs "
    "each). So mtrace-live's kernel ring is 2 MiB, and its slack (`--buffer-pages`, 8 MiB"
    " by default) is in user memory: the ring copier, a thread in C that never takes the "
    "interpreter lock (tracer/bpf/ring_copy.c), moves the committed records there, every "
    "millisecond while they come fast (docs/live-tracing.md). By hand, 8 alternating "
    "runs of 3 M hits on jmp_loop: 1.400 s with the "
    "8 MiB ring read by the interpreter, 1.307 s with the copier and a 2 MiB ring, "
    "1.293 s with a 1 MiB ring, which lost records in 1 run in 16 (the copier was seen to "
    "wait up to 5 ms for a CPU), and 1.343 s with the copier's thread made real-time "
    "(it then preempts the traced program). Before the copier, reading a 1 MiB ring from "
    "Python lost 0.5-0.8% of the records; a consumer that takes the records the moment "
    "they are committed (woken at every one it catches up with) costs more, 510 ns a "
    "hit; committing without waking the reader made no difference beyond the noise.",
    "",
    "bcc: `funccount` cannot attach USDT probes in bcc 0.26 (it hands the library path "
    "on as the text of a bytes object, `b'/...'`), so its `trace` stands in, printing a "
    "line per hit through bcc's perf buffer. `trace` needs the pid for probes with several "
    "sites, so the workload waits on stdin until `trace -p PID` has attached; and bcc "
    "generates no code for rip-relative arguments (`8@32+mp_(%rip)`), so the "
    "mallopt/tunable probes that have them are left out of its probe list (they fire at "
    "start-up, before the timed work).",
    "",
]


def render(data: dict[str, object]) -> tuple[list[str], dict[str, bool | None]]:
    lines = list(_INTRO)
    targets: dict[str, bool | None] = {}
    for name, result in data.items():
        if name != "derived":
            lines += _workload(name, result, targets)  # type: ignore[arg-type]
    lines += _NOTES
    if "derived" in data:
        lines += render_derived(data["derived"])  # type: ignore[arg-type]
    return lines, targets


def _workload(name: str, result: dict[str, object], targets: dict[str, bool | None]) -> list[str]:
    """One workload's table and verdicts; its targets' verdicts into ``targets``."""
    rows: dict[str, dict[str, float]] = result["rows"]  # type: ignore[assignment]
    metric = "bpf_ns" if any("bpf_ns" in row for row in rows.values()) else "ns_per_hit"
    title = "BPF ns per run" if metric == "bpf_ns" else "ns per hit"
    bpftrace = rows.get("bpftrace count()", {}).get(metric)
    lines = [
        f"### {name}",
        "",
        str(result["title"]) + ".",
        "",
        f"| configuration | median s | vs untraced | hits | {title} | vs bpftrace count() | lost |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for config, row in rows.items():
        cost = row.get(metric)
        versus = f"{cost / bpftrace:.2f}x" if cost is not None and bpftrace else "-"
        lines.append(_table_row(config, row, cost, versus))
    for config in ("mtrace-live counters only", "mtrace-live event stream"):
        ours = rows[config].get(metric)
        key = f"USDT per-hit cost, {name}, {config.removeprefix('mtrace-live ')}"
        targets[key] = None if ours is None or not bpftrace else ours <= bpftrace
    record = _record_costs(rows, metric)
    key = f"USDT event stream: its record costs at most a bare {EVENT_BYTES}-byte one, {name}"
    targets[key] = None if record is None else record[0] <= record[1]
    over_hit = _over_hit_floor(rows, metric)
    key = (f"USDT event stream: at most {EVENT_BUDGET_NS} ns over the least record that "
           f"holds a hit, {name}")  # fmt: skip
    targets[key] = None if over_hit is None else over_hit <= EVENT_BUDGET_NS
    lines.append("")
    lines += _floor_verdict(rows, metric, bpftrace, record)
    return lines


def _record_costs(rows: dict[str, dict[str, float]], metric: str) -> tuple[float, float] | None:
    """What the record adds to a hit: to mtrace-live's (event stream less
    counters only), and to the floor's (the record floor less the empty one)."""
    got = [
        rows.get(name, {}).get(metric)
        for name in (
            "mtrace-live event stream",
            "mtrace-live counters only",
            RECORD_FLOOR,
            EMPTY_FLOOR,
        )
    ]
    if any(value is None for value in got):
        return None
    stream, counters, record, empty = got  # type: ignore[misc]
    return stream - counters, record - empty


def _over_hit_floor(rows: dict[str, dict[str, float]], metric: str) -> float | None:
    """What mtrace-live's event stream costs over the least record that holds a hit."""
    ours = rows.get("mtrace-live event stream", {}).get(metric)
    hit = rows.get(HIT_RECORD, {}).get(metric)
    return None if ours is None or hit is None else ours - hit


def _floor_verdict(
    rows: dict[str, dict[str, float]],
    metric: str,
    bpftrace: float | None,
    record: tuple[float, float] | None,
) -> list[str]:
    """What the floors say of this workload's event-stream target."""
    least = rows.get(LEAST_RECORD, {}).get(metric)
    hit = rows.get(HIT_RECORD, {}).get(metric)
    if least is None or hit is None or record is None or not bpftrace:
        return []
    unit = "ns of BPF time a run" if metric == "bpf_ns" else "ns a hit"
    if least > bpftrace:
        verdict = (
            f"No event stream can cost at most bpftrace's count() here: one 8-byte record "
            f"a hit, read and nothing else, already costs {least:,.0f} {unit}, "
            f"{least / bpftrace:.2f}x count()'s {bpftrace:,.0f}."
        )
    elif hit > bpftrace:
        verdict = (
            f"No event stream that carries its hits can cost at most bpftrace's count() "
            f"here: the least record that holds a hit ({HIT_BYTES} bytes: the thread's ids, "
            f"the site and three arguments), read and nothing else, already costs "
            f"{hit:,.0f} {unit}, {hit / bpftrace:.2f}x count()'s {bpftrace:,.0f} (an 8-byte "
            f"record, which holds no more than the thread, {least:,.0f})."
        )
    else:
        verdict = (
            f"Here the least record that holds a hit ({HIT_BYTES} bytes: the thread's ids, "
            f"the site and three arguments), read and nothing else, costs {hit:,.0f} {unit} "
            f"against count()'s {bpftrace:,.0f}: the floors leave an event stream "
            f"{bpftrace - hit:,.0f} {unit} for everything else it does."
        )
    ours, bare = record
    over_hit = _over_hit_floor(rows, metric)
    budget = ""
    if over_hit is not None:
        budget = (
            (
                " The target the floors set instead"
                if max(least, hit) > bpftrace
                else " The target beside it"
            )
            + ": mtrace-live's event stream at most "
            f"{EVENT_BUDGET_NS} {unit} over that least record, for what an event stream "
            "needs besides (the process filter, the gate that makes a stop lossless, the "
            "kernel's own count of hits that the loss accounting checks, the time, CPU, "
            "probe and argument count, the room for three more arguments and the stack ids): "
            f"{over_hit:,.0f}, **{'met' if over_hit <= EVENT_BUDGET_NS else 'NOT met'}**."
        )
    return [
        f"What the record adds, in {unit}: {ours:,.0f} to mtrace-live's (event stream less "
        f"counters only), {bare:,.0f} to the floor's ({EVENT_BYTES}-byte record less empty "
        f"program). {verdict}{budget}",
        "",
    ]


def _table_row(config: str, row: dict[str, float], cost: float | None, versus: str) -> str:
    hits, lost = row.get("hits"), row.get("lost")
    return (
        f"| {config} | {row['median_s']:.3f} | {row['ratio']:.2f}x | "
        f"{'-' if hits is None else f'{hits:,.0f}'} | "
        f"{'-' if cost is None else f'{cost:,.0f}'} | {versus} | "
        f"{'-' if lost is None else f'{lost:,.0f}'} |"
    )


# Each derived configuration and the SDT one it is compared with.
SAME_MODE = {
    "derived probes, counted": "SDT probes, counted",
    "derived probes, event stream": "SDT probes, event stream",
    "stock libc, derived probes, counted": "SDT probes, counted",
}


def render_derived(result: dict[str, object]) -> list[str]:
    rows: dict[str, dict[str, float]] = result["rows"]  # type: ignore[assignment]
    lines = [
        "### The derived probes against the SDT probes",
        "",
        str(result["title"]) + ".",
        "",
        "ns per event = (median time - untraced median of the same libc) / events counted; "
        "the last column is what a derived event costs more than an SDT one in the same "
        "mode: the difference of the two, each against its own libc's untraced run. With the "
        "event stream "
        "the tracer itself runs on one of the two CPUs while the workload's two threads "
        "run, which lowers their contention and so their CPU time below the untraced run's: "
        "there only the difference between the two streams means something. "
        "docs/derived-probes.md says what each derived probe is built from.",
        "",
        "| configuration | median s | vs untraced | events | ns per event | more than SDT, "
        "ns per event | lost |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for config, row in rows.items():
        raw = row.get("ns_per_hit")
        peer = rows.get(SAME_MODE.get(config, ""), {}).get("ns_per_hit")
        more = f"{raw - peer:+,.0f}" if raw is not None and peer is not None else "-"
        cost = raw if raw is None or raw >= 0 else None  # the event stream: see above
        lines.append(_table_row(config, row, cost, more))
    lines += [
        "",
        "On the SDT build the derived sites for the heaps are the SDT notes' own `nop`s, and "
        "sbrk comes from the `brk` tracepoints: a derived event costs about what an SDT one "
        "does. On Debian's stock libc the heap-growth site is single-stepped (its store has "
        "no emulated instruction after it on the same path), which the stock row shows.",
        "",
    ]
    return lines
