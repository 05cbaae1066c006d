"""Writing a kmemtrace record set: batches of ring-buffer events
(probes/records.py) converted to records with numpy, one ``cpuN`` file per
CPU (the ABI: ``abi``)."""

from __future__ import annotations

import errno
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from mtrace_live.exporters.data.sink import WholeAppends
from mtrace_live.probes.errors import OutputError, RecordSetError
from mtrace_live.probes.records import KMEM_FREE_EVENTS

from .abi import (
    ABI_FILE,
    ABI_VERSION,
    ALLOC_TASK_RECORD,
    CPUS_FILE,
    FREE_TASK_RECORD,
    KALLSYMS_FILE,
    NODES_FILE,
    OVERRUNS_FILE,
    PROBE_TASK_RECORD,
    PROBES_FILE,
    TASK_FEATURE_SIZE,
    USER_ALLOC_RECORD,
    USER_FEATURE_SIZE,
    USER_FREE_RECORD,
    USER_MAPS_FILE,
    EventId,
    FeatureId,
    TypeId,
    cpu_files,
    cpu_list_text,
    libc_records,
    parse_cpu_list,
    possible_cpus,
)


def _machine_nodes() -> str:
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
    fields = _Fields(rows)
    fields.kernel(rows["kind"] == kmem_kind, page_shift)
    if user_kinds is not None:
        fields.user_calls(rows["kind"] == user_kinds[0], rows["kind"] == user_kinds[1])
    fields.libc(libc_probes)
    seqs = ((np.arange(n, dtype=np.int64) + seq) & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
    out = np.zeros((n, PROBE_TASK_RECORD.itemsize), dtype=np.uint8)
    sizes = np.empty(n, dtype=np.int64)
    for eid, dtype, of_user in (
        (EventId.ALLOC, ALLOC_TASK_RECORD, False),
        (EventId.FREE, FREE_TASK_RECORD, False),
        (EventId.PROBE, PROBE_TASK_RECORD, False),
        (EventId.ALLOC, USER_ALLOC_RECORD, True),
        (EventId.FREE, USER_FREE_RECORD, True),
    ):
        pick = np.flatnonzero((fields.event_id == eid) & (fields.user == of_user))
        if len(pick):
            rec = fields.records(pick, eid, dtype, of_user, seqs)
            out[pick, : dtype.itemsize] = rec.view(np.uint8).reshape(len(pick), dtype.itemsize)
            sizes[pick] = dtype.itemsize
    columns = np.arange(out.shape[1])
    per_cpu = {}
    cpus = rows["cpu"]
    for cpu in np.unique(cpus):
        mine = cpus == cpu
        per_cpu[int(cpu)] = out[mine][columns < sizes[mine, None]].tobytes()
    return Encoded(per_cpu, n, seq + n)


class _Fields:
    """Every row's record fields, by kind of event: event id, type id,
    pointer, sizes, flags and node."""

    def __init__(self, rows: np.ndarray) -> None:
        n = len(rows)
        self.rows = rows
        self.args = rows["args"]
        self.event_number = rows["probe"].astype(np.int64)
        self.event_id = np.full(n, EventId.PROBE, dtype=np.uint8)
        self.type_id = np.full(n, TypeId.LIBC_PROBE, dtype=np.uint8)
        self.ptr = np.zeros(n, dtype=np.uint64)
        self.req = np.zeros(n, dtype=np.uint64)
        self.alloc = np.zeros(n, dtype=np.uint64)
        self.gfp = np.zeros(n, dtype=np.uint32)
        self.target = np.full(n, -1, dtype=np.int32)
        self.kmem = np.zeros(n, dtype=bool)
        self.user = np.zeros(n, dtype=bool)

    def kernel(self, kmem: np.ndarray, page_shift: int) -> None:
        args = self.args
        self.kmem = kmem
        kfree = kmem & np.isin(self.event_number, tuple(KMEM_FREE_EVENTS))
        self.event_id[kmem] = np.where(kfree[kmem], EventId.FREE, EventId.ALLOC)
        self.type_id[kmem] = self.rows["site"][kmem].astype(np.uint8)  # enum kmem_type
        pages = kmem & (self.type_id == TypeId.PAGES)
        self.ptr[kmem] = args[kmem, 0]
        self.ptr[pages] = args[pages, 0] << np.uint64(page_shift)
        self.req[kmem] = args[kmem, 1]
        self.alloc[kmem] = args[kmem, 2]
        self.gfp[kmem] = args[kmem, 3].astype(np.uint32)
        self.target[kmem] = args[kmem, 4].astype(np.int64).astype(np.int32)

    def user_calls(self, allocs: np.ndarray, frees: np.ndarray) -> None:
        """The allocation functions' calls (``allocs`` and ``frees``)."""
        user = self.user = allocs | frees
        self.event_id[user] = np.where(allocs[user], EventId.ALLOC, EventId.FREE)
        self.type_id[user] = TypeId.USER
        self.ptr[user] = self.args[user, 0]
        self.req[allocs] = self.alloc[allocs] = self.args[allocs, 1]

    def libc(self, libc_probes: Sequence[str]) -> None:
        """The libc probes recorded as allocations and frees (sbrk, heap, arena)."""
        libc = ~self.kmem & ~self.user
        for table, eid in (
            (libc_records("alloc"), EventId.ALLOC),
            (libc_records("free"), EventId.FREE),
        ):
            for name, tid in table.items():
                if name not in libc_probes:
                    continue
                hit = libc & (self.event_number == libc_probes.index(name))
                self.event_id[hit] = eid
                self.type_id[hit] = tid
                self.ptr[hit] = self.args[hit, 0]
                if eid == EventId.ALLOC:
                    self.req[hit] = self.alloc[hit] = self.args[hit, 1]

    def records(self, pick: np.ndarray, eid: int, dtype: np.dtype, of_user: bool,
                seqs: np.ndarray) -> np.ndarray:  # fmt: skip
        """The records of the rows ``pick``, all of event ``eid``, as ``dtype``."""
        rows, args = self.rows, self.args
        rec = np.zeros(len(pick), dtype=dtype)
        rec["event_id"] = eid
        rec["type_id"] = self.type_id[pick]
        rec["event_size"] = dtype.itemsize
        rec["seq"] = seqs[pick]
        rec["call_site"] = rows["ip"][pick]
        rec["ptr"] = self.ptr[pick]
        if eid == EventId.ALLOC:
            rec["bytes_req"] = self.req[pick]
            rec["bytes_alloc"] = self.alloc[pick]
            rec["gfp_flags"] = self.gfp[pick]
            rec["target"] = self.target[pick]
        if eid == EventId.PROBE:
            rec["probe"] = self.event_number[pick]
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
        return rec


FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk (or quota), not bad input


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
            self._files = {cpu: WholeAppends(directory / f"cpu{cpu}") for cpu in self.cpus}
            (directory / ABI_FILE).write_text(f"{ABI_VERSION}\n")
            (directory / CPUS_FILE).write_text(cpu_list_text(self.cpus) + "\n")
            (directory / PROBES_FILE).write_text("".join(f"{p}\n" for p in self.libc_probes))
            (directory / NODES_FILE).write_text("" if cpus else _machine_nodes())
            (directory / KALLSYMS_FILE).write_text(kallsyms)
        except OSError as exc:
            if exc.errno in FULL:
                raise OutputError(f"cannot write the record set {directory}: {exc.strerror}; "
                                  "no record was written") from None  # fmt: skip
            raise RecordSetError(f"cannot write the record set {directory}: {exc}") from None

    def write(self, batch: np.ndarray, kmem_kind: int, probe_kind: int,
              user_kinds: tuple[int, int] | None = None) -> None:  # fmt: skip
        """A batch's records, whole or not at all: where a write fails (a
        full disk), every file is cut back to the batches before, which
        stay readable, and OutputError says so."""
        encoded = encode(batch, self._seq, self.libc_probes, kmem_kind, probe_kind,
                         user_kinds=user_kinds)  # fmt: skip
        before = {cpu: file.size for cpu, file in self._files.items()}
        try:
            for cpu, data in encoded.per_cpu.items():
                self._files[cpu].append(data)
        except OSError as exc:
            for cpu, size in before.items():
                self._files[cpu].truncate(size)
            raise OutputError(
                f"cannot write the record set {self.directory}: {exc.strerror}; the "
                f"{self.records} records before are kept"
            ) from None
        self._seq = encoded.next_seq
        self.records += encoded.records
        self.bytes += sum(len(data) for data in encoded.per_cpu.values())

    def close(self, overrun_bytes: int, user_maps: str = "") -> None:
        """``user_maps``: the traced processes' executable mappings, as
        ``pid start end offset path`` lines, for naming user call sites."""
        for handle in self._files.values():
            handle.close()
        try:
            (self.directory / OVERRUNS_FILE).write_text(f"{overrun_bytes}\n")
            (self.directory / USER_MAPS_FILE).write_text(user_maps)
        except OSError as exc:
            raise OutputError(
                f"cannot write the record set {self.directory}: {exc.strerror}; its "
                f"{self.records} records are kept, without the overruns or the processes' maps"
            ) from None
