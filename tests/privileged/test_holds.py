"""Holds (tracer/holds.py): only a process the trace started is ever
stopped, and every stop ends, whatever becomes of the tracer.

- The tracer is killed with SIGKILL at random points, 100 times, while its
  command (the churn: forks, execs, dlopens, exits) is held again and
  again: afterwards no process on the machine is stopped.
- The tracer itself is stopped (SIGSTOP) while its command is held: the
  guardian lets the command go past the bound, and the trace says so.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from mtrace_live.tracer.holds import GUARDIAN_NAME

from .conftest import MTRACE, built
from .tracing import Reaper, wait_for_line, wait_until

KILLS = 100
READY = "Ctrl-C to stop"


def stopped_processes() -> set[int]:
    """Every process (and thread) on the machine in state T."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            tasks = list((entry / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                state = (task / "stat").read_bytes().rpartition(b") ")[2][:1]
            except OSError:
                continue
            if state == b"T":
                found.add(int(task.name))
    return found


def guardians() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_bytes().strip() == GUARDIAN_NAME:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def command_pid(err: Path) -> int:
    found = re.search(r"for command pid (\d+)", err.read_text(errors="replace"))
    assert found, err.read_text(errors="replace")
    return int(found.group(1))


def start_churn_trace(
    tmp: Path, reaper: Reaper, seconds: int
) -> tuple[subprocess.Popen[bytes], Path]:
    churn = [str(built("churn")), str(built("libcfi_plugin.so")), str(seconds)]
    err = tmp / "trace.err"
    with open(err, "wb") as errors:
        tracer = reaper.add(subprocess.Popen(
            [*MTRACE, "run", "--follow-forks", "-o", "summary", "--", *churn],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=errors,
        ))  # fmt: skip
    assert tracer.stdin is not None
    wait_for_line(err, READY, tracer, timeout=120)
    tracer.stdin.write(b"g")  # the churn's go
    tracer.stdin.close()
    return tracer, err


@pytest.mark.soak  # (make soak: slower than make test's budget)
def test_a_tracer_killed_at_any_point_leaves_no_process_stopped(tmp_path: Path) -> None:
    before = stopped_processes()
    rng = random.Random(46)
    stopped_after: list[set[int]] = []
    for _ in range(KILLS):
        with Reaper() as reaper:
            # GIVEN the churn run by the tracer, held at each new process's
            # first allocation, each dlopen and each exit
            tracer, err = start_churn_trace(tmp_path, reaper, 30)
            churn = command_pid(err)
            # WHEN the tracer is killed with SIGKILL at a random point of the
            # churn's first half second (a kill point, not a synchronization)
            time.sleep(rng.uniform(0.0, 0.5))
            tracer.kill()
            tracer.wait()
            # THEN once its guardian is gone, nothing it held stays stopped
            wait_until(lambda: not guardians(), "the guardian ends")
            stopped_after.append(stopped_processes() - before)
            # (a kill that came before the tracer let the churn exec leaves it
            # never started: at its door it reads the tracer gone and exits)
            with contextlib.suppress(ProcessLookupError):
                os.kill(churn, signal.SIGKILL)
    assert not any(stopped_after), [sorted(s) for s in stopped_after if s]


def test_a_hold_the_tracer_cannot_end_is_let_go_past_the_bound(tmp_path: Path) -> None:
    with Reaper() as reaper:
        # GIVEN the churn under a tracer that is itself stopped
        tracer, err = start_churn_trace(tmp_path, reaper, 5)
        churn = command_pid(err)
        tracer.send_signal(signal.SIGSTOP)
        # WHEN the churn is held meanwhile (its next new process's first call)
        wait_until(lambda: bool(stopped_processes() & churn_tree(churn)), "a churn process is held")
        # THEN the guardian lets it go
        wait_until(lambda: not stopped_processes() & churn_tree(churn), "the guardian lets it go")
        tracer.send_signal(signal.SIGCONT)
        # AND the trace ends with the churn, saying so
        assert tracer.wait(timeout=120) == 0, err.read_text()
    said = [line for line in err.read_text().splitlines() if "let go after 2 s" in line]
    assert len(said) == 1, err.read_text()


def churn_tree(root: int) -> set[int]:
    """``root`` and its descendants' threads."""
    tree, parents = set(), {root}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_bytes().rpartition(b") ")[2].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid in parents or int(entry.name) == root:
            try:
                tree.update(int(task.name) for task in (entry / "task").iterdir())
            except OSError:
                continue
    return tree
