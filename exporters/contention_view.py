"""The live view's contention panel: per arena, the time threads waited for
its lock in each interval (per second of wall time, and as a share of the
process's thread time) with a sparkline of the recent intervals; per
process, the share of thread time spent waiting and what the numbers
suggest (exporters/contention.py); and the stacks that waited longest."""

from __future__ import annotations

from collections import deque

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from .alloc_view import sparkline
from .contention import INFLATED_NOTE, advice, duration_text
from .data.alloc_snapshot import FrameNames
from .data.allocator_state import ProcessState
from .data.lock_waits import ARENA_KINDS, MAIN, LockWaits

HISTORY = 20  # intervals a sparkline shows
ARENAS_SHOWN = 12
STACKS_SHOWN = 5


class ContentionPanel:
    """What the live view shows of the lock waits in time."""

    def __init__(self, names: FrameNames, inflated: bool) -> None:
        self.names = names
        self.inflated = inflated  # the allocation probes are on
        self.waits: LockWaits | None = None
        self._before: dict[tuple[int, int], int] = {}  # (pid, futex) -> wait ns so far
        self._threads_before: dict[int, int] = {}  # pid -> thread ns so far
        self.rates: dict[tuple[int, int], float] = {}  # wait ns per second, last interval
        self.shares: dict[tuple[int, int], deque[float]] = {}  # share of thread time, by interval
        self.process_share: dict[int, float] = {}  # the last interval's

    def update(self, waits: LockWaits, elapsed: float) -> None:
        thread_delta = {
            pid: time.thread_ns - self._threads_before.get(pid, 0)
            for pid, time in waits.threads.items()
        }
        self._threads_before = {pid: time.thread_ns for pid, time in waits.threads.items()}
        now: dict[tuple[int, int], int] = {}
        for row in waits.rows:
            if row.kind in ARENA_KINDS:
                key = (row.pid, row.futex)
                now[key] = now.get(key, 0) + row.times.total_ns
        waited: dict[int, int] = {}
        for key, total in now.items():
            delta = total - self._before.get(key, 0)
            self.rates[key] = delta / elapsed if elapsed > 0 else 0.0
            spent = thread_delta.get(key[0], 0)
            history = self.shares.setdefault(key, deque(maxlen=HISTORY))
            history.append(min(1.0, delta / spent) if spent > 0 else 0.0)
            waited[key[0]] = waited.get(key[0], 0) + delta
        self.process_share = {pid: min(1.0, waited.get(pid, 0) / spent)
                              for pid, spent in thread_delta.items() if spent > 0}  # fmt: skip
        self._before = now
        self.waits = waits

    def render(self, processes: list[ProcessState]) -> list[RenderableType]:
        if self.waits is None:
            return []
        states = {state.pid: state for state in processes}
        parts: list[RenderableType] = [self._arena_table(states)]
        lines = self._process_lines(states)
        if lines:
            parts.append(Text("\n".join(lines)))
        stacks = self._stack_table()
        if stacks is not None:
            parts.append(stacks)
        return parts

    def _arena_table(self, states: dict[int, ProcessState]) -> Table:
        table = Table(title="arena lock waits in time", title_justify="left")
        for column in ("pid", "arena", "threads", "wait/s", "share", "recent share", "max"):
            table.add_column(column, justify="left" if column in ("pid", "arena", "recent share")
                             else "right", no_wrap=True)  # fmt: skip
        assert self.waits is not None
        rows = sorted(self.waits.rows, key=lambda r: -self.rates.get((r.pid, r.futex), 0.0))
        shown: set[tuple[int, int]] = set()
        for row in rows:
            key = (row.pid, row.futex)
            if row.kind not in ARENA_KINDS or key in shown or len(shown) == ARENAS_SHOWN:
                continue
            shown.add(key)
            state = states.get(row.pid)
            arena = state.arenas.get(row.futex) if state is not None else None
            threads = arena.attached_threads if arena is not None else None
            history = list(self.shares.get(key, ()))
            table.add_row(
                str(row.pid), f"{row.futex:#x}" + (" main" if row.kind == MAIN else ""),
                "?" if threads is None else str(threads),
                f"{duration_text(self.rates.get(key, 0.0))}/s",
                f"{history[-1]:.1%}" if history else "-", sparkline(history, top=1.0),
                duration_text(row.times.max_ns),
            )  # fmt: skip
        if not shown:
            table.add_row("(no arena lock waits yet)", "", "", "", "", "", "")
        return table

    def _process_lines(self, states: dict[int, ProcessState]) -> list[str]:
        assert self.waits is not None
        lines = []
        for pid, share in sorted(self.process_share.items()):
            state = states.get(pid)
            limit = ""
            if state is not None and state.arena_limit is not None:
                limit = (f"; {len(state.arenas)} arenas of a limit of {state.arena_limit} "
                         f"({state.arena_limit_source})")  # fmt: skip
            other = self.waits.of(pid, ("other",))
            lines.append(f"pid {pid}: {share:.1%} of thread time waiting on malloc arenas in "
                         f"the last interval{limit}; other libc locks "
                         f"{duration_text(other.total_ns)} in {other.count} waits")  # fmt: skip
            lines += [f"  advice ({item.rule}): {item.text}" for item in advice(self.waits, state)]
            if self.inflated and share > 0:
                lines.append(f"  note: {INFLATED_NOTE}")
        return lines

    def _stack_table(self) -> Table | None:
        assert self.waits is not None
        top = self.waits.top_stacks(STACKS_SHOWN)
        if not top:
            return None
        table = Table(title="stacks by arena lock wait time", title_justify="left")
        for column in ("pid", "total", "waits", "max", "call stack"):
            table.add_column(column, justify="left" if column in ("pid", "call stack") else "right")
        for row in top:
            stack = " < ".join(self.names.stack(row.pid, row.frames[:4])) or "(not walked)"
            table.add_row(str(row.pid), duration_text(row.times.total_ns), str(row.times.count),
                          duration_text(row.times.max_ns), stack)  # fmt: skip
        return table
