"""The allocation wrappers, named in one place: functions that allocate on
their caller's behalf, so that the line an allocation belongs to is their
caller's. The allocinfo table (exporters/allocinfo.py) charges each stack to
its first frame outside them, as the kernel's alloc_hooks() charge an
allocation to the code that asked for it rather than to kmalloc's wrapper.

Each entry is a shell-style pattern (fnmatch, case-sensitive) matched
against the frame's demangled function name; a frame in no named function
is matched as its module's path and offset (``/usr/lib/libfoo.so.1+0x1a2b``,
which ``*libfoo.so*+0x1a2b`` matches). ``--wrappers`` adds more.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

ALLOCATION_WRAPPERS = (
    # C++: libstdc++'s operators new (every overload: sized, aligned,
    # nothrow) and the standard allocators where they are not inlined
    "operator new(*", "operator new[](*",
    "std::allocator<*>::allocate(*", "std::__new_allocator<*>::allocate(*",
    "__gnu_cxx::new_allocator<*>::allocate(*", "std::allocator_traits<*>::allocate(*",
    # glibc: functions that return memory malloc gave them
    "strdup", "__strdup", "strndup", "__strndup", "wcsdup", "asprintf", "__asprintf",
    "vasprintf", "__vasprintf", "__vasprintf_internal", "reallocarray", "__libc_reallocarray",
    "__libc_alloc_buffer_allocate", "getline", "getdelim", "__getdelim", "realpath",
    "__realpath", "__libc_dynarray_emplace_enlarge", "__libc_dynarray_resize",
    # Rust's global allocator shims
    "__rust_alloc", "__rust_alloc_zeroed", "__rust_realloc", "__rdl_alloc",
    "__rdl_alloc_zeroed", "__rdl_realloc", "alloc::alloc::*", "__rustc::__rust_alloc*",
    "__rustc::__rust_realloc", "__rustc::__rdl_*",
    # GLib
    "g_malloc", "g_malloc0", "g_malloc_n", "g_malloc0_n", "g_realloc", "g_realloc_n",
    "g_try_malloc", "g_try_malloc0", "g_try_malloc_n", "g_try_malloc0_n", "g_try_realloc",
    "g_try_realloc_n", "g_memdup", "g_memdup2", "g_strdup", "g_strndup", "g_strdup_printf",
    "g_strdup_vprintf", "g_slice_alloc", "g_slice_alloc0",
    # gnulib's and libiberty's x* wrappers, which exit instead of returning NULL
    "xmalloc", "xzalloc", "xcalloc", "xrealloc", "xstrdup", "xstrndup", "xmemdup",
    "ximalloc", "xicalloc", "xirealloc", "xnmalloc", "xnrealloc", "x2realloc", "x2nrealloc",
)  # fmt: skip


@dataclass(frozen=True)
class Wrappers:
    """The allocation wrappers: the known ones and those the user added."""

    patterns: tuple[str, ...] = ALLOCATION_WRAPPERS

    @functools.cached_property
    def _union(self) -> re.Pattern[str]:
        return re.compile("|".join(fnmatch.translate(p) for p in self.patterns) or r"(?!)")

    def wraps(self, name: str) -> bool:
        """Whether the function ``name`` (demangled) allocates for its caller."""
        return self._union.match(name) is not None

    def adding(self, values: Iterable[str]) -> Wrappers:
        """These wrappers and those ``--wrappers`` names: comma-separated
        patterns, any number of times."""
        added = tuple(p.strip() for value in values for p in value.split(",") if p.strip())
        return Wrappers(self.patterns + added) if added else self
