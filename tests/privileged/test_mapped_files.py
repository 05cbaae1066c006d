"""The file a process maps, found again when its path no longer names it:
deleted, or replaced by another file (tracer/unwind/unwind_tables.py: mapped_file),
as a package upgrade leaves a running server's libraries."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mtrace_live.tracer.unwind.unwind_tables import exec_mappings, mapped_file

from .conftest import REPO

LIBRARY = REPO / "tests" / "fixtures" / "elf" / "no_notes.so"


@pytest.mark.parametrize("change", ["deleted", "replaced"])
def test_a_deleted_or_replaced_library_is_read_through_map_files(tmp_path: Path,
                                                                  change: str) -> None:  # fmt: skip
    # GIVEN a process mapping a copy of a library
    copy = tmp_path / "libcopy.so"
    shutil.copy(LIBRARY, copy)
    script = (
        f"import ctypes, sys; ctypes.CDLL({str(copy)!r}); print('ready', flush=True); "
        "sys.stdin.read()"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        (mapping,) = [m for m in exec_mappings(child.pid) if m.path.startswith(str(copy))]
        # WHEN its path is deleted, or names another file now
        copy.unlink()
        if change == "replaced":
            shutil.copy(REPO / "tests" / "fixtures" / "elf" / "sdt_fixture.so", copy)
        # THEN the mapped file is found through /proc/PID/map_files (root
        # here), the very file mapped, never the file the path names now
        found = mapped_file(child.pid, mapping)
        assert found == Path(f"/proc/{child.pid}/map_files/{mapping.start:x}-{mapping.end:x}")
        status = os.stat(found)
        assert (status.st_dev, status.st_ino) == mapping.inode
        assert found.read_bytes() == LIBRARY.read_bytes()
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
        child.stdout.close()  # type: ignore[union-attr]
