"""Every output a live trace can write, registered once.

A *stream* is what ``--output NAME`` prints on standard output (one at a
time). A *file output* is an option of its own, ``--NAME VALUE``, that the
trace commands declare from this table; any number can be given together.
Each entry names its sink class as "module:Class", imported only when the
output is used, so ``--help`` loads none of them.

Adding an output: a module in exporters/ with a ``Sink`` subclass
(exporters/data/sink.py), and one entry here.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the sinks and their data load only when an output is built
    from .data.sink import Sink


@dataclass(frozen=True)
class Stream:
    """``--output NAME``: the sink is built with no arguments."""

    name: str
    help: str
    sink: str  # "module:Class"
    alloc_events: bool = False  # wants each allocation and free through the ring
    event_times: bool = False  # shows each probe event's time to the nanosecond


@dataclass(frozen=True)
class FileOutput:
    """``--NAME VALUE``: the sink is built with the value as a Path."""

    name: str
    metavar: str
    help: str
    sink: str  # "module:Class"
    directory: bool = False  # VALUE names a directory, not a file
    kmem: bool = False  # turns the kmem tracepoints on (as --kmem does)
    kernel_records: bool = False  # wants each kmem event in the ring, when they are on
    alloc_records: bool = False  # wants each allocation and free through the ring
    event_times: bool = False  # writes each probe event's time to the nanosecond


STREAMS = (
    Stream("live", "a top-like view (the default on a terminal)",
           "mtrace_live.exporters.live_view:LiveView"),
    Stream("text", "a line per event (the default otherwise)",
           "mtrace_live.exporters.lines:TextLines", event_times=True),
    Stream("json", "JSON lines of events, allocations and frees included",
           "mtrace_live.exporters.lines:JsonLines", alloc_events=True, event_times=True),
    Stream("summary", "only the summary at the end", "mtrace_live.exporters.summary:SummarySink"),
)  # fmt: skip

FILE_OUTPUTS = (
    FileOutput("kmemtrace", "DIR",
               "Write kmemtrace records (kernel and libc events) to this new directory.",
               "mtrace_live.exporters.kmemtrace.sink:KmemtraceSink",
               directory=True, kmem=True, kernel_records=True, alloc_records=True,
               event_times=True),
    FileOutput("sp-rtrace", "FILE",
               "Write the allocation events to this file as an sp-rtrace text report.",
               "mtrace_live.exporters.sprtrace.sink:SpRtraceSink", kernel_records=True,
               alloc_records=True, event_times=True),
    FileOutput("pprof", "FILE",
               "Write the allocations by call stack to this file as a gzipped pprof profile "
               "(alloc_objects, alloc_space, inuse_objects, inuse_space).",
               "mtrace_live.exporters.pprof:PprofSink"),
    FileOutput("pprof-mutex", "FILE",
               "Write the libc's lock waits by the waiting thread's call stack to this file "
               "as a gzipped pprof contention profile (contentions, delay), as Go's "
               "/debug/pprof/mutex gives.",
               "mtrace_live.exporters.pprof:ContentionSink"),
    FileOutput("folded", "FILE",
               "Write the live bytes by whole call stack to this file as folded stacks "
               "(flamegraph.pl, inferno, speedscope) when the trace ends.",
               "mtrace_live.exporters.folded:FoldedSink"),
    FileOutput("allocinfo", "FILE",
               "Write what is still allocated to this file as /proc/allocinfo lines when the "
               "trace ends: per line that asked for it, the first frame outside the allocation "
               "wrappers (operator new, strdup, g_malloc, ...; --wrappers adds more).",
               "mtrace_live.exporters.allocinfo:AllocinfoSink"),
)  # fmt: skip


def _load(where: str) -> Any:
    module, _, name = where.partition(":")
    return getattr(importlib.import_module(module), name)


def stream(name: str) -> Sink:
    for entry in STREAMS:
        if entry.name == name:
            sink: Sink = _load(entry.sink)()
            return sink
    raise KeyError(name)


def stream_wants_events(name: str) -> bool:
    return any(entry.alloc_events for entry in STREAMS if entry.name == name)


def stream_shows_times(name: str) -> bool:
    return any(entry.event_times for entry in STREAMS if entry.name == name)


def file_output(name: str) -> FileOutput:
    for entry in FILE_OUTPUTS:
        if entry.name == name:
            return entry
    raise KeyError(name)


def file_sink(name: str, value: Path) -> Sink:
    sink: Sink = _load(file_output(name).sink)(value)
    return sink
