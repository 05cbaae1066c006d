"""Perf events closed by a child process, so that the tracer's stop does
not wait for the kernel (BpfProgram.close says why); the child is named
DETACHER_NAME while it works."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading

from mtrace_live.tracer.bpf.bpf_syscalls import close_quietly

DETACHER_NAME = b"mtrace-detach"
_PR_SET_NAME = 15


def detach_in_child(perf_fds: list[int], apart: list[int] | None = None) -> bool:
    """Fork a process that closes ``perf_fds`` (in order) and every other
    descriptor, in a session of its own, and close this process's copies;
    False (nothing closed) if it cannot.

    Each of ``apart`` (the uprobe links) is closed by a thread of its own,
    at the same time as ``perf_fds`` (``_close_apart``).

    The child closes the perf events only once this process has closed its
    copies (it waits for the end of a pipe this process holds open until
    then): the last close of an event is the one that waits for the kernel,
    and a child scheduled first would otherwise leave that wait here (a stop
    of 7 s was seen once in five)."""
    apart = list(apart or ())
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
        try:
            for fd in [*perf_fds, *apart]:
                close_quietly(fd)
        finally:
            os.close(released)
            os.close(holding)  # the child reads the end of file: its copies are the last
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)  # the first child exits at once: no zombie is left
        return True
    try:  # the child: few calls from here on, no library's (other threads' locks are not
        # ours): system calls, a directory listed, and the links' closers (_close_apart)
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
        _detach(perf_fds, apart, released)
    finally:
        os._exit(0)


def _detach(perf_fds: list[int], apart: list[int], released: int) -> None:
    """The detacher's work: in a session of its own, every descriptor but
    the events closed; once ``released`` ends (the tracer's copies are
    closed), ``apart`` on threads and ``perf_fds`` in order."""
    os.setsid()
    keep = {*perf_fds, *apart, released}
    for entry in os.listdir("/proc/self/fd"):
        fd = int(entry)
        if fd not in keep:
            close_quietly(fd)
    with contextlib.suppress(OSError):
        os.read(released, 1)  # end of file: the parent's copies are closed, or it is gone
    os.close(released)
    closers = _close_apart(apart)
    for fd in perf_fds:
        close_quietly(fd)
    for closer in closers:
        closer.join()


def _close_apart(apart: list[int]) -> list[threading.Thread]:
    """In the detacher: a thread for each of ``apart``, which closes it (the
    last copy: the threads wait for the kernel side by side); the threads,
    to join. A descriptor no thread could take is closed here, in turn.

    A link's last close waits for an RCU grace period (30 to 80 ms here)
    under no lock another link's needs, so the waits overlap: one after the
    other, a ``--pid`` trace's 26 links kept the detacher alive 1.4 s of its
    2.4 s, against the next trace's start. The tracepoints' events wait
    under the kernel's event_mutex, one after the other whoever closes
    them: those stay in order.

    Threads, where the rest of the detacher calls little but the kernel:
    this process is a fork of the one-threaded child of ``os.fork``, whose
    interpreter's locks Python set free, and the locks a thread's start
    takes in glibc (its stacks' cache, the TLS tables, malloc's arenas)
    glibc's fork set free in the child. (A tracer's thread caught in the
    middle of a dlopen would leave the TLS tables half made: the tracer
    opens no library while it stops.) Each thread has the detacher's name,
    which Python 3.14 gives the thread in the kernel too. Processes of
    their own did the same in 3 ms each of copying the tracer's page
    tables, 80 ms for a trace's 26 links, the CPU of the next start."""
    threads = []
    for fd in apart:
        closer = threading.Thread(target=close_quietly, args=(fd,), daemon=True,
                                  name=DETACHER_NAME.decode())  # fmt: skip
        try:
            closer.start()
        except RuntimeError:  # (no thread could be started)
            close_quietly(fd)
            continue
        threads.append(closer)
    return threads
