"""A full disk while writing: record's record set, --kmemtrace's, --sp-rtrace's
report and each output file (--pprof, --folded, --allocinfo, --pprof-mutex)
on a small tmpfs. Each gives one error line and exit 20,
no traceback, and what was written before stays readable by report and
convert: a batch that does not fit is cut off whole."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import MTRACE, built
from .tracing import wait_for_line


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs of 12 MiB: the kernel's symbols (5 MiB or so) fit, the records fill the rest."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path, leave: int) -> None:
    """Fill the disk but ``leave`` bytes (about: a page's rounding)."""
    free = subprocess.run(["df", "--output=avail", "-B1", str(disk)], capture_output=True,
                          text=True, check=True).stdout.split()[-1]  # fmt: skip
    with open(disk / "filler", "wb") as filler:
        filler.write(b"\0" * max(0, int(free) - leave))


def one_error(done: subprocess.CompletedProcess[str], starts: str) -> str:
    assert done.returncode == 20, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(f"mtrace-live: error: {starts}"), errors
    assert "Traceback" not in done.stderr
    return errors[0]


@pytest.mark.parametrize(
    "command",
    [["record", "-o", "{records}", "--libc"], ["run", "-o", "summary", "--kmemtrace", "{records}"]],
    ids=["record", "kmemtrace"],
)
def test_a_full_disk_during_a_record_set_keeps_every_whole_batch_readable(
    disk: Path, command: list[str]
) -> None:
    # GIVEN a record set (record's, or run --kmemtrace's) of more allocations
    # than the disk holds
    records = disk / "rec.d"
    argv = [arg.format(records=records) for arg in command]
    done = subprocess.run([*MTRACE, *argv, "--", str(built("alloc_bench")), "300000", "1", "1"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    # THEN it stops with one error line, exit 20, which says how many records are kept
    error = one_error(done, f"cannot write the record set {records}: No space left on device")
    kept = re.search(r"the (\d+) records before are kept", error)
    assert kept is not None and int(kept[1]) > 0, error
    # AND report reads exactly those, with no damage
    report = subprocess.run([*MTRACE, "report", str(records)], capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert report.returncode == 0, report.stderr
    assert f"ABI 3, {kept[1]} records" in report.stdout, report.stdout


CALL = re.compile(r"^\d+\. .*$", re.MULTILINE)  # an sp-rtrace call's first line


def test_a_full_disk_during_an_sp_rtrace_report_keeps_it_readable(disk: Path) -> None:
    # GIVEN an sp-rtrace report of more calls than the disk holds: 4.5 MiB
    # left, more than one of the trace's batches while it runs (16,384
    # events of some 200 bytes each), less than the 50,000 calls the
    # workload makes (gated: it waits before exiting until the report holds
    # a batch, so that the batches are not all read at its end, as one)
    fill(disk, 4608 * 1024)
    report = disk / "trace.txt"
    out, err = disk.parent / "out", disk.parent / "err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        tracer = subprocess.Popen([*MTRACE, "run", "-o", "summary", "--sp-rtrace", str(report),
                                   "--", str(built("alloc_bench")), "25000", "1", "1"],
                                  stdin=subprocess.PIPE, stdout=stdout, stderr=stderr,
                                  env={**os.environ, "GATE": "1"})  # fmt: skip
    try:
        assert tracer.stdin is not None
        tracer.stdin.write(b"g")  # the workload's loop starts
        tracer.stdin.flush()
        # (an empty line ends a call's backtrace: one is in the report)
        wait_for_line(report, "\n\n", tracer, timeout=300)
    finally:
        if tracer.stdin is not None:
            tracer.stdin.close()  # and it exits
        returncode = tracer.wait(timeout=300)
    done = subprocess.CompletedProcess(tracer.args, returncode, out.read_text(), err.read_text())
    # THEN one error line, exit 20, which says the report so far is kept
    error = one_error(done, f"cannot write {report}: No space left on device")
    assert error.endswith("the report up to then is kept"), error
    # AND the report ends after a whole item: a call's backtrace, which the
    # protocol ends with an empty line, or a comment line ("## ...", an
    # event that is no call); its calls numbered in order
    text = report.read_text()
    calls = CALL.findall(text)
    numbers = [int(call.split(".")[0]) for call in calls]
    assert len(calls) > 0 and numbers == sorted(set(numbers)), calls[-5:]
    last = text.split("\n")[-2]
    assert text.endswith("\n") and (last == "" or last.startswith("## ")), text[-300:]
    # AND convert reads every one of those calls back
    again = subprocess.run([*MTRACE, "convert", str(report)], capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert CALL.findall(again.stdout) == calls


@pytest.mark.parametrize("option", ["--pprof", "--folded", "--allocinfo", "--pprof-mutex"])
def test_a_full_disk_for_an_output_file_is_one_error_line(disk: Path, option: str) -> None:
    # GIVEN an output file on a disk with no room left
    output = disk / f"out{option}"
    output.touch()
    fill(disk, 0)
    # WHEN a trace writes it at its end
    done = subprocess.run([*MTRACE, "run", "-o", "summary", option, str(output), "--",
                           str(built("alloc_bench")), "30000", "1", "1"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    # THEN one error line, exit 20, no traceback
    one_error(done, f"cannot write {output}: No space left on device")


def test_a_disk_too_full_for_a_record_set_s_header_is_one_error_line(disk: Path) -> None:
    # GIVEN a disk without room for the record set's kernel symbols
    records = disk / "kmem.d"
    fill(disk, 256 * 1024)
    done = subprocess.run([*MTRACE, "run", "-o", "summary", "--kmemtrace", str(records), "--",
                           str(built("alloc_bench")), "3000", "1", "1"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    # THEN the full disk is said as such, once, with the exit code of one
    error = one_error(done, f"cannot write the record set {records}: No space left on device")
    assert error.endswith("no record was written"), error
