"""The catalog data: complete for glibc 2.36, and validated when loaded."""

import re
from pathlib import Path
from typing import Any

import pytest
from mtrace_live.probes.catalog import (
    CatalogError,
    build_catalog,
    load_catalog,
    parse_note_arg,
    type_layout,
)

TEXI = Path(__file__).resolve().parents[3] / "shared" / "specs" / "glibc-probes.texi"

NPTL_PROBES = {
    "mutex_init", "mutex_destroy", "mutex_entry", "mutex_acquired", "mutex_timedlock_entry",
    "mutex_clocklock_entry", "mutex_timedlock_acquired", "mutex_release", "lll_lock_wait",
    "lll_lock_wait_private", "cond_init", "cond_destroy", "cond_wait", "cond_signal",
    "cond_broadcast", "rdlock_entry", "rdlock_acquire_read", "wrlock_entry",
    "wrlock_acquire_write", "rwlock_unlock", "rwlock_destroy", "pthread_create",
    "pthread_start", "pthread_join", "pthread_join_ret",
}  # fmt: skip

MANUAL_PROBES = {
    "memory_sbrk_more", "memory_sbrk_less", "memory_heap_new", "memory_heap_free",
    "memory_heap_more", "memory_heap_less", "memory_malloc_retry", "memory_realloc_retry",
    "memory_memalign_retry", "memory_calloc_retry", "memory_arena_retry", "memory_arena_new",
    "memory_arena_reuse", "memory_arena_reuse_wait", "memory_arena_reuse_free_list",
    "memory_mallopt", "memory_mallopt_mxfast", "memory_mallopt_trim_threshold",
    "memory_mallopt_top_pad", "memory_mallopt_mmap_threshold", "memory_mallopt_mmap_max",
    "memory_mallopt_perturb", "memory_mallopt_arena_test", "memory_mallopt_arena_max",
    "memory_mallopt_free_dyn_thresholds", "memory_tunable_tcache_max_bytes",
    "memory_tunable_tcache_count", "memory_tunable_tcache_unsorted_limit",
    "memory_tcache_double_free", "setjmp", "longjmp", "longjmp_target",
}  # fmt: skip


def test_catalog_covers_all_57_libc_probes_of_glibc_2_36() -> None:
    names = {name for provider, name in load_catalog().probes if provider == "libc"}
    assert names == MANUAL_PROBES | NPTL_PROBES
    assert len(names) == 57


def test_catalog_covers_every_probe_the_manual_documents() -> None:
    # The shared spec is beside the repository in a checkout; the list above
    # must agree with it, so it is read when present.
    if not TEXI.exists():
        pytest.fail(f"{TEXI} is missing: the tests expect shared/ beside the checkout")
    documented = set(re.findall(r"@deftpx? Probe (\w+)", TEXI.read_text()))
    assert documented == MANUAL_PROBES


def test_catalog_has_the_rtld_probes_and_six_kmem_tracepoints() -> None:
    catalog = load_catalog()
    rtld = {name for provider, name in catalog.probes if provider == "rtld"}
    assert {"init_start", "init_complete", "map_start", "map_complete", "reloc_start",
            "reloc_complete", "unmap_start", "unmap_complete", "map_failed"} <= rtld  # fmt: skip
    assert set(catalog.tracepoints) == {
        "kmalloc", "kfree", "kmem_cache_alloc", "kmem_cache_free", "mm_page_alloc", "mm_page_free",
    }  # fmt: skip


def test_sbrk_probes_record_the_manuals_swapped_arguments() -> None:
    spec = load_catalog().probe("libc", "memory_sbrk_more")
    assert spec is not None
    assert [a.name for a in spec.args] == ["brk", "size"]
    assert [a.role for a in spec.args] == ["address", "bytes"]
    assert (spec.args[1].size, spec.args[1].signed) == (8, True)  # long, note -8@%r15
    assert "(size, pointer)" in spec.manual


def good_probe(**changes: Any) -> dict[str, Any]:
    probe = {
        "provider": "p", "name": "n", "source": "s.c", "fires": "after", "meaning": "m",
        "args": [{"name": "a", "type": "size_t", "role": "bytes"}],
    }  # fmt: skip
    probe.update(changes)
    return probe


@pytest.mark.parametrize(
    ("probe", "complaint"),
    [
        (good_probe(fires="during"), "fires must be one of"),
        (good_probe(args=[{"name": "a", "type": "size_t", "role": "size"}]), "unknown role"),
        (good_probe(args=[{"name": "a", "type": "float", "role": "bytes"}]), "unknown C type"),
        (good_probe(meaning=""), "lacks meaning"),
        (good_probe(colour="red"), "unknown keys"),
        (good_probe(args=[{"name": "a", "type": "int", "role": "flag"}] * 2), "names repeat"),
        (good_probe(effect="explode"), "unknown effect"),
        (good_probe(retry="malloc"), "retry goes with effect retry or arena_retry"),
        (good_probe(effect="setting"), "setting goes with effect setting"),
        (good_probe(kmemtrace="alloc slab"), "kmemtrace must be"),
        (good_probe(kmemtrace="grow heap"), "kmemtrace must be"),
    ],
)
def test_invalid_entries_are_refused_when_loaded(probe: dict[str, Any], complaint: str) -> None:
    with pytest.raises(CatalogError, match=complaint):
        build_catalog({"bad.toml": {"probe": [probe]}})


def test_a_probe_listed_twice_is_refused() -> None:
    with pytest.raises(CatalogError, match="listed twice"):
        build_catalog({"a.toml": {"probe": [good_probe()]}, "b.toml": {"probe": [good_probe()]}})


def test_type_layouts_follow_lp64() -> None:
    assert type_layout("long") == (8, True)
    assert type_layout("size_t") == (8, False)
    assert type_layout("int") == (4, True)
    assert type_layout("struct r_debug *") == (8, False)


@pytest.mark.parametrize(
    ("text", "size", "signed", "location"),
    [
        ("-4@%esi", 4, True, "%esi"),
        ("8@%rcx", 8, False, "%rcx"),
        ("8@32+mp_(%rip)", 8, False, "32+mp_(%rip)"),
        ("-8@demo_counter(%rip)", 8, True, "demo_counter(%rip)"),
        ("%eax", None, False, "%eax"),
    ],
)
def test_note_arguments_parse(text: str, size: int | None, signed: bool, location: str) -> None:
    arg = parse_note_arg(text)
    assert (arg.size, arg.signed, arg.location) == (size, signed, location)


def test_every_effect_has_a_handler_in_the_model_and_each_probe_says_its_own() -> None:
    from mtrace_live.probes.catalog import EFFECTS
    from mtrace_live.probes.meanings import meanings
    from mtrace_live.tracer.loop.model import _HANDLERS

    # GIVEN the meanings the specs give
    known = meanings()
    # THEN every effect is handled (lock waits are counted in bulk) ...
    assert set(_HANDLERS) | {"lock_wait"} == EFFECTS
    # ... and the tables the outputs used to hold by hand are what the specs say
    assert known.retries == {
        "memory_malloc_retry": "malloc", "memory_realloc_retry": "realloc",
        "memory_memalign_retry": "memalign", "memory_calloc_retry": "calloc",
        "memory_arena_retry": "arena",
    }  # fmt: skip
    assert known.with_effect("double_free_check") == ("memory_tcache_double_free",)
    assert known.kmemtrace_probes("alloc") == {
        "memory_sbrk_more": "sbrk",
        "memory_heap_new": "heap",
        "memory_arena_new": "arena",
    }
    assert known.kmemtrace_probes("free") == {
        "memory_sbrk_less": "sbrk",
        "memory_heap_free": "heap",
    }
    assert known.kmemtrace["kfree"] == ("free", "kmalloc")
    assert len(known.settings) == 12 and known.settings["memory_mallopt_arena_max"] == "M_ARENA_MAX"
    # AND each probe's own catalog entry gives that effect
    catalog = load_catalog()
    for probe, effect in known.effects.items():
        spec = catalog.probe("libc", probe)
        assert spec is not None and spec.effect == effect
    assert "lll_lock_wait_private" not in known.stateful
