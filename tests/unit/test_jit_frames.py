"""Frames in JIT code (anonymous executable memory): a perf map's lines read
as perf reads them (exporters/data/perf_map.py), incrementally; the frames
kept where a stack is cut, named by the perf map or shown as ``[jit]
0xaddr``, in every output."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from mtrace_live.exporters.data.alloc_snapshot import (
    FrameNames,
    StackRow,
    frame_text,
    function_name,
    kind_name,
)
from mtrace_live.exporters.data.perf_map import PerfMap, parse_perf_map
from mtrace_live.exporters.data.symbolize import (
    JIT_MODULE,
    ProcessSymbols,
    is_anonymous,
    is_jit,
)
from mtrace_live.exporters.folded import folded_lines
from mtrace_live.exporters.lines import stack_table_json
from mtrace_live.exporters.pprof import build_profile
from mtrace_live.probes.elf.maps import Mapping

from .profile_proto import parsed
from .test_allocations import snapshot
from .test_file_frames import GONE, libc

CODE = Mapping(0x7F0000000000, 0x7F0000040000, 0, "", True, (0, 0), "rwxp")  # JIT code
DATA = Mapping(0x7F0000100000, 0x7F0000140000, 0, "", False, (0, 0), "rw-p")  # anonymous data
SWEPT = 2000  # lines in one read: more than are laid one by one
LIBC = Mapping(0x7F1000000000, 0x7F1000200000, 0x28000, str(libc()), True, (0, 0), "r-xp")


def test_perf_map_lines_are_start_size_name_in_hex() -> None:
    # GIVEN lines as V8, perf-map-agent and CPython write them, and lines
    # that are none (no name, no size, not hex, a size of 0)
    text = ("7f0000001000 40 JS:^leaf /srv/app.js:41:14\n"
            "0x7f0000002000 0x20 Interpreted [jit] py::f:/srv/a.py\n"
            "7f0000003000 10 Lcom/example/Foo;::bar\n"
            "7f0000004000 10\n"
            "7f0000005000 0 empty\n"
            "nothex 10 name\n"
            "\n")  # fmt: skip
    # WHEN it is parsed THEN each good line is its [start, end) and its
    # name (spaces and all)
    assert parse_perf_map(text) == [
        (0x7F0000001000, 0x7F0000001040, "JS:^leaf /srv/app.js:41:14"),
        (0x7F0000002000, 0x7F0000002020, "Interpreted [jit] py::f:/srv/a.py"),
        (0x7F0000003000, 0x7F0000003010, "Lcom/example/Foo;::bar"),
    ]


def test_the_later_line_wins_where_ranges_overlap() -> None:
    # GIVEN code freed and its memory used again: a later line over part of
    # an earlier one, laid one by one and in one sweep (many lines at once)
    few = [(0x1000, 0x1100, "old"), (0x1040, 0x1080, "new")]
    many = few + [(0x10000 + 0x100 * i, 0x10000 + 0x100 * i + 0x80, f"f{i}") for i in range(SWEPT)]
    for entries in (few, many):
        perf_map = PerfMap([])
        perf_map.add(entries)
        # THEN the new line names its range, the old one what sticks out,
        # each with the start of its own code
        assert perf_map.name(0x1000) == ("old", 0x1000)
        assert perf_map.name(0x1040) == perf_map.name(0x107F) == ("new", 0x1040)
        assert perf_map.name(0x1080) == perf_map.name(0x10FF) == ("old", 0x1000)
        assert perf_map.name(0x1100) is None and perf_map.name(0xFFF) is None


@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 20)), max_size=80),
       st.integers(0, 80), st.booleans())  # fmt: skip
def test_each_address_is_named_by_the_last_line_over_it(
    drawn: list[tuple[int, int]], split: int, swept: bool
) -> None:
    # GIVEN lines, taken in two reads (the first ``split`` of them, then the
    # rest), the first laid one by one or (with lines far from them) in a sweep
    entries = [(start, start + size, f"f{i}") for i, (start, size) in enumerate(drawn)]
    far = [(0x10000 + 4 * i, 0x10002 + 4 * i, "far") for i in range(SWEPT if swept else 0)]
    perf_map = PerfMap([])
    perf_map.add(entries[:split] + far)
    perf_map.add(entries[split:])
    for address in range(90):
        # THEN each address is the last covering line's, from that line's start
        covering = [(name, start) for start, end, name in entries if start <= address < end]
        assert perf_map.name(address) == (covering[-1] if covering else None)


def test_a_perf_map_is_read_from_where_the_last_read_ended(tmp_path: Path) -> None:
    # GIVEN a perf map with a line, and one not ended yet
    path = tmp_path / "perf-1.map"
    path.write_text("1000 10 first\n2000 10 sec")
    perf_map = PerfMap([tmp_path / "elsewhere.map", path])
    # WHEN it is read THEN the whole line is taken, the other waits
    assert perf_map.read() and perf_map.name(0x1000) == ("first", 0x1000)
    assert perf_map.name(0x2000) is None and perf_map.entries == 1
    # AND nothing new reads nothing
    assert not perf_map.read()
    # WHEN the line ends and another comes THEN both are taken, the first not again
    with open(path, "a") as file:
        file.write("ond\n3000 10 third\n")
    assert perf_map.read() and perf_map.entries == 3
    assert perf_map.name(0x2000) == ("second", 0x2000)
    # WHEN the file is written anew (shorter) THEN it is read from its start
    path.write_text("4000 10 fourth\n")
    assert perf_map.read() and perf_map.entries == 1
    assert perf_map.name(0x1000) is None and perf_map.name(0x4000) == ("fourth", 0x4000)
    # WHEN it is another file (same size) THEN it is read from its start too
    path.unlink()
    path.write_text("5000 10 fifth\n")
    assert perf_map.read() and perf_map.name(0x5000) == ("fifth", 0x5000)
    assert perf_map.name(0x4000) is None


def test_a_process_s_perf_map_is_in_its_own_tmp_under_its_own_pid() -> None:
    # GIVEN this process (its own pid namespace's)
    pid = os.getpid()
    # THEN its map is read through its root, and from our /tmp
    assert PerfMap.of_process(pid).paths == (Path(f"/proc/{pid}/root/tmp/perf-{pid}.map"),
                                             Path(f"/tmp/perf-{pid}.map"))  # fmt: skip


def names_with(perf_map_text: str, tmp: Path) -> FrameNames:
    """A gone process's names by its mappings as saved (the libc's, JIT
    code, anonymous data), its perf map read from ``perf_map_text``."""
    symbols = ProcessSymbols(GONE, saved=[LIBC, CODE, DATA])
    path = tmp / "perf.map"
    path.write_text(perf_map_text)
    symbols.perf_map = PerfMap([path])
    symbols.perf_map.read()
    return FrameNames(live=False, symbols={GONE: symbols})


def test_anonymous_memory_is_memory_of_no_file() -> None:
    # GIVEN mappings as /proc/PID/maps names them
    def named(path: str) -> Mapping:
        return Mapping(0x1000, 0x2000, 0, path)

    # THEN private, named and shared anonymous memory is anonymous, files are not
    assert all(is_anonymous(named(path)) for path in
               ("", "[anon:v8 code]", "/dev/zero (deleted)", "/dev/zero"))  # fmt: skip
    assert not any(is_anonymous(named(path)) for path in
                   ("/usr/bin/node", "/memfd:jit (deleted)", "[vdso]", "[heap]"))  # fmt: skip


def test_a_stack_is_cut_at_a_frame_in_no_executable_mapping_not_at_jit_code(
    tmp_path: Path,
) -> None:
    # GIVEN a stack: the libc, JIT code named and not, then anonymous data
    names = names_with(f"{CODE.start + 0x100:x} 80 JS:^leaf /srv/app.js:1:1\n", tmp_path)
    frames = (LIBC.start + 0x1000, CODE.start + 0x140, CODE.start + 0x9000,
              DATA.start + 0x10, LIBC.start + 0x2000)  # fmt: skip
    # WHEN it is cut THEN the JIT frames are kept, the data's is the cut
    assert names.cut(GONE, frames) == frames[:3]
    # AND the JIT frames are named by the perf map (as the call before
    # their return address), or shown as [jit] and their address
    named, unnamed = (names.resolve(GONE, frame) for frame in frames[1:3])
    assert named is not None and unnamed is not None and is_jit(named) and is_jit(unnamed)
    assert (named.function, named.offset) == ("JS:^leaf /srv/app.js:1:1", 0x40)
    assert named.span == unnamed.span == (CODE.start, CODE.end)
    assert frame_text(frames[1], named) == function_name(named, frames[1]) == named.function
    assert frame_text(frames[2], unnamed) == f"[jit] {frames[2]:#x}"
    assert kind_name(frames[1], named) == kind_name(frames[2], unnamed) == "jit"
    assert kind_name(frames[0], names.resolve(GONE, frames[0])) == "address"
    # AND a frame in no mapping is none of them
    assert names.resolve(GONE, DATA.start + 0x10) is None


def test_a_line_written_after_the_read_is_read_when_a_frame_is_not_found(
    tmp_path: Path,
) -> None:
    # GIVEN a perf map read before a function was compiled
    names = names_with(f"{CODE.start:x} 10 early\n", tmp_path)
    # WHEN its line is written and a frame in its code is named
    with open(tmp_path / "perf.map", "a") as file:
        file.write(f"{CODE.start + 0x200:x} 40 late\n")
    symbol = names.resolve(GONE, CODE.start + 0x210)
    # THEN the map was read again for it
    assert symbol is not None and symbol.function == "late"


def test_the_outputs_place_jit_frames_under_jit(tmp_path: Path) -> None:
    # GIVEN a stack row through JIT code, named and not
    names = names_with(f"{CODE.start + 0x100:x} 80 JS:^leaf /srv/app.js:1:1\n", tmp_path)
    frames = (LIBC.start + 0x1000, CODE.start + 0x140, CODE.start + 0x9000)
    row = StackRow(GONE, "malloc", frames[0], frames, 3, 300, 300, 0, 0, 0, 0)
    snap = snapshot(stacks=(row,), processes=(), outstanding=())
    # WHEN it is written as pprof, folded stacks and JSON
    profile = parsed(build_profile(snap, names))
    folded = folded_lines(snap, names)
    (stack,) = [json.loads(line) for line in stack_table_json(snap, names)
                if '"alloc_stacks"' in line]  # fmt: skip
    # THEN pprof has one mapping [jit] over the JIT code, the named frame's
    # function the perf map's name
    strings = profile.string_table
    mappings = {strings[m.filename]: (m.memory_start, m.memory_limit) for m in profile.mapping}
    assert mappings[JIT_MODULE] == (CODE.start, CODE.end)
    assert "JS:^leaf /srv/app.js:1:1" in {strings[f.name] for f in profile.function}
    # AND the folded stack reads the name and [jit] with the address (spaces as "_")
    caller = function_name(names.resolve(GONE, frames[0]), frames[0])
    assert folded == [f"[jit]_{frames[2]:#x};JS:^leaf_/srv/app.js:1:1;{caller} 300"]
    # AND JSON says their kind is jit, in the module [jit]
    assert [(f["kind"], f["module"], f["function"]) for f in stack["frames"][1:]] == [
        ("jit", JIT_MODULE, "JS:^leaf /srv/app.js:1:1"),
        ("jit", JIT_MODULE, None),
    ]


def test_a_live_process_s_jit_code_is_named_by_its_perf_map_read_with_its_maps() -> None:
    # GIVEN this process with anonymous executable memory, and its perf map
    pid, page = os.getpid(), mmap.PAGESIZE
    code = mmap.mmap(-1, 4 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                     prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)  # fmt: skip
    start = ctypes.addressof(ctypes.c_char.from_buffer(code))
    path = Path(f"/tmp/perf-{pid}.map")
    try:
        path.write_text(f"{start:x} {page:x} first\n")
        names = FrameNames()
        # WHEN its maps are read THEN the map is read with them
        names.remember(pid)
        assert names.frame(pid, start + 0x10) == "first"
        # WHEN a line is written after THEN the frame in it is named by the
        # map read again (not found in what was read)
        with open(path, "a") as file:
            file.write(f"{start + page:x} {page:x} second\n")
        assert names.frame(pid, start + page + 0x10) == "second"
        # AND a frame named nothing is named once a read of the maps took its line
        unnamed = start + 2 * page + 0x10
        assert names.frame(pid, unnamed) == f"[jit] {unnamed:#x}"
        with open(path, "a") as file:
            file.write(f"{start + 2 * page:x} {page:x} third\n")
        names.refresh(pid)
        assert names.frame(pid, unnamed) == "third"
        # AND once the file is gone, what was read still names the frames
        path.unlink()
        names.refresh(pid)
        assert names.frame(pid, start + page + 0x20) == "second"
        # AND an address in no mapping ends a stack there, the JIT frame before it kept
        assert names.cut(pid, (start, start + 0x10, 0x10)) == (start, start + 0x10)
    finally:
        path.unlink(missing_ok=True)
        code.close()
