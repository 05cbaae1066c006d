"""Holds.release on real BPF maps (tracer/processes/holds.py): a process is continued
only when it is held and every stop counted was made before the work it was
held for began; one stopped by someone else, or stopped again since (a
dlopen while its tables were being written without a hold), is left
stopped. Each case is a real process, stopped by a real SIGSTOP; its state
is read from /proc."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from mtrace_live.tracer.bpf import bpf_syscalls
from mtrace_live.tracer.processes.holds import Holds

from .tracing import wait_until

BPF_MAP_TYPE_HASH = 1
HOLD = struct.Struct("=QQ")  # struct hold (common.bpf.h): stops, since
U64 = struct.Struct("=Q")


class Maps:
    """The two maps Holds reads and writes, made as the program makes them."""

    def __init__(self) -> None:
        self.fds = {
            "holds": bpf_syscalls.create_map(bpf_syscalls.MapInfo(
                BPF_MAP_TYPE_HASH, 4, HOLD.size, 64, 0, "holds")),
            "hold_continued": bpf_syscalls.create_map(bpf_syscalls.MapInfo(
                BPF_MAP_TYPE_HASH, 4, U64.size, 64, 0, "hold_continued")),
        }  # fmt: skip
        assert None not in self.fds.values()

    def map_fd(self, name: str) -> int:
        fd = self.fds[name]
        assert fd is not None
        return fd

    def stopped(self, pid: int, stops: int, continued: int) -> None:
        """``pid`` stopped, with ``stops`` counted and ``continued`` written down."""
        os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: state(pid) == "T", "stopped")
        assert bpf_syscalls.update_u32(self.map_fd("holds"), pid, HOLD.pack(stops, 0))
        if continued:
            assert bpf_syscalls.update_u32(self.map_fd("hold_continued"), pid,
                                           U64.pack(continued))  # fmt: skip

    def continued(self, pid: int) -> int:
        raw = bpf_syscalls.lookup_u32(self.map_fd("hold_continued"), pid, U64.size)
        return U64.unpack(raw)[0] if raw else 0


def state(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("State:"):
            return line.split()[1]
    return ""


@pytest.fixture
def sleeper() -> Iterator[int]:
    proc = subprocess.Popen(["sleep", "600"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_held_process_is_continued_and_its_stops_written_down(sleeper: int) -> None:
    maps = Maps()
    maps.stopped(sleeper, stops=2, continued=1)
    Holds(maps).release(sleeper, covered=2)  # type: ignore[arg-type]
    wait_until(lambda: state(sleeper) != "T", "continued")
    assert maps.continued(sleeper) == 2


def test_a_stop_made_since_the_work_began_is_left_to_its_own_ask(sleeper: int) -> None:
    # GIVEN a process held twice, the second time after its maps were read
    maps = Maps()
    maps.stopped(sleeper, stops=2, continued=0)
    # WHEN the first ask's work is done (it covered one stop)
    Holds(maps).release(sleeper, covered=1)  # type: ignore[arg-type]
    # THEN it stays stopped, nothing written down; the second ask continues it
    assert state(sleeper) == "T" and maps.continued(sleeper) == 0
    Holds(maps).release(sleeper, covered=2)  # type: ignore[arg-type]
    wait_until(lambda: state(sleeper) != "T", "continued")


def test_a_process_not_held_is_sent_nothing(sleeper: int) -> None:
    # GIVEN a process whose every stop was continued, stopped by someone else
    maps = Maps()
    maps.stopped(sleeper, stops=1, continued=1)
    # WHEN released (a forked process's ask, which held nothing)
    Holds(maps).release(sleeper)  # type: ignore[arg-type]
    # THEN it is still stopped
    assert state(sleeper) == "T"
