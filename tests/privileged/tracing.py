"""Helpers for running a workload held at a gate while tracers attach."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from mtrace_live.tracer.bpf.detacher import DETACHER_NAME

from tests.unit.profile_proto import parsed

BPFTRACE_READY = "mtrace-live-test-ready"


T = TypeVar("T")


class Reaper:
    """Kills, at the end of a `with` block, every process still running, so a
    failing test leaves no tracer attached and no workload waiting."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Reaper:
        return self

    def add(self, proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
        self.procs.append(proc)
        return proc

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class GatedWorkload:
    """A command started under `sh`, waiting on a FIFO until released.

    `sh` reads the FIFO and then execs the command, so the pid tracers follow
    is the command's own pid from its first instruction on.
    """

    def __init__(self, argv: list[str], tmp: Path, reaper: Reaper) -> None:
        self.fifo = tmp / "gate"
        os.mkfifo(self.fifo)
        script = 'read _ < "$0"; exec "$@"'
        self.proc = reaper.add(subprocess.Popen(["/bin/sh", "-c", script, str(self.fifo), *argv]))
        self.pid = self.proc.pid

    def release(self) -> None:
        with open(self.fifo, "w") as gate:
            gate.write("go\n")

    def wait(self, timeout: float = 120) -> int:
        return self.proc.wait(timeout=timeout)


def wait_until(ready: Callable[[], bool], what: str) -> None:
    """Until ``ready()`` (a guard against a hang, not a measure)."""
    for _ in range(600):
        if ready():
            return
        time.sleep(0.1)
    raise AssertionError(f"never: {what}")


def perf_events(pid: int) -> int:
    """How many perf events process ``pid`` holds."""
    count = 0
    for entry in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/{pid}/fd/{entry}") == "anon_inode:[perf_event]"
    return count


def nm_symbols(path: Path, dynamic: bool = False) -> dict[str, tuple[int, int, str]]:
    """What ``nm -S --defined-only`` lists in ``path`` (``-D``, its dynamic
    symbols, with ``dynamic``), by name less its version: (address, size,
    nm's letter for its kind), the size 0 where nm gives none; of a name
    listed in several versions, its default one (``name@@VERSION``)."""
    option = ["-D"] if dynamic else []
    listed = subprocess.run(["nm", "-S", "--defined-only", *option, str(path)],
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    found: dict[str, tuple[int, int, str]] = {}
    for fields in map(str.split, listed.splitlines()):
        if len(fields) in (3, 4):
            name, _, version = fields[-1].partition("@")
            symbol = (int(fields[0], 16), int(fields[1], 16) if len(fields) == 4 else 0, fields[-2])
            if version.startswith("@") or name not in found:
                found[name] = symbol
    return found


def wait_for_line(path: Path, needle: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and needle in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise AssertionError(f"tracer exited early: {path.read_text(errors='replace')}")
        time.sleep(0.1)
    raise AssertionError(f"no {needle!r} in {path} after {timeout}s")


def end_held_workload(
    proc: subprocess.Popen[bytes], truth_file: Path, out: Path, tracer: subprocess.Popen[bytes]
) -> dict[str, Any]:
    """Let a workload run with ``--hold`` end once the trace (``-o json`` into
    ``out``) has delivered an event line of its process for each call its
    truth says it made; its truth. A process the trace did not start is
    never held, and its maps (to name its frames) are read when its first
    call's request for its tables, made before any of its events, is
    handled: one that ended at once could be gone before then."""
    assert proc.stdin is not None and proc.stdout is not None
    assert proc.stdout.readline() == b"done\n"
    proc.stdout.close()
    truth: dict[str, Any] = json.loads(truth_file.read_text())
    needle, wanted = f'"pid":{truth["pid"]},', sum(site["calls"] for site in truth["sites"])
    deadline = time.monotonic() + 120
    while out.read_text(errors="replace").count(needle) < wanted:
        assert tracer.poll() is None and time.monotonic() < deadline, "its events never came"
        time.sleep(0.1)
    proc.stdin.write(b"\n")
    proc.stdin.close()
    assert proc.wait(timeout=120) == 0
    return truth


def bpftrace_counts(
    libc: Path, probes: list[str], pid: int, tmp: Path
) -> tuple[subprocess.Popen[bytes], Path]:
    """Start bpftrace counting `probes` of `libc` for `pid` and its children.

    bpftrace 0.17 cannot expand `libc:*` on glibc (it fails on an nptl probe),
    so every probe is named.
    """
    attach = ",".join(f"usdt:{libc}:libc:{name}" for name in probes)
    return start_bpftrace(
        "tracepoint:task:task_newtask /pid == $1 || @follow[pid]/ {\n"
        "  if ((args->clone_flags & 0x10000) == 0) { @follow[args->pid] = 1; }\n"
        "}\n"
        f"{attach} /pid == $1 || @follow[pid]/ {{ @hits[probe] = count(); }}\n"
        "END { clear(@follow); }\n",
        pid,
        tmp,
    )


KMEM_TRACEPOINTS = ("kmalloc", "kfree", "kmem_cache_alloc", "kmem_cache_free", "mm_page_alloc",
                    "mm_page_free", "mm_page_free_batched")  # fmt: skip


def bpftrace_kmem_counts(pid: int, tmp: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """Start bpftrace counting the kmem tracepoints that fire in `pid`'s context."""
    attach = ",".join(f"tracepoint:kmem:{name}" for name in KMEM_TRACEPOINTS)
    return start_bpftrace(f"{attach} /pid == $1/ {{ @hits[probe] = count(); }}\n", pid, tmp)


def watch_frees(pid: int, cache: str, tmp: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """Start bpftrace following the objects of slab ``cache`` that ``pid``
    allocates, printing every 100 ms how many of them were freed, in any
    context (RCU callbacks included): what a test waits on before it stops
    a trace that must see those frees."""
    body = (
        f'tracepoint:kmem:kmem_cache_alloc /pid == $1 && str(args->name) == "{cache}"/ '
        "{ @live[args->ptr] = 1; }\n"
        "tracepoint:kmem:kmem_cache_free /@live[args->ptr]/ "
        "{ delete(@live[args->ptr]); @freed = count(); }\n"
        "interval:ms:100 { print(@freed); }\n"
        "END { clear(@live); }\n"
    )
    return start_bpftrace(body, pid, tmp, "watch")


def wait_freed(proc: subprocess.Popen[bytes], out: Path, expected: int) -> None:
    """Until the watcher of ``watch_frees`` has seen ``expected`` frees, less
    any runs of its programs the kernel skipped (a guard against a hang, not
    a measure)."""

    def freed() -> int:
        counts = [int(json.loads(line)["data"]["@freed"])
                  for line in out.read_text(errors="replace").splitlines()
                  if line.startswith('{"type": "map"') and "@freed" in line]  # fmt: skip
        return counts[-1] if counts else 0

    wait_until(lambda: freed() + skipped_runs_of(proc.pid) >= expected,
               f"{expected} objects freed (seen: {out})")  # fmt: skip


def start_bpftrace(body: str, pid: int, tmp: Path,
                   name: str = "count") -> tuple[subprocess.Popen[bytes], Path]:  # fmt: skip
    script = tmp / f"{name}.bt"
    # bpftrace prints "attached_probes" before it attaches; BEGIN runs after.
    script.write_text(f'BEGIN {{ printf("{BPFTRACE_READY}\\n"); }}\n{body}')
    out = tmp / f"bpftrace-{name}.out"
    with open(out, "wb") as sink:
        proc = subprocess.Popen(
            ["bpftrace", "-f", "json", str(script), str(pid)], stdout=sink, stderr=sink
        )
    return proc, out


def interrupt_bpftrace(proc: subprocess.Popen[bytes]) -> None:
    """Stop bpftrace (SIGINT: it prints its maps) and wait for its exit.

    bpftrace 0.17 can miss the SIGINT: its handler sets a flag that its loop
    reads only when epoll_wait fails with EINTR, and epoll_wait returns 0
    instead when its 100 ms had run out before the signal came (the signal
    came while the loop ran, or while the woken bpftrace waited for a CPU,
    as on a loaded machine): it then polls until another signal comes.
    While it still waits there, each second, a SIGUSR1 (which it catches:
    its maps printed at most) interrupts that wait, and the loop sees the
    flag. A hung test once took that for a slow bpftrace (over 60 s)."""
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 300  # a guard against a hang, not a measure
    while True:
        try:
            proc.wait(timeout=1)
            return
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                proc.kill()
                raise
        if _polls_with_sigusr1_caught(proc.pid):
            proc.send_signal(signal.SIGUSR1)


def _polls_with_sigusr1_caught(pid: int) -> bool:
    """Process ``pid`` sleeps in epoll_wait and has a handler for SIGUSR1
    (a SIGUSR1 sent before bpftrace sets its handlers would end it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        waits = Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return False  # gone meanwhile
    found = re.search(r"^SigCgt:\s*([0-9a-f]+)$", status, re.M)
    caught = int(found.group(1), 16) if found else 0
    return waits == "do_epoll_wait" and bool(caught >> (signal.SIGUSR1 - 1) & 1)


def stop_bpftrace(proc: subprocess.Popen[bytes], out: Path) -> dict[str, int]:
    """bpftrace's counts at its end: ``@hits[probe]`` by function name, and
    ``@extra[name]`` (a script's other counts) by name."""
    interrupt_bpftrace(proc)
    counts: dict[str, int] = {}
    hits = False
    for line in out.read_text(errors="replace").splitlines():
        record = json.loads(line) if line.startswith("{") else {}
        if record.get("type") != "map":
            continue
        if "@hits" in record["data"]:
            hits = True
            counts |= {k.rsplit(":", 1)[1]: int(v) for k, v in record["data"]["@hits"].items()}
        counts |= {k: int(v) for k, v in record["data"].get("@extra", {}).items()}
    if not hits:
        raise AssertionError(f"bpftrace printed no counts: {out.read_text(errors='replace')}")
    return counts


def bpf_fdinfo(pid: int, kind: str = "bpf-prog") -> dict[int, dict[str, str]]:
    """The fdinfo fields of each BPF descriptor of ``kind`` (bpf-prog,
    bpf-map) process ``pid`` holds, by descriptor."""
    found = {}
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd) != f"anon_inode:{kind}":
                continue
            info = Path(f"/proc/{pid}/fdinfo/{fd.name}").read_text()
        except OSError:
            continue
        fields = (line.split(":", 1) for line in info.splitlines() if ":" in line)
        found[int(fd.name)] = {key.strip(): value.strip() for key, value in fields}
    return found


def program_fdinfo(pid: int) -> list[dict[str, str]]:
    """The fdinfo fields of each BPF program descriptor process ``pid`` holds."""
    return list(bpf_fdinfo(pid).values())


def bpftool_show(kind: str, ident: int) -> dict[str, Any]:
    """What bpftool says of the program or map (``kind``: prog, map) ``ident``."""
    done = subprocess.run(["bpftool", "-j", kind, "show", "id", str(ident)],
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    shown: dict[str, Any] = json.loads(done.stdout)
    return shown


def tracing_a_sleeper(
    tmp: Path,
    mtrace: list[str],
    options: list[str],
    look: Callable[[int], T],
    env: dict[str, str] | None = None,
) -> tuple[int, T]:
    """A --pid trace of a sleeping process, with ``options``: the sleeper's
    pid, and what ``look`` saw of the tracer (given its pid) once the trace
    was on; the trace then stopped, and asserted to end well."""
    err = tmp / "trace.err"
    with Reaper() as reaper:
        target = reaper.add(subprocess.Popen(["sleep", "600"]))
        with open(err, "wb") as errors:
            tracer = reaper.add(subprocess.Popen(
                [*mtrace, "--pid", str(target.pid), *options],
                stdout=subprocess.DEVNULL, stderr=errors, env=env,
            ))  # fmt: skip
        wait_for_line(err, "Ctrl-C to stop", tracer, timeout=120)
        seen = look(tracer.pid)
        tracer.send_signal(2)
        assert tracer.wait(timeout=120) == 0, err.read_text()
    return target.pid, seen


def uprobe_links(holders: list[int] | None = None) -> list[dict[str, Any]]:
    """The uprobe_multi links processes ``holders`` (default: every process)
    hold, as the kernel's fdinfo describes each: its kind (link_type), the
    holder, the program (prog_id), the file (path), the process it is for
    (pid: 0 for every process), its uprobe count (uprobe_cnt) and each
    uprobe's offset (offsets)."""
    if holders is None:
        holders = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    found = []
    for holder in holders:
        try:
            fds = list(Path(f"/proc/{holder}/fd").iterdir())
        except OSError:
            continue  # gone meanwhile
        for fd in fds:
            try:
                info = Path(f"/proc/{holder}/fdinfo/{fd.name}").read_text()
            except OSError:
                continue
            fields = dict(re.findall(r"^(\w+):\s*(.*)$", info, re.M))
            if fields.get("link_type") not in ("uprobe_multi", "uretprobe_multi"):
                continue
            offsets = re.findall(r"^\d+\s+(0x[0-9a-f]+)\s+0x[0-9a-f]+$", info, re.M)
            found.append({**fields, "holder": holder, "prog_id": int(fields["prog_id"]),
                          "pid": int(fields["pid"]), "uprobe_cnt": int(fields["uprobe_cnt"]),
                          "offsets": [int(text, 16) for text in offsets]})  # fmt: skip
    return found


def programs_of(pid: int) -> set[int]:
    """The ids of the BPF programs process ``pid`` holds: what a test asks
    of its own tracer, whatever other tools load meanwhile."""
    return {int(fields["prog_id"]) for fields in program_fdinfo(pid)}


def skipped_runs_of(pid: int) -> int:
    """The runs the kernel skipped of every BPF program process ``pid``
    holds (their ``recursion_misses``): a tracepoint whose program could
    not run because another BPF program, or a BPF map system call, was
    active on that CPU, as when an interrupt frees memory while a handler
    runs."""
    return sum(int(fields.get("recursion_misses", 0)) for fields in program_fdinfo(pid))


def gate(proc: subprocess.Popen[bytes], say: bytes, expect: bytes) -> None:
    """Write a line to a gated exerciser (if any) and expect one back (if any)."""
    assert proc.stdin is not None and proc.stdout is not None
    if say:
        proc.stdin.write(say)
        proc.stdin.flush()
    if expect:
        assert proc.stdout.readline() == expect


def finish(proc: subprocess.Popen[bytes]) -> int:
    """Let a gated exerciser exit, and close its pipes."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"end\n")
    proc.stdin.close()
    proc.stdout.close()
    return proc.wait(timeout=60)


def processes() -> list[tuple[int, bytes, bytes, int]]:
    """(pid, name, state, parent pid) of every process, from /proc/PID/stat."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            head, _, rest = stat.read_bytes().partition(b") ")
        except OSError:
            continue
        fields = rest.split()
        found.append((int(stat.parent.name), head.partition(b" (")[2], fields[0], int(fields[1])))
    return found


def detachers() -> list[int]:
    """Detachers still at work (a zombie, not yet reaped, has closed everything)."""
    return [pid for pid, name, state, _ in processes() if name == DETACHER_NAME and state != b"Z"]


def wait_for_detach() -> None:
    """Until no detacher runs (a guard against a hang, not a measure)."""
    for _ in range(600):
        if not detachers():
            return
        time.sleep(0.1)
    raise AssertionError("the perf events were never closed")


def trace_cxx_stacks(argv: list[str], find_pid: Callable[[int], int], outputs: list[str],
                     tmp: Path) -> dict[str, int]:  # fmt: skip
    """Run ``argv`` (cxx_stacks, perhaps in a chroot), trace the process
    ``find_pid`` gives for the one started (by its pid) with ``outputs``
    from its first allocation to its "done", and return what the workload
    says it did ("leaked_objects", "vector_allocs", ...). The tracer's
    summary is left in ``tmp / "summary"``, what it said in ``tmp / "mtrace.err"``."""
    from .conftest import MTRACE  # conftest imports this module

    known: dict[str, int] = {}
    with Reaper() as reaper:
        work = reaper.add(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        assert work.stdout is not None and work.stdin is not None
        assert work.stdout.readline() == b"ready\n"
        err = tmp / "mtrace.err"
        with open(err, "wb") as stderr, open(tmp / "summary", "wb") as stdout:
            tracer = reaper.add(subprocess.Popen(
                [*MTRACE, "--pid", str(find_pid(work.pid)), *outputs, "-o", "summary"],
                stdout=stdout, stderr=stderr))  # fmt: skip
        wait_for_line(err, "Ctrl-C to stop", tracer, timeout=120)
        work.stdin.write(b"x")
        work.stdin.flush()
        for line in iter(work.stdout.readline, b"done\n"):
            name, _, value = line.decode().partition(" ")
            known[name] = int(value.split()[0])
        tracer.send_signal(signal.SIGINT)
        assert tracer.wait(timeout=120) == 0, err.read_text()
        work.stdin.close()
        work.stdout.close()
        assert work.wait(timeout=60) == 0
    return known


def pprof_mappings(raw: str) -> dict[str, str]:
    """File -> build-id of each mapping ``go tool pprof -raw`` lists."""
    listed = {}
    for line in raw.partition("\nMappings\n")[2].splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[0].endswith(":"):
            listed[fields[2]] = fields[3]
    return listed


def readelf_build_id(path: str | Path) -> str:
    """The build-id ``readelf -n`` reads in the file at ``path``."""
    notes = subprocess.run(["readelf", "-n", str(path)], capture_output=True, text=True,
                           check=True).stdout  # fmt: skip
    found = re.search(r"Build ID: ([0-9a-f]+)", notes)
    assert found is not None, f"{path} has no build-id"
    return found.group(1)


def malloc_samples(profile: Path) -> Iterator[tuple[int, int, list[str]]]:
    """The malloc samples of a pprof profile the trace wrote: each one's
    process, its calls (alloc_objects) and its stack's function names."""
    for pid, calls, stack in malloc_stacks(profile):
        yield pid, calls, [name for name, _ in stack]


def malloc_stacks(profile: Path, allocator: str | None = "malloc",
                  ) -> Iterator[tuple[int, int, list[tuple[str, str]]]]:  # fmt: skip
    """``malloc_samples`` (or ``allocator``'s, None: every function's),
    each frame with its mapping's file name."""
    prof = parsed(profile.read_bytes())
    strings = prof.string_table
    objects = [strings[t.type] for t in prof.sample_type].index("alloc_objects")
    names = {f.id: strings[f.name] for f in prof.function}
    files = {m.id: strings[m.filename] for m in prof.mapping}
    frames = {loc.id: [(names[line.function_id], files.get(loc.mapping_id, ""))
                       for line in loc.line] for loc in prof.location}  # fmt: skip
    for sample in prof.sample:
        labels = {strings[label.key]: label for label in sample.label}
        if allocator is None or strings[labels["allocator"].str] == allocator:
            stack = [frame for loc in sample.location_id for frame in frames[loc]]
            yield int(labels["pid"].num), int(sample.value[objects]), stack
