"""The uprobe site of each allocation function: the first instruction the
kernel emulates, with the arguments intact (probes/alloc_sites.py)."""

from __future__ import annotations

from pathlib import Path

import capstone
import pytest
from mtrace_live.probes.alloc_sites import ALLOC_FUNCTIONS, alloc_sites, choose_site

DEBIAN_LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")


def test_sites_in_debians_stock_libc() -> None:
    # GIVEN Debian's glibc 2.36, which has no SDT notes
    sites = alloc_sites(DEBIAN_LIBC)
    # THEN every allocation function is found in its dynamic symbols
    assert set(sites) == set(ALLOC_FUNCTIONS)
    # AND malloc's first instruction (push %r12) is emulated: the entry itself
    assert sites["malloc"].offset == 0 and sites["malloc"].instruction == "push r12"
    # AND free's first (test %rdi,%rdi) is stepped, so the je after it is chosen
    assert sites["free"].offset == 3 and sites["free"].instruction.startswith("je ")
    # AND memalign and aligned_alloc are one address
    assert sites["memalign"].address == sites["aligned_alloc"].address
    assert sites["memalign"].aliases == ("aligned_alloc",)
    # AND reallocarray's mul writes %rdx (its size) before any emulated instruction
    assert not sites["reallocarray"].emulated and sites["reallocarray"].offset == 0
    assert all(site.emulated for name, site in sites.items() if name != "reallocarray")


def test_an_argument_written_before_an_emulated_instruction_leaves_the_entry() -> None:
    # test rdi,rdi ; mov edi,eax ; push rbp
    code = bytes.fromhex("4885ff89c755")
    assert choose_site(code, 0x1000, ("rdi",))[:3] == (0x1000, "test rdi, rdi", False)
    # the same with the register left alone: the push is the site
    code = bytes.fromhex("4885ff89c655")  # mov esi,eax writes rsi, not an argument here
    assert choose_site(code, 0x1000, ("rdi",))[:3] == (0x1005, "push rbp", True)


# mimalloc 2.0's mi_calloc: mov rdx,[rip+x]; mov rax,rdi; mov rdi,fs:[rdx];
# cmp rax,1; je +8; mul rsi ...
MI_CALLOC = bytes.fromhex("488b15c9ad00004889f864488b3a4883f80174 08 48f7e6".replace(" ", ""))


def test_arguments_moved_to_other_registers_are_followed_to_the_first_emulated_one() -> None:
    # GIVEN calloc's count copied from rdi to rax, then rdi overwritten
    # WHEN the moves are followed, THEN the je is the site, count in rax
    assert choose_site(MI_CALLOC, 0x1000, ("rdi", "rsi"), follow_moves=True) == (
        0x1012, "je 0x101c", True, ("rax", "rsi"))  # fmt: skip
    # AND when they are not (a kernel without attach cookies), the entry is
    assert choose_site(MI_CALLOC, 0x1000, ("rdi", "rsi"))[:3] == (
        0x1000, "mov rdx, qword ptr [rip + 0xadc9]", False)  # fmt: skip


def test_an_argument_overwritten_before_it_was_copied_leaves_the_entry() -> None:
    # mov rdi,rax ; mov rsi,rdi ; push rbp: the argument is lost at the first
    code = bytes.fromhex("4889c74889fe55")
    assert choose_site(code, 0x1000, ("rdi",), follow_moves=True)[2] is False
    # a 32-bit copy (mov esi,edi) truncates it: not followed
    code = bytes.fromhex("89fe4889c755")
    assert choose_site(code, 0x1000, ("rdi",), follow_moves=True)[2] is False


@pytest.mark.parametrize("name", sorted(ALLOC_FUNCTIONS))
def test_the_file_offset_holds_the_sites_instruction(name: str) -> None:
    # GIVEN a site, WHEN the bytes at its file offset are decoded at its address
    site = alloc_sites(DEBIAN_LIBC)[name]
    with DEBIAN_LIBC.open("rb") as stream:
        stream.seek(site.file_offset)
        code = stream.read(16)
    disassembler = capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)
    insn = next(disassembler.disasm(code, site.address))
    # THEN they are the instruction chosen (uprobes are placed by file offset)
    assert f"{insn.mnemonic} {insn.op_str}".strip() == site.instruction
