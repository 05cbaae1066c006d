"""Section 9: arena contention in time, and how much the tracer disturbs it.

Three measurements, on Debian's stock glibc (no SDT notes):

1. The cost of timing a wait. ``lock_wait_calls`` enters the libc's
   lock-wait slow path (``__lll_lock_wait_private``) on a free lock, again
   and again: each call takes the lock at once, so its time is the probes'.
   ns per call, untraced; with mtrace-live counting the waits
   (``--no-lock-times``: the derived ``lll_lock_wait_private`` probe, which
   fires only when a thread sleeps); timing them (the default, ``-o
   summary``); and bpftrace timing them (entry and return probes; its entry
   stands on the function's first instruction, which the kernel
   single-steps: bpftrace 0.17 cannot probe an offset in a function).
2. The observer effect. ``arena_waits 8 2 OPS``: 8 threads over 2 arenas,
   each making OPS rounds of 64 free()/malloc() pairs of 1-4 KiB, after the
   tracer has attached. Each configuration reports the run's wall time, the
   waits and their time as it measured them, and the share of the threads'
   own time (as the workload measures it) spent waiting. One configuration
   runs ``--contention``, perf (``perf probe`` at the instruction mtrace-live
   probes, entry and return; ``perf record``) and bpftrace on the same waits.
3. Throughput at low contention: ``arena_waits 8 16 OPS`` (an arena per
   thread), untraced and under ``--contention``.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
from collections.abc import Callable, Iterator
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
    say,
    summarise,
)

CALLS = 100_000 if QUICK else 300_000
OPS = 10_000 if QUICK else 20_000
LIBC = Path("/usr/lib/x86_64-linux-gnu/libc.so.6")
WAIT = f"{LIBC}:__lll_lock_wait_private"
TIMING = ("BEGIN { printf(\"ready\\n\"); } "
          f"uprobe:{WAIT} /pid == $1/ {{ @start[tid] = nsecs; }} "
          f"uretprobe:{WAIT} /pid == $1 && @start[tid]/ {{ @waits = count(); "
          "@total = sum(nsecs - @start[tid]); delete(@start[tid]); }")  # fmt: skip
CONTENTION = "mtrace-live --contention"
ALONE = "mtrace-live, lock-wait probes alone"
BOTH = "mtrace-live --contention, perf and bpftrace, on the same waits"
COUNTED = "mtrace-live --no-lock-times (counted)"
TIMED = "mtrace-live (timed)"


def _bpftrace_figures(text: str) -> tuple[int, int]:
    found = dict(re.findall(r"@(waits|total): (\d+)", text))
    return int(found.get("waits", 0)), int(found.get("total", 0))


def _mtrace_figures(text: str) -> tuple[int, int]:
    """Waits and their ns on arenas, from -o json's lock_waits tables."""
    waits = total = 0
    for line in text.splitlines():
        if line.startswith('{"table":"lock_waits"'):
            row = json.loads(line)
            if row["lock"] in ("main", "arena"):
                waits, total = waits + row["waits"], total + row["total_ns"]
    return waits, total


def _run(argv: list[str], tracers: list[tuple[Callable[[int], list[str]], str]],
         tmp: Path, until: str) -> tuple[dict[str, str], list[str]]:  # fmt: skip
    """The gated workload with ``tracers`` (argv of its pid, ready text)
    attached: its lines from the start to ``until``, and each tracer's output."""
    work = Gated(argv)
    started: list[Background] = []
    lines: list[str] = []
    try:
        for index, (argv_of, ready) in enumerate(tracers):
            started.append(Background(argv_of(work.pid), ready, tmp / f"tracer-{index}.log"))
        work.start()
        while not lines or not lines[-1].startswith(until):
            line = work.line()
            if not line:
                raise RuntimeError(f"the workload ended early: {lines[-3:]}")
            lines.append(line.strip())
    finally:
        outputs = [tracer.stop() for tracer in started]
        if work.process.poll() is None:
            work.finish()
    values = {}
    for line in lines:
        parts = line.split()
        if len(parts) == 2:
            values[parts[0]] = parts[1]
    return values, outputs


def _mtrace(*args: str, output: str = "json") -> tuple[Callable[[int], list[str]], str]:
    return (lambda pid: ["sh", "-c", f"exec {' '.join(MTRACE)} --pid {pid} -o {output} "
                         f"{' '.join(args)} 2>&1"], "Ctrl-C")  # fmt: skip


PERF_EVENTS = ("mtrace_bench:lw_enter", "mtrace_bench:lw_return__return")


@contextlib.contextmanager
def perf_probes() -> Iterator[None]:
    """perf's probes on the slow path, at the instruction mtrace-live probes
    (as ``mtrace-live probes`` says: the first one the kernel emulates)."""
    from mtrace_live.probes.lock_sites import lock_wait_site

    site = lock_wait_site(LIBC)
    assert site is not None
    for probe in (f"mtrace_bench:lw_enter={site.address:#x}",
                  "mtrace_bench:lw_return=__lll_lock_wait_private%return"):  # fmt: skip
        subprocess.run(["perf", "probe", "-q", "-x", str(LIBC), "-a", probe], check=True)
    try:
        yield
    finally:
        subprocess.run(["perf", "probe", "-q", "-d", "mtrace_bench:*"], check=False)


def _perf(tmp: Path) -> tuple[Callable[[int], list[str]], str]:
    """perf record, started disabled and enabled through its control FIFO:
    its acknowledgement says the events are on."""
    data, ctl, ack = tmp / "perf.data", tmp / "perf.ctl", tmp / "perf.ack"
    events = " ".join(f"-e {event}" for event in PERF_EVENTS)
    script = (f"rm -f {ctl} {ack}; mkfifo {ctl} {ack}; "
              f"perf record -q -D -1 --control fifo:{ctl},{ack} {events} -p $0 -o {data} & "
              "p=$!; trap 'kill -INT $p' INT; "
              f"echo enable > {ctl}; read reply < {ack}; echo ready; wait $p; wait $p")  # fmt: skip
    return (lambda pid: ["sh", "-c", script, str(pid)], "ready")


def _perf_figures(tmp: Path) -> tuple[int, int]:
    """The calls perf saw, and their time (entry to return, per thread)."""
    script = subprocess.run(["perf", "script", "-i", str(tmp / "perf.data"), "--ns", "-F",
                             "tid,time,event"], capture_output=True, text=True).stdout  # fmt: skip
    started: dict[int, int] = {}
    count = total = 0
    for found in re.finditer(r"(?m)^\s*(\d+)\s+(\d+)\.(\d{9}):\s+mtrace_bench:(\w+)", script):
        tid, at = int(found.group(1)), int(found.group(2)) * 10**9 + int(found.group(3))
        if found.group(4) == "lw_enter":
            started[tid] = at
        elif tid in started:
            count, total = count + 1, total + at - started.pop(tid)
    return count, total


def _bpftrace() -> tuple[Callable[[int], list[str]], str]:
    return (lambda pid: ["bpftrace", "-e", TIMING, str(pid)], "ready")


def cost(tmp: Path, tracer: tuple[Callable[[int], list[str]], str] | None) -> Sample:
    values, _ = _run([str(BUILD / "lock_wait_calls"), str(CALLS)],
                     [tracer] if tracer else [], tmp, "ns_per_call")  # fmt: skip
    return Sample(float(values["ns_per_call"]))


def contention(tmp: Path, arenas: int, tracers: list[tuple[Callable[[int], list[str]], str]],
               figures: Callable[[list[str]], tuple[int, int]] | None = None,
               peers: bool = False) -> Sample:  # fmt: skip
    """One run of arena_waits: wall seconds; waits, wait seconds and share
    as ``figures`` reads them from the tracers' outputs (and, with
    ``peers``, perf's and bpftrace's, the second and third tracers)."""
    values, outputs = _run([str(BUILD / "arena_waits"), "8", str(arenas), str(OPS)], tracers,
                           tmp, "lifetimes")  # fmt: skip
    thread_s = float(values["thread_seconds"])
    extra: dict[str, float] = {}
    measured = [("", figures(outputs))] if figures is not None else []
    if peers:
        measured += [("perf_", _perf_figures(tmp)), ("bpftrace_", _bpftrace_figures(outputs[2]))]
    for prefix, (waits, total) in measured:
        extra.update({f"{prefix}waits": waits, f"{prefix}wait_s": total / 1e9,
                      f"{prefix}share": total / 1e9 / thread_s})  # fmt: skip
    return Sample(float(values["wall"]), extra)


def run(tmp: Path, peers: dict[str, str | None]) -> dict[str, object]:
    ours = ("mtrace-live", "untraced")
    bpftrace = bool(peers.get("bpftrace"))
    say("contention: the cost of a timed wait")
    costs: dict[str, Callable[[], Sample]] = {
        "untraced": lambda: cost(tmp, None),
        COUNTED: lambda: cost(tmp, _mtrace("--no-allocs", "--no-lock-times", output="summary")),
        TIMED: lambda: cost(tmp, _mtrace("--no-allocs", output="summary")),
    }
    if bpftrace:
        costs["bpftrace entry + return, timed"] = lambda: cost(tmp, _bpftrace())
    mine = lambda outputs: _mtrace_figures(outputs[0])  # noqa: E731
    say(f"contention: the observer effect (8 threads, 2 arenas, {OPS:,} rounds each)")
    high: dict[str, Callable[[], Sample]] = {
        "untraced": lambda: contention(tmp, 2, []),
        ALONE: lambda: contention(tmp, 2, [_mtrace("--no-allocs", "--probes",
                                                   "lll_lock_wait_private")], mine),
        CONTENTION: lambda: contention(tmp, 2, [_mtrace("--contention")], mine),
        "mtrace-live --sample-bytes 524288": lambda: contention(
            tmp, 2, [_mtrace("--sample-bytes", "524288")], mine),
        "mtrace-live (every allocation: the default)": lambda: contention(
            tmp, 2, [_mtrace()], mine),
    }  # fmt: skip
    if bpftrace:
        high["bpftrace entry + return, timed"] = lambda: contention(
            tmp, 2, [_bpftrace()], lambda outputs: _bpftrace_figures(outputs[0])
        )
    if bpftrace and peers.get("perf"):
        high[BOTH] = lambda: contention(tmp, 2, [_mtrace("--contention"), _perf(tmp),
                                                 _bpftrace()], mine, peers=True)  # fmt: skip
    say(f"contention: throughput at low contention (8 threads, 16 arenas, {OPS:,} rounds)")
    low: dict[str, Callable[[], Sample]] = {
        "untraced": lambda: contention(tmp, 16, []),
        CONTENTION: lambda: contention(tmp, 16, [_mtrace("--contention")], mine),
    }
    cost_samples = alternate(costs, REPS, ours=ours)
    with perf_probes() if BOTH in high else contextlib.nullcontext():
        high_samples = alternate(high, REPS, ours=ours)
    spread = {
        name: {key: _spread([s.extra.get(key, 0.0) for s in runs]) for key in ("waits", "wait_s")}
        for name, runs in high_samples.items()
    }
    return {"calls": CALLS, "ops": OPS, "cost": summarise(cost_samples),
            "high": summarise(high_samples), "spread": spread,
            "low": summarise(alternate(low, REPS, ours=ours))}  # fmt: skip


def _spread(values: list[float]) -> float:
    return max(values) - min(values) if values else 0.0


def render(data: dict) -> tuple[list[str], dict[str, bool | None]]:
    cost_rows, high, low = data["cost"], data["high"], data["low"]
    lines = [
        "## 9. Arena contention in time",
        "",
        f"**The cost of timing a wait.** `lock_wait_calls` enters the lock-wait slow path "
        f"on a free lock {data['calls']:,} times: each call's time is the probes'.",
        "",
        "| configuration | ns per call |",
        "|---|---:|",
        *(f"| {name} | {row['median_s']:.0f} |" for name, row in cost_rows.items()),
        "",
        f"**The observer effect.** `arena_waits 8 2 {data['ops']:,}`: 8 threads over 2 arenas. "
        "Wall time of the run; waits on the arenas and their time as each tracer measured "
        "them; their share of the threads' own time (the workload's).",
        "",
        "| configuration | wall (s) | waits | wait time (s) | share |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in high.items():
        waits = row.get("waits")
        shown = (f"{waits:,.0f} | {row['wait_s']:.3f} | {row['share']:.1%}" if waits is not None
                 else "n/a | n/a | n/a")  # fmt: skip
        lines.append(f"| {name} | {row['median_s']:.3f} | {shown} |")
        for peer in ("perf", "bpftrace"):
            if f"{peer}_waits" in row:
                waits, wait_s, share = (
                    row[f"{peer}_{key}"] for key in ("waits", "wait_s", "share")
                )
                lines.append(
                    f"| ({peer}, same run) | | {waits:,.0f} | {wait_s:.3f} | {share:.1%} |"
                )
    lines += [
        "",
        f"**Throughput at low contention.** `arena_waits 8 16 {data['ops']:,}` (an arena per "
        "thread): wall time of the run.",
        "",
        "| configuration | wall (s) |",
        "|---|---:|",
        *(f"| {name} | {row['median_s']:.3f} |" for name, row in low.items()),
        "",
        *_NOTES,
    ]
    return lines, _verdicts(data)


def _verdicts(data: dict) -> dict[str, bool | None]:
    cost_rows, high, low, spread = data["cost"], data["high"], data["low"], data["spread"]
    verdicts: dict[str, bool | None] = {}
    counted, timed = cost_rows.get(COUNTED, {}), cost_rows.get(TIMED, {})
    if counted and timed:
        verdicts["Contention: timing a wait adds at most 1 us to counting it"] = (
            timed["median_s"] - counted["median_s"] <= 1000
        )
    ours, alone = high.get(CONTENTION, {}), high.get(ALONE, {})
    if ours and alone:
        within = all(abs(ours[key] - alone[key]) <= max(spread[ALONE][key], spread[CONTENTION][key])
                     for key in ("waits", "wait_s"))  # fmt: skip
        verdicts["Contention: --contention's waits and wait time within the run-to-run spread "
                  "of the lock-wait probes alone"] = within  # fmt: skip
    if "untraced" in low and CONTENTION in low:
        verdicts[
            "Contention: throughput under --contention at least 95% of untraced at low contention"
        ] = low["untraced"]["median_s"] / low[CONTENTION]["median_s"] >= 0.95
    both = high.get(BOTH)
    verdicts["Contention: the share of waiting within 2 points of perf's on the same "
             "instruction (same run)"] = (
        None if both is None else abs(both["share"] - both["perf_share"]) <= 0.02
    )  # fmt: skip
    return verdicts


_NOTES = [
    "Timing a wait costs two probes that the kernel emulates (a conditional jump five bytes "
    "into the function, where both the entry and the return probes stand: "
    "`mtrace-live probes` shows it). On the function's first instruction, which loads the "
    "lock, the kernel single-steps instead: about 15 us a wait here, as the bpftrace row "
    "shows (bpftrace 0.17 cannot probe an offset). Counting alone costs nothing on a free "
    "lock: the counting probe fires only where a thread goes to sleep.",
    "",
    "On the same waits, perf's probes on the same instruction measure what mtrace-live "
    "measures; bpftrace's waits start at the function's first instruction, before its own "
    "single-step, during which an oversubscribed CPU may also run another thread: its "
    "times are longer by that.",
    "",
    "The allocation probes lengthen every malloc and free, and so every hold of an arena's "
    "lock: with them on, the same work waits far more, in count and in time. "
    "`--contention` (the allocation functions left alone) is the configuration for watching "
    "contention; the live view and the summary say so when the allocation probes are on "
    "while they show waits. Medians of the runs; the spread is max - min.",
    "",
]
