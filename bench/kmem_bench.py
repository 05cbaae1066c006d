"""Kernel kmem tracing: slowdown of an allocation-heavy loop under each
tracer, kmemtrace record throughput, and report decode throughput.

    python bench/kmem_bench.py            # writes docs/kmem-performance.md
    QUICK=1 python bench/kmem_bench.py    # fewer repetitions, smaller data

The workload (tests/workloads/kmem_exerciser.c) times its own loop of
socket()/close() and pipe()/close() pairs, so tracer start-up is not counted.
Configurations run in alternating order; medians are reported.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from live_bench import BUILD, MTRACE, QUICK, REPO, machine
from mtrace_live.exporters.kmemtrace import DECODED, KmemtraceWriter, _scan_file, read_record_set
from mtrace_live.tracer.events import EVENT_DTYPE, EventKind
from mtrace_live.tracer.report import analyse

REPS = 3 if QUICK else 5
PAIRS = 20_000 if QUICK else 50_000
DECODE_RECORDS = 2_000_000 if QUICK else 12_000_000
SIX = ("kmalloc", "kfree", "kmem_cache_alloc", "kmem_cache_free", "mm_page_alloc", "mm_page_free")


def workload(tmp: Path) -> list[str]:
    return [str(BUILD / "kmem_exerciser"), "--sockets", str(PAIRS), "--pipes", str(PAIRS),
            "--out", str(tmp / "truth.json")]  # fmt: skip


def work_seconds(tmp: Path) -> float:
    return float(json.loads((tmp / "truth.json").read_text())["work_ns"]) / 1e9


def run(argv: list[str], tmp: Path) -> float:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed: {done.stderr[-800:]}")
    (tmp / "last.out").write_text(done.stdout + done.stderr)
    return work_seconds(tmp)


def with_bpftrace(tmp: Path) -> float:
    attach = ",".join(f"tracepoint:kmem:{name}" for name in SIX)
    script = f'BEGIN {{ printf("ready\\n"); }} {attach} {{ @[probe] = count(); }}'
    out = tmp / "bpftrace.out"
    with open(out, "w") as sink:
        tracer = subprocess.Popen(["bpftrace", "-e", script], stdout=sink, stderr=sink)
    try:
        deadline = time.monotonic() + 60
        while "ready" not in out.read_text():
            if tracer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"bpftrace did not start: {out.read_text()}")
            time.sleep(0.05)
        return run(workload(tmp), tmp)
    finally:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(timeout=60)


def slowdown(tmp: Path) -> dict[str, object]:
    records = tmp / "records"

    def record() -> float:
        shutil.rmtree(records, ignore_errors=True)
        return run([*MTRACE, "record", "-o", str(records), "--", *workload(tmp)], tmp)

    configs: dict[str, Callable[[], float]] = {
        "untraced": lambda: run(workload(tmp), tmp),
        "mtrace-live aggregation, pid filter": lambda: run(
            [*MTRACE, "run", "--kmem-only", "-o", "summary", "--", *workload(tmp)], tmp
        ),
        "mtrace-live aggregation + kmemtrace records": record,
        "perf stat -e 'kmem:*'": lambda: run(
            ["perf", "stat", "-e", "kmem:*", "-x,", "--", *workload(tmp)], tmp
        ),
        "bpftrace count(), six tracepoints": lambda: with_bpftrace(tmp),
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    recorded: list[tuple[int, int, float]] = []
    for rep in range(REPS):
        order = list(configs) if rep % 2 == 0 else list(reversed(configs))
        for name in order:
            times[name].append(configs[name]())
            print(f"  {name}: {times[name][-1]:.3f} s", file=sys.stderr)
            if name.endswith("records"):
                text = (tmp / "last.out").read_text()
                match = re.search(r"kmemtrace: (\d+) records .*?, (\d+) lost", text)
                if match:
                    recorded.append((int(match[1]), int(match[2]), times[name][-1]))
    base = statistics.median(times["untraced"])
    rows = {name: {"median_s": statistics.median(s), "ratio": statistics.median(s) / base,
                   "samples": s} for name, s in times.items()}  # fmt: skip
    rate = statistics.median(r / s for r, _, s in recorded) if recorded else 0.0
    lost = max((lost for _, lost, _ in recorded), default=0)
    return {"pairs": PAIRS, "rows": rows, "records_per_s": rate, "records_lost": lost,
            "records_per_run": recorded[0][0] if recorded else 0}  # fmt: skip


def synthetic_set(directory: Path, records: int) -> None:
    """A record set of kmalloc/kfree pairs and cache allocations, written
    through the same encoder the tracer uses."""
    rng = np.random.default_rng(1)
    writer = KmemtraceWriter(directory, ["memory_mallopt"], "")
    batch_size = 200_000
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


def decode_throughput(tmp: Path) -> dict[str, float]:
    warm = tmp / "warm"
    synthetic_set(warm, 1000)
    read_record_set(warm)  # compile (or load) the walker first
    directory = tmp / "decode"
    synthetic_set(directory, DECODE_RECORDS)
    size = sum(p.stat().st_size for p in directory.glob("cpu*"))
    started = time.perf_counter()
    rs = read_record_set(directory)
    decoded = time.perf_counter() - started
    # The compiled pass alone, on memory already touched: page faults on
    # fresh memory cost much of the end-to-end time in a VM.
    cpu0 = np.fromfile(directory / "cpu0", dtype=np.uint8)
    out = np.empty(len(cpu0) // 24, dtype=DECODED)
    for _ in range(2):
        started = time.perf_counter()
        walked = len(_scan_file(cpu0, sys.byteorder == "big", 0, out)[0])
        scan_s = time.perf_counter() - started
    started = time.perf_counter()
    analyse(rs)
    analysed = time.perf_counter() - started
    started = time.perf_counter()
    ordered = len(rs.records)
    order_s = time.perf_counter() - started
    n = len(rs.unordered)
    assert ordered == n
    return {"records": n, "bytes": size, "decode_s": decoded, "decode_records_per_s": n / decoded,
            "scan_records_per_s": walked / scan_s, "order_s": order_s, "analyse_s": analysed,
            "report_records_per_s": n / (decoded + analysed)}  # fmt: skip


def write_report(data: dict) -> None:
    rows = data["slowdown"]["rows"]
    ours = rows["mtrace-live aggregation, pid filter"]["ratio"]
    bpftrace = rows["bpftrace count(), six tracepoints"]["ratio"]
    met = "met" if ours <= 1.3 and ours < bpftrace else "NOT met"
    decode = data["decode"]
    lines = [
        "# Performance of kernel kmem tracing",
        "",
        "Written by `make bench` (`bench/kmem_bench.py`); numbers from one run.",
        "",
        f"Machine: {data['machine']}.",
        "",
        "## Slowdown of an allocation-heavy loop",
        "",
        f"`kmem_exerciser` makes {data['slowdown']['pairs']} socket()/close() and as many "
        "pipe()/close() pairs and times its own loop; median of "
        f"{len(rows['untraced']['samples'])} runs per configuration, run in alternating order.",
        "",
        "| configuration | loop (s) | vs untraced |",
        "|---|---:|---:|",
    ]
    lines += [
        f"| {name} | {row['median_s']:.3f} | {row['ratio']:.2f}x |" for name, row in rows.items()
    ]
    lines += [
        "",
        f"Target: mtrace-live aggregation at most 1.3x untraced and below bpftrace: **{met}** "
        f"({ours:.2f}x against bpftrace's {bpftrace:.2f}x).",
        "",
        "mtrace-live filters allocations by pid in the kernel but must look up every free "
        "system-wide (frees are matched by pointer, whoever frees), so its cost is "
        "allocation-side map updates plus one hash lookup per free anywhere; bpftrace "
        "`count()` only bumps a per-CPU counter. perf stat counts in the kernel without BPF.",
        "",
        "## Record throughput",
        "",
        f"Under `record`, each run wrote {data['slowdown']['records_per_run']} records at "
        f"{data['slowdown']['records_per_s']:,.0f} records/s of loop time, "
        f"{data['slowdown']['records_lost']} lost (the ring buffer never filled).",
        "",
        "## Report throughput",
        "",
        f"A synthetic record set of {decode['records']:,} records ({decode['bytes'] / 1e6:.0f} MB, "
        "kmalloc/kfree and cache pairs on two CPUs, written by the tracer's own encoder):",
        "",
        "| step | seconds | records/s |",
        "|---|---:|---:|",
        f"| decode (walk every file, read every field) | {decode['decode_s']:.2f} | "
        f"{decode['decode_records_per_s']:,.0f} |",
        f"| the compiled walk alone, warm memory, one file | | "
        f"{decode['scan_records_per_s']:,.0f} |",
        f"| order all records by sequence number (`RecordSet.records`) | {decode['order_s']:.2f} "
        f"| {decode['records'] / decode['order_s']:,.0f} |",
        f"| decode + analysis (the whole `report`: pointer matching in sequence order, "
        "per call site) | "
        f"{decode['decode_s'] + decode['analyse_s']:.2f} | {decode['report_records_per_s']:,.0f} |",
        "",
        f"Target: decode at least 20 M records/s: **"
        f"{'met' if decode['decode_records_per_s'] >= 20e6 else 'NOT met'}** end to end; the "
        "compiled walk itself is well above it. End to end, most of the time goes to the first "
        "touch of fresh memory (the file read and the decoded array, about 1.6 GB here), which "
        "costs far more in this Firecracker VM than on bare metal and varies from run to run. "
        "Decoding in fixed-size chunks into one reused buffer would keep the memory warm and "
        "bounded; the analysis (two sorts of every kernel record) is the next cost.",
        "",
    ]
    (REPO / "docs" / "kmem-performance.md").write_text("\n".join(lines))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        print("kmem slowdown ...", file=sys.stderr)
        slow = slowdown(tmp)
        print("report throughput ...", file=sys.stderr)
        decode = decode_throughput(tmp)
    data = {"slowdown": slow, "decode": decode, "machine": machine()}
    out = BUILD / "bench-kmem.json"
    out.write_text(json.dumps(data, indent=2))
    write_report(data)
    print(f"wrote {out} and docs/kmem-performance.md", file=sys.stderr)


if __name__ == "__main__":
    if sys.argv[1:] == ["--rewrite"]:
        write_report(json.loads((BUILD / "bench-kmem.json").read_text()))
    else:
        main()
