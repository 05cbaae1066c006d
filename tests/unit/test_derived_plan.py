"""probes/derived.py on this machine's libcs, without root: what is derived
from what, with and without the debug file."""

from __future__ import annotations

import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
from mtrace_live.probes import derived
from mtrace_live.probes.elf import debug
from mtrace_live.probes.errors import DebugInfoError
from mtrace_live.tracer.processes.target import default_libc


def test_without_a_debug_file_the_syscall_and_symbol_probes_remain(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # GIVEN no debug file to be found by build-id
    monkeypatch.setattr(debug, "DEBUG_ROOT", tmp_path)
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
    with pytest.raises(DebugInfoError, match="another build"):
        derived.plan(default_libc(), other)


def readelf_functions(path: Path) -> dict[str, list[tuple[int, int]]]:
    """Each FUNC symbol's (address, size) as binutils' readelf reads the
    symbol table: an independent reader of the debug file."""
    done = subprocess.run(["readelf", "-sW", str(path)], capture_output=True, text=True,
                          check=True)  # fmt: skip
    functions: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for line in done.stdout.splitlines():
        fields = line.split()
        # Num: Value Size Type Bind Vis Ndx Name
        if len(fields) >= 8 and fields[3] == "FUNC" and fields[6] != "UND":
            size = int(fields[2], 16) if fields[2].startswith("0x") else int(fields[2])
            functions[fields[7].split("@")[0]].append((int(fields[1], 16), size))
    return functions


def test_every_site_is_inside_the_function_it_names() -> None:
    # GIVEN the function bounds readelf gives for the libc's debug file
    plan = derived.plan(default_libc())
    assert plan.debug_file is not None
    functions = readelf_functions(plan.debug_file)
    sites = 0
    for probe in plan.probes.values():
        for site in probe.sites:
            # THEN each site lies inside a function of the name it gives
            bounds = functions.get(site.function, [])
            assert any(start <= site.address < start + size for start, size in bounds), (
                probe.name, site, bounds)  # fmt: skip
            assert site.args and all(arg.text for arg in site.args)
            sites += 1
    assert sites >= 10
