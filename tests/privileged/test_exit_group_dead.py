"""Whether sched_process_exit says ``group_dead`` (tracer/loop/plan.py's
exit_says_group_dead): the kernel's answer, checked against its BTF as
bpftool dumps it, and kept between runs so that a start reads no tracefs
format file (one waited 10-15 ms on the kernel's event_mutex)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from mtrace_live.probes.elf import facts
from mtrace_live.probes.errors import TracepointMissingError
from mtrace_live.tracer.bpf import tracefs
from mtrace_live.tracer.loop import plan


def btf_says_group_dead() -> bool:
    """The tracepoint's record, as the kernel's BTF declares it (bpftool)."""
    dumped = subprocess.run(["bpftool", "btf", "dump", "file", "/sys/kernel/btf/vmlinux",
                             "format", "c"], capture_output=True, text=True, timeout=120,
                            check=True)  # fmt: skip
    record = re.search(r"^struct trace_event_raw_sched_process_exit \{(.*?)^\};",
                       dumped.stdout, re.MULTILINE | re.DOTALL)  # fmt: skip
    assert record is not None, "the kernel's BTF has no sched_process_exit record"
    return re.search(r"\bgroup_dead;", record.group(1)) is not None


@pytest.fixture
def own_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> facts.FactStore:
    monkeypatch.setenv("MTRACE_LIVE_PLAN_CACHE", str(tmp_path / "plans"))
    return facts.fact_store()


def test_the_answer_is_the_kernels_and_is_kept(
    own_store: facts.FactStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN the kernel's own record of the tracepoint (its BTF, through bpftool)
    expected = btf_says_group_dead()
    # WHEN a start asks, with nothing kept yet
    first = plan.exit_says_group_dead()
    # THEN it answers as the kernel declares
    assert first is expected
    # AND a later start answers the same without reading tracefs at all
    read: list[tuple[str, str]] = []

    def refused(category: str, event: str) -> str:
        read.append((category, event))
        raise AssertionError("tracefs read again")

    monkeypatch.setattr(tracefs, "tracepoint_format", refused)
    assert plan.exit_says_group_dead() is expected
    # AND so does the next run's, which reads the document this one saved
    facts.save()
    monkeypatch.setattr(facts, "_STORE", None)
    assert facts.fact_store() is not own_store
    assert plan.exit_says_group_dead() is expected
    assert read == []


def test_a_failed_read_is_not_kept(own_store: facts.FactStore,
                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    # GIVEN a tracefs that cannot say (the tracepoint missing)
    real = tracefs.tracepoint_format

    def missing(category: str, event: str) -> str:
        raise TracepointMissingError(f"this kernel has no tracepoint {category}:{event}")

    monkeypatch.setattr(tracefs, "tracepoint_format", missing)
    # WHEN a start asks
    # THEN it is taken as an older kernel's exit (main's)
    assert plan.exit_says_group_dead() is False
    # AND nothing is kept: once tracefs answers, the kernel's answer is given
    monkeypatch.setattr(tracefs, "tracepoint_format", real)
    assert plan.exit_says_group_dead() is btf_says_group_dead()
