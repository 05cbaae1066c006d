"""Frames in numbered files (probes/frame_kinds.py, exporters/data/
file_frames.py): named by the file and the link-time address alone, with
no process's maps, as binutils' nm names the same addresses; never a cut;
placed apart from the process's own mappings."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from mtrace_live.exporters.data.alloc_snapshot import FrameNames
from mtrace_live.exporters.data.file_frames import FileFrames, NumberedFile
from mtrace_live.exporters.data.symbolize import ProcessSymbols
from mtrace_live.probes.elf.file import load_segments, open_elf
from mtrace_live.probes.frame_kinds import FILE_SHIFT, file_frame, in_file

GONE = 2**22 + 7  # a pid no process has (above pid_max's default): no maps to read


def libc() -> Path:
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "/libc.so" in line:
            return Path(line.split()[-1])
    raise AssertionError("this process maps no libc")


def nm_dynamic(path: Path) -> dict[str, tuple[int, int]]:
    """Each exported function's [start, end), as nm reads .dynsym."""
    out = subprocess.run(["nm", "-D", "-S", "--defined-only", str(path)], check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    spans = {}
    for fields in (line.split() for line in out.splitlines()):
        if len(fields) == 4 and fields[2] in "TtWi":
            spans[fields[3].split("@")[0]] = (int(fields[0], 16),
                                              int(fields[0], 16) + int(fields[1], 16))  # fmt: skip
    return spans


def numbered(path: Path, segments: bool = True) -> tuple[FileFrames, int]:
    files = FileFrames()
    with open_elf(path) as elf:
        found = tuple(load_segments(elf)) if segments else ()
    status = path.stat()
    return files, files.number(NumberedFile(str(path), (status.st_dev, status.st_ino), found))


def test_a_frame_in_a_numbered_file_is_named_as_nm_names_its_address() -> None:
    # GIVEN the libc numbered, and a frame 5 bytes into malloc, by nm
    path = libc()
    start, end = nm_dynamic(path)["malloc"]
    for segments in (True, False):  # its segments known, or read from the file
        files, number = numbered(path, segments)
        frame = file_frame(number, start + 5)
        # WHEN a process that is gone (no maps) is named with it
        names = FrameNames(live=False, files=files)
        symbol = names.resolve(GONE, frame)
        # THEN it is malloc's (or an alias of its address), at offset 5
        assert symbol is not None and symbol.function is not None, symbol
        alias = {name for name, span in nm_dynamic(path).items() if span[0] == start}
        assert symbol.function in alias | {"__libc_malloc", "__GI___libc_malloc"}, symbol
        assert symbol.offset == 5 and symbol.module == str(path)
        # AND its span starts at the file's place, link-time address 0 there
        assert symbol.span is not None and in_file(symbol.span[0]) == (number, 0)
        assert end <= symbol.span[1] - symbol.span[0] < 1 << FILE_SHIFT


def test_an_unnamed_number_is_no_cut_and_is_named_once_known() -> None:
    path = libc()
    start, _ = nm_dynamic(path)["malloc"]
    files = FileFrames()
    names = FrameNames(live=False, files=files)
    number = 5  # a number the kernel gave, not named yet
    frames = (0x1234, file_frame(number, start + 5), 0x5678)
    # WHEN the stack is cut while the number has no path
    # THEN it is not cut at the frame in the file (only at the address after it)
    assert names.cut(GONE, frames) == frames[:2]
    assert names.resolve(GONE, frames[1]) is None
    # AND once the number is named, the same frame is malloc's (no None kept)
    status = path.stat()
    files.name(number, NumberedFile(str(path), (status.st_dev, status.st_ino), ()))
    symbol = names.resolve(GONE, frames[1])
    assert symbol is not None and symbol.offset == 5


def test_placed_files_are_not_the_process_s_own_mappings() -> None:
    path = libc()
    files, number = numbered(path)
    symbols = ProcessSymbols(GONE, saved=[])
    symbols.add(files.mappings(number))
    # THEN the process still has no mappings of its own (it is named as
    # gone: by its parent's or its learned ones), but the file's are listed
    assert symbols.mappings == [] and symbols.modules() == []
    assert {m.path for m in symbols.file_mappings} == {str(path)}
    assert all(in_file(m.start) is not None for m in symbols.file_mappings)


def test_a_number_its_hearer_could_not_name_is_named_by_the_thread_naming_its_frames() -> None:
    # GIVEN a number heard by a thread that could not read its file's path
    # (serve's unwinder threads, without capabilities): its path asked again later
    path = libc()
    start, _ = nm_dynamic(path)["malloc"]
    status = path.stat()
    files = FileFrames()
    asked: list[str] = []

    def path_of() -> str:
        asked.append("asked")
        return str(path)

    files.name_later(7, (status.st_dev, status.st_ino), path_of)
    assert asked == []
    # WHEN a frame of that number is named
    symbol = FrameNames(live=False, files=files).resolve(GONE, file_frame(7, start + 5))
    # THEN its path was asked once, from there, and the frame is malloc's
    assert asked == ["asked"]
    assert symbol is not None and symbol.module == str(path) and symbol.offset == 5
    # AND a number whose path cannot be found even then stays unnamed, asked once
    files.name_later(8, (0, 0), lambda: "")
    assert files.mappings(8) == [] and files.mappings(8) == []
    # AND a number named already is not asked about
    files.name_later(7, (0, 0), lambda: pytest.fail("asked again"))
    assert files.mappings(7)
