"""``--kmemtrace DIR`` and ``record``: a live trace's events as a kmemtrace
record set (the format: abi.py)."""

from __future__ import annotations

from pathlib import Path

from mtrace_live.exporters.data.alloc_snapshot import FrameNames
from mtrace_live.exporters.data.kallsyms import saved_text
from mtrace_live.exporters.data.sink import EventBatch, Sink, TraceInfo, TraceResult
from mtrace_live.exporters.kmemtrace.abi import ALLOC_TASK_RECORD, FREE_TASK_RECORD, record_size
from mtrace_live.exporters.kmemtrace.writer import KmemtraceWriter, new_record_set
from mtrace_live.probes.records import EventKind


class KmemtraceSink(Sink):
    """``--kmemtrace DIR`` (and ``record``): every kmem event and libc probe
    hit of a live trace as kmemtrace records, with the kernel's symbols."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        new_record_set(directory)  # a bad directory fails before anything attaches
        self.writer: KmemtraceWriter | None = None

    def start(self, info: TraceInfo) -> None:
        self.writer = KmemtraceWriter(self.directory, info.probes, saved_text())

    def consume(self, batch: EventBatch) -> None:
        if self.writer is not None:
            self.writer.write(batch.records, EventKind.KMEM, EventKind.PROBE,
                              (EventKind.ALLOC, EventKind.FREE))  # fmt: skip

    def finish(self, result: TraceResult) -> None:
        """Closes the set, its total_overruns the bytes of the records the
        ring had no room for; the figures go into ``result.kmem``."""
        if self.writer is None:
            return
        kmem = result.kmem
        lost = sum(n * record_size(probe) for probe, n in result.lost.items())
        if kmem is not None:
            lost += (
                kmem.totals.lost_allocs * ALLOC_TASK_RECORD.itemsize
                + kmem.totals.lost_frees * FREE_TASK_RECORD.itemsize
            )
            kmem.records_written = self.writer.records
            kmem.directory = self.directory
            kmem.overrun_bytes = lost
        if result.allocations is not None:  # the processes still running: their maps now
            for proc in result.allocations.processes:
                if proc.tgid not in result.frame_names.symbols:
                    result.frame_names.remember(proc.tgid)
        self.writer.close(lost, user_maps_text(result.frame_names))
        self.writer = None


def user_maps_text(names: FrameNames) -> str:
    """``pid start end offset x|- path`` per file mapping of each process
    whose frames were named (read while it ran, or as it exited); x marks
    the executable ones."""
    lines = []
    for tgid, symbols in sorted(names.symbols.items()):
        names.place_files(tgid)
        lines += [f"{tgid} {m.start:#x} {m.end:#x} {m.offset:#x} {'x' if m.executable else '-'} "
                  f"{m.path}" for m in symbols.file_mappings]  # fmt: skip
    return "".join(f"{line}\n" for line in lines)
