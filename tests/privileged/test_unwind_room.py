"""Room for every file: a file no process maps any more is evicted from
the unwinder's tables, its rows given to the next file that needs them
(tracer/unwind/unwind_room.py, UnwindTables._evict).

Two Pythons of pyenv's, one after the other, under ``run`` with room
(``--unwind-rows 150000``: 131,250 rows for the trace, the rest the file
server's) for the libc, the loader and one libpython, not two:
libpython3.13 has 77,570 rows, then libpython3.12 69,241. Checked: the
second's rows were written over the first's (its files evicted, none left
without room), and at least 99% of each Python's allocations are whole
down to its start."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from .conftest import MTRACE
from .tracing import malloc_stacks

PYENV = Path("/root/.pyenv/versions")
# (the larger first: the run of rows it leaves fits the smaller, which a
# library between the two runs, the libm, would otherwise keep apart)
PYTHONS = (PYENV / "3.13.0" / "bin" / "python3.13", PYENV / "3.12.1" / "bin" / "python3.12")
ROWS = 150000
CODE = "import json; json.dumps([{'k': i} for i in range(1000)])"


@pytest.mark.soak  # (make soak: slower than make test's budget)
def test_a_file_no_process_maps_gives_its_rows_to_the_next(tmp_path: Path) -> None:
    for python in PYTHONS:
        if not python.exists():
            pytest.fail(f"{python} is missing: the machine image's pyenv Pythons")
    profile = tmp_path / "heap.pb.gz"
    # GIVEN a trace with room for one libpython, running two Pythons in turn
    script = "; ".join(f'{python} -c "{CODE}"' for python in PYTHONS)
    run = subprocess.run(
        [*MTRACE, "run", "--unwind-rows", str(ROWS), "-o", "summary", "--pprof", str(profile),
         "--", "sh", "-c", script],
        capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr
    # THEN the first Python's libpython was evicted for the second's, and
    # no file was left without rows
    tables = next(line for line in run.stdout.splitlines() if line.startswith("  tables:"))
    evicted = re.search(r"(\d+) files evicted", tables)
    assert evicted is not None and int(evicted[1]) >= 1 and "no room" not in tables, tables
    # AND each Python's calls are whole down to its start (the Python that
    # came second unwound by the rows written over the first's)
    calls: Counter[str] = Counter()
    whole: Counter[str] = Counter()
    for _, n, stack in malloc_stacks(profile, allocator=None):
        libpython = next((Path(f).name for _, f in stack if "libpython3." in f), None)
        if libpython is None:
            continue
        names = [name for name, _ in stack]
        calls[libpython] += n
        # (the program's main is a tail call of libpython's Py_BytesMain)
        whole[libpython] += n * ("Py_BytesMain" in names and names[-1] == "_start")
    assert set(calls) == {"libpython3.12.so.1.0", "libpython3.13.so.1.0"}, calls
    for name, n in calls.items():
        print(f"{name}: {whole[name] / n:.2%} of {n} calls whole")  # (pytest -s)
        assert whole[name] >= 0.99 * n, (name, whole[name], n, run.stdout[-3000:])
