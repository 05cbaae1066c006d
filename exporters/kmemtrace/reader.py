"""Reading a kmemtrace record set: its header files checked, and each
``cpuN`` file walked by the C walker (``walker.c``: each record's size is in
its own header, and no array operation can follow that chain) into one
array of decoded records."""

from __future__ import annotations

import re
import stat
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from mtrace_live.probes.elf.maps import Mapping as FileMapping
from mtrace_live.probes.errors import RecordSetError

from ._walker import scan
from ._walker import unwrap as walker_unwrap
from .abi import (
    ABI_FILE,
    CORE_SIZE,
    CPU_FILE,
    CPUS_FILE,
    DECODED,
    KALLSYMS_FILE,
    MAX_ARGS,
    MAX_CPU,
    NODES_FILE,
    OVERRUNS_FILE,
    PROBE_SIZE,
    PROBES_FILE,
    READABLE_ABI_VERSIONS,
    SKIP_REASONS,
    USER_MAPS_FILE,
    WALK_BAD_SIZE,
    WALK_TRUNCATED,
    EventId,
    cpu_files,
    cpu_ranges,
)
from .writer import encode


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


def unwrap(seq32: np.ndarray, prev: int | None = None) -> np.ndarray:
    """32-bit sequence numbers in file order -> int64, wraparound undone
    (consecutive records are taken to be less than 2**31 apart), the first
    against ``prev`` where given: the walker's own unwrapping (walker.c)."""
    seq = np.array(seq32, dtype=np.int64)  # a contiguous copy, unwrapped in place
    walker_unwrap(seq, prev)
    return seq


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
    directory, files = _files_of(path)
    abi = _abi_version(directory, files)
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
    nodes = _recorded_nodes(directory)
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


def _files_of(path: Path) -> tuple[Path, dict[int, Path]]:
    """The set's directory and its cpuN files, by CPU: a directory's, or
    the one cpuN file given."""
    if path.is_file():
        directory = path.parent
        match = CPU_FILE.fullmatch(path.name)
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
    return directory, files


def _abi_version(directory: Path, files: Mapping[int, Path]) -> int:
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
    return abi


def _recorded_nodes(directory: Path) -> dict[int, int]:
    """cpu_nodes' CPU -> node, of the lines that name a CPU a record can have."""
    nodes = {}
    for line in (_read_text(directory / NODES_FILE) or "").splitlines():
        match = _CPU_NODE.fullmatch(line.strip())
        if match and int(match[1]) <= MAX_CPU and int(match[2]) <= MAX_NODE:
            nodes[int(match[1])] = int(match[2])
    return nodes


def damage_line(path: Path, status: int, offset: int, size: int, records: int) -> str | None:
    """What a file's walk that stopped with ``status`` says of it (None: no damage)."""
    if status == WALK_TRUNCATED:
        return (
            f"{path}: truncated record at offset {offset} ({size - offset} bytes left); "
            f"the {records} records before it were read"
        )
    if status == WALK_BAD_SIZE:
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
        records["seq"] = unwrap(records["seq"])
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
        part["seq"] += int(unwrap(part["seq"][:1], base)[0]) - first
    args = np.concatenate(arg_parts)
    probe_seq = np.concatenate([p["seq"][p["event_id"] == EventId.PROBE] for p in parts])
    return args[np.argsort(probe_seq, kind="stable")]
