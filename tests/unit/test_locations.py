"""SDT argument operands -> what BPF reads, for every form glibc's notes use."""

from pathlib import Path

import pytest
from mtrace_live.probes.locations import ArgKind, ArgLocation, layout_sites, parse_location
from mtrace_live.probes.sdt_notes import SdtSite

SYMBOLS = {"mp_": 0x1E3280, "perturb_byte": 0x1E5A10, "global_max_fast": 0x1E6B00}
SITE = 0x8DD53


def parse(text: str) -> ArgLocation:
    return parse_location(text, SITE, SYMBOLS.get)


@pytest.mark.parametrize(
    ("text", "slot", "size", "signed"),
    [
        ("8@%rax", 10, 8, False),
        ("-4@%ebx", 5, 4, True),
        ("4@%esi", 13, 4, False),
        ("8@%r15", 0, 8, False),
        ("-4@%r8d", 9, 4, True),
        ("2@%di", 14, 2, False),
        ("1@%sil", 13, 1, False),
        ("%rdi", 14, 8, False),  # no size: the register's width
        ("%ecx", 11, 4, False),
    ],
)
def test_registers(text: str, slot: int, size: int, signed: bool) -> None:
    assert parse(text) == ArgLocation(ArgKind.REG, size, signed, reg=slot)


def test_register_plus_displacement() -> None:
    assert parse("8@1592(%rbx)") == ArgLocation(ArgKind.DEREF_REG, 8, False, reg=5, value=1592)
    assert parse("-4@-8(%rbp)") == ArgLocation(ArgKind.DEREF_REG, 4, True, reg=4, value=-8)
    assert parse("8@(%rsp)") == ArgLocation(ArgKind.DEREF_REG, 8, False, reg=19, value=0)


def test_rip_relative_is_a_distance_from_the_site() -> None:
    # 32+mp_(%rip) is mp_.arena_max: symbol + offset, wherever libc is loaded.
    assert parse("8@32+mp_(%rip)") == ArgLocation(
        ArgKind.DEREF_IP, 8, False, value=SYMBOLS["mp_"] + 32 - SITE
    )
    assert parse("-4@perturb_byte(%rip)").value == SYMBOLS["perturb_byte"] - SITE
    assert parse("8@global_max_fast+8(%rip)").value == SYMBOLS["global_max_fast"] + 8 - SITE


def test_constants() -> None:
    assert parse("-4@$-1") == ArgLocation(ArgKind.CONST, 4, True, value=-1)
    assert parse("8@$0x10") == ArgLocation(ArgKind.CONST, 8, False, value=16)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("8@missing_(%rip)", "not in the file's symbol tables"),
        ("8@(%rax,%rbx,8)", "not supported"),
        ("1@%ah", "not readable"),
        ("3@%rax", "unsupported size"),
        ("8@16(%rip)", "not supported"),
    ],
)
def test_what_cannot_be_read_is_said(text: str, why: str) -> None:
    location = parse(text)
    assert not location.readable
    assert why in location.why and text in location.why


def test_layout_of_register_arguments_needs_no_symbols() -> None:
    fixture = Path(__file__).parents[1] / "fixtures" / "elf" / "sdt_fixture.so"
    site = SdtSite("p", "n", 0x1000, 0x1000, 0, ("-4@%edi", "8@%rsi"))
    (layout,) = layout_sites(fixture, [site])
    assert [a.kind for a in layout.args] == [ArgKind.REG, ArgKind.REG]
