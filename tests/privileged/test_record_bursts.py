"""A burst of kmem events at record's default settings: the kmem exerciser
makes 30,000 sockets and 30,000 pipes as fast as it can, some 950,000 kmem
events in about a quarter of a second, far faster than records are written.
Record's default room for them (128 MiB, 1.4 million events) keeps all."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from .conftest import MTRACE

SOCKETS = PIPES = 30_000


def test_record_keeps_a_burst_of_kmem_events_whole_by_default(
    kmem_exerciser: Path, tmp_path: Path
) -> None:
    # GIVEN the exerciser's burst recorded with no --buffer-pages
    records = tmp_path / "rec.d"
    done = subprocess.run([*MTRACE, "record", "-o", str(records), "--", str(kmem_exerciser),
                           "--sockets", str(SOCKETS), "--pipes", str(PIPES), "--out",
                           str(tmp_path / "truth.json")],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    # THEN nothing was lost: every event the kernel gave went into the records
    said = re.search(r"kmemtrace: (\d+) records in .* \((\d+) kmem events delivered, (\d+) lost; "
                     r"total_overruns (\d+) bytes\)", done.stdout + done.stderr)  # fmt: skip
    assert said is not None, done.stdout + done.stderr
    assert int(said[3]) == 0 and int(said[4]) == 0, said[0]
    assert int(said[1]) == int(said[2]) > 6 * SOCKETS
    # AND report finds each socket's inode, as the exerciser made them
    report = subprocess.run([*MTRACE, "report", str(records), "--limit", "0"],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert report.returncode == 0, report.stderr
    inode = next(line for line in report.stdout.splitlines()
                 if line.startswith("sock_alloc_inode+"))  # fmt: skip
    assert int(inode.split()[2]) == SOCKETS, inode
