"""A live trace's plan, without root: which probes, and which program
switches, each request makes (tracer/loop/plan.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from mtrace_live.tracer.loop import alloc_probes
from mtrace_live.tracer.loop.plan import (
    KERNEL_RING_PAGES,
    Probes,
    TraceRequest,
    choose_probes,
    program_plan,
)
from mtrace_live.tracer.loop.usdt import ProbeSelection
from mtrace_live.tracer.processes.target import default_libc

from .needs import needs

NO_PROBES = Probes(ProbeSelection(Path("/nonexistent/libc.so.6"), (), (), {}), False, None, ())


def defines(request: TraceRequest, target_pid: int | None = None,
            probes: Probes = NO_PROBES) -> dict[str, int]:  # fmt: skip
    return program_plan(request, probes, target_pid, None).config.defines()


def test_a_pid_is_followed_by_the_first_target_slot_and_alone() -> None:
    # GIVEN --pid 1234 without --follow-forks
    plan = program_plan(TraceRequest(pid=1234), NO_PROBES, 1234, None)
    found = plan.config.defines()
    # THEN the pid filter is on, forks are not followed, and the pid is named
    # in first_target once loaded, not compiled in
    assert (found["FILTER_PIDS"], found["FOLLOW_FORKS"], found["FIRST_TGID"]) == (1, 0, 1)
    assert 1234 not in found.values()
    # AND the uprobes are attached for that process alone
    assert plan.alloc_pid == 1234
    # AND the kernel's ring is the small one the copier empties
    assert plan.ring_pages == KERNEL_RING_PAGES == found["RINGBUF_PAGES"]
    assert "FILTER_COMM" not in found and "FILTER_CGROUP" not in found


def test_follow_forks_attaches_for_every_process() -> None:
    plan = program_plan(TraceRequest(pid=1234, follow_forks=True), NO_PROBES, 1234, None)
    assert plan.alloc_pid == -1
    assert plan.config.defines()["FOLLOW_FORKS"] == 1


def test_a_process_name_is_compiled_as_the_kernels_comm_words() -> None:
    # GIVEN serve's --comm nginx
    found = defines(TraceRequest(comm="nginx", end_with_target=False))
    # THEN the 16 bytes of the comm, NUL-padded, are two little-endian words
    raw = b"nginx".ljust(16, b"\0")
    assert found["FILTER_COMM"] == 1
    assert found["COMM_LO"] == int.from_bytes(raw[:8], "little")
    assert found["COMM_HI"] == int.from_bytes(raw[8:], "little")
    # AND the processes it forks are followed, none named in advance
    assert found["FOLLOW_FORKS"] == 1 and "FIRST_TGID" not in found


def test_all_processes_filter_nothing() -> None:
    found = defines(TraceRequest(all_processes=True))
    assert found["FILTER_PIDS"] == 0 and "FIRST_TGID" not in found


def test_kmem_records_take_the_whole_ring_asked_for(tmp_path: Path) -> None:
    # GIVEN --kmemtrace DIR, which wants every kmem event through the ring
    request = TraceRequest(pid=1, buffer_pages=4096, files=(("kmemtrace", tmp_path / "set"),))
    plan = program_plan(request, NO_PROBES, 1, {"HAVE_CACHE_NAME": 1})
    found = plan.config.defines()
    # THEN the kernel's ring is the buffer asked for, and kmem events go through it
    assert plan.ring_pages == 4096 == found["RINGBUF_PAGES"]
    assert (found["WITH_KMEM"], found["KMEM_EVENTS"], found["HAVE_CACHE_NAME"]) == (1, 1, 1)


def test_stacks_and_exact_times_follow_the_request() -> None:
    found = defines(TraceRequest(output="json", stack_depth=16, stack_entries=4096))
    assert (found["WITH_STACKS"], found["STACK_DEPTH"], found["STACK_ENTRIES"]) == (1, 16, 4096)
    assert found["PROBE_EXACT_TIME"] == 1
    found = defines(TraceRequest(output="summary"))
    assert (found["WITH_STACKS"], found["PROBE_EXACT_TIME"]) == (0, 0)


def exported_exit(libc: Path) -> bool:
    """Whether the libc exports _exit, as binutils' readelf reads it."""
    table = subprocess.run(["readelf", "--dyn-syms", "-W", str(libc)], capture_output=True,
                           text=True, check=True).stdout  # fmt: skip
    names = [line.split()[-1] for line in table.splitlines() if line.split()]
    return any(name.split("@")[0] == "_exit" for name in names)


@pytest.mark.parametrize("dropped", [False, True])
def test_a_process_the_trace_did_not_start_is_never_held_and_is_unwound_by_cfi(
    dropped: bool,
) -> None:
    # GIVEN the system libc's allocation functions, for one running process
    libc = default_libc()
    probes = Probes(NO_PROBES.selection, False, alloc_probes.plan_sites(libc), ())
    request = TraceRequest(pid=1234, privileges_dropped=dropped, sample_bytes=65536)
    plan = program_plan(request, probes, 1234, None)
    found = plan.config.defines()
    # THEN they are compiled in, sampled, for one process
    assert (found["WITH_ALLOCS"], found["ALLOC_ONE_PROCESS"], found["SAMPLE_BYTES"]) == (
        1,
        1,
        65536,
    )
    # AND nothing can stop it: not at _exit, not for its tables; its stacks
    # are unwound by CFI all the same, also in a trace that gives up root
    assert exported_exit(libc)
    assert (plan.hold, plan.holds, found["HOLD_AT_EXIT"], found["HOLDS"]) == (False, False, 0, 0)
    assert found.get("WITH_UNWIND") == 1


@pytest.mark.parametrize(("request_", "holds"), [
    (TraceRequest(command=("true",)), True),
    (TraceRequest(command=("true",), follow_forks=True), True),
    (TraceRequest(pid=1234, follow_forks=True), False),
    (TraceRequest(comm="sqlite3", end_with_target=False), False),
    (TraceRequest(all_processes=True), False),
    (TraceRequest(cgroup="/"), False),
])  # fmt: skip
def test_only_a_command_the_trace_starts_may_be_held(request_: TraceRequest, holds: bool) -> None:
    libc = default_libc()
    probes = Probes(NO_PROBES.selection, False, alloc_probes.plan_sites(libc), ())
    plan = program_plan(request_, probes, 1234 if request_.pid or request_.command else None, None)
    found = plan.config.defines()
    assert (plan.holds, found["HOLDS"], found["HOLD_AT_EXIT"]) == (holds, int(holds), int(holds))


def test_a_libc_without_sdt_notes_gets_derived_probes_and_says_so() -> None:
    # GIVEN the system libc (Debian's has no SDT notes)
    libc = default_libc()
    notes = subprocess.run(["readelf", "-n", str(libc)], capture_output=True, text=True,
                           check=True).stdout  # fmt: skip
    needs(
        "stapsdt" not in notes,
        f"this machine's libc ({libc}) is not Debian's: it has SDT notes, so nothing is derived",
    )
    probes = choose_probes(TraceRequest(pid=1234), libc)
    # THEN the memory_* probes are derived, the first notice says where from,
    # and the allocation functions are planned too
    assert probes.sdt and probes.selection.derived is not None
    assert "derived from system calls" in probes.notices[0]
    assert probes.alloc_plan is not None and "malloc" in probes.alloc_plan.sites
    # AND the program gets the derived syscall handlers
    assert defines(TraceRequest(pid=1234), 1234, probes)["DERIVED_SYSCALLS"] == 1


def test_a_process_is_shown_with_its_own_pid_where_its_namespace_gives_it_another() -> None:
    from mtrace_live.exporters.data.processes import described, namespace_pid

    assert described(4321) == "pid 4321"
    assert described(4321, "nginx") == "pid 4321 (nginx)"
    assert described(4321, "nginx", 7) == "pid 4321 (nginx; pid 7 in its pid namespace)"
    assert described(4321, ns_pid=7) == "pid 4321 (pid 7 in its pid namespace)"
    # this process is in the pid namespace of the one reading /proc: one pid
    assert namespace_pid(os.getpid()) is None


def test_kmem_records_get_room_for_a_burst_unless_told(tmp_path: Path) -> None:
    from mtrace_live.tracer.loop.plan import DEFAULT_BUFFER_PAGES, RECORD_BUFFER_PAGES

    records = (("kmemtrace", tmp_path / "set"),)
    # THEN kmem records through the ring get 128 MiB, other traces 8 MiB, by default
    assert TraceRequest(pid=1, files=records).ring_buffer_pages == RECORD_BUFFER_PAGES == 32768
    assert TraceRequest(pid=1).ring_buffer_pages == DEFAULT_BUFFER_PAGES == 2048
    # AND --buffer-pages, when given, is what is used
    assert TraceRequest(pid=1, files=records, buffer_pages=1024).ring_buffer_pages == 1024
    plan = program_plan(TraceRequest(pid=1, files=records), NO_PROBES, 1, {"HAVE_CACHE_NAME": 1})
    assert plan.ring_pages == 32768 == plan.config.defines()["RINGBUF_PAGES"]
