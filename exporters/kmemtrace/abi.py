"""The kmemtrace ABI: the 2008 record layouts, mtrace-live's ids and feature
blocks, the header files of a record set and its decoded form.

A record set is a directory laid out as kmemtrace's debugfs directory was:
one ``cpuN`` file of binary records per CPU, ``abi_version`` and
``total_overruns``. mtrace-live writes ABI version 3: the 2008 records
(version 1) byte for byte, plus new ids and feature blocks, as the ABI's own
extension rules allow. docs/kmemtrace-format.md describes every byte;
``writer`` writes them, ``reader`` and the C walker (``walker.c``) read them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from enum import IntEnum
from pathlib import Path
from typing import NamedTuple

from mtrace_live.probes.elf.lazy import lazy_dtype
from mtrace_live.probes.meanings import meanings

ABI_VERSION = 3
READABLE_ABI_VERSIONS = (1, 2, 3)
CORE_SIZE = 24
ALLOC_SIZE = 48  # core + the allocation fields
PROBE_SIZE = 80  # core + the probe block
FEATURE_HEADER = 3
MAX_ARGS = 6


class EventId(IntEnum):
    ALLOC = 0  # 2008
    FREE = 1  # 2008
    PROBE = 2  # ABI 2: a libc probe hit with its arguments


class TypeId(IntEnum):
    KMALLOC = 0  # 2008
    CACHE = 1  # 2008
    PAGES = 2  # 2008
    SBRK = 3  # ABI 2: memory_sbrk_more / memory_sbrk_less
    HEAP = 4  # ABI 2: memory_heap_new / memory_heap_free
    ARENA = 5  # ABI 2: memory_arena_new
    LIBC_PROBE = 6  # ABI 2: with EventId.PROBE
    USER = 7  # ABI 3: user-space heap blocks (malloc & co), with FeatureId.USER_CALL


KERNEL_TYPES = (TypeId.KMALLOC, TypeId.CACHE, TypeId.PAGES)


class TypeInfo(NamedTuple):
    """What an allocation type is called, and what allocates and frees it."""

    name: str
    desc: str
    alloc: str  # the kmem tracepoint or libc probe
    free: str
    refcount: bool = False  # taken again, not freed (sp-rtrace's refcount flag)


TYPES = {
    TypeId.KMALLOC: TypeInfo("kmalloc", "kernel kmalloc objects", "kmalloc", "kfree"),
    TypeId.CACHE: TypeInfo("kmem_cache", "kernel slab cache objects", "kmem_cache_alloc",
                           "kmem_cache_free"),
    TypeId.PAGES: TypeInfo("pages", "kernel page allocations", "mm_page_alloc", "mm_page_free"),
    TypeId.SBRK: TypeInfo("sbrk", "main heap growth by sbrk", "memory_sbrk_more",
                          "memory_sbrk_less"),
    TypeId.HEAP: TypeInfo("heap", "mmapped malloc heaps", "memory_heap_new", "memory_heap_free"),
    TypeId.ARENA: TypeInfo("arena", "malloc arenas", "memory_arena_new", "memory_arena_free", True),
    # sp-rtrace's own name for heap blocks; the function is each record's own
    TypeId.USER: TypeInfo("memory", "memory allocation in bytes", "malloc", "free"),
}  # fmt: skip


class FeatureId(IntEnum):
    TASK = 1  # ABI 2: pid, tid and a CLOCK_MONOTONIC timestamp
    USER_CALL = 2  # ABI 3: the allocation function, realloc's old pointer, the sample weight


@functools.cache
def libc_records(record: str) -> dict[str, TypeId]:
    """The libc probes written as ``record`` ("alloc" or "free") records, and
    their type, from the catalog's ``kmemtrace`` key (probes/specs/*.toml)."""
    by_name = {info.name: type_id for type_id, info in TYPES.items()}
    return {probe: by_name[name] for probe, name in meanings().kmemtrace_probes(record).items()}


# Native byte order, packed: the layouts of docs/kmemtrace-format.md.
_CORE = [
    ("event_id", "u1"),
    ("type_id", "u1"),
    ("event_size", "=u2"),
    ("seq", "=i4"),
    ("call_site", "=u8"),
    ("ptr", "=u8"),
]
_ALLOC = [("bytes_req", "=u8"), ("bytes_alloc", "=u8"), ("gfp_flags", "=u4"), ("target", "=i4")]
_PROBE = [("probe", "=u2"), ("nargs", "u1"), ("reserved", "u1"), ("reserved2", "=u4"),
          ("args", "=u8", (MAX_ARGS,))]  # fmt: skip
_TASK = [("f_size", "=u2"), ("f_id", "u1"), ("f_reserved", "u1"), ("pid", "=u4"),
         ("tid", "=u4"), ("f_reserved2", "=u4"), ("timestamp", "=u8")]  # fmt: skip
TASK_FEATURE_SIZE = 24
_USER = [("u_size", "=u2"), ("u_id", "u1"), ("fn", "u1"), ("u_reserved", "=u4"),
         ("aux", "=u8"), ("weight", "=u8")]  # fmt: skip
USER_FEATURE_SIZE = 24
NO_FUNCTION = 0xFF  # DECODED.fn of a record that is not a user-space allocation or free

ALLOC_RECORD = lazy_dtype(_CORE + _ALLOC)
FREE_RECORD = lazy_dtype(_CORE)
PROBE_RECORD = lazy_dtype(_CORE + _PROBE)
ALLOC_TASK_RECORD = lazy_dtype(_CORE + _ALLOC + _TASK)
FREE_TASK_RECORD = lazy_dtype(_CORE + _TASK)
PROBE_TASK_RECORD = lazy_dtype(_CORE + _PROBE + _TASK)
USER_ALLOC_RECORD = lazy_dtype(_CORE + _ALLOC + _TASK + _USER)
USER_FREE_RECORD = lazy_dtype(_CORE + _TASK + _USER)
# (their sizes: tests/unit/test_kmemtrace_format.py; made at the first use, numpy)

# Files of a record set besides cpuN.
ABI_FILE = "abi_version"
OVERRUNS_FILE = "total_overruns"
CPUS_FILE = "cpus"  # ABI 2: the cpuN files written, "0-1"
KALLSYMS_FILE = "kallsyms"  # ABI 2: /proc/kallsyms at record time
PROBES_FILE = "libc_probes"  # ABI 2: probe names, line i = probe number i
NODES_FILE = "cpu_nodes"  # ABI 2: "cpu node" per line
USER_MAPS_FILE = "user_maps"  # ABI 3: "pid start end offset path" of the traced processes


def possible_cpus() -> list[int]:
    return parse_cpu_list(Path("/sys/devices/system/cpu/possible").read_text())


MAX_CPU = 65535  # a record's CPU is 16 bits (the kernel's NR_CPUS is at most 8192)
_CPU_RANGE = re.compile(r"([0-9]{1,5})(?:-([0-9]{1,5}))?")


def cpu_ranges(text: str) -> list[tuple[int, int]]:
    """ "0-3,5" -> [(0, 3), (5, 5)], without expanding them; ValueError for
    anything else, or a CPU over MAX_CPU."""
    ranges = []
    for part in text.strip().split(","):
        if not part:
            continue
        match = _CPU_RANGE.fullmatch(part)
        if match is None:
            raise ValueError(part)
        first, last = int(match[1]), int(match[2] or match[1])
        if last < first or last > MAX_CPU:
            raise ValueError(part)
        ranges.append((first, last))
    return ranges


def cpu_list_text(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 3, 5] -> "0-3,5", the kernel's own notation."""
    parts: list[str] = []
    ordered = sorted(set(cpus))
    start = previous = ordered[0] if ordered else 0
    for cpu in [*ordered[1:], None]:
        if cpu is not None and cpu == previous + 1:
            previous = cpu
            continue
        parts.append(f"{start}-{previous}" if previous > start else f"{start}")
        if cpu is not None:
            start = previous = cpu
    return ",".join(parts) if ordered else ""


def parse_cpu_list(text: str) -> list[int]:
    """ "0-3,5" -> [0, 1, 2, 3, 5]."""
    return [cpu for first, last in cpu_ranges(text) for cpu in range(first, last + 1)]


# ---- reading ----------------------------------------------------------------

# One decoded record; args only mean something for EventId.PROBE.
DECODED = lazy_dtype(
    [
        ("seq", "<i8"),  # unwrapped, then made global across files
        ("call_site", "<u8"),
        ("ptr", "<u8"),
        ("bytes_req", "<u8"),
        ("bytes_alloc", "<u8"),
        ("timestamp", "<u8"),
        ("pid", "<u4"),
        ("tid", "<u4"),
        ("gfp_flags", "<u4"),
        ("target", "<i4"),
        ("probe", "<u2"),
        ("cpu", "<u2"),
        ("event_id", "u1"),
        ("type_id", "u1"),
        ("has_task", "u1"),
        ("fn", "u1"),  # ABI 3: the allocation function (enum alloc_fn), NO_FUNCTION otherwise
        ("aux", "<u8"),  # ABI 3: realloc's old pointer, the alignment
        ("weight", "<u8"),  # ABI 3: bytes a sampled allocation stands for
    ]
)

# Why a file's walk stopped (the scanner's status codes).
WALK_OK, WALK_TRUNCATED, WALK_BAD_SIZE = 0, 1, 2
# Counters the scanner keeps of records it skipped.
SKIP_REASONS = ("unknown event id", "unknown type id", "allocation shorter than 48 bytes",
                "bad feature block")  # fmt: skip


def record_size(probe: str) -> int:
    """The size of the kmemtrace record a libc probe's event becomes."""
    if probe in libc_records("alloc"):
        return ALLOC_TASK_RECORD.itemsize
    if probe in libc_records("free"):
        return FREE_TASK_RECORD.itemsize
    return PROBE_TASK_RECORD.itemsize


CPU_FILE = re.compile(r"cpu([0-9]{1,12})(?:\.out)?")  # kmemtrace-user's kmemtraced wrote cpuN.out


def cpu_files(directory: Path) -> dict[int, Path]:
    files = {}
    for path in directory.iterdir():
        match = CPU_FILE.fullmatch(path.name)
        if match and path.is_file():
            files[int(match[1])] = path
    return files
