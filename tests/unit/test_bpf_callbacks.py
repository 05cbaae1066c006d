"""A program's callback linked in as bcc 0.26 cannot (tracer/bpf/bpf_callbacks.py):
the callback's code appended, the one 64-bit load of 0 that bcc left for its
address made a BPF_PSEUDO_FUNC load of it, and the functions' BTF. The
kernel's verifier accepting the result is the privileged tests' (every trace
with whole stacks loads unwind_vma so)."""

from __future__ import annotations

import struct

import pytest
from mtrace_live.tracer.bpf.bpf_callbacks import callback_of, func_btf, has_callback, link


def insn(opcode: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", opcode, dst | src << 4, off, imm)


LD_IMM64, MOV64_IMM, CALL, EXIT = 0x18, 0xB7, 0x85, 0x95


def program(loads: int) -> bytes:
    """r1 = 1; ``loads`` times r3 = 0 ll; a 64-bit constant; call 180; exit."""
    code = insn(MOV64_IMM, 1, imm=1)
    for _ in range(loads):
        code += insn(LD_IMM64, 3) + insn(0)
    code += insn(LD_IMM64, 4, imm=0x7C15) + insn(0, imm=0x9E37)  # a constant, not an address
    return code + insn(CALL, imm=180) + insn(EXIT)


def test_the_load_of_the_callback_becomes_a_pseudo_func_load_of_its_code() -> None:
    # GIVEN a program of 8 instructions whose load of 0 is its 2nd, and a callback of 2
    code, callback = program(1), insn(MOV64_IMM, 0) + insn(EXIT)
    # WHEN linked
    linked = link(code, callback)
    # THEN the callback follows the program, unchanged
    assert len(linked) == len(code) + len(callback) and linked.endswith(callback)
    # AND the load names BPF_PSEUDO_FUNC (4), and its immediate reaches the
    # callback's first instruction from the load's next: 1 + 1 + 6 = 8
    opcode, regs, _, imm = struct.unpack_from("<BBhi", linked, 8)
    assert (opcode, regs & 0xF, regs >> 4) == (LD_IMM64, 3, 4)
    assert 1 + 1 + imm == len(code) // 8
    # AND nothing else changed (the constant's load among it)
    assert linked[:8] == code[:8] and linked[16 : len(code)] == code[16:]


@pytest.mark.parametrize("loads", [0, 2])
def test_code_without_exactly_one_load_of_0_is_refused(loads: int) -> None:
    with pytest.raises(ValueError, match=f"holds {loads} loads of 0"):
        link(program(loads), insn(EXIT))


def test_code_that_is_not_whole_instructions_is_refused() -> None:
    with pytest.raises(ValueError, match="whole instructions"):
        link(program(1)[:-3], insn(EXIT))


def test_a_program_s_callback_is_found_by_its_name() -> None:
    functions = {"unwind_vma": b"", callback_of("unwind_vma"): b"", "unwind_step": b""}
    assert has_callback("unwind_vma", functions)
    assert not has_callback("unwind_step", functions)
    assert not has_callback(callback_of("unwind_vma"), functions)


def test_the_btf_names_the_two_functions_with_their_prototypes() -> None:
    blob = func_btf("unwind_vma", "unwind_vma__callback")
    magic, version, _, header, type_off, type_len, str_off, str_len = struct.unpack_from(
        "<HBBIIIII", blob)  # fmt: skip
    assert (magic, version, header) == (0xEB9F, 1, 24)
    types = blob[header + type_off : header + type_off + type_len]
    strings = blob[header + str_off : header + str_off + str_len]
    assert strings.startswith(b"\0") and strings.endswith(b"\0")

    def name(offset: int) -> str:
        return strings[offset:].split(b"\0", 1)[0].decode()

    # the types in order: INT, PTR, FUNC_PROTO (3 params), FUNC, FUNC_PROTO (1), FUNC
    kinds, funcs, at = [], {}, 0
    while at < len(types):
        name_off, info, size_or_type = struct.unpack_from("<III", types, at)
        kind, vlen = info >> 24 & 0x1F, info & 0xFFFF
        kinds.append(kind)
        if kind == 12:  # FUNC: linkage in vlen, its prototype's id
            funcs[name(name_off)] = (vlen, size_or_type)
        at += 12 + (4 if kind == 1 else 8 * vlen if kind == 13 else 0)
    assert kinds == [1, 2, 13, 12, 13, 12]
    # the callback static (0), of the 3-parameter prototype (type 3); the program global
    assert funcs == {"unwind_vma__callback": (0, 3), "unwind_vma": (1, 5)}
