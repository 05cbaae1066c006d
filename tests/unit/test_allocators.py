"""Which allocator a set of objects binds malloc to, and where each known
allocator is probed, on the Debian packages' own files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from mtrace_live.probes.allocators import JEMALLOC, KNOWN, MIMALLOC, TCMALLOC, identify
from mtrace_live.probes.elf.file import open_elf
from mtrace_live.probes.elf.symbols import defined_functions
from mtrace_live.tracer.loop.alloc_probes import plan_sites
from mtrace_live.tracer.processes.providers import resolve, search_order

from .cli_runs import assert_one_line, mtrace
from .needs import needs

LIBS = Path("/usr/lib/x86_64-linux-gnu")
LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")
FILES = {
    "glibc": LIBC,
    "jemalloc": LIBS / "libjemalloc.so.2",
    "tcmalloc": LIBS / "libtcmalloc_minimal.so.4",
    "mimalloc": LIBS / "libmimalloc.so.2",
}


def file_of(name: str) -> Path:
    path = FILES[name]
    needs(path.exists(), f"{path} (make setup installs the allocators' Debian packages)")
    return path


@pytest.mark.parametrize("name", sorted(FILES))
def test_each_allocators_library_is_told_by_its_symbols(name: str) -> None:
    # GIVEN the functions each allocator's library defines
    with open_elf(file_of(name)) as elf:
        defined = defined_functions(elf)
    # THEN it is told as that allocator, and it defines malloc
    found = identify(defined)
    assert found is not None and found.name == name
    assert "malloc" in defined


@pytest.mark.parametrize(("allocator", "own"), [
    (JEMALLOC, {"mallocx": "malloc", "rallocx": "realloc", "sdallocx": "free",
                "dallocx": "free", "aligned_alloc": "aligned_alloc"}),
    (TCMALLOC, {"tc_new": "malloc", "tc_free_sized": "free", "tc_delete_aligned": "free"}),
    # (mi_memalign jumps to mi_malloc_aligned, its arguments swapped: probed
    # as itself, not seen as the malloc it jumps to)
    (MIMALLOC, {"mi_zalloc": "malloc", "mi_mallocn": "calloc", "mi_memalign": "memalign",
                "mi_new_n": "calloc"}),
])  # fmt: skip
def test_each_allocators_own_entry_points_are_probed_as_their_kind(
    allocator: object, own: dict[str, str]
) -> None:
    # GIVEN the sites chosen in the allocator's library
    plan = plan_sites(file_of(allocator.name), allocator)  # type: ignore[attr-defined]
    # THEN each of its own entry points has a probe that reads it as its
    # kind, or is seen as one that does (it jumps there, or shares its address)
    for function, kind in own.items():
        probed = function
        while probed in plan.seen_as:
            probed = plan.seen_as[probed]
        assert plan.sites[probed].handler == kind, function
    # and the standard names are each probed, or seen as a probed function
    for function in ("malloc", "calloc", "realloc", "free", "posix_memalign"):
        seen = plan.seen_as.get(function, function)
        while seen in plan.seen_as:
            seen = plan.seen_as[seen]
        assert seen in plan.sites, function


@pytest.mark.parametrize("name", sorted(FILES))
def test_no_site_of_any_allocator_is_single_stepped(name: str) -> None:
    # GIVEN the sites planned in each allocator's library (mimalloc's move
    # their arguments to other registers before any emulated instruction)
    allocator = next(known for known in KNOWN if known.name == name)
    plan = plan_sites(file_of(name), allocator)
    # THEN every one is an instruction the kernel emulates
    assert plan.sites and plan.stepped == []
    # AND a site whose arguments moved says where they went in its cookie
    if name == "mimalloc":
        malloc = plan.sites["malloc"]  # mi_malloc is the same function
        assert malloc.instruction.startswith("ja ") and malloc.registers == ("rsi",)
        assert malloc.cookie == 0x2_0000_0000  # records.h: SR_RSI in bits 32-35


def test_a_jump_taken_on_one_path_only_is_no_tail_call() -> None:
    # GIVEN mimalloc's mi_heap_malloc_aligned, which jumps to
    # mi_heap_malloc_small for small sizes and allocates itself otherwise
    plan = plan_sites(file_of("mimalloc"), MIMALLOC)
    # THEN it has a probe of its own, its arguments one register on (the heap first)
    assert "mi_heap_malloc_aligned" not in plan.seen_as
    assert plan.sites["mi_heap_malloc_aligned"].registers == ("rsi",)
    # AND mi_heap_recalloc, whose every path ends in its jump to
    # mi_heap_rezalloc or returns NULL, is seen as that one
    assert plan.seen_as["mi_heap_recalloc"] == "mi_heap_rezalloc"


def test_malloc_binds_to_the_first_object_in_the_search_order_that_defines_it() -> None:
    # GIVEN a program, and jemalloc preloaded before its libc
    program = ("true", Path("/bin/true"))
    jemalloc, libc = file_of("jemalloc"), file_of("glibc")
    find = {"libc.so.6": libc, "libjemalloc.so.2": jemalloc}
    preloaded = search_order(program, [("libjemalloc.so.2", jemalloc)], find)
    plain = search_order(program, [], find)
    # THEN preloaded, jemalloc provides malloc, and glibc is traced beside it
    assert [name for name, _ in preloaded] == ["true", "libjemalloc.so.2", "libc.so.6"]
    found = resolve(preloaded, preloaded[1:])
    assert found.binding is not None and found.binding.label == "jemalloc (libjemalloc.so.2)"
    assert [p.allocator.name for p in found.all] == ["jemalloc", "glibc"]
    # and without it, glibc's libc does
    alone = resolve(plain, plain[1:])
    assert alone.binding is not None and alone.binding.allocator.name == "glibc"


def test_a_jemalloc_built_in_under_a_prefix_is_told_and_probed_under_it() -> None:
    # GIVEN the symbols of a program with jemalloc built in, as Rust's
    # tikv-jemallocator builds it (_rjem_ prefix), beside glibc's
    defined = {"_rjem_malloc", "_rjem_mallocx", "_rjem_sdallocx", "__libc_malloc", "main"}
    # THEN it is jemalloc, and its prefixed entry points are among those probed
    assert identify(defined) is JEMALLOC
    assert JEMALLOC.symbols["_rjem_mallocx"] == "malloc"
    assert JEMALLOC.symbols["_rjem_sdallocx"] == "free"


def test_an_object_of_no_known_allocator_that_defines_malloc_is_named() -> None:
    # GIVEN the workloads' own allocator (tests/workloads/bump_malloc.c),
    # preloaded before the libc: it defines the standard names, no one's marks
    bump = Path(__file__).parents[2] / "build" / "libbump_malloc.so"
    needs(bump.exists(), f"{bump} (make exercisers builds it)")
    order = [("true", Path("/bin/true")), ("libbump_malloc.so", bump),
             ("libc.so.6", file_of("glibc"))]  # fmt: skip
    found = resolve(order, order[1:])
    # THEN it is the binding, told as unknown, and not traced unless given;
    # glibc, which the process maps, is
    assert found.unknown_binding is not None
    assert found.unknown_binding.label == "unknown (libbump_malloc.so)"
    assert [p.allocator.name for p in found.all] == ["glibc"]


@pytest.mark.parametrize(("given", "code", "words"), [
    ("/bin/true", 5, "/bin/true exports none of the allocation functions"),
    ("/etc/passwd", 9, "/etc/passwd: not a readable ELF file"),
    ("/nonexistent/libx.so", 6, "/nonexistent/libx.so: No such file or directory"),
])  # fmt: skip
def test_an_allocator_lib_with_nothing_to_trace_is_refused_in_one_line(
    given: str, code: int, words: str
) -> None:
    # GIVEN --allocator-lib naming a file with no allocation function, no ELF
    # file at all, or nothing; the trace of this very process
    done = mtrace("--pid", str(os.getpid()), "--allocator-lib", given, "--duration", "1")
    # THEN one line says why, with its exit code, before anything is attached
    assert_one_line(done, code, words)
