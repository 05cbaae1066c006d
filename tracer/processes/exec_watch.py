"""Followed processes that exec a program with another libc.

The uprobes sit on one libc file (by inode). A followed process (a command's
children, --follow-forks) that execs a program mapping another libc (a
container's, a glibc built elsewhere) or none (a static or Go binary) makes
no call the trace can see. Its libc is mapped by the dynamic linker after the
exec, so each exec'ing process is looked at a moment later (one that has ended
by then goes unsaid), and one line says so, once per program.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from mtrace_live.probes.errors import MtraceError
from mtrace_live.tracer.processes import target

LOOK_AFTER_S = 0.05  # the dynamic linker has mapped the libraries by then


class ExecWatch:
    """Execs seen, looked at LOOK_AFTER_S later."""

    def __init__(self, libc: Path) -> None:
        try:
            stat = os.stat(libc)
            self.libc = (stat.st_dev, stat.st_ino)
        except OSError:
            self.libc = (0, 0)
        self.libc_path = libc
        self._waiting: list[tuple[float, int]] = []
        self._said: set[str] = set()
        self.looked: list[int] = []  # the processes the last look was at

    def exec_seen(self, pids: list[int]) -> None:
        now = time.monotonic()
        self._waiting.extend((now, pid) for pid in pids)

    def look(self) -> list[str]:
        """Lines about the processes due to be looked at whose program does
        not map the traced libc."""
        due = time.monotonic() - LOOK_AFTER_S
        ready = [pid for seen, pid in self._waiting if seen <= due]
        self._waiting = [(seen, pid) for seen, pid in self._waiting if seen > due]
        self.looked = ready
        lines = []
        for pid in ready:
            line = self._check(pid)
            if line is not None:
                lines.append(line)
        return lines

    def _check(self, pid: int) -> str | None:
        try:
            program = os.readlink(f"/proc/{pid}/exe")
            libc = target.mapped_glibc(pid).libc
            stat = os.stat(libc)
        except MtraceError:
            if target.process_state(pid) is None:
                return None  # gone: nothing to say
            what = "maps no glibc libc (static, or not glibc)"
            libc = None
        except OSError:
            return None  # gone
        else:
            if (stat.st_dev, stat.st_ino) == self.libc:
                return None
            what = f"maps {libc}"
        if program in self._said:
            return None
        self._said.add(program)
        hint = f"; trace it with --pid {pid} --lib {libc}" if libc is not None else ""
        return (f"process {pid} exec'd {program}, which {what}, not the traced "
                f"{self.libc_path}: its calls are not seen{hint}")  # fmt: skip
