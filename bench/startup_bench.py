"""Section 12: start-up, the whole wait a user sees, against bpftrace.

Each configuration runs RUNS times one after the other, the way a user
starts a trace again: nothing waits between runs for the last one's
detacher. Measured from starting the command to:

- ``run -o text -- true``: its first event line (the command's exec);
- ``--pid`` of a sleeping process (on the system libc), with and without
  ``--contention``: the line that says it traces (every probe attached);
- ``serve --pid``: the line that says it serves.

Warm is with the caches a previous start filled (the compiled program, the
derived probes' plan, the CFI rows); cold is with every cache off.
bpftrace attaches the same kind of points, the libc's allocation functions
(entries and returns) and the tracepoints a trace of mtrace-live's default
attaches, and is timed to its first event line (``-c /bin/true``, the
exec) and to its BEGIN line (``-p PID``: printed once every probe is
attached).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import attach_costs
from common import MTRACE, QUICK, REPO, detached, say, time_to_line
from mtrace_live.tracer.processes.target import default_libc

RUNS = 3 if QUICK else 20
SETUP_RUNS = 1 if QUICK else 3  # each a whole warm-up (about 10 s)
# Options setup's starts never had, each a run-time value or size of the one
# program (docs/architecture.md, "One program for many options")
NEW_OPTIONS = ["--sample-bytes", "4096", "--max-outstanding", "100000", "--alloc-stacks", "4096",
               "--buffer-pages", "1024", "--follow-forks"]  # fmt: skip
FINISH_RUNS = 1 if QUICK else 5
COLD_ENV = {"MTRACE_LIVE_BPF_CACHE": "off", "MTRACE_LIVE_PLAN_CACHE": "off",
            "MTRACE_LIVE_CFI_CACHE": "off"}  # fmt: skip
ALLOC_FUNCTIONS = ("malloc", "free", "calloc", "realloc", "posix_memalign", "aligned_alloc",
                   "valloc", "pvalloc")  # fmt: skip
TRACEPOINTS = ("sched:sched_process_exec", "sched:sched_process_exit", "task:task_newtask",
               "syscalls:sys_enter_mmap", "syscalls:sys_exit_mmap", "syscalls:sys_enter_munmap",
               "syscalls:sys_enter_brk", "syscalls:sys_exit_brk")  # fmt: skip
# Start-ups as they were before the uprobes went into links and the derived
# probes' plan was kept: one perf event per uprobe, the plan derived each time.
BEFORE_ENV = {"MTRACE_LIVE_UPROBE_MULTI": "0", "MTRACE_LIVE_PLAN_CACHE": "off"}
GOAL_MEDIAN_S, GOAL_P90_S, GOAL_PROGRAM_ONLY_S = 0.25, 0.35, 1.0
GOAL_RUN_S, GOAL_FINISH_S = 0.5, 1.0
# Every cache but the compiled program (make setup's) removed.
PROGRAM_ONLY_ENV = {"MTRACE_LIVE_PLAN_CACHE": "off", "MTRACE_LIVE_CFI_CACHE": "off"}
CACHES = ("MTRACE_LIVE_BPF_CACHE", "MTRACE_LIVE_PLAN_CACHE", "MTRACE_LIVE_CFI_CACHE")
# The finish: a Python program whose stacks run through a libpython with
# full debug info (pyenv's), its imports making thousands of stacks.
DEBUG_PYTHON = Path("/root/.pyenv/versions/3.11.7/bin/python3")
IMPORTS = ("json", "decimal", "email.parser", "http.client", "argparse", "csv", "logging",
           "xml.dom.minidom", "sqlite3", "asyncio", "unittest", "pydoc")  # fmt: skip


def bpftrace_script(first: str) -> str:
    libc = default_libc()
    uprobes = ",".join(f"{kind}:{libc}:{name}" for kind in ("uprobe", "uretprobe")
                       for name in ALLOC_FUNCTIONS)  # fmt: skip
    others = ",".join(f"tracepoint:{name}" for name in TRACEPOINTS[1:])
    return (f"BEGIN {{ printf(\"ready\\n\"); }} {first} {{ printf(\"exec\\n\"); }} "
            f"{uprobes},{others} {{ @[probe] = count(); }}")  # fmt: skip


def configurations(pid: int, peers: dict[str, str | None],
                   python_pid: int | None = None) -> dict[str, Callable[[], float]]:  # fmt: skip
    def attached(line: str) -> bool:
        return "Ctrl-C to stop" in line

    def exec_line(line: str) -> bool:
        return " exec " in line or line.strip() == "exec"

    run = [*MTRACE, "run", "-o", "text", "--", "true"]
    on_pid = [*MTRACE, "--pid", str(pid), "-o", "summary"]
    serve = [*MTRACE, "serve", "--pid", str(pid), "--web.listen-address", "127.0.0.1:0"]
    configs: dict[str, Callable[[], float]] = {
        "mtrace-live run -o text -- true, to its first event": lambda: time_to_line(
            run, exec_line, "stdout"),
        "mtrace-live --pid, to attached": lambda: time_to_line(on_pid, attached, "stderr"),
        "mtrace-live --pid --contention, to attached": lambda: time_to_line(
            [*on_pid, "--contention"], attached, "stderr"),
        **({"mtrace-live --pid of a Python process, to attached": lambda: time_to_line(
            [*MTRACE, "--pid", str(python_pid), "-o", "summary"], attached, "stderr")}
           if python_pid is not None else {}),
        "mtrace-live serve --pid, to serving": lambda: time_to_line(
            serve, lambda line: "serving" in line, "stderr"),
        "mtrace-live --pid as it was: a perf event per uprobe, the plan derived each time":
            lambda: time_to_line(on_pid, attached, "stderr", BEFORE_ENV),
        "cold: mtrace-live run -o text -- true": lambda: time_to_line(
            run, exec_line, "stdout", COLD_ENV),
        "cold: mtrace-live --pid, to attached": lambda: time_to_line(
            on_pid, attached, "stderr", COLD_ENV),
        "every cache but the program removed: mtrace-live --pid, to attached": lambda: (
            time_to_line(on_pid, attached, "stderr", PROGRAM_ONLY_ENV)),
        "mtrace-live run -o summary -- true, end to end": lambda: end_to_end(
            [*MTRACE, "run", "-o", "summary", "--", "true"]),
    }  # fmt: skip
    if peers.get("bpftrace"):
        first = "tracepoint:sched:sched_process_exec"
        configs["bpftrace -c /bin/true, to its first event"] = lambda: time_to_line(
            ["bpftrace", "-B", "line", "-c", "/bin/true", "-e", bpftrace_script(first)],
            lambda line: line.strip() == "exec", "stdout")  # fmt: skip
        configs["bpftrace -p PID, to BEGIN"] = lambda: time_to_line(
            ["bpftrace", "-B", "line", "-p", str(pid), "-e", bpftrace_script(first)],
            lambda line: line.strip() == "ready", "stdout")  # fmt: skip
        configs["bpftrace -c /bin/true, end to end"] = lambda: end_to_end(
            ["bpftrace", "-c", "/bin/true", "-e", bpftrace_script(first)])  # fmt: skip
    return configs


def end_to_end(argv: list[str], env: dict[str, str] | None = None) -> float:
    """Seconds from starting ``argv`` to its exit (its output discarded)."""
    started = time.monotonic()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300,
                          env={**os.environ, **(env or {})})  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed: {done.stderr.decode(errors='replace')[-300:]}")
    return time.monotonic() - started


def after_setup(pid: int, options: list[str]) -> float:
    """A first trace after make setup: its caches emptied (directories of
    its own), filled by setup's step (scripts/warm-caches.sh), then the
    start timed."""
    with tempfile.TemporaryDirectory(prefix="mtrace-setup-") as scratch:
        env = {name: str(Path(scratch) / name.lower()) for name in CACHES}
        warmed = subprocess.run(["bash", str(REPO / "scripts" / "warm-caches.sh"), MTRACE[0]],
                                env={**os.environ, **env}, capture_output=True)  # fmt: skip
        if warmed.returncode != 0:
            raise RuntimeError("scripts/warm-caches.sh failed: see /tmp/mtrace-live-warm.log")
        detached()
        return time_to_line([*MTRACE, "--pid", str(pid), "-o", "live", *options],
                            lambda line: "Ctrl-C to stop" in line, "stderr", env)  # fmt: skip


def finish(tmp: Path, line_cache: str | None) -> tuple[float, int]:
    """A trace of a Python program importing IMPORTS under pyenv's python3
    (its libpython with full debug info), summarized: seconds from the
    program's end (the time it writes last) to mtrace-live's exit, and the
    stacks the summary names. ``line_cache``: None, the lines kept; "off"."""
    stamp = tmp / "ended"
    program = (f"import {', '.join(IMPORTS)}\nimport time\n"
               f"open({str(stamp)!r}, 'w').write(repr(time.time()))\n")  # fmt: skip
    env = {**os.environ, **({"MTRACE_LIVE_LINE_CACHE": line_cache} if line_cache else {})}
    done = subprocess.run([*MTRACE, "run", "-o", "summary", "--", str(DEBUG_PYTHON), "-c", program],
                          capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    ended = time.time()
    if done.returncode != 0:
        raise RuntimeError(f"the finish's trace failed: {done.stderr[-300:]}")
    stacks = re.search(r"stacks unwound by CFI: (\d+)", done.stdout)
    return ended - float(stamp.read_text()), int(stacks.group(1)) if stacks else 0


def run(tmp: Path, peers: dict[str, str | None]) -> dict[str, object]:
    say("12. start-up ...")
    target = subprocess.Popen(["sleep", "3600"])
    python: subprocess.Popen[bytes] | None = None
    try:
        python = subprocess.Popen(["/usr/bin/python3", "-c", "import time; time.sleep(3600)"])
        configs = configurations(target.pid, peers, python.pid)
        for name, start in configs.items():  # the caches filled: one unmeasured start each
            if not name.startswith("cold") and "before" not in name:
                start()
        rows: dict[str, dict[str, object]] = {}
        for name, start in configs.items():
            detached()  # the configuration before's detacher: not this one's
            samples = [start() for _ in range(RUNS)]
            rows[name] = _row(samples)
        for label, options in (("", []), (" --contention", ["--contention"])):
            samples = [after_setup(target.pid, options) for _ in range(SETUP_RUNS)]
            rows[f"the first trace after make setup: mtrace-live --pid{label}, to attached"] = _row(
                samples
            )
        samples = [after_setup(target.pid, NEW_OPTIONS) for _ in range(SETUP_RUNS)]
        rows[f"options no start had, after make setup: mtrace-live --pid {' '.join(NEW_OPTIONS)}, "
             "to attached"] = _row(samples)  # fmt: skip
    finally:
        for sleeper in (target, python):
            if sleeper is not None:
                sleeper.kill()
                sleeper.wait()
    detached()
    if DEBUG_PYTHON.exists():
        finish(tmp, None)  # the lines kept
        for label, cache in (("lines kept", None), ("lines not kept", "off")):
            runs = [finish(tmp, cache) for _ in range(FINISH_RUNS)]
            rows[f"finish: summary of pyenv's python3 importing {len(IMPORTS)} modules "
                 f"({statistics.median(r[1] for r in runs):.0f} stacks walked), {label}"] = (
                _row([r[0] for r in runs]))  # fmt: skip
    costs = [attach_costs.measure() for _ in range(RUNS // 4 or 1)]
    kernel = {name: {key: statistics.median(run[name][key] for run in costs)
                     for key in ("attach_s", "close_s", "count")}
              for name in costs[0]}  # fmt: skip
    return {"runs": RUNS, "rows": rows, "kernel": kernel, "kernel_runs": len(costs)}


def _row(samples: list[float]) -> dict[str, object]:
    ordered = sorted(samples)
    return {"median_s": statistics.median(samples),
            "p90_s": ordered[max(0, round(0.9 * len(ordered)) - 1)],
            "max_s": ordered[-1], "samples": samples}  # fmt: skip


def render(data: dict) -> tuple[list[str], dict[str, bool | None]]:
    rows = data["rows"]
    lines = [
        "## 12. Start-up: the whole wait",
        "",
        f"Each configuration started {data['runs']} times in a row, as a user starts a trace "
        "again (no wait for the last one's detacher), from the command to its first event line "
        "or to the line that says it traces: every probe attached. Warm: with the compiled "
        "program, the derived probes' plan and the CFI rows a previous start kept; cold: every "
        "cache off. The target of `--pid` and `serve` is a sleeping process on the system libc "
        "(derived probes, the allocation functions, the lock waits and the tracepoints "
        'mtrace-live attaches by default); "a Python process" is Debian\'s python3 sleeping '
        "(its trace walks Python frames too). bpftrace attaches the libc's allocation functions "
        f"(entries and returns, {2 * len(ALLOC_FUNCTIONS)} uprobes) and {len(TRACEPOINTS)} "
        "tracepoints, timed to its first event line (`-c /bin/true`) and to its BEGIN line "
        '(`-p`, printed once all are attached) and end to end. The row "as it was" turns off '
        "the uprobes' links and the plan cache (`MTRACE_LIVE_UPROBE_MULTI=0`, "
        '`MTRACE_LIVE_PLAN_CACHE=off`): the start-up before them. "Every cache but the '
        'program removed" keeps only the compiled program (`MTRACE_LIVE_PLAN_CACHE=off`, '
        '`MTRACE_LIVE_CFI_CACHE=off`). "The first trace after make setup" empties every '
        "cache, fills them as `make setup` does (scripts/warm-caches.sh), then times the "
        f"first `--pid` start from a terminal's options (`-o live`), {SETUP_RUNS} times; "
        '"options no start had" does the same for options none of those starts had: their '
        "program is the one setup compiled, given other run-time values and sizes, and "
        "nothing was made for them ahead of the start (no earlier start with them). "
        "The finish: `run -o summary` of pyenv's python3 (its libpython with full debug "
        f"info) importing {len(IMPORTS)} modules, timed from the program's end (the time it "
        f"writes last) to mtrace-live's exit, {FINISH_RUNS} times, with the source lines kept "
        "by build-id from the run before and without (`MTRACE_LIVE_LINE_CACHE=off`).",
        "",
        "| configuration | median s | p90 s | max s |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {row['median_s']:.2f} | {row['p90_s']:.2f} | {row['max_s']:.2f} |"
              for name, row in rows.items()]  # fmt: skip
    lines.append("")
    if "kernel" in data:
        lines += _kernel_lines(data)
    return lines, _verdicts(rows)


def _verdicts(rows: dict) -> dict[str, bool | None]:
    """The issue's goals, each met or not (None: not measured)."""
    warm = rows["mtrace-live --pid, to attached"]
    peer = rows.get("bpftrace -p PID, to BEGIN")
    program_only = rows.get("every cache but the program removed: mtrace-live --pid, to attached")
    run_row = rows.get("mtrace-live run -o summary -- true, end to end")
    peer_run = rows.get("bpftrace -c /bin/true, end to end")
    setups = [row for name, row in rows.items() if name.startswith("the first trace after")]
    finishes = [row for name, row in rows.items() if name.startswith("finish:")]

    return {
        f"start-up (--pid, warm) median <= {GOAL_MEDIAN_S} s": warm["median_s"] <= GOAL_MEDIAN_S,
        f"start-up (--pid, warm) p90 <= {GOAL_P90_S} s": warm["p90_s"] <= GOAL_P90_S,
        f"start-up (the first trace after make setup, default and --contention) median <= "
        f"{GOAL_MEDIAN_S} s": (all(r["median_s"] <= GOAL_MEDIAN_S for r in setups)
                               if setups else None),
        f"start-up (every cache but the program removed) median <= {GOAL_PROGRAM_ONLY_S} s": (
            None if program_only is None else program_only["median_s"] <= GOAL_PROGRAM_ONLY_S),
        f"run -o summary -- true, end to end, median <= {GOAL_RUN_S} s": (
            None if run_row is None else run_row["median_s"] <= GOAL_RUN_S),
        "run -o summary -- true at most half of bpftrace's -c /bin/true": (
            None if run_row is None or peer_run is None
            else run_row["median_s"] <= peer_run["median_s"] / 2),
        f"finish (the lines kept) median <= {GOAL_FINISH_S} s": (
            finishes[0]["median_s"] <= GOAL_FINISH_S if finishes else None),
        "start-up (--pid, warm) ahead of bpftrace's": (
            None if peer is None else warm["median_s"] < peer["median_s"]),
    }  # fmt: skip


def _kernel_lines(data: dict) -> list[str]:
    lines = [
        "Where the kernel spends an attach and a detach (bench/attach_costs.py: a program that "
        "returns 0 on the libc's allocation functions and on those tracepoints, each kind's "
        "system calls timed alone; the second row of a kind attaches while another thread "
        f"closes as many of another program; median of {data['kernel_runs']} runs):",
        "",
        "| kind | attach ms | close ms |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {row['attach_s'] * 1000:.1f} | {row['close_s'] * 1000:.1f} |"
              for name, row in data["kernel"].items()]  # fmt: skip
    return [*lines, "", *KERNEL_TEXT, ""]


KERNEL_TEXT = [
    "The attach calls themselves are cheap: a perf event's `perf_event_open`, its "
    "`PERF_EVENT_IOC_SET_BPF` and `ENABLE` take about 1.5 ms for a uprobe and 0.2 ms for a "
    "tracepoint. The cost is in the close: the last close of a uprobe's or a tracepoint's perf "
    "event waits for RCU grace periods (`perf_trace_event_unreg` calls "
    "`tracepoint_synchronize_unregister`, and a uprobe's unregister waits for its own), about "
    "100 ms a uprobe and 75 ms a tracepoint here, one after the other. A uprobe_multi link "
    "unregisters all its uprobes and waits once; a raw tracepoint's link frees itself after "
    "the grace period, without waiting. mtrace-live's detacher child closes a trace's events "
    "after it has exited (section 6), so a user does not wait for them; a trace started again "
    "meanwhile shares the kernel with it. Another thread's closes of the same kind did not slow "
    "an attach here (the second rows), but a real detacher at work did, in one run by hand: "
    "8 tracepoints' perf events took 78 ms to attach instead of 1.3 ms; a profile of traces "
    "started one after the other, before links, found 48 ms per uprobe and 144 ms per "
    "tracepoint. "
    "Since uprobes are attached in links (tracer/bpf/uprobe_multi.py), a trace's detach is one "
    "link per handler and file (25 links for a `--pid` trace of the system libc, against "
    "34 perf events) plus the tracepoints' perf events, which are still one each. "
    "The detacher closes each link on a thread of its own (tracer/bpf/detacher.py), since a "
    "link's wait takes no lock another link's needs: a `--pid` trace's detacher was at work "
    "2.3-2.5 s after Ctrl-C with its links (26 today) closed one after the other, 1.04-1.11 s with "
    "them side by side, what is left being the 13 tracepoints' events (about 80 ms each, "
    "under the kernel's event_mutex, however many threads close them). By hand, "
    "`run -o summary -- true` started right after the last one took 0.435-0.46 s against "
    "0.38-0.40 s once its detacher was gone (two series of 10 each), where it took 0.48-0.53 s "
    "against 0.39-0.41 s before; the tracepoints' opens of a start still wait for that mutex "
    "(9-10 ms a start on average, at most 40 ms, traced by bpftrace). Processes of their own "
    "for the "
    "links did as well but took 3 ms each to fork (the tracer's page tables copied), CPU the "
    "next start needs; a pause of 3 ms after each tracepoint's close, to let a waiting start "
    "take the mutex, made the starts' waits longer, not shorter (0.13-0.14 s against "
    "0.09-0.10 s in 10 starts), and was left out. A warm `--pid` started 10 times in a "
    "row, each series following the last one's detacher at work, alternated between the tree "
    "before the threads (3e6d3b0) and the one after them, 4 series each: 0.307 and 0.312 s "
    "(median of 40), p90 0.350 and 0.348 s: the threads' closes did not slow the next start.",
    "",
    "Where a warm `--pid` start goes (measured by hand on this machine, not by this bench: a "
    "sampling profile of starts, `-X importtime`, each cached program and map made alone). "
    "The program the last start with the same command line loaded is begun first, before "
    "click is imported (tracer/entry.py; the line as typed is the key, each `--pid` value "
    "replaced by the program the process runs, the options in one order, "
    "tracer/bpf/preload.py): on a thread of its "
    "own, its 69 maps, in one batch of bpf(2) calls that lets the interpreter lock go once "
    "(tracer/bpf/bpf_batch.c; the five large arrays, 0.035 s of kernel time, are most of it: "
    "the per-process and per-thread tables, hash maps of 65,536 entries, are allocated as "
    "their keys come where the kernel allows it, Linux 6.1, PROC_TABLE in common.bpf.h). "
    "Made with a call each, each call let the lock go and then waited to take it back from "
    "the busy main thread: the maps took about 0.080 s of a start, against 0.042-0.048 s in "
    "one batch, and a warm `--pid` went from 0.256 to 0.237 s (alternated, 20 pairs). Then "
    "its 13 tracepoints' handlers, and its uprobe programs through the verifier from two "
    "threads that let the interpreter lock go, about 0.095 s of kernel time in all (the "
    "verifier's own count, log level 4): unwind_step 0.050 s (31,589 instructions "
    "processed), alloc_return 0.016 s, lock_wait_enter 0.0075 s, the rest 0.0002-0.002 s "
    "each. The unwinders' frames go through bpf_loop (UNWIND_LOOP, Linux 5.17), whose "
    "callback the verifier checks once where it followed each of a step's frames "
    "(unwind_step took 0.095 s before it). The handlers the last start with the same line "
    "never asked for are loaded only when first asked for (14 of 44 for a `--pid` of a "
    "sleeping process: the jemalloc and exit handlers, 8 sites, unwind_python), and the "
    "longest to verify at that start go first, by their load times kept with its facts "
    "(the largest code went first before, and alloc_return's is larger than "
    "unwind_step's). The unwinder's tail calls are set at the end of the uprobes' batch, "
    "after the links (the gate keeps every event out until then), so the main thread "
    "attaches while unwind_step finishes: 0.222 against 0.212 s (alternated, 20 pairs). "
    "The main thread meanwhile: the interpreter, click and the line's "
    "parsing, about 0.035 s; the trace's imports, about 0.065 s while the other threads work. "
    "Half of them was `dataclasses` compiling its classes' methods: about 100 data classes "
    "are made before the line, 555 methods written as text and compiled, 0.054-0.072 s of "
    "0.118-0.158 s of imports; the command's entry now keeps their code, marshalled by text "
    "(probes/elf/kept_code.py), and the classes took 0.012-0.018 s, their imports "
    "0.062-0.085 s; a warm `--pid` went from 0.260 to 0.212 s (alternated, 20 pairs). "
    "Up to the line a warm start now uses about 0.11 s of user time (0.20 s before) and "
    "0.15-0.17 s of system time, most of it the maps and the verifier, on 2 CPUs: both are "
    "busy, and moving work between the threads moves the wait, not its sum "
    "(the tree before this section's last changes, 101bc74, and after them, alternated in "
    "one spell: 0.297 against 0.236 s, 20 pairs). "
    "(The project's own modules: numpy, bcc, capstone, pyderust, rich and the DWARF line "
    "reader are not imported, nor importlib.resources, tempfile, shutil and subprocess, "
    "which cold starts, commands and the end use (0.008 s), "
    "`tests/privileged/test_start_imports.py`, of a Python process too; the live view "
    "imports rich as it starts, after the line, 0.02 s of an `-o live` start before; numpy, "
    "0.035-0.045 s, comes with the trace's first events, after the line: before it the "
    "record layouts are dtypes made at their first use (probes/elf/lazy.py), every table is "
    "written as raw bytes (a file's unwind rows and page index are kept by build-id as the "
    "kernel's arrays hold them and copied into their mapping as they are; a process's "
    "mappings, a file's entry and a Python process's entry are packed with struct), and "
    "the file server reads its asks without it; by hand, alternated with the tree before, "
    "a warm `--pid` went from 0.240 to 0.225 s (20 pairs) and one of Debian's python3 from "
    "0.265 to 0.239 s (15), but `run -o summary -- true` end to end from 0.37 to 0.40 s "
    "(15 and 12 pairs): before the line, numpy's import overlapped the verifier's work on "
    "the preload thread, and after it a command's first events paid it whole; so `run` and "
    "`record`, whose user waits for the whole command, not the line, import numpy as they "
    "start, while the programs begun are in the verifier (tracer/commands/trace.py): "
    "0.40 against 0.35 s end to end, with the switch and without (15 pairs); numpy "
    "imported on a thread of its own from the very start was slower, not faster (0.245 "
    "against 0.265 s and 0.253 against 0.267 s, alternated series of 15, before): its "
    "import holds the interpreter lock as the main thread's do; "
    "`OPENBLAS_NUM_THREADS=1` is set before numpy's import); the plan, "
    "from the facts kept of the files (probes/elf/facts.py), "
    "about 0.02 s (whether sched_process_exit says group_dead is read from the BTF, a "
    "kept fact: reading "
    "its tracefs format waited 0.010-0.015 s for the kernel's event_mutex, held by the "
    "start's own tracepoint attaches and the last trace's detacher); the "
    "unwinders' tables, the uprobes' links and the gate, about 0.035 s (a file's rows and "
    "page index are written through a mapping of their arrays, made BPF_F_MMAPABLE: the "
    "libc's took 0.006 s through BPF_MAP_UPDATE_BATCH, 0.0005 s so). A Python process's "
    "interpreter (its layout, read from its symbols and from a symbolic walk of "
    "`_tss_key`'s code) and its libc's thread-key slot (from `pthread_getspecific`'s code) "
    "are kept facts too: they took 0.05 s of a warm start of a Python process. The file server "
    "imports pyelftools' parser itself, after its fork, on the other CPU (the main thread "
    "imported it and waited 0.015-0.025 s before the fork; a thread of the trace "
    "importing the same module at the fork would leave it locked in the child, so the "
    "server's import is bounded by an alarm, `tests/privileged/test_file_server_import.py`). "
    "The tracepoints' "
    "perf events are opened on a thread of their own, waited for before the targets' tables "
    "are written (a trace that just ended holds the kernel's event_mutex while its detacher "
    "closes its own). Before the data classes' code was kept, timed in 4 warm starts, the "
    "main thread waited for the preload thread's uprobe programs 0 to 26 ms: what was left "
    "before the line was mostly its own Python under the interpreter lock, on one CPU; with "
    "half its imports gone it reached the program's take at 0.13-0.18 s and then waited "
    "about 0.017 s for unwind_step's verifier, before its tail calls moved to the end of the "
    "batch. The other "
    "CPU is not free on this machine: a busy loop at nice 19 made a warm `--pid` start "
    "0.05 s slower (median of 15 each, alternated), and a file server forked at the very "
    "start, to import what it serves with on the other CPU while the trace starts, made it "
    "0.017-0.020 s slower (alternated series of 20 and 30), so it was left out: work taken "
    "off the main thread helps only where it is also less work. "
    "At the end, the process leaves with os._exit once the command is done, its threads "
    "waited for, its exit functions run and its output flushed (tracer/cli.py, "
    "`main_and_leave`): the interpreter's own teardown, freeing every object, took 0.05-0.07 s "
    "after a trace, much of it copy-on-write faults on pages shared with the trace's forked "
    "children and the trace's own free() calls passing its uprobes.",
]
