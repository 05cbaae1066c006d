"""The one interface between the tracer and its outputs.

The tracer hands every output (a *sink*) the same things, in this order:

1. ``start(info)``: a plain description of the trace (``TraceInfo``), with
   the probes, the target, the allocator model's state, and a
   ``CounterSource`` to read the kernel's counters through;
2. ``consume(batch)`` for each batch of events read from the ring buffer
   (``EventBatch``: the records, and how to decode them);
3. ``tick()`` each time round the tracing loop (a few times a second);
4. ``finish(result)`` once, with what the trace saw (``TraceResult``).

Sinks run in the order they are listed; the allocator model comes first, so
the outputs after it see its state with each batch applied. No sink holds
the BPF program: everything comes through these four calls. A new output is
a subclass of ``Sink`` in a module of its own, registered in
exporters/registry.py.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

from mtrace_live.probes.elf.lazy import lazy_module
from mtrace_live.probes.errors import OutputError
from mtrace_live.probes.records import EventKind

from .alloc_snapshot import AllocSnapshot, FrameNames
from .allocator_state import Allocators
from .events import Event, EventDecoder, SiteInfo
from .kmem import KmemTotals
from .lock_waits import LockWaits
from .wrappers import Wrappers

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # (at the first use: probes/elf/lazy.py)


class RunStats(NamedTuple):
    """What the kernel counted for one BPF handler (or the sum over several)."""

    run_time_ns: int  # counted only while statistics are enabled
    run_cnt: int
    misses: int  # runs skipped: another BPF program, or a map syscall, was active on that CPU


class ProcessHits(NamedTuple):
    tgid: int
    probe: int  # slot
    hits: int
    comm: str


@dataclass(frozen=True)
class KernelCounters:
    """One reading of the kernel's counters (and of how many events the
    tracer has read from the ring so far)."""

    probe_hits: Mapping[str, int]  # probe -> hits that passed the filter
    probe_lost: Mapping[str, int]  # probe -> events the ring had no room for
    delivered: int = 0  # libc probe events read from the ring
    kmem_delivered: int = 0  # kmem events read from the ring
    process_hits_dropped: int = 0  # hits the per-process table had no room for
    lost_lifecycle: int = 0  # exec/exit events the ring had no room for
    kmem: KmemTotals | None = None  # the in-kernel kmem aggregation, when asked for
    runs: Mapping[str, RunStats] = field(default_factory=dict)  # by handler; when asked for
    run_time_counted: bool = False  # the kernel counts run time (``runs[...].run_time_ns``)


class CounterSource(Protocol):
    """How a sink reads the kernel's counters (tracer/loop/counters.py reads
    them from the BPF maps; tests hand plain values)."""

    def read(self, kmem: bool = False, runs: bool = False) -> KernelCounters:
        """The counters now; the kmem aggregation and the handlers' run
        counts only when asked for, as they cost more to read."""
        ...

    def process_hits(self) -> list[ProcessHits]:
        """Hits per (process, probe slot), with the name of the thread that hit first."""
        ...

    def take_process_hits(self, tgids: set[int]) -> list[ProcessHits]:
        """The per-process hits of ``tgids``, removed from the kernel's table."""
        ...

    def stack(self, stack_id: int) -> list[int]:
        """The addresses of a stack the events refer to (``ustack``/``kstack``)."""
        ...

    def allocations(self, outstanding: bool = False, named: bool = True) -> AllocSnapshot | None:
        """The allocations by stack and process now (None when the
        allocation functions are not traced); with ``outstanding``, each
        allocation not freed yet too (costlier). ``named``: each stack cut
        where its frames leave the process's code (which reads its maps);
        without, the stacks as walked (enough for the per-process sums)."""
        ...

    def lock_waits(self, stacks: bool = True) -> LockWaits | None:
        """The lock waits in time now, per process and lock, and with
        ``stacks`` per stack too (None when they are not timed)."""
        ...

    def forget(self, tgids: set[int]) -> None:
        """Drop the kernel's per-process rows of ``tgids``, processes that are
        gone and whose counts the caller keeps."""
        ...


@dataclass(frozen=True)
class TraceInfo:
    """What a sink is told when the trace starts."""

    probes: tuple[str, ...]  # libc probe slot -> name
    sites: tuple[SiteInfo, ...]  # site index -> its probe and arguments
    site_addresses: tuple[int, ...]  # site index -> link-time address in ``libc``
    libc: Path | None  # the libc attached to, None for the kmem tracepoints only
    counters: CounterSource
    allocators: Allocators  # the allocator model's state; read it under its lock
    pid: int | None = None  # the target (the command's pid for run)
    command: tuple[str, ...] = ()
    all_processes: bool = False
    filtered_by_pid: bool = True  # the tracer follows processes (--pid, COMMAND, --comm)
    kmem: bool = False  # the kmem tracepoints are attached
    kmem_records: bool = False  # each kmem event comes through the ring too
    interval: float = 1.0  # the live view's refresh
    stack_depth: int = 0  # frames of each event's stack, 0 for none
    tracepoints: int = 0  # tracepoint handlers attached
    version: str = "unknown"  # mtrace-live's
    bcc_version: str = "unknown"
    allocs: bool = False  # the allocation functions are traced
    alloc_events: bool = False  # each allocation and free comes through the ring
    sample_bytes: int = 0
    frame_names: FrameNames = field(default_factory=FrameNames)
    leaks_older_than: float | None = None  # show what has been outstanding this long (seconds)
    wrappers: Wrappers = field(default_factory=Wrappers)  # for the allocinfo table

    @property
    def libc_probes(self) -> bool:
        return self.libc is not None


class EventBatch:
    """The records of one read of the ring buffer, in the order the kernel
    reserved them: libc probe hits, exec/exit of followed processes, and (when
    a sink asked for them) kmem tracepoint events."""

    def __init__(
        self, records: np.ndarray, decoder: EventDecoder, libc: np.ndarray | None = None
    ) -> None:
        """``libc``: the records without the kmem events, when the reader
        already knows them (it is the same array when there are none)."""
        self.records = records  # probes/records.py: EVENT_DTYPE
        self.decoder = decoder
        if libc is not None:
            self.__dict__["libc"] = libc

    def __len__(self) -> int:
        return len(self.records)

    @cached_property
    def libc(self) -> np.ndarray:
        """The records without the kmem events."""
        records: np.ndarray = self.records
        kmem = records["kind"] == EventKind.KMEM
        return records[~kmem] if kmem.any() else records

    def events(self) -> list[Event]:
        """The libc and lifecycle records, decoded (one object per event:
        for outputs that show every event)."""
        return self.decoder.decode(self.libc)


@dataclass
class KmemResult:
    totals: KmemTotals
    delivered: int
    lost: int
    records_written: int = 0  # by the kmemtrace output, when there is one
    overrun_bytes: int = 0
    directory: Path | None = None


@dataclass
class TraceResult:
    """What the trace saw; ``exit_code`` is the command's, for ``run``."""

    probes: tuple[str, ...]
    kernel_hits: dict[str, int]
    lost: dict[str, int]
    delivered: int
    lost_lifecycle: int
    per_process: dict[int, dict[str, int]]
    duration_s: float
    model: Allocators
    exit_code: int | None = None
    ended_by: str = ""
    unreadable: list[str] = field(default_factory=list)
    kmem: KmemResult | None = None
    missed: dict[str, int] = field(default_factory=dict)  # handler runs the kernel skipped
    stacks_lost: tuple[int, int] = (0, 0)  # user, kernel stacks the stack map did not store
    allocations: AllocSnapshot | None = None  # the allocation functions' tables at the end
    frame_names: FrameNames = field(default_factory=FrameNames)  # names the stacks' frames
    leaks_older_than: float | None = None
    alloc_delivered: int = 0  # allocation and free events read from the ring
    lock_waits: LockWaits | None = None  # the lock waits in time at the end, when timed
    lock_delivered: int | None = None  # lock wait events read from the ring, when streamed

    @property
    def total_hits(self) -> int:
        return sum(self.kernel_hits.values())

    @property
    def total_lost(self) -> int:
        return sum(self.lost.values())


class Sink:
    """An output of a live trace. Every method does nothing unless
    overridden; ``written`` counts the events an output wrote, for the
    message when its reader goes away (BrokenPipeError ends the trace)."""

    written = 0

    def start(self, info: TraceInfo) -> None:
        pass

    def consume(self, batch: EventBatch) -> None:
        pass

    def tick(self) -> None:
        pass

    def finish(self, result: TraceResult) -> None:
        pass


class FileAtEndSink(Sink):
    """An output written whole to a file when the trace ends: the file is
    created first, so that an unwritable path is refused before tracing."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            path.touch()
        except OSError as exc:
            raise OutputError(f"cannot write {path}: {exc.strerror}") from None

    def content(self, result: TraceResult) -> bytes | None:
        """What the file holds, or None when the trace has nothing for it."""
        raise NotImplementedError

    def finish(self, result: TraceResult) -> None:
        data = self.content(result)
        if data is not None:
            write_file(self.path, data)


def write_file(path: Path, data: bytes) -> None:
    try:
        path.write_bytes(data)
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror}") from None


class WholeAppends:
    """A file written by appending whole pieces (a batch's records or
    lines): a piece whose write fails (a full disk) is cut off again, so
    that the file ends after the last whole piece, readable. Unbuffered:
    each piece goes to the file as it is appended."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = 0
        self._handle = open(path, "wb", buffering=0)  # noqa: SIM115

    def append(self, data: bytes) -> None:
        """All of ``data``, or none of it (OSError)."""
        done = 0
        try:
            while done < len(data):
                done += self._handle.write(memoryview(data)[done:]) or 0
        except OSError:
            self.truncate(self.size)
            raise
        self.size += done

    def truncate(self, size: int) -> None:
        """Cut the file back to ``size`` bytes (a size it had), if it can be."""
        with contextlib.suppress(OSError):
            os.ftruncate(self._handle.fileno(), size)
        self.size = size

    def close(self) -> None:
        self._handle.close()
