"""``make soak``: hours of churn under ``serve``, and what the tracers did.

Two tracers run side by side for SOAK_MINUTES (default 30) while the churn
workload (tests/workloads/churn.c) starts and ends processes by the thousand,
threads, dlopen/dlclose, fork/exec and allocation bursts, and other programs
(``ls``, in a shell loop: NEIGHBOURS) start beside it, so that pids the churn
used go to programs of other names:
  - ``serve`` system-wide (the default), and
  - ``serve --pid`` of the churn (which follows its forks),
with bpftrace beside them counting the churn's allocations as the kernel
sees them (uprobes by process name, nested calls left out as mtrace-live
leaves them out). Every SAMPLE seconds each tracer is scraped, its RSS read
and its BPF maps' entries counted. At the end:
  - each tracer's ``mtrace_alloc_calls`` of the churn's process name equals
    bpftrace's count, and is at least what the churn says it called itself
    (the churn runs as a copy named churnPID, this run's own: no other
    process on the machine shares its name);
  - the label caps held (``--max-processes``, ``--top-stacks``,
    ``--top-functions``, each plus ``other``) and no BPF map was full;
  - the tracers stopped with exit 0 and printed no traceback, left no zombie
    child, and no program or probe of theirs stayed in the kernel;
  - (runs of 10 minutes or more) RSS grew at most 5% from minute 5 to the end.

    make soak                      # 30 minutes; writes docs/reliability.md's soak section
    make soak SOAK_MINUTES=1       # a short run (the docs are left alone below 10 minutes)

tests/privileged/test_soak.py runs it for 60 seconds in ``make test``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mtrace_live.tracer.bpf import bpf_syscalls
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build"
MTRACE = [sys.executable, "-m", "mtrace_live.tracer.cli"]
SERVE_READY = "serving metrics at"
BPFTRACE_READY = "bpftrace-ready"
NAME = f"churn{os.getpid()}"[:15]  # the churn's process name (comm), this run's own
NEIGHBOURS = ["sh", "-c", "while :; do ls / > /dev/null; done"]  # programs of other names
CAPS = {"process": 50, "stack": 20, "function": 20}  # serve's defaults, each plus "other"
RSS_MINUTE = 5  # RSS growth is measured from here to the end
RSS_GROWTH = 0.05
# The frame store (frames.bpf.c) keeps every distinct stack for the trace's
# life; once full, a stack not stored is counted (mtrace_alloc_table_dropped
# {table="frames"}) and its calls aggregated by call site alone.
COUNTED_WHEN_FULL = {"alloc_frame_cla"}
HASH_MAPS = {1, 5, 9, 10}  # hash, per-CPU hash, LRU hash, LRU per-CPU hash
# The allocating functions bpftrace counts at their return, as mtrace-live
# does: a call inside another one (realloc of NULL calls malloc) is the outer
# call's; aligned_alloc is memalign's address in glibc 2.36, and reallocarray
# jumps to realloc.
ALLOCATING = ("malloc", "calloc", "realloc", "memalign", "valloc", "pvalloc")


@dataclass
class Sample:
    seconds: float  # since the churn was released
    rss_kib: int
    series: int  # the samples one scrape held
    labels: dict[str, int]  # capped label -> values seen
    maps: dict[str, tuple[int, int]]  # map name -> (entries, max entries)


@dataclass
class Tracer:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    err: Path
    programs: set[int] = field(default_factory=set)
    samples: list[Sample] = field(default_factory=list)
    zombies: int = 0  # most zombie children seen at once
    exit_code: int | None = None
    final: dict[str, float] = field(default_factory=dict)  # the churn's figures at the end
    log: Path | None = None  # each sample as a JSON line


@dataclass
class Result:
    seconds: float
    churn: dict[str, int]
    bpftrace: int
    tracers: list[Tracer]

    def failures(self) -> list[str]:
        """Every target the run missed, one line each."""
        failed = self.churn["failures"]
        found = [f"the churn failed {failed} times"] if failed else []
        own = self.churn["mallocs"] + self.churn["callocs"]
        for tracer in self.tracers:
            found += [f"{tracer.name}: {what}" for what in tracer_failures(tracer, self, own)]
        return found


def tracer_failures(tracer: Tracer, result: Result, own: int) -> Iterator[str]:
    calls = tracer.final.get("alloc_calls")
    if calls != result.bpftrace:
        yield f'alloc_calls{{process="{NAME}"}} {calls}, bpftrace {result.bpftrace}'
    if calls is None or calls < own:
        yield f"alloc_calls {calls} below the churn's own {own}"
    if tracer.exit_code != 0:
        yield f"exit {tracer.exit_code}"
    err = tracer.err.read_text(errors="replace")
    if "Traceback" in err:
        yield "printed a traceback"
    if tracer.zombies:
        yield f"{tracer.zombies} zombie children"
    for sample in tracer.samples:
        for label, count in sample.labels.items():
            if count > CAPS[label] + 1:
                yield f"{count} values of label {label} at {sample.seconds:.0f} s"
        for name, (entries, most) in sample.maps.items():
            if entries >= most and name not in COUNTED_WHEN_FULL:
                yield f"map {name} full ({entries}) at {sample.seconds:.0f} s"
    yield from rss_failures(tracer, result.seconds)
    if tracer.programs & set(bpf_syscalls.program_ids()):
        yield "BPF programs left loaded after the exit"


def rss_failures(tracer: Tracer, seconds: float) -> Iterator[str]:
    if seconds < 600:
        return  # too short to tell growth from warming up
    after = [s for s in tracer.samples if s.seconds >= RSS_MINUTE * 60]
    if len(after) >= 2 and after[-1].rss_kib > (1 + RSS_GROWTH) * after[0].rss_kib:
        yield f"RSS grew from {after[0].rss_kib} KiB to {after[-1].rss_kib} KiB after minute 5"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(path: Path, needle: str, proc: subprocess.Popen[bytes], what: str) -> None:
    """Until ``needle`` is in ``path`` (a guard against a hang, not a measure)."""
    for _ in range(1200):
        if needle in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"{what} ended: {path.read_text(errors='replace')[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError(f"{what} never got ready")


def start_serve(name: str, args: list[str], tmp: Path) -> Tracer:
    port = free_port()
    err = tmp / f"{name}.err"
    with open(err, "wb") as sink:
        proc = subprocess.Popen([*MTRACE, "serve", "--listen", f"127.0.0.1:{port}", *args],
                                stdout=sink, stderr=sink)  # fmt: skip
    wait_for(err, SERVE_READY, proc, name)
    log = tmp / f"{name.replace(' ', '')}.samples"
    log.unlink(missing_ok=True)
    tracer = Tracer(name, proc, port, err, log=log)
    tracer.programs = programs_of(proc.pid)
    return tracer


def start_bpftrace(libc: Path, tmp: Path) -> tuple[subprocess.Popen[bytes], Path]:
    entries = ",".join(f"uprobe:{libc}:{name}" for name in ALLOCATING)
    returns = ",".join(f"uretprobe:{libc}:{name}" for name in ALLOCATING)
    script = tmp / "churn.bt"
    script.write_text(
        f'BEGIN {{ printf("{BPFTRACE_READY}\\n"); }}\n'
        f'{entries} /comm == "{NAME}"/ {{ @depth[tid]++; }}\n'
        f'{returns} /comm == "{NAME}" && @depth[tid] > 0/ {{\n'
        "  if (@depth[tid] == 1 && retval != 0) { @allocs = count(); }\n"
        "  @depth[tid]--;\n"
        "  if (@depth[tid] == 0) { delete(@depth[tid]); }\n"
        "}\n"
        f'uprobe:{libc}:posix_memalign /comm == "{NAME}"/ {{ @depth[tid]++; }}\n'
        f'uretprobe:{libc}:posix_memalign /comm == "{NAME}" && @depth[tid] > 0/ {{\n'
        "  if (@depth[tid] == 1 && retval == 0) { @allocs = count(); }\n"
        "  @depth[tid]--;\n"
        "  if (@depth[tid] == 0) { delete(@depth[tid]); }\n"
        "}\n"
        "interval:s:1 { print(@allocs); }\n"
        "END { clear(@depth); }\n"
    )
    out = tmp / "bpftrace.out"
    with open(out, "wb") as sink:
        proc = subprocess.Popen(["bpftrace", "-f", "json", str(script)], stdout=sink, stderr=sink)
    wait_for(out, BPFTRACE_READY, proc, "bpftrace")
    return proc, out


def stop_bpftrace(proc: subprocess.Popen[bytes], out: Path) -> int:
    """bpftrace's count once the churn has ended, then bpftrace killed.

    The count is the second print after now: the first may have read its map
    before now. bpftrace's own exit is not waited for: on a busy machine it
    has taken over 120 s to detach."""
    seen = len(printed_counts(out))
    for _ in range(1200):
        counts = printed_counts(out)
        if len(counts) >= seen + 2:
            proc.kill()
            proc.wait()
            return counts[seen + 1]
        if proc.poll() is not None:
            raise RuntimeError(f"bpftrace ended: {out.read_text(errors='replace')[-2000:]}")
        time.sleep(0.1)
    raise RuntimeError("bpftrace printed no count")


def printed_counts(out: Path) -> list[int]:
    """Each ``@allocs`` bpftrace printed, in order."""
    counts = []
    for line in out.read_text(errors="replace").splitlines():
        if line.startswith("{") and line.endswith("}"):
            record = json.loads(line)
            if record.get("type") == "map" and "@allocs" in record.get("data", {}):
                counts.append(int(record["data"]["@allocs"]))
    return counts


def programs_of(pid: int) -> set[int]:
    return {int(fields["prog_id"]) for fields in fdinfo(pid, "anon_inode:bpf-prog")}


def fdinfo(pid: int, kind: str) -> Iterator[dict[str, str]]:
    """The fdinfo fields of each descriptor of ``kind`` process ``pid`` holds."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd) != kind:
                continue
            info = Path(f"/proc/{pid}/fdinfo/{fd.name}").read_text()
        except OSError:
            continue
        pairs = (line.split(":", 1) for line in info.splitlines() if ":" in line)
        yield {key.strip(): value.strip() for key, value in pairs}


def possible_cpus() -> int:
    text = Path("/sys/devices/system/cpu/possible").read_text().strip()
    return max(int(part.split("-")[-1]) for part in text.split(",")) + 1


def map_entries(pid: int) -> dict[str, tuple[int, int]]:
    """(entries, max entries) of each hash map process ``pid`` holds, by name."""
    found = {}
    for fields in fdinfo(pid, "anon_inode:bpf-map"):
        if int(fields.get("map_type", -1)) not in HASH_MAPS:
            continue
        fd = bpf_syscalls.map_fd(int(fields["map_id"]))
        if fd is None:
            continue
        try:
            info = bpf_syscalls.map_info(fd)
            if info is None:
                continue
            per_cpu = info.type in (5, 10)
            cpus = possible_cpus() if per_cpu else 1
            reader = bpf_syscalls.BatchReader(fd, info.key_size, info.value_size,
                                              info.max_entries, cpus)  # fmt: skip
            read = reader.read()
            if read is not None:
                found[info.name] = (len(read[0]), info.max_entries)
        finally:
            os.close(fd)
    return found


def rss_kib(pid: int) -> int:
    match = re.search(r"^VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(match.group(1)) if match else 0


PER_PROCESS = {"process", "allocator", "allocator_lib"}


def scrape(port: int) -> tuple[int, dict[str, int], dict[str, float]]:
    """The samples a scrape held, the values of each capped label, and the
    churn's own figures."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:
        text = response.read().decode()
    series = 0
    values: dict[str, set[str]] = {label: set() for label in CAPS}
    churn: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series += 1
            for label, value in sample.labels.items():
                if label in values:
                    values[label].add(value)
            # the churn's per-process families (process, and its allocator's labels)
            if sample.labels.get("process") == NAME and set(sample.labels) <= PER_PROCESS:
                churn[sample.name.removeprefix("mtrace_").removesuffix("_total")] = sample.value
            elif sample.name == "mtrace_alloc_table_dropped_total":  # counted, for the report
                churn[f"dropped_{sample.labels['table']}"] = sample.value
    return series, {label: len(v) for label, v in values.items()}, churn


def zombies_of(pid: int) -> int:
    count = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_bytes().rpartition(b") ")[2].split()
        except OSError:
            continue
        count += fields[0] == b"Z" and int(fields[1]) == pid
    return count


def sample(tracer: Tracer, seconds: float, with_maps: bool) -> None:
    series, labels, churn = scrape(tracer.port)
    maps = map_entries(tracer.proc.pid) if with_maps else {}
    tracer.samples.append(Sample(seconds, rss_kib(tracer.proc.pid), series, labels, maps))
    if tracer.log is not None:
        with open(tracer.log, "a") as log:  # to follow a long run as it goes
            print(json.dumps(dataclasses.asdict(tracer.samples[-1])), file=log)
    tracer.zombies = max(tracer.zombies, zombies_of(tracer.proc.pid))
    tracer.final = churn


def libc_of(pid: int) -> Path:
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        path = line.split(maxsplit=5)[5:] or [""]
        if re.search(r"/libc[.-][^/]*so", path[0]):
            return Path(path[0])
    raise RuntimeError(f"process {pid} maps no libc")


def soak(seconds: float, tmp: Path, every: float = 10.0, maps_every: float = 60.0,
         neighbours: bool = True, wraps: int = 0) -> Result:  # fmt: skip
    """Run the churn for ``seconds`` under both tracers and bpftrace, and
    (``neighbours``) the programs of other names beside it; past ``seconds``,
    until the pids it is given have wrapped ``wraps`` times (tests/workloads/
    churn.c bounds that at 20 times ``seconds``)."""
    program = tmp / NAME
    shutil.copy2(BUILD / "churn", program)
    argv = [str(program), str(BUILD / "libcfi_plugin.so"), str(seconds), str(wraps)]
    churn = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    tracers: list[Tracer] = []
    bpftrace = None
    others = None
    try:
        assert churn.stdout is not None and churn.stdin is not None
        if churn.stdout.readline() != b"ready\n":
            raise RuntimeError("the churn did not start")
        tracers.append(start_serve("serve", [], tmp))
        tracers.append(start_serve("serve --pid", ["--pid", str(churn.pid)], tmp))
        bpftrace, out = start_bpftrace(libc_of(churn.pid), tmp)
        churn.stdin.write(b"go")
        churn.stdin.close()
        others = subprocess.Popen(NEIGHBOURS, stdout=subprocess.DEVNULL) if neighbours else None
        follow(churn, tracers, every, maps_every)
        if others is not None:
            others.kill()
            others.wait()
        totals = json.loads(churn.stdout.read())
        churn.stdout.close()
        settle(tracers)
        counted = stop_bpftrace(bpftrace, out)
        bpftrace = None
        for tracer in tracers:
            tracer.proc.send_signal(signal.SIGTERM)
            tracer.exit_code = tracer.proc.wait(timeout=300)
        wait_unloaded(tracers)
        return Result(seconds, totals, counted, tracers)
    finally:
        rest = [p for p in (bpftrace, others) if p is not None]
        for proc in [churn, *(t.proc for t in tracers), *rest]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def follow(churn: subprocess.Popen[bytes], tracers: list[Tracer], every: float,
           maps_every: float) -> None:  # fmt: skip
    """Sample the tracers every ``every`` seconds (their maps every
    ``maps_every``) until the churn ends."""
    start = time.monotonic()
    next_maps = start
    while True:
        try:
            churn.wait(timeout=every)
            return
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        for tracer in tracers:
            sample(tracer, now - start, now >= next_maps)
        if now >= next_maps:
            next_maps = now + maps_every


def settle(tracers: list[Tracer]) -> None:
    """The last samples, once each tracer's page shows the churn's final
    counts (the same in three renders in a row) and its maps."""
    for tracer in tracers:
        seen: list[float | None] = []
        for _ in range(120):  # a guard against a hang, not a measure
            seen.append(scrape(tracer.port)[2].get("alloc_calls"))
            if len(seen) >= 3 and seen[-1] is not None and len(set(seen[-3:])) == 1:
                break
            time.sleep(1)
        last = tracer.samples[-1].seconds if tracer.samples else 0.0
        sample(tracer, last + 1, True)


def wait_unloaded(tracers: list[Tracer]) -> None:
    """Until the tracers' programs are unloaded (their detachers closed the
    perf events), or a minute passed (then the verdict says so)."""
    ours = set().union(*(t.programs for t in tracers))
    for _ in range(600):
        if not ours & set(bpf_syscalls.program_ids()):
            return
        time.sleep(0.1)


# ---- the report ------------------------------------------------------------
DOC = ROOT / "docs" / "reliability.md"
PLOT = ROOT / "docs" / "soak.svg"
BEGIN, END = "<!-- soak: written by make soak -->", "<!-- /soak -->"
PLOTTED_MAPS = ("alloc_procs", "thread_times", "brk_last", "alloc_frame_cla")


def report(result: Result) -> str:
    """docs/reliability.md's soak section."""
    churn = result.churn
    lines = [
        BEGIN,
        f"Last run: {time.strftime('%Y-%m-%d')}, {result.seconds / 60:.0f} minutes "
        f"(`make soak SOAK_MINUTES={result.seconds / 60:g}`), on this machine.",
        "",
        f"The churn made {churn['processes']:,} forked processes, {churn['execs']:,} exec'd ones, "
        f"{churn['threads']:,} threads, {churn['dlopens']:,} dlopen/dlclose pairs and "
        f"{churn['mallocs'] + churn['callocs']:,} allocations of its own in "
        f"{churn['rounds']:,} rounds. bpftrace counted {result.bpftrace:,} allocations by its "
        "processes (libc's own included).",
        "",
        "| | " + " | ".join(f"`{t.name}`" for t in result.tracers) + " |",
        "|---|" + "---|" * len(result.tracers),
    ]
    for label, cell in ROWS:
        lines.append(f"| {label} | " + " | ".join(cell(t, result) for t in result.tracers) + " |")
    failures = result.failures()
    lines += ["", "Verdict: " + ("every target met." if not failures else "; ".join(failures))]
    lines += ["", "![RSS, series and map entries over the soak](soak.svg)", END]
    return "\n".join(lines)


def _rss_growth(tracer: Tracer, _: Result) -> str:
    after = [s for s in tracer.samples if s.seconds >= RSS_MINUTE * 60]
    if len(after) < 2:
        return "(run too short)"
    first, last = after[0].rss_kib, after[-1].rss_kib
    return f"{first / 1024:.0f} → {last / 1024:.0f} MiB ({100 * (last - first) / first:+.1f}%)"


def _map_fill(tracer: Tracer, _: Result) -> str:
    most: dict[str, tuple[int, int]] = {}
    for sample in tracer.samples:
        for name, (entries, capacity) in sample.maps.items():
            if entries > most.get(name, (-1, 0))[0]:
                most[name] = (entries, capacity)
    busiest = sorted(most.items(), key=lambda item: -item[1][0] / item[1][1])[:4]
    return ", ".join(f"{name} {n:,}/{cap:,}" for name, (n, cap) in busiest)


ROWS = (
    ("`mtrace_alloc_calls` of the churn (bpftrace)",
     lambda t, r: f"{t.final.get('alloc_calls', 0):,.0f} ({r.bpftrace:,})"),
    ("RSS from minute 5 to the end", _rss_growth),
    ("samples per scrape (first, last)",
     lambda t, _: f"{t.samples[0].series}, {t.samples[-1].series}" if t.samples else "-"),
    ("most label values (process, stack, function)",
     lambda t, _: ", ".join(str(max((s.labels[k] for s in t.samples), default=0))
                            for k in ("process", "stack", "function"))),
    ("fullest hash maps (most entries seen)", _map_fill),
    ("allocations a table had no room for (outstanding, stacks, frames)",
     lambda t, _: ", ".join(f"{t.final.get(f'dropped_{k}', 0):,.0f}"
                            for k in ("outstanding", "stacks", "frames"))),
    ("exit on SIGTERM; zombie children; programs left", lambda t, _: (
        f"{t.exit_code}; {t.zombies}; "
        f"{len(t.programs & set(bpf_syscalls.program_ids()))}")),
)  # fmt: skip


def plot(result: Result) -> str:
    """An SVG of each tracer's RSS, samples per scrape and map entries over time."""
    panels = [
        ("RSS (MiB)", lambda s: s.rss_kib / 1024, False),
        ("samples per scrape", lambda s: s.series, False),
        ("map entries: " + ", ".join(PLOTTED_MAPS), None, True),
    ]
    width, height, left = 720, 170, 60
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height * len(panels)}" font-family="sans-serif" font-size="11">'
    ]
    span = max((s.seconds for t in result.tracers for s in t.samples), default=1) / 60 or 1
    colours = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf")
    for row, (title, value, maps) in enumerate(panels):
        series = []
        for tracer in result.tracers:
            if maps:
                for name in PLOTTED_MAPS:
                    points = [(s.seconds / 60, s.maps[name][0]) for s in tracer.samples
                              if name in s.maps]  # fmt: skip
                    series.append((f"{tracer.name}: {name}", points))
            else:
                series.append((tracer.name, [(s.seconds / 60, value(s)) for s in tracer.samples]))
        parts += _panel(title, series, row * height, width, height, left, span, colours)
    parts.append("</svg>")
    return "\n".join(parts)


def _panel(title: str, series: list[tuple[str, list[tuple[float, float]]]], top: int,
           width: int, height: int, left: int, span: float,
           colours: tuple[str, ...]) -> list[str]:  # fmt: skip
    peak = max((y for _, points in series for _, y in points), default=1) or 1
    inner_w, inner_h = width - left - 170, height - 45
    x0, y0 = left, top + 20 + inner_h
    out = [f'<text x="{left}" y="{top + 14}">{title}</text>',
           f'<line x1="{x0}" y1="{y0}" x2="{x0 + inner_w}" y2="{y0}" stroke="black"/>',
           f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y0 - inner_h}" stroke="black"/>',
           f'<text x="{x0 - 4}" y="{y0 - inner_h + 4}" text-anchor="end">{peak:,.0f}</text>',
           f'<text x="{x0 - 4}" y="{y0}" text-anchor="end">0</text>',
           f'<text x="{x0 + inner_w}" y="{y0 + 14}" text-anchor="end">'
           f"{span:.0f} min</text>"]  # fmt: skip
    for index, (name, points) in enumerate(series):
        colour = colours[index % len(colours)]
        path = " ".join(f"{x0 + inner_w * x / span:.1f},{y0 - inner_h * y / peak:.1f}"
                        for x, y in points)  # fmt: skip
        out.append(f'<polyline fill="none" stroke="{colour}" points="{path}"/>')
        out.append(f'<text x="{x0 + inner_w + 8}" y="{top + 30 + 13 * index}" '
                   f'fill="{colour}">{name}</text>')  # fmt: skip
    return out


def write_docs(result: Result) -> None:
    text = DOC.read_text()
    section = report(result)
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n## Hours of churn: `make soak`\n\n" + section + "\n"
    DOC.write_text(text)
    PLOT.write_text(plot(result))


def main() -> int:
    minutes = float(os.environ.get("SOAK_MINUTES", "30"))
    out = BUILD / "soak"
    out.mkdir(parents=True, exist_ok=True)
    result = soak(minutes * 60, out, every=10.0 if minutes >= 10 else 5.0)
    (out / "report.md").write_text(report(result) + "\n")
    (out / "soak.svg").write_text(plot(result))
    if minutes >= 10:
        write_docs(result)
    print(report(result))
    failures = result.failures()
    for line in failures:
        print(f"soak: {line}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
