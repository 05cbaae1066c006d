"""The allocinfo table's user-space lines: each stack charged to its first
frame outside the allocation wrappers, the known ones and --wrappers'."""

from __future__ import annotations

import pytest
from mtrace_live.exporters.allocinfo import user_allocinfo
from mtrace_live.exporters.data.alloc_snapshot import AllocSnapshot, FrameNames, StackRow
from mtrace_live.exporters.data.symbolize import Symbol
from mtrace_live.exporters.data.wrappers import Wrappers

PID = 42
# function -> its start; a frame's address is start + 0x10
FUNCTIONS = {"operator new(unsigned long)": 0x1000, "g_strdup": 0x2000, "arena_take": 0x3000,
             "parse_config": 0x4000, "main": 0x5000}  # fmt: skip
UNNAMED = 0x7000  # in the program, in no function
KNOWN = Wrappers()


class TableNames(FrameNames):
    def resolve(self, tgid: int, address: int) -> Symbol | None:
        for name, start in FUNCTIONS.items():
            if start <= address < start + 0x100:
                line = f"conf.c:{address - start}" if name == "parse_config" else None
                return Symbol("/usr/bin/prog", name, address - start, line, (0, 0x8000))
        return Symbol("/usr/bin/prog", None, 0, None, (0, 0x8000)) if address < 0x8000 else None


def at(name: str) -> int:
    return FUNCTIONS[name] + 0x10


def stack(frames: tuple[int, ...], calls: int, size: int, frees: int) -> StackRow:
    return StackRow(PID, "malloc", frames[0], frames, calls, calls * size, calls * size, frees,
                    frees * size, frees * size, 0)  # fmt: skip


def lines(rows: tuple[StackRow, ...], wrappers: Wrappers = KNOWN) -> list[str]:
    snapshot = AllocSnapshot(rows, (), {}, {}, 0, 0, 0)
    return user_allocinfo(snapshot, TableNames(), wrappers)


def test_a_stack_is_charged_to_its_first_frame_past_the_known_wrappers() -> None:
    # GIVEN live blocks allocated through operator new from parse_config
    rows = (stack((at("operator new(unsigned long)"), at("parse_config"), at("main")), 10, 48, 4),)
    # THEN they are parse_config's, at its line, with their live blocks and bytes
    assert lines(rows) == [f"{6 * 48:12d} {6:8d} conf.c:16 func:parse_config"]


def test_one_line_per_allocating_line_with_the_blocks_summed() -> None:
    rows = (
        stack((at("operator new(unsigned long)"), at("parse_config"), at("main")), 10, 48, 4),
        stack((at("g_strdup"), at("parse_config"), at("main")), 5, 16, 0),
    )
    assert lines(rows) == [f"{6 * 48 + 5 * 16:12d} {11:8d} conf.c:16 func:parse_config"]


def test_wrappers_given_are_looked_past_as_the_known_ones_are() -> None:
    # GIVEN a program's own pool allocator, which the known wrappers do not name
    rows = (stack((at("arena_take"), at("parse_config"), at("main")), 3, 100, 0),)
    assert lines(rows) == [f"{300:12d} {3:8d} prog+0x3010 func:arena_take"]
    # THEN --wrappers (globs, comma-separated) makes its caller the line
    wrappers = Wrappers().adding(["arena_*", "  ,other"])
    assert lines(rows, wrappers) == [f"{300:12d} {3:8d} conf.c:16 func:parse_config"]


def test_a_stack_of_wrappers_only_is_its_outermost_frame_s() -> None:
    # GIVEN a stack cut after operator new (no caller known)
    rows = (stack((at("operator new(unsigned long)"),), 2, 8, 0),)
    # THEN the line is operator new's rather than nothing
    assert lines(rows) == [f"{16:12d} {2:8d} prog+0x1010 func:operator new(unsigned long)"]


def test_frames_in_no_function_are_module_and_offset_and_freed_stacks_are_left_out() -> None:
    rows = (stack((UNNAMED + 0x20, at("main")), 4, 10, 1), stack((at("main"),), 7, 10, 7))
    assert lines(rows) == [f"{30:12d} {3:8d} prog+0x7020 func:prog+0x7020"]


@pytest.mark.parametrize(
    ("name", "wrapped"),
    [("operator new(unsigned long)", True), ("operator new[](unsigned long, std::nothrow_t const&)",
      True), ("operator new(unsigned long, std::align_val_t)", True), ("strdup", True),
     ("g_malloc0", True), ("xmalloc", True), ("__rust_alloc", True), ("main", False),
     ("operator<<(std::ostream&, int)", False), ("strdup_helper", False),
     ("std::vector<int, std::allocator<int> >::_M_realloc_insert(int const&)", False)],
)  # fmt: skip
def test_the_known_wrappers(name: str, wrapped: bool) -> None:
    assert Wrappers().wraps(name) is wrapped
