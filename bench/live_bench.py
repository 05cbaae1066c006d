"""Benchmarks of the live trace, written to docs/performance.md.

1. Per-hit cost of a USDT probe on a setjmp/longjmp loop (three probe hits
   per iteration) under the SDT glibc, in one run, configurations in
   alternating order: untraced; mtrace-live counters only (`count`);
   mtrace-live with the event stream into the allocator model
   (`run -o summary`); bpftrace count() on the same probes.
2. Event path throughput: records laid out in a ring exactly as the kernel
   lays them out, read in bulk, decoded and fed to the allocator model; and
   end to end, the paced loop at 200,000 probe hits/s with the loss counted.
3. Probe hit rates of everyday programs, which chose the default probe set.

Run as root after `make sdt-glibc exercisers`: `make bench` (QUICK=1 for
fewer repetitions).
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import re
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build"
MTRACE = [str(REPO / ".venv" / "bin" / "mtrace-live")]
QUICK = os.environ.get("QUICK") == "1"
REPS = 3 if QUICK else 5
ITERATIONS = 200_000 if QUICK else 500_000
JMP_PROBES = ["setjmp", "longjmp", "longjmp_target"]


def sdt_runner() -> tuple[Path, Path]:
    build = Path(Path("/var/cache/mtrace-live/sdt-glibc/current").read_text().strip())
    return build / "testrun.sh", build / "libc.so.6"


def loop_seconds(output: str) -> float:
    """jmp_loop prints its own elapsed seconds as the last number line."""
    for line in reversed(output.splitlines()):
        if re.fullmatch(r"\d+\.\d+", line.strip()):
            return float(line)
    raise RuntimeError(f"no elapsed time in: {output[-500:]}")


def untraced(runner: Path) -> float:
    done = subprocess.run(
        [str(runner), str(BUILD / "jmp_loop"), str(ITERATIONS)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return loop_seconds(done.stdout)


def mtrace_counters() -> float:
    probes = [arg for p in JMP_PROBES for arg in ("--probes", p)]
    done = subprocess.run(
        [*MTRACE, "count", "--sdt-glibc", *probes, "--json", "--",
         str(BUILD / "jmp_loop"), str(ITERATIONS)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return loop_seconds(done.stdout.split("{", 1)[0])


def mtrace_events() -> float:
    probes = [arg for p in JMP_PROBES for arg in ("--probes", p)]
    done = subprocess.run(
        [*MTRACE, "run", "--sdt-glibc", *probes, "-o", "summary", "--",
         str(BUILD / "jmp_loop"), str(ITERATIONS)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    lost = re.search(r"(\d+) lost", done.stdout)
    if lost and int(lost.group(1)):
        print(f"  (event stream lost {lost.group(1)} events)", file=sys.stderr)
    return loop_seconds(done.stdout.split("mtrace-live:", 1)[0])


def bpftrace_count(runner: Path, libc: Path) -> float:
    attach = ",".join(f"usdt:{libc}:libc:{name}" for name in JMP_PROBES)
    script = f'BEGIN {{ printf("ready\\n"); }} {attach} {{ @[probe] = count(); }}'
    with tempfile.TemporaryFile("w+") as out:
        tracer = subprocess.Popen(["bpftrace", "-e", script], stdout=out, stderr=out, text=True)
        deadline = time.monotonic() + 60
        while True:
            out.seek(0)
            if "ready" in out.read():
                break
            if tracer.poll() is not None or time.monotonic() > deadline:
                out.seek(0)
                raise RuntimeError(f"bpftrace did not start: {out.read()}")
            time.sleep(0.05)
        try:
            return untraced(runner)
        finally:
            tracer.send_signal(signal.SIGINT)
            tracer.wait(timeout=60)


def per_hit_cost() -> dict[str, object]:
    runner, libc = sdt_runner()
    configs = {
        "untraced": lambda: untraced(runner),
        "mtrace-live counters only": mtrace_counters,
        "mtrace-live event stream": mtrace_events,
        "bpftrace count()": lambda: bpftrace_count(runner, libc),
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    for rep in range(REPS):
        order = list(configs) if rep % 2 == 0 else list(reversed(configs))
        for name in order:
            times[name].append(configs[name]())
            print(f"  {name}: {times[name][-1]:.3f} s", file=sys.stderr)
    hits = 3 * ITERATIONS
    base = statistics.median(times["untraced"])
    rows = {}
    for name, samples in times.items():
        median = statistics.median(samples)
        rows[name] = {
            "median_s": median,
            "ns_per_hit": (median - base) / hits * 1e9,
            "samples": samples,
        }
    return {"iterations": ITERATIONS, "hits": hits, "rows": rows}


# ---- event path ---------------------------------------------------------------


def synthetic_throughput(records: int = 2_000_000) -> dict[str, float]:
    """Bulk read + decode-free counting + model, on a ring in a memfd."""
    from mtrace_live.probes.catalog import load_catalog
    from mtrace_live.probes.locations import ArgKind, ArgLocation, SiteLayout
    from mtrace_live.probes.sdt_notes import SdtSite
    from mtrace_live.tracer.events import EVENT_DTYPE, EventDecoder, site_info
    from mtrace_live.tracer.model import AllocatorModel
    from mtrace_live.tracer.ringbuf import RingReader, record_stride

    page = mmap.PAGESIZE
    data = 1 << 24  # 16 MiB, as --buffer-pages 4096
    stride = record_stride(EVENT_DTYPE.itemsize)
    per_fill = data // stride - 1
    fd = os.memfd_create("bench-ring")
    os.ftruncate(fd, 2 * page + 2 * data)
    ring = mmap.mmap(fd, 2 * page + 2 * data)
    reg = ArgLocation(ArgKind.REG, 8, False, reg=14)
    names = ["setjmp", "memory_arena_reuse_wait", "lll_lock_wait_private"]
    catalog = load_catalog()
    layouts = [
        SiteLayout(SdtSite("libc", n, 0x1000, 0x1000, 0, ()), (reg, reg, reg)) for n in names
    ]
    infos = [site_info(lay, catalog.probe("libc", lay.site.name)) for lay in layouts]
    model = AllocatorModel(EventDecoder(infos), names)
    batch = np.zeros(per_fill, dtype=EVENT_DTYPE)
    batch["tgid"] = np.arange(per_fill) % 8 + 1000
    batch["tid"] = batch["tgid"]
    batch["ts"] = np.arange(per_fill)
    # 1 in 100 records is a contention event the model handles one by one.
    batch["probe"] = np.where(np.arange(per_fill) % 100 == 0, 1, 0)
    batch["site"] = batch["probe"]
    header = np.zeros(per_fill, dtype=[("len", "<u4"), ("pgoff", "<u4"), ("event", EVENT_DTYPE)])
    header["len"] = EVENT_DTYPE.itemsize
    header["event"] = batch
    raw = header.tobytes()
    ring[2 * page : 2 * page + len(raw)] = raw
    reader = RingReader(fd, data, EVENT_DTYPE)
    done = 0
    elapsed = 0.0
    position = 0
    while done < records:
        struct.pack_into("<Q", ring, 0, position)
        struct.pack_into("<Q", ring, page, position + len(raw))
        start = time.perf_counter()
        got = reader.read()
        model.consume(got)
        elapsed += time.perf_counter() - start
        done += len(got)
        position = 0
    reader.close()
    ring.close()
    os.close(fd)
    return {"records": done, "seconds": elapsed, "per_second": done / elapsed}


def paced_loss(rate_hits: int, seconds: float = 3.0) -> dict[str, float]:
    """The loop paced at rate_hits probe hits/s, traced into the model."""
    iterations = int(rate_hits / 3 * seconds)
    probes = [arg for p in JMP_PROBES for arg in ("--probes", p)]
    done = subprocess.run(
        [*MTRACE, "run", "--sdt-glibc", *probes, "-o", "summary", "--",
         str(BUILD / "jmp_loop"), str(iterations), str(rate_hits / 3)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    match = re.search(r"events: (\d+) in the kernel, (\d+) delivered, (\d+) lost", done.stdout)
    if not match:
        raise RuntimeError(done.stdout + done.stderr)
    kernel, delivered, lost = (int(x) for x in match.groups())
    achieved = kernel / loop_seconds(done.stdout.split("mtrace-live:", 1)[0])
    return {"target": rate_hits, "achieved": achieved, "kernel": kernel,
            "delivered": delivered, "lost": lost}  # fmt: skip


# ---- probe rates ---------------------------------------------------------------

RATE_WORKLOADS = {
    "python3, JSON encoding": [
        "/usr/bin/python3", "-c",
        "import json\nfor i in range(300000): json.dumps({str(i): [i] * 10})",
    ],
    "python3, 8 threads": [
        "/usr/bin/python3", "-c",
        "import threading, json\n"
        "def work():\n    for i in range(50000): json.dumps([i] * 50)\n"
        "ts = [threading.Thread(target=work) for _ in range(8)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]",
    ],
    "sort -n, 300,000 lines": ["/usr/bin/sort", "-n", "NUMS", "-o", "/dev/null"],
}  # fmt: skip


def probe_rates() -> dict[str, dict[str, float]]:
    rates: dict[str, dict[str, float]] = {}
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as nums:
        nums.write("\n".join(str((i * 7919) % 300_000) for i in range(300_000)) + "\n")
        nums.flush()
        for title, argv in RATE_WORKLOADS.items():
            argv = [nums.name if a == "NUMS" else a for a in argv]
            start = time.monotonic()
            done = subprocess.run(
                [*MTRACE, "count", "--sdt-glibc", "--probes", "*", "--json", "--", *argv],
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            seconds = time.monotonic() - start
            counts = json.loads(done.stdout[done.stdout.index("{") :])["usdt"]
            rates[title] = {name: n / seconds for name, n in counts.items() if n}
    return rates


# ---- report --------------------------------------------------------------------


def record_bytes() -> int:
    from mtrace_live.tracer.events import EVENT_DTYPE

    return EVENT_DTYPE.itemsize


def machine() -> str:
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    virt = subprocess.run(["systemd-detect-virt"], capture_output=True, text=True).stdout.strip()
    bpftrace = subprocess.run(
        ["bpftrace", "--version"], capture_output=True, text=True
    ).stdout.strip()
    bcc = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Version}", "python3-bpfcc"], capture_output=True, text=True
    ).stdout
    return (
        f"{cpu}, {os.cpu_count()} CPUs, {virt or 'not'} virtualised; Linux {platform.release()}; "
        f"glibc 2.36 (SDT build); bcc {bcc}; {bpftrace}; Python {platform.python_version()}"
    )


def main() -> None:
    print("per-hit cost ...", file=sys.stderr)
    cost = per_hit_cost()
    print("event path ...", file=sys.stderr)
    synthetic = synthetic_throughput()
    paced = [paced_loss(rate) for rate in (200_000,)]
    print("probe rates ...", file=sys.stderr)
    rates = probe_rates()
    out = REPO / "build" / "bench-live.json"
    out.write_text(json.dumps({"cost": cost, "synthetic": synthetic, "paced": paced,
                               "rates": rates, "machine": machine()}, indent=2))  # fmt: skip
    print(f"wrote {out}", file=sys.stderr)
    write_report(cost, synthetic, paced, rates)


def rewrite() -> None:
    """Write docs/performance.md again from build/bench-live.json."""
    data = json.loads((REPO / "build" / "bench-live.json").read_text())
    write_report(data["cost"], data["synthetic"], data["paced"], data["rates"])


def write_report(cost: dict, synthetic: dict, paced: list[dict], rates: dict) -> None:
    rows = cost["rows"]
    bpftrace_ns = rows["bpftrace count()"]["ns_per_hit"]
    lines = [
        "# Performance of the live trace",
        "",
        "Written by `make bench` (`bench/live_bench.py`); numbers from one run.",
        "",
        f"Machine: {machine()}.",
        "",
        "## Per-hit cost of a USDT probe",
        "",
        f"`build/jmp_loop {cost['iterations']}` under the SDT glibc: {cost['hits']} probe hits "
        f"(setjmp, longjmp, longjmp_target). Median of {REPS} runs per configuration, "
        "run in alternating order; the loop times itself, so start-up and attach are excluded.",
        "",
        "| configuration | median s | ns per hit | vs bpftrace count() |",
        "|---|---:|---:|---:|",
    ]
    for name, row in rows.items():
        ratio = row["ns_per_hit"] / bpftrace_ns if name != "untraced" and bpftrace_ns > 0 else None
        lines.append(
            f"| {name} | {row['median_s']:.3f} | {row['ns_per_hit']:.0f} | "
            + (f"{ratio:.2f}x" if ratio is not None else "-")
            + " |"
        )
    counters = rows["mtrace-live counters only"]["ns_per_hit"] / bpftrace_ns
    events = rows["mtrace-live event stream"]["ns_per_hit"] / bpftrace_ns
    lines += [
        "",
        f"Target: per-hit cost within 1.05x of bpftrace's. Counters only: {counters:.2f}x "
        f"({'met' if counters <= 1.05 else 'not met'}); with the event stream: {events:.2f}x "
        f"({'met' if events <= 1.05 else 'not met'}).",
    ]
    if events > 1.05:
        lines += [
            "",
            "Why the event stream is above target: over a bare counter, each hit also copies the",
            "registers (168 bytes) to the stack, fills six argument slots and reserves and submits",
            f"an {record_bytes()}-byte ring record. Reading only the registers a site needs",
            "(one 8-byte read per argument) and sizing records by argument count would remove",
            "most of that.",
        ]
    lines += [
        "",
        "## Event path",
        "",
        f"- Into the consumers (bulk ring read, per-process counting, the allocator model; "
        f"1 record in 100 handled one by one): **{synthetic['per_second'] / 1e6:.1f} M events/s** "
        f"({synthetic['records']} records in {synthetic['seconds']:.2f} s). Target 1 M events/s: "
        f"{'met' if synthetic['per_second'] >= 1e6 else 'not met'}.",
    ]
    for run in paced:
        lines.append(
            f"- End to end, the loop paced at {run['target']:,} hits/s (achieved "
            f"{run['achieved']:,.0f}/s): {run['kernel']} in the kernel, "
            f"{run['delivered']} delivered, "
            f"{run['lost']} lost. Zero loss at 200 k events/s: "
            f"{'met' if run['lost'] == 0 else 'not met'}."
        )
    lines += [
        "",
        "## Probe hit rates of everyday programs (the default probe set)",
        "",
        "Hits per second, all 57 libc probes counted, each program run under the SDT glibc.",
        "",
    ]
    for title, by_probe in rates.items():
        top = sorted(by_probe.items(), key=lambda kv: -kv[1])
        lines.append(f"- {title}: " + ", ".join(f"{n} {r:,.0f}/s" for n, r in top[:8]))
    lines += [
        "",
        "The pthread mutex probes and setjmp fire on every call; the memory_* probes and",
        "lll_lock_wait_private (a contended private lock, as arena locks are) fire rarely.",
        "So the default is `memory_*` and `lll_lock_wait_private`; `--probes '*'` adds the rest.",
        "",
    ]
    (REPO / "docs" / "performance.md").write_text("\n".join(lines))
    print("wrote docs/performance.md", file=sys.stderr)


if __name__ == "__main__":
    rewrite() if sys.argv[1:] == ["--rewrite"] else main()
