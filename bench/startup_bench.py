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

import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

import attach_costs
from common import MTRACE, QUICK, detached, say, time_to_line
from mtrace_live.tracer.processes.target import default_libc

RUNS = 3 if QUICK else 20
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
GOAL_MEDIAN_S, GOAL_P90_S, GOAL_COLD_S = 0.3, 0.5, 2.0


def bpftrace_script(first: str) -> str:
    libc = default_libc()
    uprobes = ",".join(f"{kind}:{libc}:{name}" for kind in ("uprobe", "uretprobe")
                       for name in ALLOC_FUNCTIONS)  # fmt: skip
    others = ",".join(f"tracepoint:{name}" for name in TRACEPOINTS[1:])
    return (f"BEGIN {{ printf(\"ready\\n\"); }} {first} {{ printf(\"exec\\n\"); }} "
            f"{uprobes},{others} {{ @[probe] = count(); }}")  # fmt: skip


def configurations(pid: int, peers: dict[str, str | None]) -> dict[str, Callable[[], float]]:
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
        "mtrace-live serve --pid, to serving": lambda: time_to_line(
            serve, lambda line: "serving" in line, "stderr"),
        "mtrace-live --pid as it was: a perf event per uprobe, the plan derived each time":
            lambda: time_to_line(on_pid, attached, "stderr", BEFORE_ENV),
        "cold: mtrace-live run -o text -- true": lambda: time_to_line(
            run, exec_line, "stdout", COLD_ENV),
        "cold: mtrace-live --pid, to attached": lambda: time_to_line(
            on_pid, attached, "stderr", COLD_ENV),
    }  # fmt: skip
    if peers.get("bpftrace"):
        first = "tracepoint:sched:sched_process_exec"
        configs["bpftrace -c /bin/true, to its first event"] = lambda: time_to_line(
            ["bpftrace", "-B", "line", "-c", "/bin/true", "-e", bpftrace_script(first)],
            lambda line: line.strip() == "exec", "stdout")  # fmt: skip
        configs["bpftrace -p PID, to BEGIN"] = lambda: time_to_line(
            ["bpftrace", "-B", "line", "-p", str(pid), "-e", bpftrace_script(first)],
            lambda line: line.strip() == "ready", "stdout")  # fmt: skip
    return configs


def run(tmp: Path, peers: dict[str, str | None]) -> dict[str, object]:
    say("12. start-up ...")
    target = subprocess.Popen(["sleep", "3600"])
    try:
        configs = configurations(target.pid, peers)
        for name, start in configs.items():  # the caches filled: one unmeasured start each
            if not name.startswith("cold") and "before" not in name:
                start()
        rows: dict[str, dict[str, object]] = {}
        for name, start in configs.items():
            detached()  # the configuration before's detacher: not this one's
            samples = [start() for _ in range(RUNS)]
            ordered = sorted(samples)
            rows[name] = {"median_s": statistics.median(samples),
                          "p90_s": ordered[max(0, round(0.9 * len(ordered)) - 1)],
                          "max_s": ordered[-1], "samples": samples}  # fmt: skip
    finally:
        target.kill()
        target.wait()
    detached()
    costs = [attach_costs.measure() for _ in range(RUNS // 4 or 1)]
    kernel = {name: {key: statistics.median(run[name][key] for run in costs)
                     for key in ("attach_s", "close_s", "count")}
              for name in costs[0]}  # fmt: skip
    return {"runs": RUNS, "rows": rows, "kernel": kernel, "kernel_runs": len(costs)}


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
        "mtrace-live attaches by default). bpftrace attaches the libc's allocation functions "
        f"(entries and returns, {2 * len(ALLOC_FUNCTIONS)} uprobes) and {len(TRACEPOINTS)} "
        "tracepoints, timed to its first event line (`-c /bin/true`) and to its BEGIN line "
        '(`-p`, printed once all are attached). The row "as it was" turns off the uprobes\' '
        "links and the derived probes' plan cache (`MTRACE_LIVE_UPROBE_MULTI=0`, "
        "`MTRACE_LIVE_PLAN_CACHE=off`): the start-up before them.",
        "",
        "| configuration | median s | p90 s | max s |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {row['median_s']:.2f} | {row['p90_s']:.2f} | {row['max_s']:.2f} |"
              for name, row in rows.items()]  # fmt: skip
    lines.append("")
    if "kernel" in data:
        lines += _kernel_lines(data)
    warm = rows["mtrace-live --pid, to attached"]
    cold = rows["cold: mtrace-live --pid, to attached"]
    peer = rows.get("bpftrace -p PID, to BEGIN")
    verdicts: dict[str, bool | None] = {
        f"start-up (--pid, warm) median <= {GOAL_MEDIAN_S} s": warm["median_s"] <= GOAL_MEDIAN_S,
        f"start-up (--pid, warm) p90 <= {GOAL_P90_S} s": warm["p90_s"] <= GOAL_P90_S,
        f"start-up (--pid, cold) median <= {GOAL_COLD_S} s": cold["median_s"] <= GOAL_COLD_S,
        "start-up (--pid, warm) ahead of bpftrace's": (
            None if peer is None else warm["median_s"] < peer["median_s"]),
    }  # fmt: skip
    return lines, verdicts


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
    "34 perf events) plus the tracepoints' perf events, which are still one each.",
    "",
    "Where a warm `--pid` start goes (one start timed by hand, function by function, on this "
    "machine): the interpreter and the imports, 0.2 to 0.28 s (Python with numpy, bcc, click "
    "and pyelftools alone takes 0.20 s); choosing the probes from the kept plan, 0.05 to "
    "0.08 s; the providers and the arena symbols, 0.05 s; making the program's 45 maps and "
    "loading its cached code, 0.09 to 0.15 s (the maps 0.03 s, bcc's library 0.03 s); the "
    "kernel's verifier on the uprobe programs loaded for links, 0.04 s (28 programs; "
    "`alloc_return` 14 ms of it); the links, 0.02 s. The CFI unwinder's step "
    "(`unwind_step`) was the largest single cost: the verifier follows every frame it "
    "unwinds, 144 ms at 32 frames a step. It now unwinds 8 frames a step (40 ms; a whole "
    "walk is 18 of the kernel's 33 tail calls). The goals are not met: the interpreter and "
    "the libraries mtrace-live is built on take about two thirds of the 0.3 s before any "
    "of the work, and the kernel's verification of the programs, one after the other, most "
    "of the rest.",
]
