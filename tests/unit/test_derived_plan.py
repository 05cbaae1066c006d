"""probes/derived.py on this machine's libcs, without root: what is derived
from what, with and without the debug file."""

from __future__ import annotations

from pathlib import Path

import pytest
from mtrace_live.probes import debuginfo, derived
from mtrace_live.tracer.target import default_libc


def test_without_a_debug_file_the_syscall_and_symbol_probes_remain(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # GIVEN no debug file to be found by build-id
    monkeypatch.setattr(debuginfo, "DEBUG_ROOT", tmp_path)
    plan = derived.plan(default_libc())
    # THEN the system-call and exported-symbol probes are derived
    assert plan.debug_file is None and "libc6-dbg" in plan.debug_problem
    for name in ("memory_sbrk_more", "memory_heap_new", "memory_heap_more", "memory_heap_free"):
        assert plan.probes[name].source == derived.SYSCALL, name
    for name in ("memory_mallopt", "lll_lock_wait_private"):
        assert plan.probes[name].source == derived.SYMBOL, name
    # AND heap_more, without grow_heap's store, is approximate and says why
    assert plan.probes["memory_heap_more"].status == derived.APPROXIMATE
    assert "not seen" in plan.probes["memory_heap_more"].differs
    # AND the arena probes say what they miss
    for name in ("memory_arena_new", "memory_arena_retry"):
        assert plan.probes[name].status == derived.UNAVAILABLE
        assert "needs the debug file" in plan.probes[name].differs


def test_a_debug_file_of_another_build_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other.debug"
    other.write_bytes(Path("/bin/true").read_bytes())
    with pytest.raises(debuginfo.DebugInfoError, match="another build"):
        derived.plan(default_libc(), other)


def test_every_site_is_inside_the_function_it_names() -> None:
    plan = derived.plan(default_libc())
    assert plan.debug_file is not None
    with debuginfo.DebugInfo(plan.debug_file) as info:
        for probe in plan.probes.values():
            for site in probe.sites:
                start, size = info.function(site.function) or (0, 0)
                assert start <= site.address < start + size, (probe.name, site)
                assert site.args and all(arg.text for arg in site.args)
