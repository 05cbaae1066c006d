"""The machine-wide ``kernel.pid_max``, lowered for a test and put back on
every path, a killed run's included.

Before lowering it, the value in force is written to KEPT (in /run, which a
reboot empties as it resets pid_max). A run that ends in any way but SIGKILL
restores it and removes KEPT; the next session of privileged tests finds a
KEPT that a killed run left, says so, and restores the value it holds.

It is lowered only while the machine's threads (each holds a pid, kernel
threads too) are well below the new value: past a quarter of it, the block
is refused before anything is written, as other programs would soon find
no pid to start with.

A pid namespace's own pid_max (Linux 6.14 on) would not do: on this 6.18,
``unshare -p -f --mount-proc`` and 400 written inside leave the machine's
pid_max as it was, and 500 processes started there wrap at 400 in the
namespace only: the machine's pids, which BPF programs see
(``bpf_get_current_pid_tgid``), go on rising (one was 303 inside and 19002
outside). A tracer would see no pid reused."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PID_MAX = Path("/proc/sys/kernel/pid_max")
KEPT = Path("/run/mtrace-live-tests.pid_max")


def restore_left_over(kept: Path = KEPT) -> str | None:
    """Restore the pid_max a killed run left lowered; what was done, or None."""
    try:
        before = kept.read_text().strip()
    except FileNotFoundError:
        return None
    found = PID_MAX.read_text().strip()
    PID_MAX.write_text(before)
    kept.unlink()
    return (
        f"kernel.pid_max was {found}, lowered by an earlier test run that was killed "
        f"({kept} remained): restored to {before}"
    )


NEAR = 4  # refused when the threads in use exceed the new value / NEAR


def threads_in_use() -> int:
    """The threads on the machine now, kernel threads included (the
    kernel's count, /proc/loadavg's fourth field after its slash)."""
    return int(Path("/proc/loadavg").read_text().split()[3].partition("/")[2])


@contextmanager
def lowered(value: int, kept: Path = KEPT, near: int = NEAR) -> Iterator[None]:
    """pid_max at ``value`` inside the block, and as it was after it;
    RuntimeError, before anything is written, if the machine's threads
    exceed ``value // near``."""
    restore_left_over(kept)
    in_use = threads_in_use()
    if in_use > value // near:
        raise RuntimeError(
            f"{in_use} threads run on this machine, near the pid_max of {value} this test "
            f"sets (at most {value // near}): other programs would find no pid; run it "
            "on a quieter machine"
        )
    before = PID_MAX.read_text().strip()
    kept.write_text(before + "\n")
    try:
        PID_MAX.write_text(str(value))
        yield
    finally:
        PID_MAX.write_text(before)
        kept.unlink(missing_ok=True)
