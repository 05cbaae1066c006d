"""Start a command held at the door, so tracing is attached before it runs.

The child is forked and waits on a pipe before exec; once the BPF programs are
attached and the child's pid is in the follow set, ``release()`` lets it exec.
Its very first instruction is then traced.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence

from mtrace_live.probes.errors import TargetError

# Dispositions the command gets as a shell gives a foreground job: the signals
# run passes on (a command that inherited SIGINT ignored, as a script's
# background job does, could not act on a Ctrl-C passed on), and those Python
# ignores for itself (a pipe's reader gone kills the command, as it would
# untraced).
COMMAND_DEFAULTS = (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGXFSZ)


def resolve_command(argv: Sequence[str]) -> list[str]:
    """The argv with its program found on PATH; TargetError if there is no
    such executable (before anything is attached or written)."""
    if not argv:
        raise TargetError("no command given to run")
    import shutil  # (a command's trace only: it imports bz2 and lzma)

    program = argv[0]
    resolved = program if "/" in program else shutil.which(program)
    if resolved is None or not os.access(resolved, os.X_OK) or os.path.isdir(resolved):
        raise TargetError(f"command not found or not executable: {program}")
    return [resolved, *argv[1:]]


class GatedCommand:
    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = resolve_command(argv)
        gate_r, self._gate_w = os.pipe()
        self._err_r, err_w = os.pipe2(os.O_CLOEXEC)
        self.pid = os.fork()
        if self.pid == 0:  # child: wait at the door, then become the command
            os.close(self._gate_w)
            os.close(self._err_r)
            try:
                go = os.read(gate_r, 1)
                os.close(gate_r)
                if go == b"1":
                    for sig in COMMAND_DEFAULTS:
                        signal.signal(sig, signal.SIG_DFL)
                    os.execv(self.argv[0], self.argv)
            except OSError as exc:
                os.write(err_w, f"{exc.strerror}".encode())
            os._exit(127)
        os.close(gate_r)
        os.close(err_w)
        self.status: int | None = None

    def release(self) -> None:
        """Let the command exec; raise TargetError if exec failed."""
        os.write(self._gate_w, b"1")
        os.close(self._gate_w)
        failure = os.read(self._err_r, 512)
        os.close(self._err_r)
        if failure:
            self.wait()
            raise TargetError(f"cannot run {self.argv[0]}: {failure.decode(errors='replace')}")

    def abandon(self) -> None:
        """Close the door without running the command (attach failed)."""
        os.close(self._gate_w)
        os.close(self._err_r)
        self.wait()

    def wait(self) -> int:
        """Wait for the command; returns its exit code the way a shell reports it."""
        if self.status is None:  # waitpid retries by itself on EINTR (PEP 475)
            _, raw = os.waitpid(self.pid, 0)
            self.status = os.waitstatus_to_exitcode(raw)
        code = self.status
        return 128 - code if code < 0 else code

    def finish(self, grace: float, first: signal.Signals | None = None) -> int:
        """Wait for the command; if it still runs after ``grace`` seconds (the
        trace was stopped, not ended by its exit), SIGTERM it, then SIGKILL.
        ``first``: the signal that stopped the trace, passed on at once (a
        Ctrl-C at a terminal reaches the command anyway; a signal sent to
        mtrace-live alone must too, without a wait)."""
        if first is not None and self.status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, first)
        for sig, patience in ((None, grace), (signal.SIGTERM, 2.0), (signal.SIGKILL, None)):
            if sig is not None and self.status is None:
                os.kill(self.pid, sig)
            if self._wait_for(patience):
                break
        return self.wait()

    def _wait_for(self, seconds: float | None) -> bool:
        if self.status is not None or seconds is None:
            return True
        deadline = time.monotonic() + seconds
        while True:
            pid, raw = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(raw)
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def interrupt(self, sig: signal.Signals = signal.SIGINT) -> None:
        if self.status is None:
            os.kill(self.pid, sig)
