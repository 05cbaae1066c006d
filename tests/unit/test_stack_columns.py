"""The allocation stacks as columns (no root): the kernel's stack rows read
into numbered keys and kept from one read to the next, the stacks cut and
summed by number, and the columns' figures against StackRow's own, row by
row."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from mtrace_live.exporters.data.alloc_snapshot import (
    FrameNames,
    StackCatalog,
    StackColumns,
    StackRow,
    summed,
)
from mtrace_live.exporters.data.symbolize import Symbol
from mtrace_live.probes.records import ALLOC_FRAMES_BASE, ALLOC_STACK_ROW_DTYPE
from mtrace_live.tracer.loop.alloc_probes import StackReader

APP = 300
SITE, MAIN = 0x401010, 0x401200


class FrameStore:
    """The frame store as a trace program hands it over, counting its reads."""

    def __init__(self, frames: dict[int, list[int]]) -> None:
        self.frames = frames
        self.reads: list[int] = []

    def stack(self, stack_id: int) -> list[int]:
        self.reads.append(stack_id)
        return list(self.frames[stack_id])


def stack_rows(*rows: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
    """alloc_stacks rows: (slot, stack id, calls) each, of APP's malloc at SITE."""
    table = np.zeros(len(rows), ALLOC_STACK_ROW_DTYPE)
    for index, (slot, stack, calls) in enumerate(rows):
        table[index]["tag"] = slot + 1
        table[index]["key"] = (SITE, APP, stack, 0, 0, 1)
        table[index]["stats"]["calls"] = calls
        table[index]["stats"]["bytes"] = 16 * calls
    return np.array([slot for slot, _, _ in rows], "<u4"), table


def test_a_slot_s_frames_are_read_until_they_read_the_same_twice_then_never() -> None:
    # GIVEN two stored stacks, the second still being written by the kernel
    one, two = ALLOC_FRAMES_BASE + 1, ALLOC_FRAMES_BASE + 2
    store = FrameStore({one: [SITE, MAIN], two: [SITE]})
    reader = StackReader()
    slots, table = stack_rows((5, one, 1), (9, two, 1))
    # WHEN the table is read while the second stack is written, then twice more
    first = reader.read(store, slots, table)  # type: ignore[arg-type]
    store.frames[two] = [SITE, MAIN + 8]
    second = reader.read(store, slots, table)  # type: ignore[arg-type]
    third = reader.read(store, slots, table)  # type: ignore[arg-type]
    fourth = reader.read(store, slots, table)  # type: ignore[arg-type]
    # THEN each read gives the frames as they were; a stack is read until it
    # reads the same twice (the first: twice; the second: three times)
    assert [row.frames for row in first] == [(SITE, MAIN), (SITE,)]
    assert [row.frames for row in second] == [(SITE, MAIN), (SITE, MAIN + 8)]
    assert list(third) == list(second) == list(fourth)
    assert sorted(store.reads) == [one, one, two, two, two]
    # AND a slot given to another stack is read again at once
    store.frames[ALLOC_FRAMES_BASE + 3] = [SITE, MAIN + 16]
    slots, table = stack_rows((5, one, 2), (9, ALLOC_FRAMES_BASE + 3, 4))
    fifth = reader.read(store, slots, table)  # type: ignore[arg-type]
    assert [(row.frames, row.calls, row.bytes) for row in fifth] == [
        ((SITE, MAIN), 2, 32), ((SITE, MAIN + 16), 4, 64),
    ]  # fmt: skip
    assert store.reads[5:] == [ALLOC_FRAMES_BASE + 3]


class CutAt(FrameNames):
    """Addresses below ``self.end`` are in the program."""

    end = 0x500000

    def resolve(self, tgid: int, address: int) -> Symbol | None:
        if address >= self.end:
            return None
        return Symbol("/usr/bin/app", "f", 0, None, (0x400000, self.end))


def test_cut_stacks_are_kept_by_number_until_the_process_s_names_change() -> None:
    # GIVEN two keys of one call site whose stacks differ past the program's end
    catalog = StackCatalog()
    ids = np.array([catalog.number((APP, "malloc", SITE, (SITE, MAIN, end)))
                    for end in (0x600000, 0x700000)], np.int64)  # fmt: skip
    columns = StackColumns(catalog, ids, np.array([[1, 8, 8, 0, 0, 0, 5], [2, 16, 16, 1, 8, 8, 9]]))
    names = CutAt()
    # WHEN they are cut, THEN they are one row, summed, its last time the latest
    assert [(r.frames, r.calls, r.bytes, r.frees, r.last_ts) for r in names.trim(columns)] == [
        ((SITE, MAIN), 3, 24, 1, 9)
    ]
    # WHEN the program's mappings grow and its names are read again
    names.end = 0x800000
    assert [r.frames for r in names.trim(columns)] == [(SITE, MAIN)]  # the cut kept
    names.forget({APP})
    # THEN the stacks are cut anew
    assert sorted(r.frames for r in names.trim(columns)) == [
        (SITE, MAIN, 0x600000),
        (SITE, MAIN, 0x700000),
    ]


# calls, then bytes, sizes, frees, bytes freed and the last time: an object
# estimate (calls x bytes / sizes) stays within int64
COUNT, BYTES = st.integers(0, 1 << 20), st.integers(0, 1 << 40)
VALUES = st.tuples(COUNT, BYTES, BYTES, COUNT, BYTES, BYTES)
ROWS = st.lists(st.tuples(st.integers(1, 3), st.integers(0, 3), VALUES), max_size=30)


def rows_of(drawn: list[tuple[int, int, tuple[int, ...]]]) -> list[StackRow]:
    """StackRows of processes 1-3 and stacks 0-3, their counts as drawn (a
    row frees no more than it allocated)."""
    rows = []
    for tgid, stack, (calls, nbytes, sizes, frees, freed, last) in drawn:
        frees, freed = min(frees, calls), min(freed, nbytes)
        rows.append(StackRow(tgid, "malloc", SITE, (SITE, MAIN + stack), calls, nbytes, sizes,
                             frees, freed, min(freed, sizes), last))  # fmt: skip
    return rows


@settings(deadline=None, max_examples=200)
@given(ROWS)
def test_the_columns_figures_are_the_rows_own(
    drawn: list[tuple[int, int, tuple[int, ...]]],
) -> None:
    rows = rows_of(drawn)
    columns = StackColumns.of(rows)
    # each row's heap values, each process's live objects and bytes
    assert columns.heap_values().tolist() == [list(row.heap_values) for row in rows]
    live: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for row in rows:
        live[row.tgid][0] += row.live_objects
        live[row.tgid][1] += row.live_bytes
    assert columns.live_by_process() == {tgid: tuple(pair) for tgid, pair in live.items()}
    # the top rows, by live bytes and by bytes, the first of equals first
    for key, (first, second) in (("live", ("live_bytes", "calls")), ("bytes", ("bytes", "calls"))):
        ranked = [row for row in rows if key != "live" or row.live_bytes > 0]
        ranked.sort(key=lambda r: (-getattr(r, first), -getattr(r, second)))
        assert columns.top(key, 5) == ranked[:5]


@settings(deadline=None, max_examples=200)
@given(ROWS)
def test_rows_of_one_key_are_summed(drawn: list[tuple[int, int, tuple[int, ...]]]) -> None:
    rows = rows_of(drawn)
    columns = StackColumns.of(rows)
    expected: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for row in rows:
        values = [row.calls, row.bytes, row.sizes, row.frees, row.bytes_freed, row.sizes_freed]
        known = expected.setdefault((row.tgid, row.frames), [0] * 6 + [0])
        known[:6] = [a + b for a, b in zip(known[:6], values, strict=True)]
        known[6] = max(known[6], row.last_ts)
    found = summed(columns.catalog, columns.ids, columns.values)
    assert {(r.tgid, r.frames): [r.calls, r.bytes, r.sizes, r.frees, r.bytes_freed,
                                 r.sizes_freed, r.last_ts] for r in found} == expected  # fmt: skip
    assert len(found) == len(expected)


def test_an_object_estimate_past_int64_is_held_at_its_bound() -> None:
    # GIVEN a row whose sampled bytes, over the sizes kept, make more objects
    # than an int64 holds (a profile's values are int64)
    catalog = StackCatalog()
    key = catalog.number((APP, "malloc", SITE, (SITE,)))
    columns = StackColumns(catalog, np.array([key]), np.array([[1 << 32, 1 << 40, 1, 0, 0, 0, 0]]))
    # THEN its counts are the largest an int64 holds from a float, its bytes as they are
    assert columns.heap_values().tolist() == [[2**63 - 1024, 1 << 40, 2**63 - 1024, 1 << 40]]
