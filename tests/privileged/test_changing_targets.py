"""Targets that change under a trace: main ending first (pthread_exit), a
target stopped with SIGSTOP, a zombie. Each is traced exactly, against the
workload's own count and bpftrace's in the same run (bpftrace filters by
pid in its program, so it follows every thread), or refused in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest
from mtrace_live.exporters.data.processes import live_thread
from mtrace_live.tracer.processes import sdt_glibc
from mtrace_live.tracer.processes.target import default_libc

from .conftest import MTRACE, built
from .tracing import (
    BPFTRACE_READY,
    Reaper,
    perf_events,
    start_bpftrace,
    stop_bpftrace,
    wait_for_detach,
    wait_for_line,
    wait_until,
)

READY = "Ctrl-C to stop"
# How the tracer attaches its uprobes: in links (tracer/bpf/uprobe_multi.py),
# or one perf event each, as on a kernel older than 6.6.
UPROBES = {"links": None, "perf events": {**os.environ, "MTRACE_LIVE_UPROBE_MULTI": "0"}}


@dataclass
class Traced:
    pid: int
    mallocs: int  # the kernel's count of malloc hits, as mtrace-live read it
    bpftrace: int  # bpftrace's, in the same run
    in_flight: tuple[int, int, int]  # the calls of the function in flight (trace_leader_exit)
    workload: int  # the mallocs the workload made after the attach, by its own count
    stderr: str
    stops: int  # SIGSTOPs the workload took while it was traced, as bpftrace saw them
    stacks: str  # the alloc_stacks tables, as JSON


# leader_exit's modes with a call in flight while the probes move, and its function
IN_FLIGHT = {"inside": "posix_memalign", "tail": "realloc"}


def nothing(pid: int) -> None:
    pass


# bpftrace counts the workload's mallocs, and every SIGSTOP any of its
# threads takes (signal_deliver, in the receiving thread: bpftrace's pid is
# its process's), whichever thread raised it: a hold is raised by the thread
# that called (bpf_send_signal), main or not.
LEADER_EXIT_BODY = (
    "uprobe:{libc}:malloc /pid == $1/ {{ @hits[probe] = count(); }}\n"
    "uprobe:{libc}:posix_memalign /pid == $1/ {{ @hits[probe] = count(); }}\n"
    "uprobe:{libc}:realloc /pid == $1/ {{ @hits[probe] = count(); }}\n"
    "tracepoint:signal:signal_deliver /args->sig == 19 && pid == $1/ "
    "{{ @hits[probe] = count(); }}\n"
)


def worker_runs_after_main(pid: int) -> None:
    """Until main's thread is gone, then until the oldest thread that lives
    has run 100 times more (each of its pairs sleeps: the third field of
    its /proc/PID/task/TID/schedstat)."""
    wait_until(lambda: live_thread(pid) not in (pid, None), "main's thread gone")
    worker = live_thread(pid)

    def runs_so_far() -> int:
        return int(Path(f"/proc/{pid}/task/{worker}/schedstat").read_text().split()[2])

    first = runs_so_far()
    wait_until(lambda: runs_so_far() >= first + 100, "the worker's pairs after main's end")


def returned(stdout: IO[bytes], tracer: int, before: int) -> None:
    """leader_exit's call in flight has returned; then the tracer closes
    the return probes it kept for it: fewer perf events than ``before``."""
    assert stdout.readline() == b"returned\n"
    wait_until(lambda: perf_events(tracer) < before, "the kept return probes closed")


def trace_leader_exit(tmp: Path, before_attach: Callable[[int], None] = nothing,
                      after_attach: Callable[[int], None] = nothing,
                      mode: str = "after", uprobes: str = "links") -> Traced:  # fmt: skip
    """leader_exit traced by pid beside bpftrace. ``mode``: "after", main
    makes its 5,000 pairs and calls pthread_exit, then another thread makes
    its 5,000 once the probes moved (``uprobes`` "perf events"; "links"
    follow the process: no wait); "first", main has done so before the
    attach; "busy", another thread makes pairs all along, main lingering in
    pthread_exit until the probes have moved, the other thread going on a
    while after main's end; "inside" and "tail" (IN_FLIGHT): a thread is
    inside posix_memalign, or realloc(NULL), across the move."""
    with Reaper() as reaper:
        pipe = subprocess.PIPE
        how = mode if mode in ("busy", *IN_FLIGHT) else "wait"  # (CALLS unused in flight)
        argv = [str(built("leader_exit")), "5000", how]
        workload = reaper.add(subprocess.Popen(argv, stdin=pipe, stdout=pipe))
        stdin, stdout = workload.stdin, workload.stdout
        assert stdout is not None and stdin is not None and stdout.readline() == b"ready\n"
        pid = workload.pid

        def say(byte: bytes) -> None:
            stdin.write(byte)
            stdin.flush()

        if mode == "first":
            say(b"g")
            assert stdout.readline() == b"main gone\n"
            assert Path(f"/proc/{pid}/stat").read_text().rpartition(") ")[2][0] == "Z"
        body = LEADER_EXIT_BODY.format(libc=default_libc())
        bpftrace, bpftrace_out = start_bpftrace(body, pid, tmp)
        reaper.add(bpftrace)
        wait_for_line(bpftrace_out, BPFTRACE_READY, bpftrace, timeout=120)
        before_attach(pid)
        err, out = tmp / "trace.err", tmp / "trace.out"
        with open(err, "wb") as errors, open(out, "wb") as lines:
            tracer = reaper.add(subprocess.Popen([*MTRACE, "--pid", str(pid), "-o", "json"],
                                                 stdout=lines, stderr=errors,
                                                 env=UPROBES[uprobes]))  # fmt: skip
        wait_for_line(err, READY, tracer, timeout=120)
        after_attach(pid)
        if mode != "first":
            say(b"g")
            if mode in ("after", *IN_FLIGHT):
                assert stdout.readline() == (b"main gone\n" if mode == "after" else b"inside\n")
            if uprobes == "perf events":
                wait_for_line(err, "pthread_exit", tracer, timeout=120)  # the probes moved
                wait_for_detach()  # and the old ones it closes are closed
            if mode in IN_FLIGHT:  # the tracer's perf events, the kept return probes among them
                before = perf_events(tracer.pid)
        if mode == "busy":
            say(b"o")  # main ends now
            worker_runs_after_main(pid)
        say(b"p")  # (in flight: the call returns now)
        if mode in IN_FLIGHT:
            returned(stdout, tracer.pid, before)
            say(b"q")
        done = ended(workload, tracer, err)
        counts = stop_bpftrace(bpftrace, bpftrace_out)
    return traced_as(pid, mode, out, err, counts, done)


def ended(workload: subprocess.Popen[bytes], tracer: subprocess.Popen[bytes], err: Path) -> int:
    """leader_exit's end (stdin closed), and the tracer's: the pairs it says it made."""
    assert workload.stdin is not None and workload.stdout is not None
    workload.stdin.close()
    done = workload.stdout.readline().split()
    workload.stdout.close()
    assert workload.wait(timeout=120) == 0
    assert tracer.wait(timeout=120) == 0, err.read_text()
    return int(done[1])


def traced_as(pid: int, mode: str, out: Path, err: Path, counts: dict[str, int],
              workload: int) -> Traced:  # fmt: skip
    """The trace's tables and bpftrace's counts of one trace_leader_exit."""
    tables = [json.loads(line) for line in out.read_text().splitlines() if '"table"' in line]
    (functions,) = [t for t in tables if t["table"] == "alloc_functions"]
    stacks = json.dumps([t for t in tables if t["table"] == "alloc_stacks"])
    # the calls of the function in flight: their entries as the kernel
    # counted them, the returns kept in stack rows, and bpftrace's count of
    # their entries
    fn = IN_FLIGHT.get(mode, "posix_memalign")
    kept = sum(t["calls"] for t in tables if t["table"] == "alloc_stacks" and t["allocator"] == fn)
    in_flight = (functions["calls"].get(fn, 0), kept, counts.get(fn, 0))
    return Traced(pid, functions["calls"]["malloc"], counts["malloc"], in_flight, workload,
                  err.read_text(), counts.get("signal_deliver", 0), stacks)  # fmt: skip


@pytest.mark.parametrize("uprobes", list(UPROBES))
def test_main_calling_pthread_exit_leaves_its_other_threads_traced(
    tmp_path: Path, uprobes: str
) -> None:
    # GIVEN a process whose main thread makes 5,000 pairs and calls
    # pthread_exit, after which another thread makes its 5,000
    traced = trace_leader_exit(tmp_path, uprobes=uprobes)
    # THEN it is never stopped (the trace did not start it)
    assert traced.stops == 0
    # AND every malloc of both threads is counted: as bpftrace counted, and
    # at least the workload's own (libc's come on top)
    assert traced.mallocs == traced.bpftrace >= traced.workload
    # AND the move of the probes to the thread that stayed is said once
    # (links follow the process: none moves)
    said = [line for line in traced.stderr.splitlines() if "pthread_exit" in line]
    pid = traced.pid
    if uprobes == "links":
        assert said == [], said
    else:
        assert len(said) == 1 and f"thread {pid} of process {pid}" in said[0], said


def test_no_call_is_counted_twice_while_the_probes_move(tmp_path: Path) -> None:
    # GIVEN leader_exit whose other thread makes pairs without a pause while
    # main, in pthread_exit, lingers until the probes have moved (both the
    # old and the new events fire meanwhile), traced by pid with one perf
    # event per probe (links do not move: the next test)
    traced = trace_leader_exit(tmp_path, mode="busy", uprobes="perf events")
    # THEN every malloc is counted once: as bpftrace counted (none twice
    # while both generations of the probes fired, none lost in the move)
    assert traced.mallocs == traced.bpftrace >= traced.workload // 2
    assert traced.stops == 0
    # AND the probes did move, once
    said = [line for line in traced.stderr.splitlines() if "pthread_exit" in line]
    assert len(said) == 1 and f"thread {traced.pid} of process {traced.pid}" in said[0], said


@pytest.mark.parametrize("mode", list(IN_FLIGHT))
def test_a_call_in_flight_while_the_probes_move_is_counted_once_at_its_return(
    tmp_path: Path, mode: str
) -> None:
    # GIVEN leader_exit whose other thread is inside posix_memalign (its
    # store of the pointer waits for a page userfaultfd keeps missing), or
    # inside realloc(NULL) (its second push does, and then it jumps to
    # malloc), when main calls pthread_exit, going on only once the probes
    # have moved: its entry was the old generation's (malloc's, the new
    # one's), and this kernel gives a return only to the return probes
    # that saw the call enter
    traced = trace_leader_exit(tmp_path, mode=mode, uprobes="perf events")
    # THEN the probes moved once, and the call is counted once at its
    # return, as bpftrace counted its entry (and the return probes kept for
    # it were closed once it had returned: trace_leader_exit's wait)
    said = [line for line in traced.stderr.splitlines() if "pthread_exit" in line]
    assert len(said) == 1 and f"thread {traced.pid} of process {traced.pid}" in said[0], said
    assert traced.in_flight == (1, 1, 1)
    assert traced.stops == 0


@pytest.mark.parametrize("moves", [4, pytest.param(10, marks=pytest.mark.soak)])
def test_no_call_is_lost_while_the_probes_move_again_and_again(tmp_path: Path, moves: int) -> None:
    # GIVEN probe_moves, whose thread the probes are attached for ends
    # ``moves`` times in turn (main first, then each thread they moved to, the one
    # before it maybe not gone yet), while another thread makes pairs
    # without a pause (the events ring fills), each ending thread lingering
    # in pthread_exit until its probes have moved
    argv = [str(built("probe_moves")), str(moves)]
    err, out = tmp_path / "trace.err", tmp_path / "trace.out"
    with Reaper() as reaper:
        pipe = subprocess.PIPE
        workload = reaper.add(subprocess.Popen(argv, stdin=pipe, stdout=pipe))
        assert workload.stdin is not None and workload.stdout is not None
        assert workload.stdout.readline() == b"ready\n"
        body = LEADER_EXIT_BODY.format(libc=default_libc())
        bpftrace, bpftrace_out = start_bpftrace(body, workload.pid, tmp_path)
        reaper.add(bpftrace)
        wait_for_line(bpftrace_out, BPFTRACE_READY, bpftrace, timeout=120)
        with open(err, "wb") as errors, open(out, "wb") as lines:
            tracer = reaper.add(subprocess.Popen(
                [*MTRACE, "--pid", str(workload.pid), "-o", "json"], stdout=lines,
                stderr=errors, env=UPROBES["perf events"]))  # fmt: skip
        wait_for_line(err, READY, tracer, timeout=120)
        for move in range(1, moves + 1):  # WHEN each byte ends the thread they are attached for
            workload.stdin.write(b"m")
            workload.stdin.flush()
            wait_until(lambda: err.read_text().count("called pthread_exit") >= move,  # noqa: B023
                       f"move {move}")  # fmt: skip
            workload.stdin.write(b"l")  # (it lingered in pthread_exit till they moved)
            workload.stdin.flush()
        workload.stdin.write(b"s")  # (the hammer stops)
        done = ended(workload, tracer, err)
        counts = stop_bpftrace(bpftrace, bpftrace_out)
    traced = traced_as(workload.pid, "moves", out, err, counts, done)
    # THEN each move was made, each to a thread that lived
    said = [line for line in traced.stderr.splitlines() if "pthread_exit" in line]
    assert len(said) == moves and all("they follow thread" in line for line in said), said
    # AND every malloc is counted once: as bpftrace counted, and at least
    # the hammer's own
    assert traced.mallocs == traced.bpftrace >= traced.workload
    assert traced.stops == 0


def test_links_count_every_call_made_while_main_exits(tmp_path: Path) -> None:
    # GIVEN the same, traced in uprobe links: they are attached for the
    # process, not for its main thread, and follow it when main ends
    # (tracer/bpf/uprobe_multi.py), so nothing moves
    traced = trace_leader_exit(tmp_path, mode="busy", uprobes="links")
    # THEN every malloc of the thread that made pairs all along, before,
    # while and after main called pthread_exit and ended, is counted once,
    # as bpftrace counted, the process never stopped, and no move said
    assert traced.mallocs == traced.bpftrace >= traced.workload // 2
    assert traced.stops == 0
    assert [line for line in traced.stderr.splitlines() if "pthread_exit" in line] == []


def test_a_process_whose_main_thread_exited_before_the_attach_is_traced(tmp_path: Path) -> None:
    # GIVEN leader_exit whose main thread has made its pairs and called
    # pthread_exit before the tracer attaches (its leader shows as a zombie)
    traced = trace_leader_exit(tmp_path, mode="first")
    # THEN every malloc of the thread that stayed is counted, as bpftrace
    # counted, and it was never stopped
    assert traced.mallocs == traced.bpftrace >= traced.workload // 2
    assert traced.stops == 0
    # AND its frames are named (its maps read through the thread that lives)
    assert "pairs" in traced.stacks, traced.stacks[:2000]


@pytest.mark.parametrize("uprobes", list(UPROBES))
def test_a_target_stopped_with_sigstop_is_traced_once_continued(
    tmp_path: Path, uprobes: str
) -> None:
    # GIVEN the same workload stopped (SIGSTOP) when the tracer attaches,
    # and continued after
    def stop(pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        os.waitid(os.P_PID, pid, os.WSTOPPED | os.WNOWAIT)  # stopped, seen by its parent

    traced = trace_leader_exit(tmp_path, stop, lambda pid: os.kill(pid, signal.SIGCONT),
                               uprobes=uprobes)  # fmt: skip
    # THEN the tracer said it is stopped, and traced every call once it ran
    assert f"process {traced.pid} is stopped (SIGSTOP)" in traced.stderr
    assert traced.mallocs == traced.bpftrace >= traced.workload
    # AND only the test stopped it
    assert traced.stops == 1


@pytest.mark.parametrize("command", [[], ["count"], ["serve"], ["record", "-o", "{tmp}/rec"]])
def test_a_zombie_target_is_refused_in_one_line_with_exit_6(
    tmp_path: Path, command: list[str]
) -> None:
    # GIVEN a child that has exited and that its parent (this test) has not reaped
    child = os.fork()
    if child == 0:
        os._exit(0)
    try:
        os.waitid(os.P_PID, child, os.WEXITED | os.WNOWAIT)  # a zombie now
        argv = [*MTRACE, *(part.format(tmp=tmp_path) for part in command), "--pid", str(child)]
        run = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    finally:
        os.waitpid(child, 0)
    # THEN one line says what it is, with the target error's exit code
    assert run.returncode == 6, run.stderr
    assert run.stderr.splitlines() == [
        f"mtrace-live: error: process {child} has exited: it is a zombie that its parent "
        f"(pid {os.getpid()}) has not reaped, with nothing left to trace"
    ]


def test_a_child_that_execs_a_program_with_another_libc_is_said_once(
    sdt: sdt_glibc.SdtGlibc, tmp_path: Path
) -> None:
    # GIVEN a command whose process execs a program that maps another libc
    # (the SDT glibc's), which waits for a byte before it allocates
    argv = [*MTRACE, "run", "-o", "summary", "--", *sdt.wrap([str(built("leader_exit")), "10"])]
    err = tmp_path / "trace.err"
    with Reaper() as reaper, open(err, "wb") as errors:
        tracer = reaper.add(subprocess.Popen(argv, stdin=subprocess.PIPE,
                                             stdout=subprocess.DEVNULL, stderr=errors))  # fmt: skip
        assert tracer.stdin is not None
        # THEN one line says that its calls are not seen, naming that libc
        wait_for_line(err, "exec'd", tracer, timeout=120)
        tracer.stdin.write(b"go")
        tracer.stdin.close()
        assert tracer.wait(timeout=120) == 0, err.read_text()
    said = [line for line in err.read_text().splitlines() if "exec'd" in line]
    assert len(said) == 1, said
    assert "its calls are not seen" in said[0] and "testrun.sh" not in said[0]
    named = said[0].split("which maps ", 1)[1].split(", not the traced", 1)[0]
    assert os.path.samefile(named, sdt.libc), said
