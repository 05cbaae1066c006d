"""The live view on a terminal, like top: probe rates and totals, arenas and
their contention, heaps and sbrk, the mallopt and tunables log, lost events.

Rendered with rich on the terminal's alternate screen, refreshed every
interval from the kernel's counters and the allocator model; the summary is
printed on the normal screen when the trace ends.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING

from mtrace_live.probes.elf.lazy import lazy_module

from .alloc_table import not_glibc_line, other_allocators
from .data.allocator_state import Allocators, ProcessState
from .data.sink import EventBatch, Sink, TraceInfo, TraceResult
from .summary import print_summary, setting_change

if TYPE_CHECKING:
    from rich import console as rich_console
    from rich import live as rich_live
    from rich import table as rich_table
    from rich import text as rich_text
    from rich.console import Console, Group, RenderableType
    from rich.live import Live
    from rich.table import Table

    from .alloc_view import AllocPanel
    from .contention_view import ContentionPanel
else:  # (rich, about 20 ms: at the view's start, after the line that says the trace is on)
    rich_console, rich_live = lazy_module("rich.console"), lazy_module("rich.live")
    rich_table, rich_text = lazy_module("rich.table"), lazy_module("rich.text")

SETTINGS_SHOWN = 8
ARENAS_SHOWN = 12


class LiveView(Sink):
    """``--output live``: refreshed every ``TraceInfo.interval`` from the
    kernel's counters and the allocator model's state."""

    def __init__(self, console: Console | None = None) -> None:
        self.interval = 1.0
        self._console = console
        self._info: TraceInfo | None = None
        self._live: Live | None = None
        self._started = 0.0
        self._last = 0.0
        self._previous_hits: dict[str, int] = {}
        self._previous_waits: dict[tuple[int, int], int] = {}
        self._rates: dict[str, float] = {}
        self._wait_rates: dict[tuple[int, int], float] = {}
        self._allocs: AllocPanel | None = None
        self._contention: ContentionPanel | None = None
        self._others: dict[int, str] = {}  # pid -> its allocator, where it is not glibc's

    def start(self, info: TraceInfo) -> None:
        from .alloc_view import AllocPanel
        from .contention_view import ContentionPanel

        self._info = info
        if info.allocs:
            self._allocs = AllocPanel(info.frame_names, info.leaks_older_than)
        self._contention = ContentionPanel(info.frame_names, inflated=info.allocs)
        self.interval = info.interval
        self._started = self._last = time.monotonic()
        console = self._console or rich_console.Console(file=sys.stdout)
        self._live = rich_live.Live(
            self._render({}, {}), console=console, screen=True, auto_refresh=False
        )
        self._live.start(refresh=True)

    def consume(self, batch: EventBatch) -> None:
        self.written += len(batch.libc)

    def tick(self) -> None:
        now = time.monotonic()
        if self._live is None or self._info is None or now - self._last < self.interval:
            return
        counters = self._info.counters.read()
        hits, lost = dict(counters.probe_hits), dict(counters.probe_lost)
        elapsed = now - self._last
        self._rates = {
            name: (count - self._previous_hits.get(name, 0)) / elapsed
            for name, count in hits.items()
        }
        self._previous_hits = hits
        waits = _arena_waits(self._info.allocators)
        self._wait_rates = {
            key: (count - self._previous_waits.get(key, 0)) / elapsed
            for key, count in waits.items()
        }
        self._previous_waits = waits
        if self._allocs is not None:
            snapshot = self._info.counters.allocations(outstanding=True)
            if snapshot is not None:
                self._allocs.update(snapshot, elapsed)
                self._others = other_allocators(snapshot)
        lock_waits = self._info.counters.lock_waits()
        if lock_waits is not None and self._contention is not None:
            self._contention.update(lock_waits, elapsed)
        self._last = now
        self._live.update(self._render(hits, lost), refresh=True)

    def finish(self, result: TraceResult) -> None:
        if self._live is not None:
            self._live.stop()
        print_summary(result, sys.stdout)

    # ---- rendering -----------------------------------------------------------

    def _render(self, hits: dict[str, int], lost: dict[str, int]) -> Group:
        info = self._info
        up = time.monotonic() - self._started
        total_lost = sum(lost.values())
        target = "all processes" if info is None or info.all_processes else f"pid {info.pid}"
        header = rich_text.Text.assemble(
            ("mtrace-live ", "bold"),
            f"{target}  up {up:.0f}s  events {sum(hits.values())}  ",
            (f"lost {total_lost}", "bold red" if total_lost else ""),
            "  (Ctrl-C to stop)",
        )
        parts: list[RenderableType] = [header]
        if self._allocs is not None:
            parts += self._allocs.render()
        if info is not None and info.libc_probes:
            parts.append(self._probe_table(hits, lost))
            with info.allocators.lock:
                processes = sorted(info.allocators.processes.values(), key=lambda p: p.pid)
            # the arenas are glibc's malloc's: a process on another allocator gets a line
            on_glibc = [state for state in processes if state.pid not in self._others]
            parts.append(self._arena_table(on_glibc))
            if self._others:
                said = [not_glibc_line(pid, label) for pid, label in sorted(self._others.items())]
                parts.append(rich_text.Text("\n".join(said)))
            if self._contention is not None:
                parts += self._contention.render(on_glibc)
            parts.append(self._memory_table(processes))
            parts.append(self._settings_table(processes))
        return rich_console.Group(*parts)

    def _probe_table(self, hits: dict[str, int], lost: dict[str, int]) -> Table:
        table = rich_table.Table(title="probes", title_justify="left", expand=False)
        for column in ("probe", "rate/s", "total", "lost"):
            table.add_column(column, justify="left" if column == "probe" else "right")
        rows = sorted(((n, c) for n, c in hits.items() if c), key=lambda kv: (-kv[1], kv[0]))
        for name, count in rows:
            table.add_row(
                name, f"{self._rates.get(name, 0.0):.0f}", str(count), str(lost.get(name, 0))
            )
        if not rows:
            table.add_row("(no hits yet)", "", "", "")
        return table

    def _arena_table(self, processes: list[ProcessState]) -> Table:
        table = rich_table.Table(title="arenas and contention", title_justify="left")
        for column in (
            "pid",
            "arena",
            "reused",
            "free-list",
            "reuse waits",
            "lock waits",
            "waits/s",
        ):
            table.add_column(
                column,
                justify="left" if column in ("pid", "arena") else "right",
                no_wrap=column == "arena",
                min_width=19 if column == "arena" else None,
            )
        shown = 0
        for state in processes:
            for arena in sorted(state.arenas.values(), key=lambda a: (not a.main, a.address)):
                if shown == ARENAS_SHOWN:
                    break
                rate = self._wait_rates.get((state.pid, arena.address), 0.0)
                table.add_row(
                    str(state.pid),
                    f"{arena.address:#x}" + (" main" if arena.main else ""),
                    str(arena.reused), str(arena.free_list), str(arena.reuse_waits),
                    str(state.arena_lock_waits(arena)), f"{rate:.1f}",
                )  # fmt: skip
                shown += 1
        return table

    def _memory_table(self, processes: list[ProcessState]) -> Table:
        table = rich_table.Table(title="heaps, sbrk, retries, checks", title_justify="left")
        for column in ("pid", "comm", "heaps", "heap bytes", "sbrk net", "retries",
                       "double-free checks", "setjmp/longjmp"):  # fmt: skip
            table.add_column(column, justify="left" if column in ("pid", "comm") else "right")
        for state in processes:
            setjmps, longjmps = state.jumps
            table.add_row(
                str(state.pid), state.comm, str(len(state.heaps)), str(state.heap_bytes),
                str(state.sbrk_grown - state.sbrk_shrunk), str(sum(state.retries.values())),
                str(state.double_free_checks), f"{setjmps}/{longjmps}",
            )  # fmt: skip
        return table

    def _settings_table(self, processes: list[ProcessState]) -> Table:
        table = rich_table.Table(title="mallopt and tunables (latest)", title_justify="left")
        for column in ("pid", "setting", "old -> new"):
            table.add_column(column)
        changes = sorted(
            (change for state in processes for change in state.settings), key=lambda c: c.ts_ns
        )
        for change in changes[-SETTINGS_SHOWN:]:
            table.add_row(str(change.pid), change.setting, setting_change(change))
        return table


def _arena_waits(model: Allocators) -> dict[tuple[int, int], int]:
    return {
        (state.pid, arena.address): arena.reuse_waits + state.arena_lock_waits(arena)
        for state in model.processes.values()
        for arena in state.arenas.values()
    }
