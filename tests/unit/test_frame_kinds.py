"""Frame kinds (probes/frame_kinds.py, records.h): a Python function's frame
kept whole, by its code object and instruction offset, and never a
stack's cut; named by the resolver of its kind where one is given."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from mtrace_live.exporters.allocinfo import allocating_line
from mtrace_live.exporters.data.alloc_snapshot import FrameNames, StackRow
from mtrace_live.exporters.data.symbolize import Symbol, python_symbol
from mtrace_live.exporters.data.wrappers import Wrappers
from mtrace_live.probes.frame_kinds import (
    KIND_NAMES,
    KIND_PYTHON,
    file_frame,
    frame_kind,
    in_file,
    in_python,
    python_frame,
)

USER_TOP = 1 << 47  # x86-64's user space
CALL_SITE = 0x401136
GARBAGE = 0x1234  # an address in no mapping: what a frame-pointer walk may end on


@settings(deadline=None)
@given(code=st.integers(0, USER_TOP // 8 - 1).map(lambda n: n * 8), offset=st.integers(0, 0xFFFF))
def test_a_python_frame_keeps_its_code_object_and_offset(code: int, offset: int) -> None:
    frame = python_frame(code, offset)
    assert frame_kind(frame) == KIND_PYTHON and KIND_NAMES[KIND_PYTHON] == "python"
    assert in_python(frame) == (code, offset)
    assert in_file(frame) is None


def test_a_file_frame_is_no_python_frame() -> None:
    assert in_python(file_frame(7, 0x1140)) is None
    assert in_python(CALL_SITE) is None


def test_a_python_frame_is_never_a_cut_and_is_named_by_its_kinds_resolver() -> None:
    # GIVEN a stack whose second frame is a Python function's, above an
    # address in no mapping, in a process with no maps to read
    code = 0x7F00_1234_5678
    frames = (CALL_SITE, python_frame(code, 42), GARBAGE)
    unnamed = FrameNames(live=False)
    # THEN it is cut at the address only, the Python frame kept, unnamed
    assert unnamed.cut(1, frames) == frames[:2]
    assert unnamed.resolve(1, frames[1]) is None
    # AND a resolver given for its kind names it from its code object
    named = FrameNames(live=False)
    seen: list[tuple[int, int]] = []

    def by_code(tgid: int, frame: int) -> Symbol | None:
        found = in_python(frame)
        assert found is not None
        seen.append(found)
        return Symbol("[python]", "handler", 0, "app.py:42")

    named.resolvers[KIND_PYTHON] = by_code
    assert named.cut(1, frames) == frames[:2]
    symbol = named.resolve(1, frames[1])
    assert symbol is not None and symbol.function == "handler"
    assert seen[-1] == (code, 42)


def test_allocinfo_charges_a_python_stack_to_its_first_python_frame() -> None:
    # GIVEN a stack from malloc's caller up: the interpreter's frames (unnamed
    # here), then two Python frames, the allocating one first
    leaf, caller = python_frame(0x7F00_0000_1000, 10), python_frame(0x7F00_0000_2000, 4)
    frames = (CALL_SITE, CALL_SITE + 0x40, leaf, caller)
    names = FrameNames(live=False)
    lines = {leaf: ("Cache.fill", 12), caller: ("main", 31)}
    names.resolvers[KIND_PYTHON] = lambda tgid, frame: python_symbol(
        lines[frame][0], "/srv/app.py", lines[frame][1])  # fmt: skip
    row = StackRow(1, "malloc", CALL_SITE, frames, 1, 64, 64, 0, 0, 0, 0)
    # WHEN its allocating line is worked out
    line = allocating_line(row, names, Wrappers())
    # THEN it is the first Python frame's file:line and qualified name
    assert line == "/srv/app.py:12 func:Cache.fill"
    # AND a Python function named as a wrapper is passed over, as a native one is
    assert allocating_line(row, names, Wrappers().adding(["Cache.fill"])) == (
        "/srv/app.py:31 func:main"
    )
