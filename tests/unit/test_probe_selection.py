"""Choosing probes by glob: only the libc provider, each name once, in note order."""

from hypothesis import given
from hypothesis import strategies as st
from mtrace_live.probes.sdt_notes import SdtSite
from mtrace_live.tracer.usdt import select_probes


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


@given(st.lists(st.sampled_from(["memory_*", "setjmp", "*", "nothing", "*mxfast"]), min_size=1))
def test_selection_is_a_duplicate_free_subset_in_note_order(patterns: list[str]) -> None:
    chosen = select_probes(SITES, patterns)
    order = ["memory_mallopt", "memory_mallopt_mxfast", "setjmp"]
    assert len(chosen) == len(set(chosen))
    assert chosen == [name for name in order if name in chosen]
