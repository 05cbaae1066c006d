"""Section 8b: whole stacks, unwound by CFI.

1. The cost per call of an allocation function by the depth of its stack:
   alloc_bench's malloc(32)/free loop in one thread, run 0, 12 and 60 calls
   deeper (``DEPTH``), so that each allocation's stack is 4, 16 and 64
   frames. mtrace-live unwinding by CFI (the default), walking frame
   pointers (``--frame-pointers``; the workload keeps them, so that walk
   goes as deep), unwinding by CFI with ``--sample-bytes 524288``, the
   empty-probe floor, heaptrack and bcc's memleak (which walks each stack
   with the kernel's walker), in alternating order.
2. A real program: Debian's sqlite3 running a script (``SCRIPT``) that
   makes some 1.5 million allocations (465,000 in QUICK), whose stacks run through libsqlite3 and
   libc, neither with frame pointers. The whole command's wall time: untraced,
   under mtrace-live ``run`` (whole stacks; one frame with
   ``--frame-pointers``) and under heaptrack; and the program's own time
   under each tracer.
3. Start-up: the tables of sqlite3 and its libraries written for the
   process, with the rows' disk cache empty (cold) and filled (warm), as
   mtrace-live's debug line says (``MTRACE_LIVE_DEBUG=1``), and the trace's
   start-up to "Ctrl-C to stop".
4. The time to name every frame of every stack at the end of that trace
   (the same debug lines).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import alloc_bench
from common import BUILD, MTRACE, QUICK, REPS, Sample, alternate, say, summarise

DEPTHS = (0, 12, 60)  # calls of descend: stacks of 4, 16 and 64 frames
ROWS = 200_000 if not QUICK else 60_000
SCRIPT = f"""CREATE TABLE t(a INTEGER PRIMARY KEY, b TEXT, c REAL);
WITH RECURSIVE x(i) AS (SELECT 1 UNION ALL SELECT i+1 FROM x WHERE i < {ROWS})
INSERT INTO t SELECT i, printf('row %d %s', i, hex(randomblob(16))), i * 1.5 FROM x;
CREATE INDEX tb ON t(b);
SELECT count(*), sum(length(b)) FROM t WHERE b LIKE 'row 1%';
SELECT group_concat(b, ',') FROM (SELECT b FROM t ORDER BY c DESC LIMIT 2000);
"""


def _depth_configs(tmp: Path, peers: dict[str, str | None]) -> dict[str, Callable[[], Sample]]:
    m = [*MTRACE, "-o", "summary"]

    def ours(*extra: str) -> Callable[[], Sample]:
        return lambda: alloc_bench.traced(
            lambda pid: [*m, "--pid", str(pid), *extra], "Ctrl-C", False, tmp)  # fmt: skip

    def kernel_mappings() -> Sample:
        os.environ["MTRACE_LIVE_PROCESS_TABLES"] = "off"
        try:
            return ours()()
        finally:
            del os.environ["MTRACE_LIVE_PROCESS_TABLES"]

    found: dict[str, Callable[[], Sample]] = {
        "untraced": lambda: alloc_bench.traced(None, "", False, tmp),
        "mtrace-live, CFI": ours(),
        "mtrace-live, CFI, mappings from the kernel": kernel_mappings,
        "mtrace-live, frame pointers": ours("--frame-pointers"),
        "mtrace-live, CFI, --sample-bytes 524288": ours("--sample-bytes", "524288"),
        "floor: empty programs on mtrace-live's sites": lambda: alloc_bench.traced(
            lambda pid: [sys.executable, str(alloc_bench.FLOOR), str(pid)], "ready",
            False, tmp),
    }  # fmt: skip
    if peers.get("heaptrack"):
        found["heaptrack"] = lambda: alloc_bench.under_heaptrack(False, tmp)
    if peers.get("bcc memleak"):
        memleak = ["memleak-bpfcc", "-p"]
        found["bcc memleak"] = lambda: alloc_bench.traced(
            lambda pid: [*memleak, str(pid), "1"], "Top 10 stacks", False, tmp
        )
    return found


def by_depth(tmp: Path, peers: dict[str, str | None]) -> dict[str, object]:
    out: dict[str, object] = {}
    for depth in DEPTHS:
        say(f"stacks: {depth + 4} frames")
        os.environ["DEPTH"] = str(depth)
        try:
            samples = alternate(_depth_configs(tmp, peers), REPS, ours=("mtrace-live", "untraced",
                                                                        "floor"))  # fmt: skip
        finally:
            del os.environ["DEPTH"]
        out[str(depth + 4)] = summarise(samples)
    return out


def _sqlite(prefix: list[str], tmp: Path, env: dict[str, str] | None = None,
            inner: str = "") -> Sample:  # fmt: skip
    """One run of the script (a fresh database), under ``prefix``: the
    whole command's wall time, and the program's own (sh times it, with
    ``inner`` before sqlite3: heaptrack's preload follows no exec)."""
    database = tmp / "bench.sqlite"
    database.unlink(missing_ok=True)
    script = tmp / "bench.sql"
    script.write_text(SCRIPT)
    timed = (f's=$(date +%s%N); {inner} sqlite3 "$0" < "$1" > /dev/null; e=$(date +%s%N); '
             'echo "program_ns $((e - s))" >&2')  # fmt: skip
    begun = time.monotonic()
    done = subprocess.run([*prefix, "sh", "-c", timed, str(database), str(script)],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {})})  # fmt: skip
    wall = time.monotonic() - begun
    if done.returncode != 0:
        raise RuntimeError(f"exited {done.returncode}: {done.stderr[-300:]}")
    extra = {"program_s": int(re.search(r"program_ns (\d+)", done.stderr).group(1)) / 1e9}  # type: ignore[union-attr]
    named = re.search(r"named (\d+) frames in ([\d.]+) s", done.stderr)
    if named:
        extra["frames_named"], extra["naming_s"] = int(named.group(1)), float(named.group(2))
    tables = re.search(r"unwind tables: (\d+) files, (\d+) rows, written in ([\d.]+) s",
                       done.stderr)  # fmt: skip
    if tables:
        extra["table_files"], extra["table_s"] = int(tables.group(1)), float(tables.group(3))
    return Sample(wall, extra)


def real_program(tmp: Path, peers: dict[str, str | None]) -> dict[str, object]:
    say("stacks: sqlite3")
    debug = {"MTRACE_LIVE_DEBUG": "1"}
    # the profile names every frame of every stack, as the end of a trace can
    run = [*MTRACE, "run", "-o", "summary", "--pprof", str(tmp / "sqlite.pb.gz"), "--"]
    configs: dict[str, Callable[[], Sample]] = {
        "untraced": lambda: _sqlite([], tmp),
        "mtrace-live, CFI": lambda: _sqlite(run, tmp, debug),
        "mtrace-live, frame pointers": lambda: _sqlite(
            [*MTRACE, "run", "--frame-pointers", "-o", "summary", "--"], tmp, debug
        ),
    }
    if peers.get("heaptrack"):
        configs["heaptrack"] = lambda: _sqlite([], tmp, inner=f"heaptrack -o {tmp / 'sq'}")
    out = summarise(alternate(configs, REPS, ours=("mtrace-live", "untraced")))
    cold, warm = [], []
    cache = tmp / "cfi-cache"
    for _ in range(max(REPS, 2)):
        shutil.rmtree(cache, ignore_errors=True)
        for into in (cold, warm):  # the second run finds the rows the first kept
            into.append(_sqlite(run, tmp, {**debug, "MTRACE_LIVE_CFI_CACHE": str(cache)}))
    out["cold cache"] = summarise({"x": cold})["x"]
    out["warm cache"] = summarise({"x": warm})["x"]
    return out


CHURN_RUNS = 1000 if not QUICK else 300


def churn(tmp: Path) -> dict[str, int]:
    """A short program (build/short_chain: 50 mallocs, no frame pointers)
    exec'd CHURN_RUNS times under ``--all``: how its walks found their
    mappings (the kernel's, or the process's own tables), from the summary."""
    say("stacks: short processes")
    log = tmp / "churn.log"
    loop = (f"import subprocess, sys\nfor _ in range({CHURN_RUNS}):\n"
            "    subprocess.run(sys.argv[1:], check=True)\n")  # fmt: skip
    with open(log, "wb") as sink:
        tracer = subprocess.Popen([*MTRACE, "--all", "-o", "summary"], stdout=sink, stderr=sink)
    try:
        deadline = time.monotonic() + 120
        while "Ctrl-C to stop" not in log.read_text(errors="replace"):
            if tracer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the trace did not start: {log.read_text()[-300:]}")
            time.sleep(0.1)
        subprocess.run([sys.executable, "-c", loop, str(BUILD / "short_chain")], check=True,
                       timeout=600)  # fmt: skip
    finally:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(timeout=300)
    text = log.read_text(errors="replace")
    found = {}
    patterns = {"stacks": r"stacks unwound by CFI: (\d+), (\d+) whole",
                "no_tables": r"whose tables were not written yet: (\d+)",
                "lookups": r"mappings looked up in the kernel: (\d+)",
                "unwritten": r"; (\d+) in files whose rows were not written yet"}  # fmt: skip
    for key, pattern in patterns.items():
        match = re.search(pattern, text)
        if match:
            found[key] = int(match.group(1))
            if key == "stacks":
                found["whole"] = int(match.group(2))
    return found


def run(tmp: Path, peers: dict[str, str | None]) -> dict[str, object]:
    data: dict[str, object] = {"depth": by_depth(tmp, peers)}
    if (BUILD / "short_chain").exists():
        data["churn"] = churn(tmp)
    if shutil.which("sqlite3"):
        data["sqlite"] = real_program(tmp, peers)
    return data


def _depth_lines(depth: dict) -> list[str]:
    names = list(next(iter(depth.values())))
    lines = ["| tracer | " + " | ".join(f"{d} frames" for d in depth) + " |",
             "|---|" + "---:|" * len(depth)]  # fmt: skip
    for name in names:
        cells = [f"{depth[d][name]['median_s']:.0f}" if name in depth[d] else "" for d in depth]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _sqlite_lines(sq: dict) -> list[str]:
    lines = ["| run | whole command (s) | the program itself (s) | frames named | naming (s) |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
    for name, row in sq.items():
        named, naming = row.get("frames_named"), row.get("naming_s")
        named_text = "" if named is None else f"{named:,.0f}"
        naming_text = "" if naming is None else f"{naming:.3f}"
        lines.append(f"| {name} | {row['median_s']:.2f} | {row.get('program_s', 0):.2f} | "
                     f"{named_text} | {naming_text} |")  # fmt: skip
    return lines


def _kernel_mapping_lines(data: dict, mid: dict, verdicts: dict[str, bool | None]) -> list[str]:
    """A walk by the kernel's mappings against one by the process's tables,
    and how the short-process churn's walks found theirs."""
    lines: list[str] = []
    by_kernel = mid.get("mtrace-live, CFI, mappings from the kernel", {}).get("median_s")
    by_tables = mid.get("mtrace-live, CFI", {}).get("median_s")
    if by_kernel and by_tables:
        lines += ["\"mappings from the kernel\": the process's own tables never written "
                  "(MTRACE_LIVE_PROCESS_TABLES=off), so that each walk finds its mappings "
                  "among those the kernel gave it (unwind_vmas), as a process followed from "
                  f"its exec does until its tables are written: {by_kernel:.0f} ns a call at "
                  f"16 frames, against {by_tables:.0f} by its tables.", ""]  # fmt: skip
        verdicts["Stacks: a walk by the kernel's mappings at most 2x one by the tables"] = (
            by_kernel <= 2 * by_tables
        )
    churn_counts = data.get("churn")
    if churn_counts and churn_counts.get("stacks"):
        c = churn_counts
        lines += [f"A short program (50 mallocs, no frame pointers) exec'd {CHURN_RUNS:,} times "
                  f"under `--all`: {c['stacks']:,} stacks, {c.get('whole', 0):,} whole; "
                  f"{c.get('no_tables', 0):,} ({100 * c.get('no_tables', 0) / c['stacks']:.1f}%) "
                  "walked by the mappings the kernel has (their process's tables not written "
                  f"yet), the rest by the processes' tables; {c.get('lookups', 0):,} lookups "
                  f"in the kernel; {c.get('unwritten', 0):,} frames in files whose rows were "
                  "not written yet.", ""]  # fmt: skip
    sampled = mid.get("mtrace-live, CFI, --sample-bytes 524288", {}).get("median_s")
    floor = mid.get("floor: empty programs on mtrace-live's sites", {}).get("median_s")
    if sampled and floor:
        verdicts["Stacks: with --sample-bytes 524288, within 10% of the empty-probe floor"] = (
            sampled <= 1.1 * floor
        )
    return lines


def render(data: dict) -> tuple[list[str], dict[str, bool | None]]:
    depth = data["depth"]
    lines = [
        "## 8b. Whole stacks, unwound by CFI",
        "",
        "The malloc(32)/free loop of section 8, run deeper so that each allocation's stack "
        "has 4, 16 or 64 frames; ns per call of an allocation function (a pair is two calls). "
        "The workload keeps frame pointers, so `--frame-pointers` walks as deep as the CFI; "
        "on code without them (distributions' own) it stops at the call site.",
        "",
        *_depth_lines(depth),
        "",
    ]
    verdicts: dict[str, bool | None] = {}
    mid = depth.get("16", {})
    lines += _kernel_mapping_lines(data, mid, verdicts)
    sq = data.get("sqlite")
    if sq:
        lines += [f"Debian's sqlite3 running a script ({ROWS:,} rows inserted and indexed; "
                  "stacks through libsqlite3 and libc, without frame pointers), a fresh "
                  "database each run; "
                  "medians. The table caches' rows for the cold and warm runs:", "",
                  *_sqlite_lines(sq), ""]  # fmt: skip
        ours, theirs = sq["mtrace-live, CFI"], sq.get("heaptrack")
        if theirs:
            verdicts["Stacks: sqlite3 with whole stacks no slower than under heaptrack"] = (
                ours["median_s"] <= theirs["median_s"]
            )
        names = ours.get("naming_s")
        if names is not None:
            verdicts["Stacks: naming every frame at the end in 0.3 s or less"] = names <= 0.3
        warm = sq["warm cache"].get("table_s")
        if warm is not None:
            lines += [f"Writing the tables of sqlite3 and its libraries: "
                      f"{sq['cold cache'].get('table_s', 0):.3f} s with an empty cache, "
                      f"{warm:.3f} s with the rows kept from the run before.", ""]  # fmt: skip
            verdicts["Stacks: tables written in 0.5 s or less with warm caches"] = warm <= 0.5
    return lines, verdicts
