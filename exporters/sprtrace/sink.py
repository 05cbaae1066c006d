"""``--sp-rtrace FILE``: a live trace's allocation events written as an
sp-rtrace text report while it runs.

Events are turned into records as for a kmemtrace record set, then into
calls by the same code ``convert`` uses. Kernel call sites are named from
kallsyms; the libc probe sites from the traced process's own files
(pyelftools, DWARF lines where there are any), looked up while the process
still runs. A module's map line is written before the first backtrace that
uses it, as the protocol asks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from mtrace_live.exporters.data.kallsyms import KernelSymbols
from mtrace_live.exporters.data.processes import process_name
from mtrace_live.exporters.data.sink import (
    EventBatch,
    Sink,
    TraceInfo,
    TraceResult,
    WholeAppends,
)
from mtrace_live.exporters.data.symbolize import Symbol, module_symbols
from mtrace_live.exporters.kmemtrace.abi import KERNEL_TYPES, TypeId
from mtrace_live.exporters.kmemtrace.reader import decode_batch
from mtrace_live.exporters.sprtrace.convert import RecordCalls, header, resources
from mtrace_live.exporters.sprtrace.text import Trace, lines, map_line
from mtrace_live.probes.errors import OutputError, TargetError
from mtrace_live.probes.records import FRAME_DEPTH, EventKind

LIBC_TYPES = (TypeId.SBRK, TypeId.HEAP, TypeId.ARENA)


class SpRtraceSink(Sink):
    """``--sp-rtrace FILE``: the file is created at once (so that a bad path
    fails before anything attaches), written from the trace's start."""

    def __init__(self, path: Path) -> None:
        self.probes: list[str] = []
        self.version = ""
        self.pid = 0  # the target, once known: the header names it
        self.process = ""  # and its name, if known before it runs
        # Probe sites by link-time address: a libc event's site is known
        # exactly, even once its process is gone.
        self._libc: Path | None = None
        self._site_vaddrs: list[int] = []
        self._site_of: dict[int, int] = {}  # runtime address -> link-time address
        self._types: list[TypeId] = []
        self._calls: RecordCalls | None = None
        self._depth = 1
        self._read_stack: Callable[[int], list[int]] | None = None
        self._stacks: dict[int, list[int]] = {}  # stack id -> addresses (ids are never reused)
        self._stack_ids: dict[int, tuple[int, int]] = {}  # this batch: seq -> (user, kernel) ids
        self._seq = 0
        self._file: WholeAppends | None = None
        try:
            self._file = WholeAppends(path)
        except OSError as exc:
            raise TargetError(f"cannot write {path}: {exc.strerror}") from None
        self._out: list[str] = []  # the lines of the batch being written
        self._started = False

    def start(self, info: TraceInfo) -> None:
        self.probes = list(info.probes)
        self.version = info.version
        self.pid = info.pid or 0
        if info.command:
            self.process = Path(info.command[0]).name
        self._libc = info.libc
        self._site_vaddrs = list(info.site_addresses)
        self._types = [*(KERNEL_TYPES if info.kmem else ()), *(LIBC_TYPES if self.probes else ()),
                       *((TypeId.USER,) if info.allocs else ())]  # fmt: skip
        self._calls = RecordCalls(self.probes, KernelSymbols.load(), self._user, self._stack)
        self._calls.process_name = process_name
        self._names = info.frame_names
        if info.stack_depth or info.allocs:  # allocations come with their stack walked
            self._read_stack = info.counters.stack
            self._depth = info.stack_depth or FRAME_DEPTH  # the whole walk

    def consume(self, batch: EventBatch) -> None:
        self.write(
            batch.records, EventKind.KMEM, EventKind.PROBE, (EventKind.ALLOC, EventKind.FREE)
        )

    def finish(self, result: TraceResult) -> None:
        lost = result.total_lost + (result.kmem.lost if result.kmem is not None else 0)
        self.close(lost, sum(result.stacks_lost))

    def _begin(self) -> list[str]:
        """Where this batch's lines go (the header first, once)."""
        if not self._started:
            self._started = True
            trace = Trace(header=header(self.pid, self.version, self._depth),
                          resources=resources(self._types))  # fmt: skip
            name = self.process or (process_name(self.pid) if self.pid else "")
            trace.header["process"] = name or trace.header["process"]
            trace.add_filter("resolve")  # names are looked up as events come
            self._out += [line + "\n" for line in lines(trace)]
        return self._out

    def _flush(self) -> None:
        """This batch's lines to the file, whole or not at all: a full disk
        leaves the report as it was after the last whole batch (OutputError)."""
        assert self._file is not None
        text, self._out = "".join(self._out), []
        try:
            self._file.append(text.encode())
        except OSError as exc:
            raise OutputError(f"cannot write {self._file.path}: {exc.strerror}; the report "
                              "up to then is kept") from None  # fmt: skip

    def _stack(self, record: np.void) -> list[tuple[int, bool]]:
        ids = self._stack_ids.get(int(record["seq"]))
        if ids is None or self._read_stack is None:
            return []
        frames: list[tuple[int, bool]] = []
        for stack_id, kernel in ((ids[1], True), (ids[0], False)):  # kernel frames are innermost
            if stack_id >= 0:
                if stack_id not in self._stacks:
                    self._stacks[stack_id] = self._read_stack(stack_id)
                frames += [(address, kernel) for address in self._stacks[stack_id]]
        return frames[: self._depth]

    def _user(self, pid: int, address: int) -> Symbol | None:
        vaddr = self._site_of.get(address)
        if vaddr is not None and self._libc is not None:  # a libc probe site: its libc's symbols
            libc = module_symbols(self._libc)
            function, offset, location = libc.lookup(vaddr)
            bias = address - vaddr
            return Symbol(str(self._libc), function, offset, location, libc.span(bias))
        return self._names.resolve(pid, address)  # return addresses: named by their call

    def write(self, batch: np.ndarray, kmem_kind: int, probe_kind: int,
              user_kinds: tuple[int, int] | None = None) -> None:  # fmt: skip
        out = self._begin()
        assert self._calls is not None
        probes = batch[batch["kind"] == probe_kind]
        for ip, site in zip(probes["ip"].tolist(), probes["site"].tolist(), strict=True):
            if site < len(self._site_vaddrs):
                self._site_of[ip] = self._site_vaddrs[site]
        if self._read_stack is not None:
            wanted = (batch["kind"] == kmem_kind) | (batch["kind"] == probe_kind)
            if user_kinds is not None:
                wanted |= np.isin(batch["kind"], user_kinds)
            rows = batch[wanted]
            ids = zip(rows["ustack"].tolist(), rows["kstack"].tolist(), strict=True)
            self._stack_ids = {self._seq + n: pair for n, pair in enumerate(ids)}
        records, args, self._seq = decode_batch(
            batch, self._seq, self.probes, kmem_kind, probe_kind, user_kinds
        )
        if len(records):
            items = self._calls.items(records, args)
            out += [f"@ {bit:x} : {name}\n" for bit, name in self._calls.new_contexts]
            out += [map_line(m, start, end) + "\n" for m, start, end in self._calls.new_modules]
            out += [line + "\n" for line in list(lines(Trace(items=items)))[1:]]  # no header
        self._flush()

    def close(self, lost_events: int = 0, lost_stacks: int = 0) -> None:
        if self._file is not None:
            out = self._begin()
            if lost_events:
                out.append(f"## {lost_events} events lost: the ring buffer was full\n")
            if lost_stacks:
                out.append(f"## {lost_stacks} stacks not stored: the stack map was full\n")
            try:
                self._flush()
            finally:
                self._file.close()
                self._file = None
