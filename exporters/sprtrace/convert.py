"""kmemtrace record sets as sp-rtrace reports and as JSON lines.

Each allocation and free record becomes a call of its resource type
(kmalloc, kmem_cache, pages; sbrk, heap and arena for the libc probes
recorded as allocations), indexed in sequence order, stamped with its time
since the first record, with its call site as a one-frame backtrace, named
from the kallsyms saved with the records. The other libc probe records
become permanent comments.
"""

from __future__ import annotations

import platform
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np
from mtrace_live.exporters.data.kallsyms import KernelSymbols
from mtrace_live.exporters.kmemtrace.abi import TYPES, EventId, TypeId
from mtrace_live.exporters.kmemtrace.reader import RecordSet
from mtrace_live.exporters.sprtrace.text import Call, Comment, Frame, Resource, Trace, clock
from mtrace_live.probes.records import ALLOC_FN_NAMES

if TYPE_CHECKING:
    from mtrace_live.exporters.data.symbolize import Symbol

KERNEL_MODULE = "[kernel.kallsyms]"
MAX_CONTEXTS = 32  # a context is a bit of a 32-bit mask


UserSymbols = Callable[[int, int], "Symbol | None"]  # (pid, address) -> symbol
Stacks = Callable[[np.void], list[tuple[int, bool]]]  # record -> [(address, kernel?)]


class RecordCalls:
    """Turns decoded records into sp-rtrace calls and comments, batch after
    batch: indexes and times continue, and each module a backtrace uses is
    reported once (``new_modules``) so that its map line can come first."""

    def __init__(
        self,
        probes: list[str],
        kernel: KernelSymbols,
        user: UserSymbols | None = None,
        stack: Stacks | None = None,
    ) -> None:
        self.probes = probes
        self.kernel = kernel
        self.user = user
        self.stack = stack  # a record's stack: (address, kernel?) innermost first, or []
        self.index = 0
        self.start_ns: int | None = None
        self.resolved = False
        self.modules: dict[str, tuple[int, int] | None] = {}
        self.new_modules: list[tuple[str, int, int]] = []
        # Each process (the first 32 seen) is a context: sp-rtrace-postproc -C
        # MASK then keeps one process's calls.
        self.contexts: dict[int, int] = {}  # pid -> context bit
        self.new_contexts: list[tuple[int, str]] = []
        self.process_name: Callable[[int], str] = lambda pid: ""
        self._kernel_names: dict[int, tuple[str | None, str | None]] = {}

    def items(self, recs: np.ndarray, args: np.ndarray) -> list[Call | Comment]:
        out: list[Call | Comment] = []
        self.new_modules = []
        self.new_contexts = []
        probe_args = iter(args)
        for rec in recs:
            self.index += 1
            if self.start_ns is None:
                self.start_ns = int(rec["timestamp"])
            ms = (int(rec["timestamp"]) - self.start_ns) // 1_000_000
            event, type_id = int(rec["event_id"]), int(rec["type_id"])
            if event == EventId.PROBE:
                probe = int(rec["probe"])
                name = self.probes[probe] if probe < len(self.probes) else f"probe{probe}"
                values = " ".join(f"{int(a):#x}" for a in next(probe_args))
                out.append(Comment(f"## [{clock(ms)}] pid {int(rec['pid'])} {name} {values}"))
                continue
            info = TYPES[TypeId(type_id)]
            resource, alloc_fn, free_fn = info.name, info.alloc, info.free
            if type_id == TypeId.USER and int(rec["fn"]) < len(ALLOC_FN_NAMES):
                alloc_fn = free_fn = ALLOC_FN_NAMES[int(rec["fn"])]  # realloc's free too
            if event == EventId.ALLOC and not rec["ptr"]:  # failed: nothing to track
                size_asked = int(rec["bytes_req"])
                out.append(Comment(f"## [{clock(ms)}] failed {alloc_fn}<{resource}>({size_asked})"))
                continue
            size = int(rec["bytes_req"]) if event == EventId.ALLOC else None
            if size is not None and type_id == TypeId.PAGES:
                size = int(rec["bytes_alloc"])
            pid, kernel = int(rec["pid"]), type_id <= TypeId.PAGES
            stack = self.stack(rec) if self.stack is not None else []
            if stack:
                frames = [f for f in (self._frame(a, k, pid) for a, k in stack) if f is not None]
            else:
                site = self._frame(int(rec["call_site"]), kernel, pid)
                frames = [site] if site is not None else []
            function = alloc_fn if size is not None else free_fn
            context = self._context(pid)
            call = Call(
                self.index, function, resource, int(rec["ptr"]), size, ms, context, frames=frames
            )
            if size is not None and type_id != TypeId.USER:
                call.args = [str(int(rec["bytes_alloc"])), f"{int(rec['gfp_flags']):#x}"]
            out.append(call)
        return out

    def _frame(self, address: int, kernel: bool, pid: int) -> Frame | None:
        if not address:
            return None
        frame = Frame(address)
        if kernel:
            if address not in self._kernel_names:
                found = self.kernel.function(address)
                module = (found[2] or KERNEL_MODULE) if found else None
                self._kernel_names[address] = (found[0], module) if found else (None, None)
            frame.function, frame.module = self._kernel_names[address]
            module = frame.module
            if module and module not in self.modules:
                self._module(
                    module, self.kernel.module_range("" if module == KERNEL_MODULE else module)
                )
        elif self.user is not None:
            symbol = self.user(pid, address)
            if symbol is not None:
                frame.function, frame.location = symbol.function, symbol.location
                frame.module = symbol.module
                if symbol.module not in self.modules:
                    self._module(symbol.module, symbol.span)
        self.resolved = self.resolved or frame.function is not None
        return frame

    def _context(self, pid: int) -> int:
        bit = self.contexts.get(pid)
        if bit is None:
            if len(self.contexts) >= MAX_CONTEXTS:
                return 0
            bit = self.contexts[pid] = 1 << len(self.contexts)
            name = self.process_name(pid)
            self.new_contexts.append((bit, f"pid {pid}" + (f" ({name})" if name else "")))
        return bit

    def _module(self, name: str, span: tuple[int, int] | None) -> None:
        self.modules[name] = span
        if span:
            self.new_modules.append((name, *span))


def header(pid: int, version: str, depth: int = 1) -> dict[str, str]:
    return {
        "version": "1.0", "arch": platform.machine(),
        "timestamp": time.strftime("%Y.%-m.%-d %H:%M:%S"),
        "process": f"pid-{pid}" if pid else "kernel", "pid": str(pid),
        "backtrace depth": str(depth), "origin": f"mtrace-live {version}",
    }  # fmt: skip


def resources(types: Iterable[int]) -> list[Resource]:
    wanted = set(types)
    present = [t for t in TYPES if t in wanted]
    return [Resource(bit, TYPES[t].name, TYPES[t].desc, TYPES[t].refcount)
            for bit, t in enumerate(present, 1)]  # fmt: skip


def from_record_set(records: RecordSet, symbols: KernelSymbols, version: str) -> Trace:
    recs = records.records
    pids = Counter(int(p) for p in recs["pid"][recs["has_task"] == 1]) if len(recs) else Counter()
    trace = Trace(header=header(pids.most_common(1)[0][0] if pids else 0, version))
    trace.resources = resources(
        int(t) for t in np.unique(recs["type_id"][recs["event_id"] != EventId.PROBE])
    )
    calls = RecordCalls(records.libc_probes, symbols)
    trace.items = calls.items(recs, records.args)
    trace.mmaps = sorted(calls.new_modules, key=lambda m: m[1])
    trace.contexts = dict(calls.new_contexts)
    if calls.resolved:
        trace.add_filter("resolve")
    return trace
