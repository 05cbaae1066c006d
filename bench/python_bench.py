"""Section 8c: Python frames in allocation stacks.

The cost of an allocation whose stack has its Python frames in it (the eval
loop's frame replaced by them, probes/bpf/python.bpf.c), against the same
allocation with native frames only (``--no-python-frames``) and against the
empty-probe floor, under the same Python workload.

The workload (``WORKLOAD``, written to the run's temporary directory) runs
under each interpreter of ``INTERPRETERS``: after its imports it prints
"ready" and waits for a line on stdin, while the tracer attaches to its pid.
On "go" it calls ``descend`` DEPTH calls deep (a recursion: CPython runs it
in one call of its eval loop), whose innermost call makes ``bytearray(1000)``
and lets it go, again and again: one malloc(1001) and one free a pass (the
bytearray's data, beyond what pymalloc serves itself). It runs ``WARM``
passes first, so that the stack is kept (in the kernel's table) before the
timed ones, then ``PAIRS`` passes timed by itself (time.perf_counter_ns,
and time.process_time_ns for its CPU), both from the same line, so that
both have the same stack. The figure is ns per allocation: a malloc+free
pair (only malloc's stack is walked).

Configurations, in alternating order, for each interpreter and depth:
untraced; the floor (bench/alloc_floor.py: empty programs on mtrace-live's
own sites, for the one process); mtrace-live ``--pid PID -o summary`` with
``--no-python-frames`` (native frames only) and by default (Python frames);
bpftrace counting the same functions' entries and returns (alloc_bench's).
mtrace-live's summary gives the stacks walked and the Python frames stored
in them, so the frames a walk stores are counted, not assumed.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import alloc_bench
from common import MTRACE, QUICK, REPS, Background, Sample, alternate, say, summarise

INTERPRETERS = {
    "Debian's python3.11": Path("/usr/bin/python3.11"),
    "pyenv's python3.12": Path("/root/.pyenv/versions/3.12.1/bin/python3.12"),
}
DEPTHS = (1, 10, 30)  # calls of descend: with main and <module>, 3, 12 and 32 Python frames
PAIRS = 100_000 if QUICK else 300_000
WARM = 1000
GOAL = 1.3  # an allocation with Python frames, over the same with native frames only

UNTRACED = "untraced"
FLOOR = "floor: empty programs on mtrace-live's sites"
NATIVE = "mtrace-live --no-python-frames (native frames only)"
PYTHON = "mtrace-live (Python frames: the default)"
BPFTRACE = "bpftrace entry + return count()"

WORKLOAD = '''"""bytearray(1000) (malloc(1001), then free) from descend, DEPTH calls deep.
    python workload.py DEPTH WARM PAIRS"""
import sys
import time


def descend(depth, passes):
    if depth > 1:
        return descend(depth - 1, passes)
    for _ in range(passes):
        block = bytearray(1000)
        del block


def main():
    depth, warm, pairs = (int(a) for a in sys.argv[1:4])
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    for passes in (warm, pairs):  # one line: the same stack both times
        wall, cpu = time.perf_counter_ns(), time.process_time_ns()
        descend(depth, passes)
        wall, cpu = time.perf_counter_ns() - wall, time.process_time_ns() - cpu
    print(f"wall_ns {wall / pairs:.1f} cpu_ns {cpu / pairs:.1f}", flush=True)
    return 0


sys.exit(main())
'''


def _summary_counts(summary: str) -> dict[str, float]:
    """Allocations, stacks walked and Python frames stored, from mtrace-live's
    summary (none from the other tracers)."""
    found: dict[str, float] = {}
    patterns = {"calls": r"allocations: pid \d+: (\d+) calls",
                "stacks": r"stacks unwound by CFI: (\d+),",
                "cfi_frames": r"frames: (\d+) by CFI",
                "python_frames": r"Python frames in the eval loop's place: (\d+)"}  # fmt: skip
    for key, pattern in patterns.items():
        match = re.search(pattern, summary)
        if match:
            found[key] = int(match.group(1))
    return found


def traced(python: Path, depth: int, argv_of: Callable[[int], list[str]] | None, ready: str,
           tmp: Path) -> Sample:  # fmt: skip
    """One run: the workload started and at its "ready", the tracer attached
    to its pid (none for untraced), then "go"; ns per malloc+free pair."""
    script = tmp / "python_workload.py"
    script.write_text(WORKLOAD)
    work = subprocess.Popen([str(python), "-I", str(script), str(depth), str(WARM), str(PAIRS)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert work.stdin is not None and work.stdout is not None
    tracer = None
    try:
        if work.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{python}: the workload did not start")
        if argv_of is not None:
            tracer = Background(argv_of(work.pid), ready, tmp / "python-tracer.log")
        work.stdin.write("go\n")
        work.stdin.flush()
        figures = work.stdout.readline().split()
        work.stdin.close()
        if work.wait(timeout=300) != 0 or figures[:1] != ["wall_ns"]:
            raise RuntimeError(f"{python}: the workload failed: {figures}")
    finally:
        if work.poll() is None:
            work.kill()
            work.wait()
        summary = tracer.stop() if tracer is not None else ""
    extra = {"cpu_ns": float(figures[3]), **_summary_counts(summary)}
    if argv_of is not None and ready == "Ctrl-C" and extra.get("calls", 0) < WARM + PAIRS:
        raise RuntimeError(f"mtrace-live saw {extra.get('calls')} allocations, not "
                           f"{WARM + PAIRS}: {summary[-500:]}")  # fmt: skip
    return Sample(float(figures[1]), extra)


def configs(python: Path, depth: int, tmp: Path,
            peers: dict[str, str | None]) -> dict[str, Callable[[], Sample]]:  # fmt: skip
    def run(argv_of: Callable[[int], list[str]] | None, ready: str) -> Callable[[], Sample]:
        return lambda: traced(python, depth, argv_of, ready, tmp)

    def mtrace(*extra: str) -> Callable[[int], list[str]]:
        return lambda pid: [*MTRACE, "--pid", str(pid), "-o", "summary", *extra]

    found = {
        UNTRACED: run(None, ""),
        FLOOR: run(lambda pid: [sys.executable, str(alloc_bench.FLOOR), str(pid)], "ready"),
        NATIVE: run(mtrace("--no-python-frames"), "Ctrl-C"),
        PYTHON: run(mtrace(), "Ctrl-C"),
    }
    if peers.get("bpftrace") and depth == DEPTHS[1]:  # its cost has nothing to do with depth
        found[BPFTRACE] = run(alloc_bench.bpftrace_argv, "ready")
    return found


def _version(python: Path) -> str:
    done = subprocess.run([str(python), "-c", "import platform; print(platform.python_version())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return done.stdout.strip()


def run(tmp: Path, peers: dict[str, str | None]) -> dict[str, object]:
    out: dict[str, object] = {"pairs": PAIRS, "warm": WARM}
    ours = ("mtrace-live", UNTRACED, "floor")
    by_interpreter: dict[str, object] = {}
    for name, python in INTERPRETERS.items():
        if not python.exists():
            say(f"python frames: {python} not found: {name} left out")
            continue
        depths: dict[str, object] = {}
        for depth in DEPTHS:
            say(f"python frames: {name}, descend {depth} calls deep")
            depths[str(depth)] = summarise(
                alternate(configs(python, depth, tmp, peers), REPS, ours=ours)
            )
        by_interpreter[name] = {"version": _version(python), "path": str(python),
                                "depths": depths}  # fmt: skip
    out["interpreters"] = by_interpreter
    return out


# ---- the page ----------------------------------------------------------------------


def _frames(row: dict) -> float:
    """Python frames a walk stored (the summary's count over its stacks)."""
    stacks = row.get("stacks")
    return row.get("python_frames", 0) / stacks if stacks else 0.0


def _added(rows: dict, name: str) -> float:
    return float(rows[name]["median_s"] - rows[UNTRACED]["median_s"])


def _ratio(rows: dict) -> float | None:
    """Python frames over native frames only: their costs over untraced."""
    if PYTHON not in rows or NATIVE not in rows:
        return None
    return _added(rows, PYTHON) / _added(rows, NATIVE)


def _cell(rows: dict, name: str) -> str:
    row = rows.get(name)
    if row is None:
        return ""
    if name == UNTRACED:
        return f"{row['median_s']:.0f}"
    return f"{row['median_s']:.0f} (+{_added(rows, name):.0f})"


def _table(depths: dict) -> list[str]:
    """One row per depth: each configuration's ns per allocation (its cost
    over untraced), and Python frames over native frames only."""
    lines = ["| depth | Python frames a walk | untraced | floor | native frames only | "
             "Python frames | Python / native only | bpftrace |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for depth, rows in depths.items():
        ratio = _ratio(rows)
        frames = _frames(rows[PYTHON]) if PYTHON in rows else 0
        cells = [depth, f"{frames:.0f}",
                 *(_cell(rows, name) for name in (UNTRACED, FLOOR, NATIVE, PYTHON)),
                 "" if ratio is None else f"{ratio:.2f}x", _cell(rows, BPFTRACE)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _spread_line(depths: dict) -> str:
    """How far each configuration's runs spread: (slowest - fastest) / median
    for the traced ones; untraced's (tens of ns) in ns."""
    spreads = sorted((max(row["samples"]) - min(row["samples"])) / row["median_s"]
                     for rows in depths.values() for name, row in rows.items()
                     if name != UNTRACED and len(row["samples"]) > 1)  # fmt: skip
    if not spreads:
        return "One run of each configuration: no spread to give."
    untraced = max(max(rows[UNTRACED]["samples"]) - min(rows[UNTRACED]["samples"])
                   for rows in depths.values())  # fmt: skip
    return (
        f"The runs of a traced configuration spread (slowest less fastest, over their "
        f"median) by {spreads[len(spreads) // 2]:.0%} for the typical one, "
        f"{spreads[-1]:.0%} at most; untraced's by {untraced:.0f} ns at most."
    )


def _split(depths: dict) -> tuple[float, float] | None:
    """(ns once per walk, ns per Python frame): the least-squares line
    through the depths' costs over native frames only, by the Python frames
    each walk stored."""
    points = [(_frames(rows[PYTHON]), _added(rows, PYTHON) - _added(rows, NATIVE))
              for rows in depths.values() if PYTHON in rows and NATIVE in rows]  # fmt: skip
    if len(points) < 2:
        return None
    mean_f = sum(f for f, _ in points) / len(points)
    mean_c = sum(c for _, c in points) / len(points)
    spread_f = sum((f - mean_f) ** 2 for f, _ in points)
    if spread_f == 0:
        return None
    per_frame = sum((f - mean_f) * (c - mean_c) for f, c in points) / spread_f
    return mean_c - mean_f * per_frame, per_frame


def _native_walk(depths: dict) -> tuple[float, float]:
    """The native-only walk: its cost over the floor, and the frames it
    unwinds by CFI (medians over the depths: the same native stack)."""
    costs = [rows[NATIVE]["median_s"] - rows[FLOOR]["median_s"] for rows in depths.values()]
    frames = [rows[NATIVE].get("cfi_frames", 0) / rows[NATIVE]["stacks"]
              for rows in depths.values()]  # fmt: skip
    return statistics.median(costs), statistics.median(frames)


def _split_lines(interpreters: dict) -> list[str]:
    parts = []
    for name, found in interpreters.items():
        split = _split(found["depths"])
        if split is None:
            continue
        once, per_frame = split
        native = statistics.median(_added(rows, NATIVE) for rows in found["depths"].values())
        room = ((GOAL - 1) * native - once) / per_frame if per_frame > 0 else float("inf")
        walk, frames = _native_walk(found["depths"])
        native_walk = (f"; the native-only walk itself, {frames:.0f} frames by CFI, costs "
                       f"{walk:.0f} ns over the floor ({walk / frames:.0f} ns a frame, its fixed "
                       "costs included)") if frames else ""  # fmt: skip
        parts.append(f"{name}: {once:.0f} ns once per walk and {per_frame:.0f} ns per Python "
                     f"frame, so that the goal ({GOAL - 1:.0%} over a native-only cost of "
                     f"{native:.0f} ns) leaves room for {max(room, 0):.0f} Python frames"
                     + native_walk)  # fmt: skip
    if not parts:
        return []
    return ["How the walk's cost splits (the least-squares line through each depth's cost "
            "over native frames only, by the Python frames its walks stored): once per walk, "
            "the tail call to unwind_python and the thread's state (the thread pointer, the "
            "pthread key, its slot, the cframe, the current frame: five reads); then, per "
            "Python frame, its first 80 bytes (PY_FRAME_BYTES) taken from a copy of the "
            "thread's memory below it (PY_WINDOW bytes at most, within its page), read once "
            "for the frames it holds: its callers' frames lie below it on the thread's frame "
            "stack; each stored in the row and hashed (3.12 also reads the frame its eval "
            "loop was entered with, on the C stack, which it does not store). "
            + "; ".join(parts) + ".", ""]  # fmt: skip


def _intro(data: dict) -> list[str]:
    return [
        "## 8c. Python frames in allocation stacks",
        "",
        "A Python workload: `descend`, DEPTH calls deep (a recursion, which CPython runs in "
        "one call of its eval loop; with `main` and `<module>`, DEPTH + 2 Python frames), "
        f"makes `bytearray(1000)` and lets it go, {data['pairs']:,} times after "
        f"{data['warm']:,} untimed passes (so that the stack is kept): a malloc(1001) and a "
        "free each time. Each tracer attaches to its pid while it waits at its start; the "
        "loop times itself. ns per allocation (a malloc+free pair: only malloc's stack is "
        "walked), medians, with the cost over untraced in parentheses. mtrace-live walks "
        "the stack by CFI and stores the Python frames in the eval loop's frame's place (by "
        "default), or keeps the eval loop's frames as they are (`--no-python-frames`); "
        '"Python frames a walk" is counted from its summary. The floor: empty programs '
        "on mtrace-live's sites (section 8); bpftrace: section 8's one-liner counting the "
        "same functions' entries and returns (free's first instruction single-stepped), "
        f"at depth {DEPTHS[1]} only.",
        "",
    ]


def render(data: dict) -> tuple[list[str], dict[str, bool | None]]:
    interpreters = data["interpreters"]
    lines = _intro(data)
    verdicts: dict[str, bool | None] = {}
    for name, found in interpreters.items():
        lines += [f"### {name} ({found['version']})", "", *_table(found["depths"]), "",
                  _spread_line(found["depths"]), ""]  # fmt: skip
        for depth, rows in found["depths"].items():
            ratio = _ratio(rows)
            if ratio is not None:
                verdicts[f"Python frames: an allocation at most {GOAL}x its native-only cost, "
                         f"{name}, depth {depth}"] = ratio <= GOAL  # fmt: skip
    lines += _split_lines(interpreters)
    met = [ok for ok in verdicts.values() if ok is not None]
    if met:
        lines += [f"The goal: an allocation with Python frames at most {GOAL}x its native-only "
                  "cost (the costs over untraced), for a kept stack. "
                  + ("Met at every depth measured." if all(met) else
                     "**Not met** where \"Python / native only\" exceeds it: the eval "
                     "loop's one native frame becomes DEPTH + 2 Python frames, each stored "
                     "and hashed, with a read of the process's memory for every few of them, "
                     "so the walk grows with the Python stack, and the goal's margin pays for "
                     "that many Python frames (above)."), ""]  # fmt: skip
    return lines, verdicts
