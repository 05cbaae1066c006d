"""A cached program's tracepoints attached on a thread of their own while
the start goes on (tracer/bpf/bcc_revive.py's attach_tracepoints_apart),
checked against what bpftool says the kernel has attached."""

from __future__ import annotations

import errno
import json
import os
import struct
import subprocess

import pytest
from mtrace_live.tracer.bpf import bcc_revive, bpf_cache, bpf_syscalls

from .tracing import bpf_fdinfo

# r0 = 0; exit: a tracepoint program that records nothing
RETURN_0 = struct.pack("<BBhi", 0xB7, 0, 0, 0) + struct.pack("<BBhi", 0x95, 0, 0, 0)
TRACEPOINTS = (b"sched:sched_process_exec", b"syscalls:sys_enter_getppid")


def loaded() -> bcc_revive.CachedBpf:
    """A cached program of one tracepoint handler, loaded for real."""
    bpf = bcc_revive.CachedBpf(bpf_cache.Compiled("GPL", 0, {}, []), links=False)
    fd = bpf_syscalls.load_program(RETURN_0, "GPL", "mtrace_test_tp", bcc_revive.PROG_TRACEPOINT, 0)
    bpf.funcs[b"handler"] = bcc_revive.Function(b"handler", fd)
    return bpf


def attached_here() -> dict[str, int]:
    """This process's perf events with a program on a tracepoint, as bpftool
    lists them: tracepoint -> the program's id."""
    listed = subprocess.run(["bpftool", "-j", "perf", "show"], capture_output=True, text=True,
                            timeout=60, check=True)  # fmt: skip
    return {row["tracepoint"]: row["prog_id"] for row in json.loads(listed.stdout or "[]")
            if row.get("pid") == os.getpid() and "tracepoint" in row}  # fmt: skip


def test_the_tracepoints_are_attached_once_waited_for() -> None:
    # GIVEN a loaded handler, its tracepoints attached apart
    bpf = loaded()
    try:
        bpf.attach_tracepoints_apart([(name, b"handler") for name in TRACEPOINTS])
        # WHEN the start waits for them
        bpf.tracepoints_attached()
        # THEN each is a perf event of this process with the handler on it
        assert sorted(bpf.tracepoint_fds) == sorted(TRACEPOINTS)
        found = attached_here()
        assert set(found) == {"sched_process_exec", "sys_enter_getppid"}, found
        assert len(set(found.values())) == 1
    finally:
        bpf.cleanup()
    # and the cleanup closes them all
    assert attached_here() == {}


def test_a_tracepoint_the_kernel_lacks_is_said_when_waited_for() -> None:
    # GIVEN one tracepoint that exists and one that does not
    bpf = loaded()
    try:
        bpf.attach_tracepoints_apart([(TRACEPOINTS[0], b"handler"),
                                      (b"sched:mtrace_no_such_event", b"handler")])  # fmt: skip
        # WHEN the start waits for them, THEN the kernel's refusal is raised
        with pytest.raises(OSError) as refused:
            bpf.tracepoints_attached()
        assert refused.value.errno == errno.ENOENT
        assert "sched:mtrace_no_such_event" in str(refused.value)
        # and once said, waiting again raises nothing more
        bpf.tracepoints_attached()
    finally:
        bpf.cleanup()
    assert attached_here() == {}


def test_a_handler_loaded_before_the_start_is_the_one_it_uses() -> None:
    # GIVEN a cached program of two tracepoint handlers, one of them loaded
    # already (as the start's preload thread loads them), and one program
    # loaded for a handler the program does not have
    names = ["tracepoint__syscalls__sys_enter_getppid", "tracepoint__sched__sched_process_exec"]
    compiled = bpf_cache.Compiled("GPL", 0, dict.fromkeys(names, RETURN_0), [])
    assert all(bcc_revive.loaded_here(name) for name in names)
    early = bcc_revive.load_handler(compiled, names[0], {})
    stray = bcc_revive.load_handler(compiled, names[0], {})
    given = {names[0]: early, "tracepoint__gone__gone": stray}
    bpf = bcc_revive.CachedBpf(compiled, links=True, programs=given)
    # WHEN the program is loaded
    bpf.load()
    # THEN the handler loaded before is used as it is, the other is loaded
    # now, both tracepoint programs for the kernel
    assert bpf.funcs[names[0].encode()].fd == early
    later = bpf.funcs[names[1].encode()].fd
    held = bpf_fdinfo(os.getpid())
    assert {int(held[fd]["prog_type"]) for fd in (early, later)} == {bcc_revive.PROG_TRACEPOINT}
    ids = {held[fd]["prog_id"] for fd in (early, later, stray)}
    # AND its cleanup closes every one, the unused one too (by the kernel's
    # ids: a descriptor's number may be reused meanwhile)
    bpf.cleanup()
    assert not ids & {fields["prog_id"] for fields in bpf_fdinfo(os.getpid()).values()}
