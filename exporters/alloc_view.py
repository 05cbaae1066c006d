"""The allocation panels of the live view: who holds memory, which stack
grows, what has been outstanding for long.

Each refresh reads the kernel's tables (through the trace's counter source)
and keeps a short history per process, drawn as sparklines: live bytes and
allocation rate, the way a load test is watched. Rates are per second over
the last refresh.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from .alloc_table import leak_groups, size_text, stack_text
from .data.alloc_snapshot import AllocSnapshot, FrameNames, StackRow

HISTORY = 40  # refreshes kept for the sparklines
STACKS_SHOWN = 8
BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], top: float | None = None) -> str:
    """One bar per value, scaled from the lowest to the highest, or with
    ``top`` from 0 to ``top`` (a share: 0 to 1)."""
    if not values:
        return ""
    if top is not None:
        return "".join(BARS[max(0, min(len(BARS) - 1, int(v / top * len(BARS))))] for v in values)
    low, high = min(values), max(values)
    span = high - low
    if span <= 0:
        return BARS[0 if high == 0 else 3] * len(values)
    return "".join(BARS[min(len(BARS) - 1, int((v - low) / span * len(BARS)))] for v in values)


@dataclass
class _History:
    live: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    rate: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))


class AllocPanel:
    """Keeps the history between refreshes; ``update`` with each snapshot,
    ``render`` for the view."""

    def __init__(self, names: FrameNames, leaks_older_than: float | None = None) -> None:
        self.names = names
        self.leaks_older_than = leaks_older_than
        self.snapshot: AllocSnapshot | None = None
        self._history: dict[int, _History] = {}
        self._bytes: dict[int, int] = {}  # pid -> bytes allocated at the last refresh
        self._stack_bytes: dict[tuple[int, str, tuple[int, ...]], int] = {}
        self._stack_rates: dict[tuple[int, str, tuple[int, ...]], float] = {}
        self._elapsed = 1.0

    def update(self, snapshot: AllocSnapshot, elapsed: float) -> None:
        elapsed = self._elapsed = max(elapsed, 1e-9)
        live: dict[int, int] = {}
        for row in snapshot.stacks:
            live[row.tgid] = live.get(row.tgid, 0) + row.live_bytes
        for proc in snapshot.processes:
            history = self._history.setdefault(proc.tgid, _History())
            before = self._bytes.get(proc.tgid, 0)
            history.rate.append((proc.bytes - before) / elapsed)
            history.live.append(live.get(proc.tgid, 0))
            self._bytes[proc.tgid] = proc.bytes
        rates = {}
        seen = {}
        for row in snapshot.stacks:
            key = (row.tgid, row.function, row.frames)
            rates[key] = (row.bytes - self._stack_bytes.get(key, 0)) / elapsed
            seen[key] = row.bytes
        self._stack_bytes, self._stack_rates = seen, rates
        self.snapshot = snapshot

    def render(self) -> list[RenderableType]:
        snapshot = self.snapshot
        if snapshot is None:
            return [Text("allocations: waiting for the first reading")]
        parts: list[RenderableType] = [self._process_table(snapshot)]
        oldest = self._oldest(snapshot)
        parts.append(
            self._stack_table(
                "top stacks by live bytes", snapshot.top("live", STACKS_SHOWN), oldest
            )
        )
        by_rate = sorted(snapshot.stacks, key=lambda r: -self._rate(r))
        busy = [row for row in by_rate[:STACKS_SHOWN] if self._rate(row) > 0]
        parts.append(self._stack_table("top stacks by allocation rate", busy, oldest))
        if self.leaks_older_than is not None:
            parts.append(self._leak_table(snapshot, self.leaks_older_than))
        return [Group(*parts)]

    def _rate(self, row: StackRow) -> float:
        return self._stack_rates.get((row.tgid, row.function, row.frames), 0.0)

    def _oldest(self, snapshot: AllocSnapshot) -> dict[tuple[int, str, tuple[int, ...]], float]:
        ages: dict[tuple[int, str, tuple[int, ...]], float] = {}
        for group in leak_groups(snapshot.outstanding, snapshot.now_ns):
            ages[(group.tgid, group.function, group.frames)] = (
                snapshot.now_ns - group.oldest_ns
            ) / 1e9
        return ages

    def _process_table(self, snapshot: AllocSnapshot) -> Table:
        sampled = (
            f" (sampled: 1 per {size_text(snapshot.sample_bytes)})" if snapshot.sample_bytes else ""
        )
        table = Table(title=f"allocations{sampled}", title_justify="left")
        for column in ("pid", "comm", "live since attach", "Δ live/s", "alloc/s", "frees",
                       "unknown frees", "untracked", "live over time",
                       "alloc rate over time"):  # fmt: skip
            table.add_column(
                column, justify="left" if column in ("pid", "comm") or "time" in column else "right"
            )
        for proc in sorted(snapshot.processes, key=lambda p: p.tgid):
            history = self._history.get(proc.tgid, _History())
            live = history.live[-1] if history.live else 0
            change = (
                (history.live[-1] - history.live[-2]) / self._elapsed
                if len(history.live) > 1
                else 0
            )
            table.add_row(
                str(proc.tgid), self.names.comms.get(proc.tgid, ""), size_text(live),
                ("+" if change >= 0 else "-") + size_text(abs(change)) + "/s",
                size_text(history.rate[-1] if history.rate else 0) + "/s",
                str(proc.frees), str(proc.unknown_frees), str(proc.untracked),
                sparkline(list(history.live)), sparkline(list(history.rate)),
            )  # fmt: skip
        return table

    def _stack_table(self, title: str, rows: list[StackRow],
                     oldest: dict[tuple[int, str, tuple[int, ...]], float]) -> Table:  # fmt: skip
        table = Table(title=title, title_justify="left")
        for column in (
            "live",
            "blocks",
            "oldest",
            "alloc/s",
            "calls",
            "pid",
            "function",
            "call stack",
        ):
            table.add_column(
                column, justify="left" if column in ("function", "call stack") else "right"
            )
        for row in rows:
            age = oldest.get((row.tgid, row.function, row.frames))
            table.add_row(
                size_text(row.live_bytes), str(row.live_objects),
                "" if age is None else f"{age:.0f}s", size_text(self._rate(row)) + "/s",
                str(row.objects), str(row.tgid), row.function,
                stack_text(self.names, row.tgid, row.frames, limit=3),
            )  # fmt: skip
        if not rows:
            table.add_row("", "", "", "", "", "", "(none yet)", "")
        return table

    def _leak_table(self, snapshot: AllocSnapshot, older_than: float) -> Table:
        table = Table(title=f"outstanding for over {older_than:g}s", title_justify="left")
        for column in ("bytes", "blocks", "oldest", "pid", "function", "call stack"):
            table.add_column(
                column, justify="left" if column in ("function", "call stack") else "right"
            )
        groups = leak_groups(snapshot.outstanding, snapshot.now_ns, older_than)
        for group in groups[:STACKS_SHOWN]:
            table.add_row(
                size_text(group.bytes), str(group.blocks),
                f"{(snapshot.now_ns - group.oldest_ns) / 1e9:.0f}s", str(group.tgid),
                group.function, stack_text(self.names, group.tgid, group.frames, limit=3),
            )  # fmt: skip
        if not groups:
            table.add_row("", "", "", "", "(none)", "")
        return table
