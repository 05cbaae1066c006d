"""The machine-wide ``kernel.pid_max``, lowered for a test and put back on
every path, a killed run's included.

Before lowering it, the value in force is written to KEPT (in /run, which a
reboot empties as it resets pid_max). A run that ends in any way but SIGKILL
restores it and removes KEPT; the next session of privileged tests finds a
KEPT that a killed run left, says so, and restores the value it holds."""

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


@contextmanager
def lowered(value: int, kept: Path = KEPT) -> Iterator[None]:
    """pid_max at ``value`` inside the block, and as it was after it."""
    restore_left_over(kept)
    before = PID_MAX.read_text().strip()
    kept.write_text(before + "\n")
    try:
        PID_MAX.write_text(str(value))
        yield
    finally:
        PID_MAX.write_text(before)
        kept.unlink(missing_ok=True)
