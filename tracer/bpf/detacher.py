"""Perf events closed by a child process, so that the tracer's stop does
not wait for the kernel (BpfProgram.close says why); the child is named
DETACHER_NAME while it works."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys

DETACHER_NAME = b"mtrace-detach"
_PR_SET_NAME = 15


def detach_in_child(perf_fds: list[int]) -> bool:
    """Fork a process that closes ``perf_fds`` (in order) and every other
    descriptor, in a session of its own, and close this process's copies;
    False (nothing closed) if it cannot.

    The child closes the perf events only once this process has closed its
    copies (it waits for the end of a pipe this process holds open until
    then): the last close of an event is the one that waits for the kernel,
    and a child scheduled first would otherwise leave that wait here (a stop
    of 7 s was seen once in five)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    libc = ctypes.CDLL(None)  # looked up here: dlopen in the child could find its lock held
    prctl, fork = libc.prctl, libc.fork
    try:
        released, holding = os.pipe()
    except OSError:
        return False
    try:
        pid = os.fork()
    except OSError:
        os.close(released)
        os.close(holding)
        return False
    if pid:
        for fd in perf_fds:
            os.close(fd)
        os.close(released)
        os.close(holding)  # the child reads the end of file: its copies are the last
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)  # the first child exits at once: no zombie is left
        return True
    try:  # the child: only system calls from here on (other threads' locks are not ours)
        # A grandchild does the work: the first child exits at once and is
        # reaped above, and the grandchild, whose parent is gone, is reaped
        # by init (or the nearest subreaper). A long-lived tracer (serve, a
        # test runner) keeps no zombie per trace. Where it cannot fork, the
        # child does the work itself and the tracer waits for it. The name
        # comes first: the grandchild has it from its start, so that once
        # the tracer is back, a detacher still at work is seen by its name.
        prctl(_PR_SET_NAME, ctypes.c_char_p(DETACHER_NAME), 0, 0, 0)
        if fork() > 0:  # -1: no grandchild, the work is this child's
            os._exit(0)
        os.setsid()
        keep = {*perf_fds, released}
        for entry in os.listdir("/proc/self/fd"):
            fd = int(entry)
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        with contextlib.suppress(OSError):
            os.read(released, 1)  # end of file: the parent's copies are closed, or it is gone
        for fd in perf_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    finally:
        os._exit(0)
