"""The compiled-program cache's pure parts (tracer/bpf/bpf_cache.py): the map
descriptors rewritten in BPF code, what is stored and read back, and what
the key depends on. The load itself is tested against the kernel in
tests/privileged/test_bpf_cache.py."""

from __future__ import annotations

import os
import struct
from dataclasses import replace
from pathlib import Path

import pytest
from mtrace_live.tracer.bpf import bpf_cache


def insn(opcode: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", opcode, (src << 4) | dst, off, imm)


def ld_map(dst: int, fd: int) -> bytes:
    return insn(0x18, dst, 1, 0, fd) + insn(0, 0, 0, 0, 0)


def ld_imm64(dst: int, value: int) -> bytes:
    return insn(0x18, dst, 0, 0, value & 0xFFFFFFFF) + insn(0, 0, 0, 0, value >> 32)


EXIT = insn(0x95)
MOV_R0_0 = insn(0xB7, 0, 0, 0, 0)


def test_map_descriptors_are_rewritten_and_nothing_else() -> None:
    # GIVEN code loading maps 5 and 7, and a 64-bit constant whose low word is 5
    code = ld_map(1, 5) + ld_imm64(2, 5 | (7 << 32)) + ld_map(3, 7) + MOV_R0_0 + EXIT
    # WHEN the maps are made anew as 40 and 41
    out = bpf_cache.relocate(code, {5: 40, 7: 41})
    # THEN the map loads name the new maps; the constant and the rest are unchanged
    assert out == ld_map(1, 40) + ld_imm64(2, 5 | (7 << 32)) + ld_map(3, 41) + MOV_R0_0 + EXIT


@pytest.mark.parametrize(
    "code",
    [
        ld_map(1, 9) + EXIT,  # a map that is not one of the program's
        insn(0x18, 1, 2, 0, 5) + insn(0) + EXIT,  # a map value by reference
        insn(0x18, 1, 4, 0, 5) + insn(0) + EXIT,  # a kernel object by BTF id
        EXIT[:5],  # not whole instructions
    ],
)
def test_code_that_refers_to_anything_else_is_refused(code: bytes) -> None:
    with pytest.raises(ValueError):
        bpf_cache.relocate(code, {5: 40})


def spec(name: str, fd: int) -> bpf_cache.MapSpec:
    return bpf_cache.MapSpec(name, fd - 3, fd, 2, 4, 8, 16, 0, name[:15], '"int"', '"u64"')


def test_stored_programs_read_back_whole_and_the_oldest_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MTRACE_LIVE_BPF_CACHE", str(tmp_path))
    tmp_path.chmod(0o700)
    monkeypatch.setattr(bpf_cache, "KEEP", 2)
    compiled = bpf_cache.Compiled("GPL", 0x61200, {"site_0": ld_map(1, 5) + EXIT},
                                  [spec("events", 5), spec("hits", 6)])  # fmt: skip
    bpf_cache.store("a" * 64, compiled)
    assert bpf_cache.load("a" * 64) == compiled
    assert bpf_cache.load("b" * 64) is None
    # a third program pushes out the one least recently used
    bpf_cache.store("b" * 64, compiled)
    (tmp_path / ("b" * 64 + ".json")).touch()
    os.utime(tmp_path / ("a" * 64 + ".json"), (1, 1))
    bpf_cache.store("c" * 64, compiled)
    assert sorted(p.stem[0] for p in tmp_path.glob("*.json")) == ["b", "c"]


def test_a_damaged_cache_entry_is_unusable_and_a_disabled_cache_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MTRACE_LIVE_BPF_CACHE", str(tmp_path))
    tmp_path.chmod(0o700)
    (tmp_path / ("d" * 64 + ".json")).write_text('{"license": "GPL", "maps": [{"name": 1}]}')
    with pytest.raises(bpf_cache.Unusable, match="does not read as a stored program"):
        bpf_cache.load("d" * 64)
    monkeypatch.setenv("MTRACE_LIVE_BPF_CACHE", "off")
    bpf_cache.store("e" * 64, bpf_cache.Compiled("GPL", 0, {}, []))
    assert bpf_cache.load("e" * 64) is None
    assert not list(tmp_path.glob("e*"))


def test_a_file_others_could_write_is_never_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MTRACE_LIVE_BPF_CACHE", str(tmp_path))
    tmp_path.chmod(0o700)
    compiled = bpf_cache.Compiled("GPL", 0, {"f": EXIT}, [])
    bpf_cache.store("f" * 64, compiled)
    assert bpf_cache.load("f" * 64) == compiled
    (tmp_path / ("f" * 64 + ".json")).chmod(0o666)
    with pytest.raises(bpf_cache.Unusable, match="another user"):
        bpf_cache.load("f" * 64)
    (tmp_path / ("f" * 64 + ".json")).chmod(0o600)
    tmp_path.chmod(0o777)
    with pytest.raises(bpf_cache.Unusable, match="another user"):
        bpf_cache.load("f" * 64)


def test_the_key_follows_the_source_the_constants_and_bcc() -> None:
    base = bpf_cache.cache_key([b"int x;", b"struct r;"], ["-DSITE_COUNT=7"], "0.26.0")
    assert base == bpf_cache.cache_key([b"int x;", b"struct r;"], ["-DSITE_COUNT=7"], "0.26.0")
    assert base != bpf_cache.cache_key([b"int y;", b"struct r;"], ["-DSITE_COUNT=7"], "0.26.0")
    assert base != bpf_cache.cache_key([b"int x;", b"struct r;"], ["-DSITE_COUNT=8"], "0.26.0")
    assert base != bpf_cache.cache_key([b"int x;", b"struct r;"], ["-DSITE_COUNT=7"], "0.27.0")
    # parts are delimited: moving a byte from one part to the next is another key
    assert base != bpf_cache.cache_key([b"int x;s", b"truct r;"], ["-DSITE_COUNT=7"], "0.26.0")


def test_a_cold_start_s_estimate_is_the_last_compile_measured(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MTRACE_LIVE_BPF_CACHE", str(tmp_path / "bpf"))
    # GIVEN no compile measured yet: the estimate for this kind of machine
    assert bpf_cache.compile_estimate() == bpf_cache.COMPILE_ESTIMATE_S
    # WHEN a compile took 4.4 s, THEN the next estimate is that
    bpf_cache.note_compile(4.4)
    assert bpf_cache.compile_estimate() == 4.4
    # AND a kept figure that does not read as one is not believed
    (tmp_path / "bpf" / "last-compile-seconds").write_text("soon\n")
    assert bpf_cache.compile_estimate() == bpf_cache.COMPILE_ESTIMATE_S
    # AND with the cache off, nothing is kept and the estimate stands
    monkeypatch.setenv("MTRACE_LIVE_BPF_CACHE", "off")
    bpf_cache.note_compile(9.0)
    assert bpf_cache.compile_estimate() == bpf_cache.COMPILE_ESTIMATE_S


def ld_u64(dst: int, value: int) -> bytes:
    """A 64-bit immediate load of any unsigned 64-bit value."""
    return (struct.pack("<BBhI", 0x18, dst, 0, value & 0xFFFFFFFF)
            + struct.pack("<BBhI", 0, 0, 0, value >> 32))  # fmt: skip


def test_run_time_values_are_written_over_their_marks_and_nothing_else() -> None:
    # GIVEN two functions loading run-time values' marks (mark 3 twice), a map,
    # and a 64-bit constant whose high word is the mark's but through a map load
    mark = bpf_cache.RUNTIME_MARK << 32
    first = ld_imm64(1, mark | 3) + ld_map(2, 5) + ld_imm64(3, mark | 3) + MOV_R0_0 + EXIT
    second = ld_imm64(4, mark | 9) + insn(0x18, 5, 1, 0, 6) + insn(0, imm=bpf_cache.RUNTIME_MARK)
    types = ('"int"', '"int"')
    maps = [bpf_cache.MapSpec("events", 0, 5, 27, 0, 0, 4096, 0, "events", *types),
            bpf_cache.MapSpec("rows", 1, 6, 2, 4, 16, 1024, 0, "rows", *types)]  # fmt: skip
    compiled = bpf_cache.Compiled("GPL", 0, {"a": first, "b": second + EXIT}, maps)
    # WHEN a run gives mark 3 the value 1 and mark 9 a value of 64 bits, and
    # makes its events ring 16 pages
    run = bpf_cache.Given({mark | 3: 1, mark | 9: 0x1234_5678_9ABC_DEF0}, {"events": 65536})
    given = bpf_cache.specialize(compiled, run)
    # THEN each load of a mark loads the value; the map loads and the rest are as they were
    assert given.functions["a"] == (ld_imm64(1, 1) + ld_map(2, 5) + ld_imm64(3, 1)
                                    + MOV_R0_0 + EXIT)  # fmt: skip
    assert given.functions["b"] == (ld_u64(4, 0x1234_5678_9ABC_DEF0) + insn(0x18, 5, 1, 0, 6)
                                    + insn(0, imm=bpf_cache.RUNTIME_MARK) + EXIT)  # fmt: skip
    # AND the ring is made at the run's size, the other map at the compiled one
    assert [spec.max_entries for spec in given.maps] == [65536, 1024]
    assert [replace(spec, max_entries=0) for spec in given.maps] == [
        replace(spec, max_entries=0) for spec in maps]  # fmt: skip
    # AND the stored program is left as compiled, for the next run's values
    assert compiled.functions["a"] == first and compiled.maps == maps
    # AND a negative value is its 64-bit two's complement
    negative = bpf_cache.specialize(compiled, bpf_cache.Given({mark | 3: -1, mark | 9: 0}))
    assert negative.functions["a"].startswith(ld_u64(1, 2**64 - 1))
    # AND code that loads a mark the run does not give is refused, not loaded with the mark
    with pytest.raises(ValueError, match="not given"):
        bpf_cache.specialize(compiled, bpf_cache.Given({mark | 3: 1}))


def test_every_run_time_value_has_a_mark_of_its_own_and_is_no_define() -> None:
    from mtrace_live.probes.program import ProgramConfig, runtime_values

    # GIVEN the run-time values runtime.h names
    values = runtime_values()
    assert len(values) >= 18
    # THEN each mark is the runtime mark's, and no two are one
    assert all(value.mark >> 32 == bpf_cache.RUNTIME_MARK for value in values.values())
    assert len({value.mark for value in values.values()}) == len(values)
    # AND a program's source gives each a value, by its mark, and none as a -D
    # (the compile-time key does not depend on them)
    source = ProgramConfig(follow_forks=False, exact_times=False).source()
    flags = source.cflags()
    assert not [flag for flag in flags if flag[2:].split("=")[0] in values]
    given = source.values()
    assert set(given) == {value.mark for value in values.values()}
    assert given[values["FOLLOW_FORKS"].mark] == 0 and given[values["FILTER_PIDS"].mark] == 1
    assert given[values["PROBE_EXACT_TIME"].mark] == 0
    other = ProgramConfig(follow_forks=True, exact_times=True, filter_pids=False).source()
    assert other.cflags() == flags and other.values() != given


def test_the_tables_sizes_are_the_run_s_and_their_masks_follow() -> None:
    from mtrace_live.probes.program import ProgramConfig, runtime_values

    marks = {name: value.mark for name, value in runtime_values().items()}
    # GIVEN two runs whose tables differ in size, the ring too
    sizes = {"ALLOC_OUT_ROWS": 1 << 12, "ALLOC_STACK_ROWS": 1 << 10, "FRAME_ROWS": 1 << 10}
    small = ProgramConfig(ring_pages=64, allocs={"WITH_ALLOCS": 1, **sizes}).source()
    large = ProgramConfig(ring_pages=4096, allocs={"WITH_ALLOCS": 1, **{
        name: rows * 8 for name, rows in sizes.items()}}).source()  # fmt: skip
    # THEN they compile alike
    assert small.cflags() == large.cflags()
    # AND each makes its maps at its own sizes (the ring's in bytes)
    assert small.sizes() == {"events": 64 * 4096, "outstanding": 1 << 12, "alloc_stacks": 1 << 10,
                             "alloc_frames": 1 << 10, "alloc_frame_claims": 1 << 10}  # fmt: skip
    assert large.sizes()["outstanding"] == 1 << 15 and large.sizes()["events"] == 4096 * 4096
    # AND its open-addressed tables' masks are its rows less one
    values = small.values()
    assert values[marks["ALLOC_OUT_MASK"]] == (1 << 12) - 1
    assert values[marks["ALLOC_STACK_MASK"]] == values[marks["FRAME_MASK"]] == (1 << 10) - 1


def test_a_run_without_the_allocation_functions_compiles_as_one_with_them() -> None:
    from mtrace_live.probes.program import ALLOC_HANDLERS, ProgramConfig

    # GIVEN a run with the allocation functions and one without (lock waits in
    # both, each with its stacks walked), the derived probes' system calls in
    # both or in neither
    allocs = {"WITH_ALLOCS": 1, "ALLOC_WALK": 1, "ALLOC_OUT_ROWS": 1 << 12,
              "ALLOC_STACK_ROWS": 1 << 10, "FRAME_ROWS": 1 << 10}  # fmt: skip
    locks = {"WITH_LOCK_TIMES": 1, "LOCK_STACKS": 1, "LOCK_ROWS": 4096, "LOCK_STACK_ROWS": 8192}
    derived = {"DERIVED_SYSCALLS": 1}
    for syscalls in (derived, {"DERIVED_SYSCALLS": 0}):
        on = ProgramConfig(allocs=allocs, locks=locks, derived=syscalls).source()
        off = ProgramConfig(locks=locks, derived=syscalls).source()
        # THEN both compile alike: one program
        assert on.cflags() == off.cflags()
        # AND the run without them leaves their handlers out, and makes their
        # tables with one entry each
        assert on.absent == () and set(ALLOC_HANDLERS) <= set(off.absent)
        shared = [name for name in off.absent if name not in ALLOC_HANDLERS]
        assert (shared == []) == bool(syscalls["DERIVED_SYSCALLS"])
        sizes = off.sizes()
        for table in ("outstanding", "alloc_stacks", "pending", "alloc_procs", "vm_pending"):
            assert sizes[table] == 1, table
    # AND defines set in another order compile alike
    source = ProgramConfig(locks=locks).source()
    shuffled = replace(source, defines=dict(reversed(list(source.defines.items()))))
    assert shuffled.cflags() == source.cflags()
    # AND the handlers left out are those a name or a name's beginning says
    given = bpf_cache.Given({}, {}, ("alloc_*", "tracepoint__syscalls__sys_exit_mmap"))
    code = ld_imm64(0, 0) + EXIT
    mmap = "tracepoint__syscalls__sys_exit_mmap"
    names = ["alloc_malloc", "alloc_resume", "lock_wait_enter", mmap, mmap + "2", "site_0"]
    compiled = bpf_cache.Compiled("GPL", 0, dict.fromkeys(names, code), [])
    kept = bpf_cache.specialize(compiled, given).functions
    assert sorted(kept) == ["lock_wait_enter", "site_0", "tracepoint__syscalls__sys_exit_mmap2"]
