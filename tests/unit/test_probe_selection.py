"""Choosing probes by glob: only the libc provider, each name once, in note order."""

from fnmatch import fnmatchcase

from hypothesis import given
from hypothesis import strategies as st
from mtrace_live.probes.sdt_notes import SdtSite
from mtrace_live.tracer.loop.usdt import select_probes


def site(provider: str, name: str) -> SdtSite:
    return SdtSite(provider, name, address=0, file_offset=0, semaphore=0, arguments=())


SITES = [
    site("libc", "memory_mallopt"),
    site("libc", "memory_mallopt_mxfast"),
    site("libc", "memory_mallopt_mxfast"),  # a second site of the same probe
    site("libc", "setjmp"),
    site("rtld", "init_start"),
]


def test_glob_selects_libc_probes_once_each() -> None:
    assert select_probes(SITES, ["memory_mallopt*"]) == [
        "memory_mallopt",
        "memory_mallopt_mxfast",
    ]


def test_other_providers_are_never_selected() -> None:
    assert select_probes(SITES, ["*"]) == ["memory_mallopt", "memory_mallopt_mxfast", "setjmp"]


@given(st.lists(st.sampled_from(["memory_*", "setjmp", "*", "nothing", "*mxfast", "mem*opt"]),
                min_size=1))  # fmt: skip
def test_selection_is_every_libc_probe_a_pattern_matches_once_in_note_order(
    patterns: list[str],
) -> None:
    chosen = select_probes(SITES, patterns)
    # the libc probes in note order, each matched by the shell's rules (fnmatch)
    order = ["memory_mallopt", "memory_mallopt_mxfast", "setjmp"]
    assert chosen == [name for name in order if any(fnmatchcase(name, p) for p in patterns)]


def test_site_locations_become_compile_time_constants_for_every_compiled_handler() -> None:
    from pathlib import Path

    from mtrace_live.probes.locations import ArgKind, ArgLocation, SiteLayout
    from mtrace_live.tracer.loop.usdt import ProbeSelection, handlers_compiled, site_defines

    assert [handlers_compiled(n) for n in (0, 1, 10, 11, 120, 121, 128)] == [
        0, 10, 10, 20, 120, 128, 128,
    ]  # fmt: skip
    rsi_signed = ArgLocation(ArgKind.REG, 4, True, reg=13)
    rip = ArgLocation(ArgKind.DEREF_IP, 8, False, value=-0x1234)
    selection = ProbeSelection(
        Path("/libc.so.6"),
        ("setjmp", "memory_mallopt_mxfast"),
        (
            SiteLayout(site("libc", "memory_mallopt_mxfast"), (rsi_signed, rip)),
            SiteLayout(site("libc", "setjmp"), ()),
        ),
        {},
    )
    defines = site_defines(selection)
    assert defines["SITE_COUNT"] == 2
    assert (defines["SP0"], defines["SN0"], defines["SP1"], defines["SN1"]) == (1, 2, 0, 0)
    assert defines["SA0_0"] == int(ArgKind.REG) | 4 << 8 | 1 << 16 | 13 << 24
    assert (defines["SA0_1"], defines["SV0_1"]) == (int(ArgKind.DEREF_IP) | 8 << 8, -0x1234)
    # site_2 ... site_9 are compiled in the same block of ten: zeros, never attached
    assert {key for key in defines if key.startswith("SP")} == {f"SP{n}" for n in range(10)}
    assert all(defines[f"SA9_{i}"] == defines[f"SV9_{i}"] == 0 for i in range(6))
