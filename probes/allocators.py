"""The allocators mtrace-live knows, and which one a set of symbols is.

A process allocates through whichever object its ``malloc`` binds to:
glibc's libc, or an allocator that exports the standard names itself
(jemalloc, tcmalloc, mimalloc), preloaded, linked, or built into the
executable. Each allocator has its own entry points beside the standard
names; each maps to the kind of call mtrace-live already accounts, whose
handler (allocs.bpf.c's ``alloc_<kind>``) reads its arguments: an
allocation of the size in the first argument (``malloc``), of a count
times a size (``calloc``), a reallocation (``realloc``, ``reallocarray``),
a free (``free``, sized or not: the size is not read), and the aligned
ones (``memalign``, ``posix_memalign``, ``aligned_alloc``, ``valloc``,
``pvalloc``). An entry point whose size comes first and its alignment
after (C++'s aligned ``operator new``, ``mi_malloc_aligned``) is a
``malloc`` by its arguments.

Entry points that share an address are one probe; one that calls or jumps
to another is counted once, as the outer call (allocs.bpf.c's nesting).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# glibc's names, each its own kind.
STANDARD: Mapping[str, str] = {
    name: name
    for name in ("malloc", "calloc", "realloc", "reallocarray", "free", "memalign",
                 "posix_memalign", "aligned_alloc", "valloc", "pvalloc")
}  # fmt: skip

# C++'s replaceable operator new and delete (Itanium ABI names, 64-bit size_t).
_NEW = ("_Znwm", "_Znam", "_ZnwmRKSt9nothrow_t", "_ZnamRKSt9nothrow_t",
        "_ZnwmSt11align_val_t", "_ZnamSt11align_val_t",
        "_ZnwmSt11align_val_tRKSt9nothrow_t", "_ZnamSt11align_val_tRKSt9nothrow_t")  # fmt: skip
_DELETE = ("_ZdlPv", "_ZdaPv", "_ZdlPvRKSt9nothrow_t", "_ZdaPvRKSt9nothrow_t", "_ZdlPvm",
           "_ZdaPvm", "_ZdlPvSt11align_val_t", "_ZdaPvSt11align_val_t",
           "_ZdlPvSt11align_val_tRKSt9nothrow_t", "_ZdaPvSt11align_val_tRKSt9nothrow_t",
           "_ZdlPvmSt11align_val_t", "_ZdaPvmSt11align_val_t")  # fmt: skip
CXX: Mapping[str, str] = {**dict.fromkeys(_NEW, "malloc"), **dict.fromkeys(_DELETE, "free")}


@dataclass(frozen=True)
class Allocator:
    """One allocator: the symbol that tells it, and its entry points."""

    name: str
    marks: tuple[str, ...]  # a defined symbol of these names is this allocator
    entries: Mapping[str, str]  # entry point -> its kind (an allocs.bpf.c handler)
    prefixes: tuple[str, ...] = ("",)  # a copy built in with prefixed names (je_malloc)
    known: bool = True  # False: an object that defines malloc, none of the known ones
    # entry point -> the registers of its kind's arguments, where they are not
    # the kind's own (mimalloc's mi_heap_malloc(heap, size): the size in rsi)
    registers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def symbols(self) -> dict[str, str]:
        """Each entry point's symbol, under each prefix, with its kind, in this
        table's order (the standard names first)."""
        return {prefix + entry: kind for prefix in self.prefixes
                for entry, kind in self.entries.items()}  # fmt: skip

    @property
    def symbol_registers(self) -> dict[str, tuple[str, ...]]:
        """``registers``, under each prefix."""
        return {prefix + entry: where for prefix in self.prefixes
                for entry, where in self.registers.items()}  # fmt: skip


GLIBC = Allocator("glibc", ("__libc_malloc",), STANDARD)
JEMALLOC = Allocator(
    "jemalloc",
    ("mallocx", "je_mallocx", "je_malloc", "_rjem_mallocx"),
    {**STANDARD, "mallocx": "malloc", "rallocx": "realloc", "xallocx": "xallocx",
     "sdallocx": "free", "dallocx": "free", **CXX},
    # je_: built with --with-jemalloc-prefix=je_; _rjem_: Rust's tikv-jemallocator
    prefixes=("", "je_", "_rjem_"),
)  # fmt: skip
TCMALLOC = Allocator(
    "tcmalloc",
    ("tc_malloc",),
    {**STANDARD, "tc_malloc": "malloc", "tc_calloc": "calloc", "tc_realloc": "realloc",
     "tc_free": "free", "tc_cfree": "free", "tc_free_sized": "free", "tc_memalign": "memalign",
     "tc_posix_memalign": "posix_memalign", "tc_valloc": "valloc", "tc_pvalloc": "pvalloc",
     "tc_new": "malloc", "tc_newarray": "malloc", "tc_new_nothrow": "malloc",
     "tc_newarray_nothrow": "malloc", "tc_new_aligned": "malloc",
     "tc_newarray_aligned": "malloc", "tc_new_aligned_nothrow": "malloc",
     "tc_newarray_aligned_nothrow": "malloc", "tc_malloc_skip_new_handler": "malloc",
     "tc_delete": "free", "tc_deletearray": "free", "tc_delete_sized": "free",
     "tc_deletearray_sized": "free", "tc_delete_nothrow": "free",
     "tc_deletearray_nothrow": "free", "tc_delete_aligned": "free",
     "tc_deletearray_aligned": "free", "tc_delete_sized_aligned": "free",
     "tc_deletearray_sized_aligned": "free", "tc_delete_aligned_nothrow": "free",
     "tc_deletearray_aligned_nothrow": "free", "cfree": "free", **CXX},
)  # fmt: skip

# mimalloc's functions on a heap given first: each its kind's arguments, one
# register on (the heap in rdi). Not mi_heap_alloc_new: its first instruction
# moves the stack pointer, so its only site would be single-stepped.
_MI_HEAP = {
    **dict.fromkeys(("mi_heap_malloc", "mi_heap_zalloc", "mi_heap_malloc_small",
                     "mi_heap_malloc_aligned", "mi_heap_zalloc_aligned",
                     "mi_heap_malloc_aligned_at", "mi_heap_zalloc_aligned_at"), "malloc"),
    **dict.fromkeys(("mi_heap_calloc", "mi_heap_mallocn", "mi_heap_calloc_aligned",
                     "mi_heap_calloc_aligned_at", "mi_heap_alloc_new_n"), "calloc"),
    **dict.fromkeys(("mi_heap_realloc", "mi_heap_reallocf", "mi_heap_rezalloc",
                     "mi_heap_realloc_aligned", "mi_heap_realloc_aligned_at",
                     "mi_heap_rezalloc_aligned", "mi_heap_rezalloc_aligned_at"), "realloc"),
    **dict.fromkeys(("mi_heap_reallocn", "mi_heap_recalloc", "mi_heap_recalloc_aligned",
                     "mi_heap_recalloc_aligned_at"), "reallocarray"),
}  # fmt: skip
_ONE_ON = {"malloc": ("rsi",), "calloc": ("rsi", "rdx"), "realloc": ("rsi", "rdx"),
           "reallocarray": ("rsi", "rdx", "rcx")}  # fmt: skip
MIMALLOC = Allocator(
    "mimalloc",
    ("mi_malloc",),
    {**STANDARD, "mi_malloc": "malloc", "mi_calloc": "calloc", "mi_realloc": "realloc",
     "mi_free": "free", "mi_cfree": "free", "cfree": "free", "mi_free_size": "free",
     "mi_free_aligned": "free", "mi_free_size_aligned": "free", "mi_zalloc": "malloc",
     "mi_malloc_small": "malloc", "mi_zalloc_small": "malloc", "mi_mallocn": "calloc",
     "mi_reallocn": "reallocarray", "mi_reallocf": "realloc", "reallocf": "realloc",
     "mi_rezalloc": "realloc", "mi_recalloc": "reallocarray",
     "mi_malloc_aligned": "malloc", "mi_zalloc_aligned": "malloc",
     "mi_calloc_aligned": "calloc", "mi_realloc_aligned": "realloc",
     "mi_rezalloc_aligned": "realloc", "mi_recalloc_aligned": "reallocarray",
     "mi_posix_memalign": "posix_memalign", "mi_memalign": "memalign", "mi_valloc": "valloc",
     "mi_pvalloc": "pvalloc", "mi_aligned_alloc": "aligned_alloc",
     "mi_reallocarray": "reallocarray", "mi_new": "malloc", "mi_new_nothrow": "malloc",
     "mi_new_aligned": "malloc", "mi_new_aligned_nothrow": "malloc", "mi_new_n": "calloc",
     "mi_new_realloc": "realloc", "mi_new_reallocn": "reallocarray", **_MI_HEAP, **CXX},
    registers={name: _ONE_ON[kind] for name, kind in _MI_HEAP.items()},
)  # fmt: skip
KNOWN = (GLIBC, JEMALLOC, TCMALLOC, MIMALLOC)

# CPython's own allocator, traced only when asked (--pymalloc): the object and
# memory domains' functions, each a standard kind. Blocks of 512 bytes or
# less are served from its arenas and never reach malloc; larger ones it
# passes to malloc, which is then nested in its call and counted as its.
PYMALLOC = Allocator(
    "pymalloc",
    ("PyObject_Malloc",),
    {"PyObject_Malloc": "malloc", "PyObject_Calloc": "calloc", "PyObject_Realloc": "realloc",
     "PyObject_Free": "free", "PyMem_Malloc": "malloc", "PyMem_Calloc": "calloc",
     "PyMem_Realloc": "realloc", "PyMem_Free": "free"},
)  # fmt: skip


# An object that provides ``malloc`` and is none of the known allocators (or
# one given by --allocator-lib): its standard names and C++'s operator new
# and delete are traced.
UNKNOWN = Allocator("unknown", (), {**STANDARD, **CXX}, known=False)


def identify(defined: Iterable[str]) -> Allocator | None:
    """The known allocator whose mark is among the ``defined`` symbols (glibc
    last: an allocator built into a program beside glibc is the program's)."""
    names = set(defined)
    for allocator in (*KNOWN[1:], GLIBC):
        if any(mark in names for mark in allocator.marks):
            return allocator
    return None
