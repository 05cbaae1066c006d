"""The detacher with real perf events: the child closes its copies only once
the tracer has closed its own, so that the last close of each event, the one
that waits for the kernel, is the child's. bpftrace records every close(2)
of both processes, with the kernel's clock, in the same run."""

from __future__ import annotations

import ctypes
import json
import os
import struct
from pathlib import Path

from mtrace_live.tracer.bpf.detacher import DETACHER_NAME, detach_in_child

from .tracing import (
    BPFTRACE_READY,
    Reaper,
    interrupt_bpftrace,
    processes,
    start_bpftrace,
    wait_for_detach,
    wait_for_line,
    wait_until,
)

EVENTS = 512  # enough that the closes of both sides would overlap, were they not ordered
_PERF_EVENT_OPEN = 298  # x86_64
_PERF_TYPE_SOFTWARE, _PERF_COUNT_SW_DUMMY = 1, 9
_PERF_FLAG_FD_CLOEXEC = 1 << 3


def perf_event() -> int:
    """A real perf event on this process (a software event that counts nothing)."""
    attr = ctypes.create_string_buffer(struct.pack("<IIQ", _PERF_TYPE_SOFTWARE, 128,
                                                   _PERF_COUNT_SW_DUMMY), 128)  # fmt: skip
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(_PERF_EVENT_OPEN, attr, 0, -1, -1, _PERF_FLAG_FD_CLOEXEC)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "perf_event_open")
    return int(fd)


def recorded_closes(tmp_path: Path, events: list[int], apart: list[int]) -> Path:
    """bpftrace's record of every close(2) of this process and of its
    detacher (and the detacher's closers) while ``events`` and ``apart`` are
    handed to the detacher: the file of its lines."""
    detacher = DETACHER_NAME.decode()
    # (the detacher is this process's grandchild, of that name: bpftrace
    # follows this process's forks, and no other run's detacher is taken;
    # nsecs printed whole, %llu: %d keeps its low 32 bits, which wrap every
    # 4.29 s, and a wrap between the two sides' closes put the child's
    # 4.29 s before this process's)
    body = ("tracepoint:sched:sched_process_fork /args->parent_pid == $1 || "
            "@ours[args->parent_pid]/ { @ours[args->child_pid] = 1; }\n"
            "tracepoint:syscalls:sys_enter_close /pid == $1 || "
            f'(@ours[pid] && comm == "{detacher}")/ '
            '{ printf("close %llu %d %d %d\\n", nsecs, pid == $1 ? 0 : 1, args->fd, '
            "tid); }\n")  # fmt: skip
    every = [*events, *apart]
    with Reaper() as reaper:
        bpftrace, out = start_bpftrace(body, os.getpid(), tmp_path, "closes")
        reaper.add(bpftrace)
        wait_for_line(out, BPFTRACE_READY, bpftrace, timeout=120)
        # WHEN the detacher takes them
        assert detach_in_child(events, apart)
        wait_for_detach()
        # (bpftrace drops what it has not printed when it stops: it is
        # stopped once it has printed a close of each event by each side,
        # or never did, which fails below)
        wait_until(lambda: all(set(every) <= {fd for _, fd, _ in side}
                               for side in closes_in(out).values()),
                   "bpftrace's lines of both sides' closes")  # fmt: skip
        interrupt_bpftrace(bpftrace)
    return out


def test_the_child_closes_each_perf_event_after_this_process_closed_its_copy(
    tmp_path: Path,
) -> None:
    # GIVEN real perf events, and bpftrace recording each close(2) of this
    # process and of the detacher
    events = [perf_event() for _ in range(EVENTS)]
    assert all(os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[perf_event]" for fd in events)
    # WHEN the detacher takes them
    closes = closes_in(recorded_closes(tmp_path, events, []))
    # THEN this process closed each event once (its first close of each number)
    mine = {fd: min(ns for ns, f, _ in closes[0] if f == fd) for fd in events
            if any(f == fd for _, f, _ in closes[0])}  # fmt: skip
    assert sorted(mine) == sorted(events), closes[0]
    # AND the child closed each one too, every close after the last of this
    # process's: its copies were the last, and the kernel's wait was its own
    theirs = [(ns, fd) for ns, fd, _ in closes[1] if fd in mine]
    assert sorted(fd for _, fd in theirs) == sorted(events), closes[1]
    last_mine = max(mine.values())
    early = [(fd, ns - last_mine) for ns, fd in theirs if ns <= last_mine]
    assert not early, early


def test_each_link_is_closed_last_by_a_thread_of_its_own(tmp_path: Path) -> None:
    # GIVEN perf events, and others standing for uprobe links (whose closes
    # wait for the kernel under no lock the others need), handed apart
    events = [perf_event() for _ in range(4)]
    links = [perf_event() for _ in range(6)]
    # WHEN the detacher takes them
    closes = closes_in(recorded_closes(tmp_path, events, links))
    # THEN after this process's closes, the last close of each link is by a
    # thread of its own, none of them the one that closed the events last
    handed = {*events, *links}
    # (this process's first close of each number: the numbers are used again)
    last_mine = max(min(ns for ns, f, _ in closes[0] if f == fd) for fd in handed)
    theirs = [(ns, fd) for ns, fd, _ in closes[1] if fd in handed]
    assert {fd for _, fd in theirs} == handed, theirs
    assert all(ns > last_mine for ns, _ in theirs), (last_mine, theirs)

    def last_closer(fd: int) -> int:
        return max((ns, tid) for ns, f, tid in closes[1] if f == fd)[1]

    closers = [last_closer(fd) for fd in links]
    assert len(set(closers)) == len(links), closers
    assert not {last_closer(fd) for fd in events} & set(closers)


def closes_in(out: Path) -> dict[int, list[tuple[int, int, int]]]:
    """bpftrace's closes, by who (0: this process, 1: the detacher and its
    closers): (ns, fd, thread id)."""
    closes: dict[int, list[tuple[int, int, int]]] = {0: [], 1: []}
    for line in out.read_text().splitlines():
        if line.startswith("{") and '"printf"' in line:
            text = json.loads(line)["data"]
            if text.startswith("close "):
                _, ns, who, fd, tid = text.split()
                closes[int(who)].append((int(ns), int(fd), int(tid)))
    return closes


def children(state: bytes) -> list[int]:
    """This process's children in ``state`` (b"Z": zombies)."""
    return [pid for pid, _, seen, parent in processes() if seen == state and parent == os.getpid()]


def test_a_long_lived_tracer_keeps_no_zombie_per_trace() -> None:
    # GIVEN this process (a long-lived one, as serve or a test runner is)
    # handing the events of three traces, one after the other, to detachers
    assert not children(b"Z")
    for _ in range(3):
        assert detach_in_child([perf_event() for _ in range(4)])
    wait_for_detach()
    # THEN the detachers did their work and none of them is left a zombie here
    assert not children(b"Z"), children(b"Z")
