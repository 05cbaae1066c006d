"""kmemtrace record sets: the 2008 kmemtrace ABI, written and read.

A record set is a directory laid out as kmemtrace's debugfs directory was:
one ``cpuN`` file of binary records per CPU, ``abi_version`` and
``total_overruns``. mtrace-live writes ABI version 2: the 2008 records
(version 1) byte for byte, plus new ids and a feature block, as the ABI's own
extension rules allow. docs/kmemtrace-format.md describes every byte.

Writing converts batches of ring-buffer events (probes/records.py) with numpy;
reading walks the records of each file in one compiled pass (numba), because
each record's size is in its own header and no array operation can follow
that chain.
"""

from __future__ import annotations

import functools
import re
import stat
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import NamedTuple

import numpy as np
from mtrace_live.probes.elf.errors import RecordSetError
from mtrace_live.probes.meanings import meanings
from mtrace_live.probes.records import KMEM_FREE_EVENTS

from .data.symbolize import Mapping as FileMapping

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

ALLOC_RECORD = np.dtype(_CORE + _ALLOC)
FREE_RECORD = np.dtype(_CORE)
PROBE_RECORD = np.dtype(_CORE + _PROBE)
ALLOC_TASK_RECORD = np.dtype(_CORE + _ALLOC + _TASK)
FREE_TASK_RECORD = np.dtype(_CORE + _TASK)
PROBE_TASK_RECORD = np.dtype(_CORE + _PROBE + _TASK)
USER_ALLOC_RECORD = np.dtype(_CORE + _ALLOC + _TASK + _USER)
USER_FREE_RECORD = np.dtype(_CORE + _TASK + _USER)
assert (USER_ALLOC_RECORD.itemsize, USER_FREE_RECORD.itemsize) == (96, 72)
assert (FREE_RECORD.itemsize, ALLOC_RECORD.itemsize, PROBE_RECORD.itemsize) == (24, 48, 80)
assert PROBE_TASK_RECORD.itemsize == PROBE_SIZE + TASK_FEATURE_SIZE

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


def _first_missing(ranges: list[tuple[int, int]], files: Mapping[int, Path]) -> int | None:
    """The first CPU of the ranges without a file. The walk stops at the
    first gap, so it costs no more than the files present, whatever the
    ranges claim."""
    for first, last in ranges:
        cpu = first
        while cpu <= last:
            if cpu not in files:
                return cpu
            cpu += 1
    return None


def _cpu_nodes() -> str:
    lines = []
    for node_dir in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        try:
            cpus = parse_cpu_list((node_dir / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        lines += [f"{cpu} {node_dir.name[4:]}" for cpu in cpus]
    return "".join(f"{line}\n" for line in sorted(lines, key=lambda s: int(s.split()[0])))


# ---- writing ----------------------------------------------------------------


@dataclass
class Encoded:
    """One batch as bytes per CPU file, and how many records of each kind."""

    per_cpu: dict[int, bytes]
    records: int
    next_seq: int


def encode(
    batch: np.ndarray,
    seq: int,
    libc_probes: Sequence[str],
    kmem_kind: int,
    probe_kind: int,
    page_shift: int = 12,
    user_kinds: tuple[int, int] | None = None,
) -> Encoded:
    """Turn ring events (probes/records.py: EVENT_DTYPE) into kmemtrace records.

    Sequence numbers follow the rows' order, which is the order the kernel
    reserved them in mtrace-live's single ring buffer: one total order across
    CPUs. ``kmem_kind`` and ``probe_kind`` are EventKind values, and so are
    ``user_kinds``: (allocation, free) of the allocation functions."""
    wanted = (batch["kind"] == kmem_kind) | (batch["kind"] == probe_kind)
    if user_kinds is not None:
        wanted |= (batch["kind"] == user_kinds[0]) | (batch["kind"] == user_kinds[1])
    rows = batch[wanted]
    n = len(rows)
    if n == 0:
        return Encoded({}, 0, seq)
    seqs = ((np.arange(n, dtype=np.int64) + seq) & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
    kmem = rows["kind"] == kmem_kind
    event_number = rows["probe"].astype(np.int64)
    args = rows["args"]

    # Classify every row: event id, type id, pointer, sizes.
    event_id = np.full(n, EventId.PROBE, dtype=np.uint8)
    type_id = np.full(n, TypeId.LIBC_PROBE, dtype=np.uint8)
    ptr = np.zeros(n, dtype=np.uint64)
    req = np.zeros(n, dtype=np.uint64)
    alloc = np.zeros(n, dtype=np.uint64)
    gfp = np.zeros(n, dtype=np.uint32)
    target = np.full(n, -1, dtype=np.int32)

    kfree = kmem & np.isin(event_number, tuple(KMEM_FREE_EVENTS))
    event_id[kmem] = np.where(kfree[kmem], EventId.FREE, EventId.ALLOC)
    type_id[kmem] = rows["site"][kmem].astype(np.uint8)  # enum kmem_type: kmemtrace's ids
    pages = kmem & (type_id == TypeId.PAGES)
    ptr[kmem] = args[kmem, 0]
    ptr[pages] = args[pages, 0] << np.uint64(page_shift)
    req[kmem] = args[kmem, 1]
    alloc[kmem] = args[kmem, 2]
    gfp[kmem] = args[kmem, 3].astype(np.uint32)
    target[kmem] = args[kmem, 4].astype(np.int64).astype(np.int32)

    user = np.zeros(n, dtype=bool)
    if user_kinds is not None:
        user_alloc = rows["kind"] == user_kinds[0]
        user = user_alloc | (rows["kind"] == user_kinds[1])
        event_id[user] = np.where(user_alloc[user], EventId.ALLOC, EventId.FREE)
        type_id[user] = TypeId.USER
        ptr[user] = args[user, 0]
        req[user_alloc] = alloc[user_alloc] = args[user_alloc, 1]
    libc = ~kmem & ~user
    for table, eid in (
        (libc_records("alloc"), EventId.ALLOC),
        (libc_records("free"), EventId.FREE),
    ):
        for name, tid in table.items():
            if name not in libc_probes:
                continue
            hit = libc & (event_number == libc_probes.index(name))
            event_id[hit] = eid
            type_id[hit] = tid
            ptr[hit] = args[hit, 0]
            if eid == EventId.ALLOC:
                req[hit] = alloc[hit] = args[hit, 1]

    out = np.zeros((n, PROBE_TASK_RECORD.itemsize), dtype=np.uint8)
    sizes = np.empty(n, dtype=np.int64)
    for eid, dtype, of_user in (
        (EventId.ALLOC, ALLOC_TASK_RECORD, False),
        (EventId.FREE, FREE_TASK_RECORD, False),
        (EventId.PROBE, PROBE_TASK_RECORD, False),
        (EventId.ALLOC, USER_ALLOC_RECORD, True),
        (EventId.FREE, USER_FREE_RECORD, True),
    ):
        pick = np.flatnonzero((event_id == eid) & (user == of_user))
        if len(pick) == 0:
            continue
        rec = np.zeros(len(pick), dtype=dtype)
        rec["event_id"] = eid
        rec["type_id"] = type_id[pick]
        rec["event_size"] = dtype.itemsize
        rec["seq"] = seqs[pick]
        rec["call_site"] = rows["ip"][pick]
        rec["ptr"] = ptr[pick]
        if eid == EventId.ALLOC:
            rec["bytes_req"] = req[pick]
            rec["bytes_alloc"] = alloc[pick]
            rec["gfp_flags"] = gfp[pick]
            rec["target"] = target[pick]
        if eid == EventId.PROBE:
            rec["probe"] = event_number[pick]
            rec["nargs"] = rows["nargs"][pick]
            rec["args"] = args[pick]
        rec["f_size"] = TASK_FEATURE_SIZE
        rec["f_id"] = FeatureId.TASK
        rec["pid"] = rows["tgid"][pick]
        rec["tid"] = rows["tid"][pick]
        rec["timestamp"] = rows["ts"][pick]
        if of_user:
            rec["u_size"] = USER_FEATURE_SIZE
            rec["u_id"] = FeatureId.USER_CALL
            rec["fn"] = rows["probe"][pick]
            rec["aux"] = args[pick, 2] if eid == EventId.ALLOC else 0
            rec["weight"] = args[pick, 3]
        out[pick, : dtype.itemsize] = rec.view(np.uint8).reshape(len(pick), dtype.itemsize)
        sizes[pick] = dtype.itemsize

    columns = np.arange(out.shape[1])
    per_cpu = {}
    cpus = rows["cpu"]
    for cpu in np.unique(cpus):
        mine = cpus == cpu
        per_cpu[int(cpu)] = out[mine][columns < sizes[mine, None]].tobytes()
    return Encoded(per_cpu, n, seq + n)


def new_record_set(directory: Path) -> None:
    """Make ``directory`` for a record set, or refuse one that holds a set."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        stale = sorted(cpu_files(directory).values())
    except OSError as exc:
        raise RecordSetError(f"cannot write the record set {directory}: {exc}") from None
    if stale:
        raise RecordSetError(
            f"{directory} already holds a record set ({stale[0].name}); give a new directory"
        )


class KmemtraceWriter:
    """Appends records to a record set directory as batches arrive."""

    def __init__(
        self,
        directory: Path,
        libc_probes: Sequence[str],
        kallsyms: str,
        cpus: Sequence[int] | None = None,
    ) -> None:
        """``cpus``: the CPUs of records made elsewhere (convert); by default
        this machine's possible CPUs, whose NUMA nodes are then saved too."""
        self.directory = directory
        self.libc_probes = list(libc_probes)
        self.records = 0
        self.bytes = 0
        self._seq = 0
        new_record_set(directory)
        try:
            self.cpus = sorted(set(cpus)) if cpus else possible_cpus()
            self._files = {cpu: open(directory / f"cpu{cpu}", "wb") for cpu in self.cpus}  # noqa: SIM115
            (directory / ABI_FILE).write_text(f"{ABI_VERSION}\n")
            (directory / CPUS_FILE).write_text(cpu_list_text(self.cpus) + "\n")
            (directory / PROBES_FILE).write_text("".join(f"{p}\n" for p in self.libc_probes))
            (directory / NODES_FILE).write_text("" if cpus else _cpu_nodes())
            (directory / KALLSYMS_FILE).write_text(kallsyms)
        except OSError as exc:
            raise RecordSetError(f"cannot write the record set {directory}: {exc}") from None

    def write(self, batch: np.ndarray, kmem_kind: int, probe_kind: int,
              user_kinds: tuple[int, int] | None = None) -> None:  # fmt: skip
        encoded = encode(batch, self._seq, self.libc_probes, kmem_kind, probe_kind,
                         user_kinds=user_kinds)  # fmt: skip
        self._seq = encoded.next_seq
        self.records += encoded.records
        for cpu, data in encoded.per_cpu.items():
            self._files[cpu].write(data)
            self.bytes += len(data)

    def close(self, overrun_bytes: int, user_maps: str = "") -> None:
        """``user_maps``: the traced processes' executable mappings, as
        ``pid start end offset path`` lines, for naming user call sites."""
        for handle in self._files.values():
            handle.close()
        (self.directory / OVERRUNS_FILE).write_text(f"{overrun_bytes}\n")
        (self.directory / USER_MAPS_FILE).write_text(user_maps)


# ---- reading ----------------------------------------------------------------

# One decoded record; args only mean something for EventId.PROBE.
DECODED = np.dtype(
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
_OK, _TRUNCATED, _BAD_SIZE = 0, 1, 2
# Counters the scanner keeps of records it skipped.
SKIP_REASONS = ("unknown event id", "unknown type id", "allocation shorter than 48 bytes",
                "bad feature block")  # fmt: skip


@dataclass
class RecordSet:
    directory: Path
    abi_version: int
    unordered: np.ndarray  # DECODED, file by file; sequence numbers on one scale
    args: (
        np.ndarray
    )  # (probe records, 6) uint64: the arguments of the EventId.PROBE records, in order
    skipped: dict[str, int] = field(default_factory=dict)
    damage: list[str] = field(default_factory=list)  # one line per damaged file
    total_overruns: int | None = None
    libc_probes: list[str] = field(default_factory=list)
    kallsyms: str | None = None
    user_maps: str = ""  # ABI 3: the traced processes' mappings at record time
    cpu_nodes: dict[int, int] = field(default_factory=dict)
    bytes_read: int = 0
    _ordered: np.ndarray | None = None

    @property
    def records(self) -> np.ndarray:
        """Every record, ordered by sequence number (sorted on first use:
        analyses that sort anyway work on ``unordered``)."""
        if self._ordered is None:
            order = np.argsort(self.unordered["seq"], kind="stable")
            # Whole rows as plain words: numpy copies structured rows field by field.
            words = self.unordered.view(np.uint64).reshape(-1, DECODED.itemsize // 8)
            self._ordered = words[order].reshape(-1).view(DECODED)
        return self._ordered


def _scan_file(
    data: np.ndarray, big: bool, cpu: int, out: np.ndarray
) -> tuple[np.ndarray, np.ndarray, int, int, list[int]]:
    """Decode one file's records into ``out`` (room for len(data) // 24)."""
    from .kmemtrace_scan import scan  # numba: imported only to read records

    args = np.empty((len(data) // PROBE_SIZE + 1, MAX_ARGS), dtype=np.uint64)
    skipped = np.zeros(len(SKIP_REASONS), dtype=np.int64)
    count, probes, offset, status = scan(data, big, cpu, out, args, skipped)
    return out[:count], args[:probes], int(offset), int(status), [int(s) for s in skipped]


def decode_batch(
    batch: np.ndarray, seq: int, libc_probes: Sequence[str], kmem_kind: int, probe_kind: int,
    user_kinds: tuple[int, int] | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:  # fmt: skip
    """Ring events as decoded records (DECODED, in sequence order) and the
    probe records' arguments, exactly as writing and reading them back would
    give; and the next sequence number. For writers of other formats."""
    encoded = encode(batch, seq, libc_probes, kmem_kind, probe_kind, user_kinds=user_kinds)
    parts, arg_parts = [], []
    for cpu, data in encoded.per_cpu.items():
        raw = np.frombuffer(data, dtype=np.uint8)
        records, args, _, _, _ = _scan_file(
            raw, False, cpu, np.zeros(len(raw) // CORE_SIZE, DECODED)
        )
        parts.append(records)
        arg_parts.append(args)
    if not parts:
        return np.zeros(0, DECODED), np.zeros((0, MAX_ARGS), dtype=np.uint64), encoded.next_seq
    args = _one_scale(parts, arg_parts)
    records = np.concatenate(parts)
    return records[np.argsort(records["seq"], kind="stable")], args, encoded.next_seq


def unwrap(seq32: np.ndarray) -> np.ndarray:
    """32-bit sequence numbers in file order -> int64, wraparound undone:
    consecutive records are taken to be less than 2**31 apart."""
    if len(seq32) == 0:
        return seq32.astype(np.int64)
    steps = np.diff(seq32.astype(np.int64)).astype(np.int64)
    steps = ((steps + 2**31) % 2**32) - 2**31
    unwrapped: np.ndarray = seq32[0].astype(np.int64) + np.concatenate(([0], np.cumsum(steps)))
    return unwrapped


# The most a header file may hold: one number; a list of up to 65536 CPUs;
# kallsyms (10-20 MB with every module loaded) and up to 65535 probe names.
MAX_HEADER_BYTES = 1 << 10  # abi_version, total_overruns
MAX_LIST_BYTES = 1 << 20  # cpus, cpu_nodes
MAX_KALLSYMS_BYTES = 1 << 28  # kallsyms, libc_probes


def _read_text(path: Path, limit: int = MAX_LIST_BYTES) -> str | None:
    """A header file's text (None if absent); past ``limit`` bytes, or not a
    regular file (a FIFO would block the reader), it is refused rather than read."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):
            raise RecordSetError(f"{path}: not a regular file")
        with path.open("rb") as file:
            data = file.read(limit + 1)
        if len(data) > limit:
            raise RecordSetError(f"{path}: over {limit} bytes, not a record set's header file")
        return data.decode("ascii", errors="replace")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise RecordSetError(f"cannot read {path}: {exc.strerror}") from None


_CPU_FILE = re.compile(r"cpu([0-9]{1,12})(?:\.out)?")  # kmemtrace-user's kmemtraced wrote cpuN.out


def cpu_files(directory: Path) -> dict[int, Path]:
    files = {}
    for path in directory.iterdir():
        match = _CPU_FILE.fullmatch(path.name)
        if match and path.is_file():
            files[int(match[1])] = path
    return files


@dataclass
class RecordSetHeader:
    """A record set's files and header files, checked, before any record is read."""

    path: Path  # as given: the directory or one cpuN file
    directory: Path
    files: dict[int, Path]  # cpuN files, by CPU in ascending order
    abi_version: int
    big: bool
    total_overruns: int | None
    libc_probes: list[str]
    kallsyms: str | None
    user_maps: str
    cpu_nodes: dict[int, int]

    def sizes(self) -> dict[int, int]:
        try:
            return {cpu: path.stat().st_size for cpu, path in self.files.items()}
        except OSError as exc:
            raise RecordSetError(f"cannot read {exc.filename}: {exc.strerror}") from None


def open_record_set(path: Path, big_endian: bool | None = None) -> RecordSetHeader:
    """A record set's header: a directory's cpuN files (or, given one cpuN
    file, that file with its directory's abi_version) and header files.
    Problems that leave the set unusable raise RecordSetError."""
    if path.is_file():
        directory = path.parent
        match = _CPU_FILE.fullmatch(path.name)
        if match is None:
            raise RecordSetError(f"{path} is not a kmemtrace cpuN file")
        files = {int(match[1]): path}
    elif path.is_dir():
        directory = path
        files = cpu_files(directory)
    else:
        raise RecordSetError(f"{path} does not exist")
    too_high = [cpu for cpu in files if cpu > MAX_CPU]
    if too_high:
        raise RecordSetError(f"{files[too_high[0]]}: CPU {too_high[0]} is over {MAX_CPU}")
    abi_text = _read_text(directory / ABI_FILE, MAX_HEADER_BYTES)
    if not files:
        raise RecordSetError(f"{directory} is not a kmemtrace record set: it has no cpuN files")
    if abi_text is None:
        raise RecordSetError(f"{directory / ABI_FILE} is missing; cannot tell the record ABI")
    try:
        abi = int(abi_text.strip())
    except ValueError:
        raise RecordSetError(
            f"{directory / ABI_FILE}: {abi_text.strip()[:40]!r} is not an ABI version"
        ) from None
    if abi not in READABLE_ABI_VERSIONS:
        raise RecordSetError(
            f"{directory / ABI_FILE}: ABI version {abi} is unknown (this reader knows "
            f"{', '.join(map(str, READABLE_ABI_VERSIONS))})"
        )
    cpus_text = _read_text(directory / CPUS_FILE) if path.is_dir() else None
    try:
        expected = cpu_ranges(cpus_text) if cpus_text else [(min(files), max(files))]
    except ValueError:
        raise RecordSetError(
            f"{directory / CPUS_FILE}: not a CPU list (such as 0-3,5; CPUs 0 to {MAX_CPU})"
        ) from None
    missing = _first_missing(expected, files)
    if missing is not None:
        raise RecordSetError(f"{directory} lacks the file cpu{missing} of CPU {missing}")
    overruns_text = _read_text(directory / OVERRUNS_FILE, MAX_HEADER_BYTES)
    probes_text = _read_text(directory / PROBES_FILE, MAX_KALLSYMS_BYTES)
    nodes = {}
    for line in (_read_text(directory / NODES_FILE) or "").splitlines():
        match = _CPU_NODE.fullmatch(line.strip())
        if match and int(match[1]) <= MAX_CPU and int(match[2]) <= MAX_NODE:
            nodes[int(match[1])] = int(match[2])  # other lines name no CPU a record can have
    return RecordSetHeader(
        path=path,
        directory=directory,
        files=dict(sorted(files.items())),
        abi_version=abi,
        big=sys.byteorder == "big" if big_endian is None else big_endian,
        total_overruns=_count(overruns_text),
        libc_probes=probes_text.splitlines() if probes_text else [],
        kallsyms=_read_text(directory / KALLSYMS_FILE, MAX_KALLSYMS_BYTES),
        user_maps=_read_text(directory / USER_MAPS_FILE, MAX_KALLSYMS_BYTES) or "",
        cpu_nodes=nodes,
    )


def damage_line(path: Path, status: int, offset: int, size: int, records: int) -> str | None:
    """What a file's walk that stopped with ``status`` says of it (None: no damage)."""
    if status == _TRUNCATED:
        return (
            f"{path}: truncated record at offset {offset} ({size - offset} bytes left); "
            f"the {records} records before it were read"
        )
    if status == _BAD_SIZE:
        return (
            f"{path}: event size below {CORE_SIZE} at offset {offset}; the rest of the file "
            f"cannot be walked; the {records} records before it were read"
        )
    return None


def read_record_set(path: Path, big_endian: bool | None = None) -> RecordSet:
    """Read every cpuN file of a record set (see open_record_set), ordered
    by sequence number.

    A damaged file (a truncated record, an event size below the core's)
    keeps every record before the damage and adds a line to ``damage``;
    unknown ids are skipped by their event size and counted."""
    header = open_record_set(path, big_endian)
    files = header.files
    parts = []
    arg_parts = []
    skipped = dict.fromkeys(SKIP_REASONS, 0)
    damage = []
    total_bytes = 0
    sizes = header.sizes()
    # One buffer for every file's records, so that merging needs no concatenation.
    decoded = np.empty(sum(size // CORE_SIZE for size in sizes.values()), dtype=DECODED)
    used = 0
    for cpu, path in files.items():
        try:
            data = np.fromfile(path, dtype=np.uint8)
        except OSError as exc:
            raise RecordSetError(f"cannot read {path}: {exc.strerror}") from None
        total_bytes += len(data)
        room = decoded[used : used + len(data) // CORE_SIZE]
        records, args, offset, status, skips = _scan_file(data, header.big, cpu, room)
        used += len(records)
        for reason, count in zip(SKIP_REASONS, skips, strict=True):
            skipped[reason] += count
        line = damage_line(path, status, offset, len(data), len(records))
        if line is not None:
            damage.append(line)
        records["seq"] = unwrap(records["seq"].astype(np.int32))
        parts.append(records)
        arg_parts.append(args)

    args = _one_scale(parts, arg_parts)
    return RecordSet(
        directory=header.directory,
        abi_version=header.abi_version,
        unordered=decoded[:used],
        args=args,
        skipped={k: v for k, v in skipped.items() if v},
        damage=damage,
        total_overruns=header.total_overruns,
        libc_probes=header.libc_probes,
        kallsyms=header.kallsyms,
        cpu_nodes=header.cpu_nodes,
        bytes_read=total_bytes,
        user_maps=header.user_maps,
    )


def parse_user_maps(text: str) -> dict[int, list[FileMapping]]:
    """user_maps back into mappings by pid; malformed lines are left out."""
    found: dict[int, list[FileMapping]] = {}
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) != 6 or fields[4] not in ("x", "-"):
            continue
        try:
            pid, start, end, offset = int(fields[0]), *(int(f, 16) for f in fields[1:4])
        except ValueError:
            continue
        found.setdefault(pid, []).append(
            FileMapping(start, end, offset, fields[5], fields[4] == "x")
        )
    return found


_CPU_NODE = re.compile(r"([0-9]{1,5}) ([0-9]{1,5})")
MAX_NODE = 1023  # the kernel's MAX_NUMNODES is at most 1 << 10


def _count(text: str | None) -> int | None:
    """A decimal count of up to 20 digits, or None."""
    if text is None or not re.fullmatch(r"[0-9]{1,20}", text.strip()):
        return None
    return int(text.strip())


def _one_scale(parts: list[np.ndarray], arg_parts: list[np.ndarray]) -> np.ndarray:
    """Put every file's (already unwrapped) sequence numbers on one scale, by
    unwrapping each file's first number against the first file's; return
    the probe records' arguments in sequence order."""
    nonempty = [part for part in parts if len(part)]
    if not nonempty:
        return np.zeros((0, MAX_ARGS), dtype=np.uint64)
    base = int(nonempty[0]["seq"][0])
    for part in nonempty:
        first = int(part["seq"][0])
        delta = ((first - base + 2**31) % 2**32) - 2**31
        part["seq"] += base + delta - first
    args = np.concatenate(arg_parts)
    probe_seq = np.concatenate([p["seq"][p["event_id"] == EventId.PROBE] for p in parts])
    return args[np.argsort(probe_seq, kind="stable")]


def record_size(probe: str) -> int:
    """The size of the kmemtrace record a libc probe's event becomes."""
    if probe in libc_records("alloc"):
        return ALLOC_TASK_RECORD.itemsize
    if probe in libc_records("free"):
        return FREE_TASK_RECORD.itemsize
    return PROBE_TASK_RECORD.itemsize
