"""The one chooser of a uprobe's site (probes/uprobe_sites.py): the first
instruction at or after X that the kernel emulates, on the straight path,
with no jump landing on the way, before a register asked for or the stack
is written; hand-assembled code."""

from __future__ import annotations

import pytest
from mtrace_live.probes.uprobe_sites import Site, disassemble, first_emulated, jump_targets

TEST_RDI, TEST_RSI, PUSH_RBP = "4885ff", "4885f6", "55"


def site(hexcode: str, *registers: str, **options: object) -> Site:
    insns = disassemble(bytes.fromhex(hexcode), 0x1000)
    return first_emulated(insns, 0x1000, registers, **options)  # type: ignore[arg-type]


def test_the_first_emulated_instruction_is_the_site() -> None:
    assert site(TEST_RDI + TEST_RSI + PUSH_RBP, "rdi") == Site(0x1006, "push rbp", True, ("rdi",))


def test_a_jump_landing_on_the_way_leaves_the_start() -> None:
    # GIVEN a jump elsewhere that lands on the push (or on the test before it)
    for target in (0x1003, 0x1006):
        found = site(TEST_RDI + TEST_RSI + PUSH_RBP, "rdi", targets={target})
        # THEN the push is not passed once per pass through the start: the start it is
        assert found == Site(0x1000, "test rdi, rdi", False, ("rdi",))
    # AND a jump to the start itself passes the push as often as the start: the push
    assert site(TEST_RDI + TEST_RSI + PUSH_RBP, "rdi", targets={0x1000}).address == 0x1006


# Encodings as objdump -D -b binary -mi386:x86-64 -M intel reads them.
@pytest.mark.parametrize(("before", "why"), [
    ("4883ec08", "sub rsp, 8: the return address moves"),
    ("0f05", "syscall"),
    ("c3", "ret"),
    ("f4", "hlt"),
    ("0f0b", "ud2"),
    ("4889c7", "mov rdi, rax: the register asked for"),
    ("89c7", "mov edi, eax: part of it"),
    ("ff2500000000", "jmp QWORD PTR [rip+0x0]: away, not emulated"),
    ("ff20", "jmp QWORD PTR [rax]"),
    ("ffe0", "jmp rax"),
    ("3effe0", "notrack jmp rax (a CET jump table's)"),
    ("ff1500000000", "call QWORD PTR [rip+0x0]: not emulated, and it pushes"),
    ("ff10", "call QWORD PTR [rax]"),
])  # fmt: skip
def test_a_write_of_the_stack_or_a_register_or_an_end_leaves_the_start(
    before: str, why: str
) -> None:
    assert site(before + PUSH_RBP, "rdi").emulated is False, why
    assert site(before + PUSH_RBP, "rdi").address == 0x1000, why


def test_a_one_byte_nop_is_emulated_and_a_longer_one_is_passed() -> None:
    # GIVEN nop (90), and the multi-byte nops a compiler pads with
    # (66 90: xchg ax,ax; 0f 1f 40 00: nop DWORD PTR [rax+0x0]), before a push
    # THEN the one-byte nop is the site; the longer ones, single-stepped, are
    # passed for the push
    assert site(TEST_RDI + "90" + PUSH_RBP, "rdi") == Site(0x1003, "nop", True, ("rdi",))
    assert site(TEST_RDI + "6690" + PUSH_RBP, "rdi") == Site(0x1005, "push rbp", True, ("rdi",))
    assert site(TEST_RDI + "0f1f4000" + PUSH_RBP, "rdi").address == 0x1007


def test_a_relative_jump_or_call_is_itself_the_site() -> None:
    # jmp rel32 (e9) and call rel32 (e8) are emulated, unlike those through memory
    assert site(TEST_RDI + "e900000000", "rdi") == Site(0x1003, "jmp 0x1008", True, ("rdi",))
    assert site(TEST_RDI + "e800000000", "rdi") == Site(0x1003, "call 0x1008", True, ("rdi",))


def test_a_register_not_asked_for_may_be_written() -> None:
    assert site("4889c6" + PUSH_RBP, "rdi").address == 0x1003  # mov rsi, rax


def test_the_search_stops_at_its_limit() -> None:
    assert site(TEST_RDI + TEST_RSI + PUSH_RBP, "rdi", limit=2).address == 0x1000
    assert site(TEST_RDI + TEST_RSI + PUSH_RBP, "rdi", limit=3).address == 0x1006


def test_jump_targets_are_the_direct_jumps_and_calls_landing_points() -> None:
    # je +2 ; call +0 ; jmp rax (indirect: no target)
    insns = disassemble(bytes.fromhex("7402" + "e800000000" + "ffe0"), 0x1000)
    assert jump_targets(insns) == {0x1004, 0x1007}


def test_a_start_that_is_no_instruction_is_refused() -> None:
    with pytest.raises(ValueError, match="no instruction at 0x1001"):
        first_emulated(disassemble(bytes.fromhex(TEST_RDI), 0x1000), 0x1001, ("rdi",))
