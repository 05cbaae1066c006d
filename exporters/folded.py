"""Allocations as folded stacks (``--folded FILE``, ``report --format
folded``): one line per
stack, its frames from the outermost caller to the call site separated by
``;``, then a space and a value, the input of flamegraph.pl, inferno and
speedscope. The value is the live bytes (``inuse_space``) or the bytes
allocated (``alloc_space``). A native frame is its function; a Python
function's frame is ``file:qualname:line``; a frame in JIT code is the name
its process's perf map gives it, or ``[jit]_0xADDR`` (a name's spaces are
written as ``_``)."""

from __future__ import annotations

from collections import Counter

from .data.alloc_snapshot import AllocSnapshot, FrameNames, function_name
from .data.sink import FileAtEndSink, TraceResult
from .data.symbolize import Symbol, is_python


def folded_frame(symbol: Symbol | None, address: int) -> str:
    """A frame's name in a folded stack."""
    if is_python(symbol) and symbol is not None and symbol.location:
        filename, _, line = symbol.location.rpartition(":")
        return f"{filename}:{symbol.function}:{line}"
    return function_name(symbol, address)


def folded_lines(
    snapshot: AllocSnapshot, names: FrameNames, value: str = "inuse_space"
) -> list[str]:
    totals: Counter[str] = Counter()
    for row in snapshot.stacks:
        amount = row.live_bytes if value == "inuse_space" else row.bytes
        if amount <= 0:
            continue
        frames = [folded_frame(names.resolve(row.tgid, a), a) for a in reversed(row.frames)]
        key = ";".join(f.replace(";", ":").replace(" ", "_") for f in frames)
        totals[key] += amount
    return [f"{stack} {amount}" for stack, amount in sorted(totals.items())]


class FoldedSink(FileAtEndSink):
    """``--folded FILE``: the live bytes by whole call stack when the trace ends."""

    def content(self, result: TraceResult) -> bytes | None:
        if result.allocations is None:
            return None
        lines = folded_lines(result.allocations, result.frame_names)
        return "".join(f"{line}\n" for line in lines).encode()
