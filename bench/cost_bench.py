"""Section 6: what the tracer itself costs, against bpftrace.

The target is jmp_loop under the SDT glibc, paced at RATE hits/s (setjmp,
longjmp, longjmp_target) and running throughout; each tracer attaches to its
pid.

- Start-up: from starting the tracer's command to reading its first event
  line (mtrace-live `-o text`, bpftrace `printf`), both on a pipe.
- CPU and memory: each tracer, once attached, traces for HOLD seconds; CPU %
  is its user+system time over those seconds (from /proc/PID/stat), peak RSS
  its VmHWM at the end.
- Stopping: each tracer, once attached, traces for STOP_AFTER seconds and gets
  SIGINT; the time until its process has exited (every record written; for
  mtrace-live, the perf events are then closed by its detached child).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from common import (
    BUILD,
    FLOORS,
    MTRACE,
    QUICK,
    REPS,
    Background,
    Sample,
    alternate,
    detached,
    say,
    sdt,
    summarise,
    time_to_line,
)  # fmt: skip

RATE = 300_000  # hits/s
HOLD = 1.0 if QUICK else 3.0
STOP_AFTER = 1.0  # seconds attached before the stop is timed
PROBES = ["setjmp", "longjmp", "longjmp_target"]
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


# The least any bcc tool's start-up can be: the interpreter mtrace-live runs
# on, importing bcc and compiling and loading a program that does nothing.
FLOOR = "floor: python3 + bcc compiling an empty program"
COLD = "mtrace-live -o text, compiling (no program cache)"
EMPTY_BCC = [
    str(Path(MTRACE[0]).with_name("python")),
    "-c",
    f"import bcc, time; bcc.BPF(src_file={str(FLOORS / 'empty.bpf.c')!r})"
    ".load_func('empty', bcc.BPF.KPROBE); print('loaded', flush=True); time.sleep(120)",
]


def mtrace_argv(pid: int, mode: str) -> list[str]:
    probes = [arg for p in PROBES for arg in ("--probes", p)]
    lib = ["--lib", str(sdt().libc)]
    if mode == "counters":
        return [*MTRACE, "count", "--pid", str(pid), *lib, *probes]
    return [*MTRACE, "--pid", str(pid), *lib, *probes, "-o", mode]


def bpftrace_argv(pid: int, action: str) -> list[str]:
    attach = ",".join(f"usdt:{sdt().libc}:libc:{p}" for p in PROBES)
    script = f'BEGIN {{ printf("ready\\n"); }} {attach} {{ {action} }}'
    return ["bpftrace", "-B", "line", "-p", str(pid), "-e", script]


def first_event(
    argv: list[str], is_event: Callable[[str], bool], env: dict[str, str] | None = None
) -> Sample:
    return Sample(time_to_line(argv, is_event, "stdout", env))


def steady(argv: list[str], ready: str, tmp: Path) -> Sample:
    tracer = Background(argv, ready, tmp / "cost.log")
    try:
        pid = tracer.process.pid
        c0, t0 = cpu_seconds(pid), time.monotonic()
        time.sleep(HOLD)
        c1, t1 = cpu_seconds(pid), time.monotonic()
        rss = peak_rss_mib(pid)
    finally:
        tracer.stop()
    # The figure alternate() takes the median of is, here, the CPU %.
    return Sample((c1 - c0) / (t1 - t0) * 100, {"peak_rss_mib": rss})


def stop_time(argv: list[str], ready: str, tmp: Path) -> Sample:
    tracer = Background(argv, ready, tmp / "stop.log")
    time.sleep(STOP_AFTER)
    began = time.monotonic()
    text = tracer.stop()
    took = time.monotonic() - began
    if tracer.process.returncode not in (0, 130):
        raise RuntimeError(f"{argv[0]} exited {tracer.process.returncode}: {text[-300:]}")
    return Sample(took)


def stopping(pid: int, tmp: Path, peers: dict[str, str | None]) -> dict[str, Callable[[], Sample]]:
    """The commands the hardening issue named: record, a live trace, serve;
    each with the default libc probes (38 sites) and the kmem tracepoints."""
    lib = ["--lib", str(sdt().libc)]
    configs: dict[str, Callable[[], Sample]] = {
        "mtrace-live --pid --kmem -o summary": lambda: stop_time(
            [*MTRACE, "--pid", str(pid), *lib, "--kmem", "-o", "summary"], "Ctrl-C", tmp
        ),
        "mtrace-live record --pid --libc": lambda: stop_time(
            [
                *MTRACE,
                "record",
                "-o",
                str(tmp / f"stop-{time.monotonic_ns()}.d"),
                "--pid",
                str(pid),
                "--libc",
                *lib,
            ],
            "Ctrl-C",
            tmp,
        ),
        "mtrace-live serve --pid": lambda: stop_time(
            [*MTRACE, "serve", "--pid", str(pid), *lib, "--web.listen-address", "127.0.0.1:0"],
            "serving",
            tmp,
        ),
    }
    if peers.get("bpftrace"):
        configs["bpftrace count()"] = lambda: stop_time(
            bpftrace_argv(pid, "@[probe] = count();"), "ready", tmp
        )
    return configs


def run(tmp: Path, peers: dict[str, str | None]) -> dict[str, object]:
    say("6. tracer cost ...")
    seconds = (REPS * 2 * (HOLD + 15)) + 120
    target = subprocess.Popen(
        sdt().wrap([str(BUILD / "jmp_loop"), str(int(RATE / 3 * seconds)), str(RATE / 3)]),
        stdout=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.5)
        pid = target.pid
        # The compiled-program cache (tracer/bpf/bpf_cache.py) in a directory of
        # the bench's own: filled by one unmeasured start of each command,
        # then measured warm; the cold row compiles at every start.
        cached = {"MTRACE_LIVE_BPF_CACHE": str(tmp / "bpf-cache")}
        cold = {"MTRACE_LIVE_BPF_CACHE": "off"}

        def ours(extra: list[str], env: dict[str, str]) -> Sample:
            return first_event([*mtrace_argv(pid, "text"), *extra],
                               lambda line: not line.startswith("mtrace-live"), env)  # fmt: skip

        for extra in ([], ["--no-allocs"]):
            detached()
            ours(extra, cached)
        startup: dict[str, Callable[[], Sample]] = {
            "mtrace-live -o text": lambda: ours([], cached),
            "mtrace-live -o text --no-allocs": lambda: ours(["--no-allocs"], cached),
            COLD: lambda: ours([], cold),
            FLOOR: lambda: first_event(EMPTY_BCC, lambda line: line.startswith("loaded")),
        }
        load: dict[str, Callable[[], Sample]] = {
            "mtrace-live counters (count --pid)": lambda: steady(
                mtrace_argv(pid, "counters"), "Ctrl-C", tmp
            ),
            "mtrace-live event stream (-o summary)": lambda: steady(
                mtrace_argv(pid, "summary"), "Ctrl-C", tmp
            ),
        }
        if peers.get("bpftrace"):
            startup["bpftrace printf()"] = lambda: first_event(
                bpftrace_argv(pid, 'printf("hit\\n");'), lambda line: line.startswith("hit")
            )
            load["bpftrace count()"] = lambda: steady(
                bpftrace_argv(pid, "@[probe] = count();"), "ready", tmp
            )
        first = summarise(alternate(startup, REPS))
        cost = summarise(alternate(load, REPS))
        stops = summarise(alternate(stopping(pid, tmp, peers), REPS))
    finally:
        target.kill()
        target.wait()
    return {"rate": RATE, "hold": HOLD, "startup": first, "cost": cost, "stop": stops,
            "stop_after": STOP_AFTER}  # fmt: skip


def render(data: dict) -> tuple[list[str], dict[str, bool | None]]:
    lines = [
        "## 6. What the tracer costs",
        "",
        f"The traced process: `jmp_loop` paced at {data['rate']:,} hits/s (setjmp, longjmp, "
        "longjmp_target) under the SDT glibc, running throughout; each tracer attaches to "
        "its pid.",
        "",
        "Start-up, from starting the command to reading its first event line on a pipe "
        "(compiling and loading the BPF programs included):",
        "",
        "| tracer | median s |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {row['median_s']:.2f} |" for name, row in data["startup"].items()]
    verdicts: dict[str, bool | None] = {}
    floor = data["startup"].get(FLOOR, {}).get("median_s")
    lines += ["", "Each start here follows the last one's detacher's end (so that the CPU "
              "figures below are the tracer's alone): a part of the wait. Section 12 measures "
              "the whole wait a user sees, and the start-up goals are judged there."]  # fmt: skip
    if floor is not None:
        lines += ["", _floor_text(floor)]
    lines += [
        "",
        f"CPU and memory while attached, over {data['hold']:.0f} s of tracing (start-up "
        "excluded): CPU % of one CPU (user + system, /proc/PID/stat), peak RSS (VmHWM):",
        "",
        "| tracer | CPU % | peak RSS (MiB) |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {row['median_s']:.1f} | {row['peak_rss_mib']:.0f} |"
              for name, row in data["cost"].items()]  # fmt: skip
    lines += _stopping(data, verdicts)
    return lines + _COST_NOTES, verdicts


def _floor_text(floor: float) -> str:
    return (
        f"The floor, {floor:.2f} s, is what any bcc tool pays to start: the interpreter, "
        "bcc's import, and clang parsing the kernel headers for even an empty program. "
        "mtrace-live pays it once per program: the first start with a given program "
        "(its C, the constants chosen for the sites, the kernel, bcc) compiles it and keeps "
        "its byte code and map definitions (`tracer/bpf/bpf_cache.py`); later starts create "
        "the maps, write their descriptors into the code and load it, with no clang. The "
        "first two rows are such starts; the cold row compiles every time. The pid is a "
        "value written once loaded, not a constant, so any pid shares a program. What "
        "remains is the interpreter and its imports, choosing the sites (the libc's ELF "
        "notes and symbol tables, read in bulk, and the allocation functions' "
        "disassembly), the kernel's verifier, and attaching each uprobe; `--no-allocs` "
        "leaves out the allocation functions."
    )


def _stopping(data: dict, verdicts: dict[str, bool | None]) -> list[str]:
    """The stopping table, with its verdict into ``verdicts``."""
    lines: list[str] = []
    if data.get("stop"):
        lines += [
            "",
            f"Stopping, after {data.get('stop_after', data['hold']):.0f} s attached: from SIGINT "
            "to the process's exit, "
            "every record written (mtrace-live with the default 38 libc probe sites, the "
            "`--pid` target running throughout):",
            "",
            "| tracer | median s | max s |",
            "|---|---:|---:|",
        ]
        lines += [f"| {name} | {row['median_s']:.2f} | {max(row['samples']):.2f} |"
                  for name, row in data["stop"].items()]  # fmt: skip
        ours = [max(row["samples"]) for name, row in data["stop"].items()
                if name.startswith("mtrace")]  # fmt: skip
        verdicts["Stop within 1 s of SIGINT (record, trace, serve)"] = max(ours) < 1.0
    return lines


_COST_NOTES = [
    "",
    "Without the program cache, most of mtrace-live's start-up is bcc compiling the C "
    "program with clang against the kernel headers (the cold row); bpftrace compiles a "
    "one-line script. Counting in the kernel costs neither tracer any CPU while "
    "attached; the event stream costs the decoding of every event in Python. Peak RSS "
    "is mostly the interpreter with numpy and bcc's libraries; a start from the cache "
    "never runs clang, so LLVM's memory for the compile is not in it.",
    "",
]
