"""sp-rtrace reports from real records: the kmem exerciser leaks a known
number of socket inodes on purpose, and `convert --leaks` must find them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from mtrace_live.exporters.data.symbolize import ModuleSymbols, ProcessSymbols
from mtrace_live.exporters.kmemtrace.reader import read_record_set
from mtrace_live.exporters.sprtrace import text as sprtrace
from mtrace_live.tracer.processes import sdt_glibc

from .conftest import MTRACE
from .test_kmemtrace import skipped_runs
from .tracing import Reaper, finish, gate, wait_for_line

SOCKETS, PIPES, LEAKED = 300, 100, 7


def test_convert_leaks_finds_the_sockets_the_exerciser_left_open(
    kmem_exerciser: Path, tmp_path: Path
) -> None:
    # GIVEN a record set of the gated exerciser, which leaves 7 of its 300 sockets open
    directory = tmp_path / "records"
    with Reaper() as reaper:
        argv = [str(kmem_exerciser), "--sockets", str(SOCKETS), "--pipes", str(PIPES), "--leak",
                str(LEAKED), "--out", str(tmp_path / "truth.json"), "--gated"]  # fmt: skip
        work = reaper.add(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        gate(work, b"", b"ready\n")
        err = tmp_path / "record.err"
        with open(err, "wb") as sink:
            record = reaper.add(subprocess.Popen(
                [*MTRACE, "record", "-o", str(directory), "--pid", str(work.pid)],
                stdout=sink, stderr=sink))  # fmt: skip
        wait_for_line(err, "Ctrl-C to stop", record, timeout=120)
        gate(work, b"go\n", b"done\n")
        record.send_signal(signal.SIGINT)
        assert record.wait(timeout=120) == 0, err.read_text()
        assert finish(work) == 0
    # WHEN it is converted to an sp-rtrace report with the leaks filter
    out = tmp_path / "leaks.txt"
    done = subprocess.run([*MTRACE, "convert", str(directory), "--leaks", "-o", str(out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = sprtrace.parse(out.read_text().splitlines(), str(out))
    # THEN exactly the leaked pipes are left at alloc_pipe_info: two kmalloc
    # objects each (the pipe and its buffers), freed at once on close (more
    # only if the kernel skipped some frees, and says so)
    skipped = skipped_runs(err.read_text())
    pipes = [c for c in report.calls if c.frames and c.frames[0].function == "alloc_pipe_info"]
    missed_kfree = skipped.get("tracepoint:kmem:kfree", 0)
    assert 2 * LEAKED <= len(pipes) <= 2 * LEAKED + missed_kfree, (len(pipes), missed_kfree)
    assert all(c.resource == "kmalloc" and c.function == "kmalloc" for c in pipes)
    # AND at least the leaked sockets' inodes (the others are freed by RCU
    # callbacks, some of which may come after the recording stopped)
    inodes = [c for c in report.calls if c.frames and c.frames[0].function == "sock_alloc_inode"]
    assert LEAKED <= len(inodes) <= SOCKETS and len({c.size for c in inodes}) == 1
    assert all(c.is_alloc for c in report.calls)
    # AND the leak summary it ends with counts what is left, resource by resource
    summary = out.read_text().splitlines()[-2 * len(report.resources) :]
    assert summary == sprtrace.leak_summary(report)
    header = out.read_text().splitlines()[0]
    assert f"pid={work.pid}" in header and "filter=leaks|resolve" in header
    # AND each process is a context of its own, the traced one among them
    target = next(bit for bit, name in report.contexts.items() if name == f"pid {work.pid}")
    assert all(c.context == target for c in pipes)
    # AND the JSON lines carry every record, in sequence order
    as_json = [*MTRACE, "convert", str(directory), "--to", "json"]
    lines = subprocess.run(as_json, capture_output=True, text=True, timeout=300).stdout.splitlines()
    docs = [json.loads(line) for line in lines]
    assert len(docs) == len(read_record_set(directory).records)
    assert [d["seq"] for d in docs] == sorted(d["seq"] for d in docs)
    assert sum(1 for d in docs if d.get("symbol", "").startswith("sock_alloc_inode+")) >= SOCKETS


def test_sp_rtrace_written_live_names_the_libc_sites_with_their_source_lines(
    sdt: sdt_glibc.SdtGlibc, probe_exerciser: Path, tmp_path: Path
) -> None:
    # GIVEN the probe exerciser traced with --sp-rtrace under the SDT glibc
    out, truth_file = tmp_path / "live.txt", tmp_path / "truth.json"
    done = subprocess.run(
        [*MTRACE, "run", "--sdt-glibc", "-o", "summary", "--sp-rtrace", str(out), "--",
         str(probe_exerciser), "--out", str(truth_file)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    truth = {name: p["count"] for name, p in json.loads(truth_file.read_text())["probes"].items()}
    text = out.read_text().splitlines()
    # WHEN the report is read back
    report = sprtrace.parse(text, str(out))
    # (the allocation functions' own calls, resource "memory", are checked
    # in test_allocations.py)
    calls = [c for c in report.calls if c.resource != "memory"]
    # THEN it has a call per heap and arena event the exerciser caused, and
    # every sbrk growth as a call, or as a comment when sbrk failed
    assert sum(c.function == "memory_heap_new" for c in calls) == truth["memory_heap_new"]
    assert sum(c.function == "memory_heap_free" for c in calls) == truth["memory_heap_free"]
    assert sum(c.function == "memory_arena_new" for c in calls) == truth["memory_arena_new"]
    failed = sum(1 for line in text if "failed memory_sbrk_more" in line)
    assert (
        sum(c.function == "memory_sbrk_more" for c in calls) + failed == truth["memory_sbrk_more"]
    )
    mallopts = [line for line in text if line.startswith("## [") and " memory_mallopt " in line]
    assert len(mallopts) == truth["memory_mallopt"]
    # AND each backtrace names the glibc function and source line of its probe site
    frames = [c.frames[0] for c in calls if c.frames]
    assert frames and all(f.function and f.location and ".c:" in f.location for f in frames)
    assert {f.function for f in frames if f.location.startswith("malloc.c")} >= {"sysmalloc"}
    # AND the libc's map line comes before its first backtrace, covering it
    (libc_line,) = [i for i, line in enumerate(text) if line.startswith(f": {sdt.libc}")]
    first = next(i for i, line in enumerate(text) if line.startswith("\t0x"))
    assert libc_line < first
    (_, start, end) = next(m for m in report.mmaps if m[0] == str(sdt.libc))
    assert all(start <= f.address < end for f in frames)
    # AND START is the load base, as sp-rtrace's resolver takes it: a shared
    # object's address less START is the symbol table's address
    libc = ModuleSymbols(sdt.libc)
    assert all(libc.lookup(f.address - start)[0] == f.function for f in frames)
    assert report.header["process"] == probe_exerciser.name


def test_kernel_and_user_stacks_give_the_socket_calls_their_whole_path(
    kmem_exerciser: Path, tmp_path: Path
) -> None:
    # GIVEN the gated kmem exerciser traced with stacks of depth 16
    out = tmp_path / "stacks.txt"
    with Reaper() as reaper:
        argv = [str(kmem_exerciser), "--sockets", "20", "--pipes", "0", "--out", os.devnull,
                "--gated"]  # fmt: skip
        work = reaper.add(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        gate(work, b"", b"ready\n")
        err = tmp_path / "trace.err"
        with open(err, "wb") as sink:
            trace = reaper.add(subprocess.Popen(
                [*MTRACE, "--pid", str(work.pid), "--kmem-only", "-o", "summary",
                 "--stack-depth", "16", "--sp-rtrace", str(out)],
                stdout=sink, stderr=sink))  # fmt: skip
        wait_for_line(err, "Ctrl-C to stop", trace, timeout=120)
        gate(work, b"go\n", b"done\n")
        trace.send_signal(signal.SIGINT)  # while the exerciser still runs: its maps are readable
        assert trace.wait(timeout=120) == 0, err.read_text()
        assert finish(work) == 0
    # WHEN the report is read
    report = sprtrace.parse(out.read_text().splitlines(), str(out))
    assert report.header["backtrace depth"] == "16"
    inodes = [c for c in report.calls if any(f.function == "sock_alloc_inode" for f in c.frames)]
    # THEN each socket inode's backtrace goes from the allocator up through
    # the socket() system call into the process's own libc
    assert len(inodes) >= 20
    for call in inodes:
        names = [f.function for f in call.frames]
        assert len(call.frames) <= 16
        assert {"sock_alloc", "__sys_socket"} <= set(names), names
        user = [f for f in call.frames if f.address < 1 << 63]
        assert user and "socket" in (user[0].function or ""), user
        address = user[0].address
        (module, start, _) = next(
            m for m in report.mmaps if m[1] <= address < m[2] and "libc.so" in m[0]
        )
        # the resolver's arithmetic: address - START in the module's own symbols
        function = ModuleSymbols(Path(module)).lookup(user[0].address - start)[0]
        assert function == user[0].function, (module, hex(start), user[0])


def test_a_full_stack_map_is_counted_and_said(kmem_exerciser: Path, tmp_path: Path) -> None:
    # GIVEN a stack map with room for 2 stacks
    out = tmp_path / "full.txt"
    done = subprocess.run(
        [*MTRACE, "run", "--kmem-only", "-o", "summary", "--stack-depth", "8",
         "--stack-map-size", "2", "--sp-rtrace", str(out), "--", str(kmem_exerciser),
         "--sockets", "50", "--pipes", "50", "--out", os.devnull],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # THEN the stacks it could not store are counted, in the summary and the report
    line = next(x for x in done.stdout.splitlines() if x.startswith("stacks not stored"))
    user, kernel = (int(word) for word in line.split(": ")[1].replace(",", "").split()[::2])
    assert user + kernel > 0
    assert f"## {user + kernel} stacks not stored: the stack map was full" in out.read_text()


def test_a_process_in_another_mount_namespace_resolves_through_proc_root(
    kmem_exerciser: Path, tmp_path: Path
) -> None:
    # GIVEN the exerciser run from a tmpfs mounted only in its own mount
    # namespace: its path does not exist from here
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    copy = hidden / "ns_exerciser"
    script = (f'mount -t tmpfs none "{hidden}" && cp "{kmem_exerciser}" "{copy}" && '
              f'exec "{copy}" --sockets 1 --pipes 0 --out /dev/null --gated')  # fmt: skip
    work = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    try:
        gate(work, b"", b"ready\n")
        assert not copy.exists()
        # WHEN an address in its gate() is resolved from here
        process = ProcessSymbols(work.pid)
        exe = next(m for m in process.modules() if m.path.endswith("/ns_exerciser"))
        module = ModuleSymbols(kmem_exerciser)  # the same bytes, for the expected address
        symbols = subprocess.run(["nm", str(kmem_exerciser)], capture_output=True, text=True).stdout
        gate_at = int(
            next(line.split()[0] for line in symbols.splitlines() if line.endswith(" gate")), 16
        )
        load_bias = exe.start - (module.vaddr(exe.offset) or 0)
        symbol = process.resolve(load_bias + gate_at + 4)
        # THEN it is found through /proc/PID/root, named, with its line
        assert symbol is not None and symbol.module == exe.path
        assert (symbol.function, symbol.offset) == ("gate", 4) and symbol.location
    finally:
        gate(work, b"go\n", b"")
        finish(work)
