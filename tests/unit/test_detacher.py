"""The detacher: a forked child that closes a trace's perf events, so that
the kernel's wait at each last close is the child's and not the tracer's.
Pipes stand in for the perf events here: what is tested is that this
process's copies are closed at once and the child's after. The order of the
two sides' closes is tested with real perf events, under bpftrace, in
tests/privileged/test_detacher.py."""

from __future__ import annotations

import os
import select

from mtrace_live.tracer.bpf.detacher import detach_in_child


def test_this_processs_copies_close_at_once_and_the_childs_after() -> None:
    # GIVEN two descriptors standing for perf events, their other ends held here
    events = [os.pipe() for _ in range(2)]
    readers = [read for read, _ in events]
    written = [write for _, write in events]

    # WHEN the detacher takes them
    assert detach_in_child(written)

    # THEN this process's copies are closed at once
    for fd in written:
        try:
            os.fstat(fd)
        except OSError:
            continue
        raise AssertionError(f"descriptor {fd} is still open here")
    # AND the child closes its own, the last ones: each reader sees end of file
    for fd in readers:
        ready, _, _ = select.select([fd], [], [], 60)  # a guard against a hang, not a measure
        assert ready == [fd]
        assert os.read(fd, 1) == b""
        os.close(fd)
