"""sp-rtrace reports from real records: the kmem exerciser leaks a known
number of socket inodes on purpose, and `convert --leaks` must find them."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

from mtrace_live.exporters import sprtrace
from mtrace_live.exporters.kmemtrace import read_record_set

from .conftest import MTRACE
from .test_kmemtrace import skipped_runs
from .tracing import Reaper, wait_for_line

SOCKETS, LEAKED = 300, 7


def test_convert_leaks_finds_the_sockets_the_exerciser_left_open(
    kmem_exerciser: Path, tmp_path: Path
) -> None:
    # GIVEN a record set of the gated exerciser, which leaves 7 of its 300 sockets open
    directory = tmp_path / "records"
    with Reaper() as reaper:
        argv = [str(kmem_exerciser), "--sockets", str(SOCKETS), "--pipes", "0", "--leak",
                str(LEAKED), "--out", str(tmp_path / "truth.json"), "--gated"]  # fmt: skip
        work = reaper.add(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        assert work.stdin is not None and work.stdout is not None
        assert work.stdout.readline() == b"ready\n"
        err = tmp_path / "record.err"
        with open(err, "wb") as sink:
            record = reaper.add(subprocess.Popen(
                [*MTRACE, "record", "-o", str(directory), "--pid", str(work.pid)],
                stdout=sink, stderr=sink))  # fmt: skip
        wait_for_line(err, "Ctrl-C to stop", record, timeout=120)
        work.stdin.write(b"go\n")
        work.stdin.flush()
        assert work.stdout.readline() == b"done\n"
        time.sleep(3.0)  # RCU grace periods: the closed sockets' inodes are freed by callbacks
        record.send_signal(signal.SIGINT)
        assert record.wait(timeout=120) == 0, err.read_text()
        work.stdin.write(b"end\n")
        work.stdin.close()
        work.stdout.close()
        assert work.wait(timeout=60) == 0
    # WHEN it is converted to an sp-rtrace report with the leaks filter
    out = tmp_path / "leaks.txt"
    done = subprocess.run([*MTRACE, "convert", str(directory), "--leaks", "-o", str(out)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = sprtrace.parse(out.read_text().splitlines(), str(out))
    # THEN exactly the leaked socket inodes are left at sock_alloc_inode, all
    # of one size (more only if the kernel skipped some frees, and says so)
    inodes = [c for c in report.calls if c.frames and c.frames[0].function == "sock_alloc_inode"]
    skipped = skipped_runs(err.read_text()).get("tracepoint:kmem:kmem_cache_free", 0)
    assert LEAKED <= len(inodes) <= LEAKED + skipped, (len(inodes), skipped)
    assert len({c.size for c in inodes}) == 1 and all(c.resource == "kmem_cache" for c in inodes)
    assert all(c.is_alloc for c in report.calls)
    # AND the leak summary it ends with counts what is left, resource by resource
    summary = out.read_text().splitlines()[-2 * len(report.resources) :]
    assert summary == sprtrace.leak_summary(report)
    header = out.read_text().splitlines()[0]
    assert f"pid={work.pid}" in header and "filter=leaks|resolve" in header
    # AND the JSON lines carry every record, in sequence order
    as_json = [*MTRACE, "convert", str(directory), "--to", "json"]
    lines = subprocess.run(as_json, capture_output=True, text=True, timeout=300).stdout.splitlines()
    docs = [json.loads(line) for line in lines]
    assert len(docs) == len(read_record_set(directory).records)
    assert [d["seq"] for d in docs] == sorted(d["seq"] for d in docs)
    assert sum(1 for d in docs if d.get("symbol", "").startswith("sock_alloc_inode+")) >= SOCKETS
