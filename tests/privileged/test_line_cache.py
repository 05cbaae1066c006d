"""Source lines of a trace's frames through libpython's full DWARF (pyenv's
3.11), read with libdw and kept by build-id (exporters/data/source_lines.py):
a cold cache, a warm one and one on a read-only file system name each frame
alike, and none is an error."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from mtrace_live.probes.elf.file import build_id_of

from .conftest import MTRACE

PYTHON = Path("/root/.pyenv/versions/3.11.7/bin/python3.11")
LIBPYTHON = Path("/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0")
FRAME = re.compile(r"(\S+\+0x[0-9a-f]+) \(([^()]+:\d+)\)")  # "f+0x1a (file.c:12)"


def summary_lines(cache: Path) -> dict[str, str]:
    """The summary's named frames of a small import under run: each frame
    (function+offset) and its file:line."""
    done = subprocess.run([*MTRACE, "run", "-o", "summary", "--", str(PYTHON), "-c",
                           "import json, decimal, email.parser"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MTRACE_LIVE_LINE_CACHE": str(cache)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "mtrace-live: error" not in done.stderr, done.stderr
    return dict(FRAME.findall(done.stdout))


def test_frames_are_named_alike_by_a_cold_a_warm_and_a_read_only_line_cache(
    tmp_path: Path,
) -> None:
    if not PYTHON.is_file():
        pytest.fail(f"{PYTHON} is missing: the machine image's pyenv Pythons")
    # GIVEN an empty cache, and a read-only file system for another
    cache = tmp_path / "lines"
    read_only = tmp_path / "ro"
    read_only.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(read_only)],
                   check=True)  # fmt: skip
    try:
        # WHEN the same program is traced three times: cold, warm, read-only
        cold = summary_lines(cache)
        warm = summary_lines(cache)
        unkept = summary_lines(read_only / "lines")
    finally:
        subprocess.run(["umount", "-l", str(read_only)], check=False)
    # THEN libpython's frames have their lines (obmalloc.c's allocations)
    assert any(place.startswith("obmalloc.c:") for place in cold.values()), cold
    # AND a frame shown by two of the runs has the same line in both
    for one, other in ((cold, warm), (cold, unkept), (warm, unkept)):
        shared = one.keys() & other.keys()
        assert shared and {f: one[f] for f in shared} == {f: other[f] for f in shared}
    # AND the cold run kept libpython's ranges and units by its build-id
    (folder,) = cache.glob(f"{build_id_of(LIBPYTHON)}-*.v1")
    assert (folder / "ranges.npz").is_file() and len(list(folder.glob("*.npz"))) > 1
