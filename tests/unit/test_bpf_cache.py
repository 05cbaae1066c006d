"""The compiled-program cache's pure parts (tracer/bpf/bpf_cache.py): the map
descriptors rewritten in BPF code, what is stored and read back, and what
the key depends on. The load itself is tested against the kernel in
tests/privileged/test_bpf_cache.py."""

from __future__ import annotations

import os
import struct
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
