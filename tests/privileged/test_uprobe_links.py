"""Uprobes attached in one batch (tracer/bpf/uprobe_multi.py): what the kernel
says of the tracer's links, read from its /proc/PID/fdinfo while it traces,
against what the libc's functions are; and the per-uprobe perf events of
an older kernel, forced with MTRACE_LIVE_UPROBE_MULTI=0, beside."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from mtrace_live.tracer.bpf import uprobe_multi
from mtrace_live.tracer.processes.target import default_libc

from .conftest import MTRACE
from .tracing import (
    bpf_fdinfo,
    bpftool_show,
    nm_symbols,
    perf_events,
    tracing_a_sleeper,
    uprobe_links,
)

PERF_EVENTS = {**os.environ, "MTRACE_LIVE_UPROBE_MULTI": "0"}


def extents(path: str, names: tuple[str, ...]) -> list[tuple[int, int]]:
    """(address, size) of each named exported function, as nm -D -S gives them."""
    symbols = nm_symbols(Path(path), dynamic=True)
    assert all(name in symbols and symbols[name][1] for name in names), names
    return [symbols[name][:2] for name in names]


def traced_fds(tmp: Path, env: dict[str, str] | None) -> tuple[int, list[dict[str, Any]], int]:
    """A --pid trace of a sleeping process: its pid, and the tracer's links
    and perf events while it traces."""

    def look(tracer: int) -> tuple[list[dict[str, Any]], int]:
        return uprobe_links([tracer]), perf_events(tracer)

    pid, (links, events) = tracing_a_sleeper(tmp, MTRACE, ["-o", "summary"], look, env)
    return pid, links, events


def test_doctor_says_this_kernel_attaches_uprobes_in_links() -> None:
    done = subprocess.run([*MTRACE, "doctor"], capture_output=True, text=True, timeout=120)
    (line,) = [x for x in done.stdout.splitlines() if "uprobe attach:" in x]
    assert line.startswith("ok") and "in BPF links (uprobe_multi)" in line, line
    # AND it says why not when they are turned off
    done = subprocess.run([*MTRACE, "doctor"], capture_output=True, text=True, timeout=120,
                          env=PERF_EVENTS)  # fmt: skip
    (line,) = [x for x in done.stdout.splitlines() if "uprobe attach:" in x]
    assert "one perf event per uprobe" in line and "MTRACE_LIVE_UPROBE_MULTI=0" in line, line


def test_a_trace_attaches_its_uprobes_in_a_link_per_handler_for_its_process(
    tmp_path: Path,
) -> None:
    # GIVEN a --pid trace of a process on the system libc
    pid, multi, _ = traced_fds(tmp_path, None)
    # THEN its uprobes are in uprobe_multi links on the libc and (the
    # loader's _dl_debug_state, where a dlopen's objects are mapped) the
    # dynamic loader (the one processes on this libc map, as this one
    # does), each program in one link
    assert multi
    libc = str(default_libc())
    (loader,) = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                 if "/ld-linux" in line}  # fmt: skip
    (on_loader,) = [link for link in multi if link["path"] != libc]
    assert os.path.samefile(on_loader["path"], loader), (on_loader, loader)
    assert on_loader["pid"] == pid and on_loader["uprobe_cnt"] == 1, on_loader
    programs = [(link["prog_id"], link["link_type"]) for link in multi]
    assert len(programs) == len(set(programs)), programs
    # AND the allocation functions are among them, for its process alone: a
    # uprobe in malloc's and in free's code, as nm gives their extents (the
    # libc's text is loaded at its file offset: an address is an offset)
    ours = [link for link in multi if link["pid"] == pid]
    offsets = {offset for link in ours for offset in link["offsets"]}
    for start, size in extents(libc, ("malloc", "free")):
        assert any(start <= offset < start + size for offset in offsets), (start, ours)
    # AND the return probes of the functions that return a pointer share one link
    returns = [link for link in ours if link["link_type"] == "uretprobe_multi"]
    assert max(link["uprobe_cnt"] for link in returns) >= 5, returns


def test_without_links_each_uprobe_is_a_perf_event(tmp_path: Path) -> None:
    # GIVEN the same trace, its uprobes one perf event each (MTRACE_LIVE_UPROBE_MULTI=0)
    _, with_links, events_with_links = traced_fds(tmp_path / "links", None)
    _, links, events = traced_fds(tmp_path / "perf", PERF_EVENTS)
    # THEN it holds no uprobe link, and a perf event for each uprobe the
    # links held (beside the tracepoints' events, which both hold), and one
    # on pthread_exit: events attached for one thread move when it ends
    # (tracer/processes/retarget.py), where links follow the process
    assert links == []
    uprobes = sum(link["uprobe_cnt"] for link in with_links)
    assert events - events_with_links == uprobes + 1, (events, events_with_links)


@pytest.fixture(autouse=True)
def _dirs(tmp_path: Path) -> None:
    for name in ("links", "perf"):
        (tmp_path / name).mkdir()


def test_a_batch_the_kernel_refuses_names_the_uprobe_it_refuses(tmp_path: Path) -> None:
    # GIVEN a program that returns 0, and a batch of two uprobes on the libc:
    # one at malloc, one past the end of the file
    links = uprobe_multi.UprobeLinks({"zero": uprobe_multi.RETURN_ZERO}, "GPL", 0)
    libc = default_libc()
    ((malloc, _),) = extents(str(libc), ("malloc",))
    beyond = libc.stat().st_size + 0x1000
    try:
        with pytest.raises(uprobe_multi.LinkFailure) as refused, links.batch():
            for offset in (malloc, beyond):
                links.add(uprobe_multi.Uprobe(libc, offset, "zero", -1, False, 0))
        # THEN the failure names the one past the end, and why
        assert refused.value.uprobe.offset == beyond
        assert refused.value.failure.errno == errno.EINVAL, refused.value.failure
        # AND the one the kernel took alone is attached, in a link of its own,
        # which the trace's close detaches
        assert [link.uprobes[0].offset for link in links.links] == [malloc]
    finally:
        for fd in links.take_fds():
            os.close(fd)
        links.close_programs()


def bpf_programs_of(pid: int) -> dict[int, str]:
    """The BPF programs a process holds, by fd: their names as the kernel
    has them (fdinfo's prog_id, then bpftool)."""
    return {fd: bpftool_show("prog", int(fields["prog_id"]))["name"]
            for fd, fields in bpf_fdinfo(pid).items()}  # fmt: skip


# r10 = *(u64 *)(r0 + 8): r0 read before it is set (and r10 written), which the verifier refuses
REFUSED = bytes([0x79, 0x0A, 0x08, 0x00, 0, 0, 0, 0]) + uprobe_multi.RETURN_ZERO


def test_programs_prefetched_on_loader_threads_are_the_ones_asked_for() -> None:
    # GIVEN a trace's handlers: four the verifier takes, one it refuses, one
    # left for later, one the trace never asks for
    code = {f"zero_{n}": uprobe_multi.RETURN_ZERO for n in range(4)}
    handlers = {**code, "refused": REFUSED, "later": uprobe_multi.RETURN_ZERO,
                "unasked": uprobe_multi.RETURN_ZERO}  # fmt: skip
    links = uprobe_multi.UprobeLinks(handlers, "GPL", 0)
    before = set(bpf_programs_of(os.getpid()))
    try:
        # WHEN they are loaded ahead, but "later"
        links.prefetch(frozenset({"later"}))
        # THEN each one asked for is its own program, named for its handler by the kernel
        fds = {handler: links.program(handler) for handler in code}
        held = bpf_programs_of(os.getpid())
        assert {handler: held[fd] for handler, fd in fds.items()} == {h: h for h in code}
        # AND the refused one raises the verifier's refusal when asked for
        with pytest.raises(OSError) as refused:
            links.program("refused")
        assert refused.value.errno == errno.EACCES, refused.value
        # AND the one left for later is loaded only when asked for
        assert "later" not in held.values()
        later = links.program("later")
        assert bpf_programs_of(os.getpid())[later] == "later"
    finally:
        links.close_programs()
    # AND closing leaves none of them held (the one never asked for waited for, and closed)
    assert set(bpf_programs_of(os.getpid())) <= before


def test_the_programs_longest_to_load_last_time_are_loaded_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # GIVEN handlers of three sizes, two of them known (from the last start)
    # to have taken longest to load, and one loader thread, so that the
    # kernel gives program ids in the order of the loads
    monkeypatch.setattr(uprobe_multi, "LOADERS", 1)
    move_zero = bytes.fromhex("b700000000000000")  # r0 = 0
    handlers = {"small": uprobe_multi.RETURN_ZERO,
                "large": move_zero * 40 + uprobe_multi.RETURN_ZERO,
                "medium": move_zero * 20 + uprobe_multi.RETURN_ZERO,
                "slow_b": uprobe_multi.RETURN_ZERO,
                "slow_a": move_zero + uprobe_multi.RETURN_ZERO}  # fmt: skip
    links = uprobe_multi.UprobeLinks(handlers, "GPL", 0)
    try:
        # WHEN they are loaded ahead, with those times
        links.prefetch(frozenset(), {"slow_a": 50.0, "slow_b": 20.0})
        fds = {handler: links.program(handler) for handler in handlers}
        ids = {handler: int(bpf_fdinfo(os.getpid())[fd]["prog_id"]) for handler, fd in fds.items()}
        # THEN the two known to be long go first, longest first, then the rest by size
        assert sorted(handlers, key=ids.__getitem__) == ["slow_a", "slow_b", "large", "medium",
                                                         "small"]  # fmt: skip
        # AND each load's time is kept, for the next start
        assert set(links.load_ms) == set(handlers)
        assert all(ms > 0 for ms in links.load_ms.values())
    finally:
        links.close_programs()
