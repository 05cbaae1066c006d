"""Whether sched_process_exit says ``group_dead`` (tracer/loop/plan.py's
exit_says_group_dead): the kernel's answer, checked against its BTF as
bpftool dumps it; read from the BTF and kept between runs, so that a start
reads no tracefs format file (one waited 10-15 ms on the kernel's
event_mutex), which only a kernel without BTF is asked."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from mtrace_live.probes.elf import facts
from mtrace_live.probes.errors import TracepointMissingError
from mtrace_live.tracer.bpf import kernel_btf, tracefs
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


def test_the_answer_is_the_kernels_from_its_btf_and_is_kept(
    own_store: facts.FactStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN the kernel's own record of the tracepoint (its BTF, through
    # bpftool), and a tracefs that must not be read
    expected = btf_says_group_dead()
    read: list[tuple[str, str]] = []

    def refused(category: str, event: str) -> str:
        read.append((category, event))
        raise AssertionError("tracefs read")

    monkeypatch.setattr(tracefs, "tracepoint_format", refused)
    # WHEN a start asks, with nothing kept yet
    # THEN it answers as the kernel declares, without reading tracefs
    assert plan.exit_says_group_dead() is expected
    assert read == []
    # AND the next run's answers the same from the document this one saved,
    # without reading the BTF again
    facts.save()
    monkeypatch.setattr(facts, "_STORE", None)

    def unread() -> None:
        raise AssertionError("the BTF read again")

    monkeypatch.setattr(kernel_btf, "KernelBtf", unread)
    assert plan.exit_says_group_dead() is expected


def test_without_btf_the_tracefs_format_answers(
    own_store: facts.FactStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN a kernel whose BTF cannot be read
    def no_btf(*args: object) -> None:
        raise kernel_btf.BtfUnavailable("no BTF here")

    monkeypatch.setattr(kernel_btf, "kernel_facts", no_btf)
    # WHEN a start asks
    # THEN the tracepoint's tracefs format gives the kernel's answer
    assert plan.exit_says_group_dead() is btf_says_group_dead()

    # AND where the tracepoint is missing too, it is taken as an older
    # kernel's exit (main's)
    def missing(category: str, event: str) -> str:
        raise TracepointMissingError(f"this kernel has no tracepoint {category}:{event}")

    monkeypatch.setattr(tracefs, "tracepoint_format", missing)
    assert plan.exit_says_group_dead() is False
