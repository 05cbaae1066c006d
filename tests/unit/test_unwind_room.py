"""The unwinder's tables shared out among files (tracer/unwind/unwind_room.py):
runs taken never overlap, runs given back are found again (merged with
their neighbours), and a table with room for a file always gives it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from mtrace_live.tracer.unwind.unwind_room import Extents


def test_a_run_given_back_is_taken_again_merged_with_its_neighbours() -> None:
    room = Extents(0, 100)
    a, b, c, d = room.take(30), room.take(30), room.take(30), room.take(10)
    assert (a, b, c, d) == (0, 30, 60, 90)
    assert room.take(1) is None
    room.give(0, 30)
    room.give(60, 30)
    assert room.take(40) is None  # two runs of 30, apart
    room.give(90, 10)
    assert room.free == [(0, 30), (60, 40)]
    room.give(30, 30)
    assert room.free == [(0, 100)] and room.used == 0
    assert room.take(100) == 0


def test_the_server_s_share_is_added_where_it_could_not_start() -> None:
    room = Extents(0, 70)
    assert room.take(70) == 0
    room.grow(80)
    assert room.take(10) == 70 and room.used == 80


def test_nothing_taken_for_no_entries() -> None:
    room = Extents(5, 10)
    assert room.take(0) == 5 and room.used == 0
    room.give(5, 0)
    assert room.free == [(5, 5)]


@settings(deadline=None, max_examples=300)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40)), max_size=60))
def test_runs_never_overlap_and_all_room_comes_back(steps: list[tuple[bool, int]]) -> None:
    room = Extents(0, 200)
    taken: list[tuple[int, int]] = []
    for give, size in steps:
        if give and taken:
            first, n = taken.pop(size % len(taken))
            room.give(first, n)
            continue
        first = room.take(size)
        free_runs = [n for _, n in room.free]
        if first is None:
            # THEN it says no only where no free run is that long
            assert all(n < size for n in free_runs)
            continue
        assert first >= 0 and first + size <= 200
        assert all(first + size <= f or f + n <= first for f, n in taken)
        taken.append((first, size))
        assert room.used == sum(n for _, n in taken)
    for first, n in taken:
        room.give(first, n)
    assert room.free == [(0, 200)]
