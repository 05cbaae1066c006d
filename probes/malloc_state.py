"""glibc's arenas as they lie in a process's memory: the layout of ``struct
malloc_state``, ``heap_info`` and ``struct malloc_par`` on x86-64, and the
walk of the arena list from ``main_arena``.

Arenas made before a trace attaches sent no ``memory_arena_new``; they are
found by reading the target's memory (tracer/processes/arena_walk.py reads it through
/proc/PID/mem and hands ``walk_arenas`` a reader). The layout is glibc's
since 2.27 (``have_fastchunks`` came in 2.27), the same in every build of
those versions for x86-64; it is not taken on trust: every arena the walk
passes must check out (a non-main arena is the first thing in its first
heap, whose ``heap_info.ar_ptr`` names it back, and the list must come back
to ``main_arena``), else the walk fails with ``ArenaLayoutError``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

Read = Callable[[int, int], bytes]  # (address, size) -> bytes; OSError when unreadable

MAX_ARENAS = 1024  # the walk stops here: glibc's default limit is 8 per core
MAX_HEAPS = 4096  # heaps followed per arena


@dataclass(frozen=True)
class MallocLayout:
    """Offsets in ``struct malloc_state`` (an arena), ``heap_info`` and
    ``struct malloc_par`` (``mp_``)."""

    top: int = 0x60  # mchunkptr top, after mutex, flags, have_fastchunks, fastbinsY[10]
    next: int = 0x870  # after bins[254] and binmap[4]
    attached_threads: int = 0x880
    system_mem: int = 0x888
    heap_ar_ptr: int = 0  # heap_info.ar_ptr
    heap_prev: int = 8
    heap_size: int = 16
    heap_max: int = 64 << 20  # HEAP_MAX_SIZE: 2 * DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
    mp_arena_test: int = 24  # after trim_threshold, top_pad, mmap_threshold
    mp_arena_max: int = 32


X86_64 = MallocLayout()


class ArenaLayoutError(ValueError):
    """What is at main_arena does not read as glibc 2.27+'s arena list."""


@dataclass(frozen=True)
class FoundArena:
    address: int
    main: bool
    attached_threads: int  # threads whose thread_arena it is
    system_mem: int  # bytes it has from the system
    heaps: tuple[tuple[int, int], ...]  # a non-main arena's mmapped heaps: (address, size)


def _word(read: Read, address: int) -> int:
    value: int = struct.unpack("<Q", read(address, 8))[0]
    return value


def heap_of(address: int, layout: MallocLayout = X86_64) -> int:
    """The heap a non-main arena (or any address in its heaps) lies in."""
    return address & ~(layout.heap_max - 1)


def is_arena(read: Read, address: int, layout: MallocLayout = X86_64) -> bool:
    """A non-main arena is at ``address``: the heap it lies in names it as
    its arena. OSError when that memory is unreadable."""
    heap = heap_of(address, layout)
    if heap == address or address - heap > 0x100:
        return False  # an arena lies just after its first heap's heap_info
    return _word(read, heap + layout.heap_ar_ptr) == address


def _arena_heaps(read: Read, arena: int, layout: MallocLayout) -> tuple[tuple[int, int], ...]:
    """A non-main arena's heaps, newest first: from its top chunk's, by prev."""
    heaps: list[tuple[int, int]] = []
    heap = heap_of(_word(read, arena + layout.top), layout)
    while heap and len(heaps) < MAX_HEAPS:
        if _word(read, heap + layout.heap_ar_ptr) != arena:
            raise ArenaLayoutError(f"the heap at {heap:#x} does not name arena {arena:#x}")
        heaps.append((heap, _word(read, heap + layout.heap_size)))
        heap = _word(read, heap + layout.heap_prev)
    return tuple(heaps)


def _arena(read: Read, address: int, main: bool, layout: MallocLayout) -> FoundArena:
    if not main and not is_arena(read, address, layout):
        raise ArenaLayoutError(f"no arena at {address:#x}: its heap does not name it")
    return FoundArena(
        address,
        main,
        _word(read, address + layout.attached_threads),
        _word(read, address + layout.system_mem),
        () if main else _arena_heaps(read, address, layout),
    )


def walk_arenas(read: Read, main_arena: int, layout: MallocLayout = X86_64) -> list[FoundArena]:
    """Every arena of the process whose memory ``read`` reads, main_arena's
    first, in the list's order. ArenaLayoutError when the list does not
    check out; OSError when the memory cannot be read."""
    found = [_arena(read, main_arena, True, layout)]
    at = _word(read, main_arena + layout.next)
    while at != main_arena:
        if len(found) >= MAX_ARENAS or at == 0 or any(a.address == at for a in found):
            raise ArenaLayoutError(f"the arena list from {main_arena:#x} does not come back to it")
        found.append(_arena(read, at, False, layout))
        at = _word(read, at + layout.next)
    return found


def arena_limit_setting(read: Read, mp: int, layout: MallocLayout = X86_64) -> tuple[int, int]:
    """(arena_max, arena_test) as ``mp_`` holds them: arena_max 0 is glibc's
    default, 8 arenas per core once arena_test arenas exist."""
    return _word(read, mp + layout.mp_arena_max), _word(read, mp + layout.mp_arena_test)
