"""Record sets, kallsyms and JSON lines from elsewhere: whatever their
headers claim, the work is bounded by what is there; numbers out of range
are clean errors or left out, never an OverflowError or a MemoryError; byte
totals are exact; and a user who can write nowhere can still read them."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from mtrace_live.exporters.data.kallsyms import KernelSymbols
from mtrace_live.exporters.kmemtrace.abi import TypeId
from mtrace_live.exporters.kmemtrace.json_lines import write_record_set
from mtrace_live.exporters.kmemtrace.reader import read_record_set
from mtrace_live.probes.errors import RecordSetError
from mtrace_live.probes.records import EventKind

from .cli_runs import assert_one_line, mtrace, mtrace_unprivileged
from .report_check import same_report
from .test_kmemtrace_format import CACHE_ALLOC, event, mixed_batch, write_set


def kmalloc(seq: int, ptr: int, size: int) -> str:
    doc = {"seq": seq, "ts_ns": seq, "cpu": 0, "pid": 1, "tid": 1, "event": "alloc",
           "type": "kmalloc", "call_site": 0xFFFFFFFF81000000, "ptr": ptr,
           "bytes_req": size, "bytes_alloc": size, "gfp_flags": 0, "node": -1}  # fmt: skip
    return json.dumps(doc)


@pytest.fixture
def record_set(tmp_path: Path) -> Path:
    write_set(tmp_path / "set", [mixed_batch(4)])
    return tmp_path / "set"


@pytest.mark.parametrize("cpus", ["0-50000000", "0-1000000000", "0-3,99999", "0-" + "9" * 5000])
def test_a_cpus_file_claiming_more_cpus_than_files_is_refused_at_once(
    record_set: Path, cpus: str
) -> None:
    (record_set / "cpus").write_text(cpus + "\n")
    with pytest.raises(RecordSetError, match=r"lacks the file cpu|not a CPU list"):
        read_record_set(record_set)


def test_cpu_files_far_apart_without_a_cpus_file_are_refused_at_once(record_set: Path) -> None:
    (record_set / "cpus").unlink()
    shutil.copy(record_set / "cpu0", record_set / "cpu3000000000")
    with pytest.raises(RecordSetError, match="CPU 3000000000 is over 65535"):
        read_record_set(record_set)
    (record_set / "cpu3000000000").unlink()
    shutil.copy(record_set / "cpu0", record_set / "cpu60000")
    with pytest.raises(RecordSetError, match="lacks the file cpu"):
        read_record_set(record_set)
    assert_one_line(mtrace("report", str(record_set)), 14, "lacks the file cpu")


def test_cpu_nodes_and_overruns_out_of_range_are_left_out(record_set: Path) -> None:
    (record_set / "cpu_nodes").write_text("0 99999999999999999999999\n1 \u00b2\n0 1\n")
    (record_set / "total_overruns").write_text("\u00b2\n")
    records = read_record_set(record_set)
    assert records.cpu_nodes == {0: 1} and records.total_overruns is None
    # and the analyses run on them, to the same answer: the batch's 4 kmallocs
    # of 40 bytes (64 allocated), each freed on the other CPU
    totals = same_report(record_set).as_json()["kernel"]["totals"]
    assert (totals["allocs"], totals["bytes_req"], totals["bytes_alloc"]) == (4, 160, 256)
    assert (totals["frees"], totals["cross_cpu_frees"], totals["unknown_frees"]) == (4, 4, 0)


@pytest.mark.parametrize(
    "line", ["1ffffffffffffffffffff T big", "-10 T neg", "+10 T plus", "0x10 T hex", "\u00b2 T two"]
)
def test_kallsyms_lines_outside_64_bits_are_left_out(line: str) -> None:
    symbols = KernelSymbols(f"{line}\nffffffff81000000 T start_kernel\n")
    assert len(symbols) == 1
    assert symbols.describe(0xFFFFFFFF81000010) == "start_kernel+0x10"
    assert symbols.function(1 << 70) is None and symbols.describe(1 << 70) == hex(1 << 70)


def test_byte_totals_of_2_to_the_63_and_over_are_exact(tmp_path: Path) -> None:
    # GIVEN allocations of 2^63 and 2^64 - 1 bytes at one call site
    big = [kmalloc(0, 0x1000, 1 << 63), kmalloc(1, 0x2000, (1 << 64) - 1), kmalloc(2, 0x3000, 5)]
    write_record_set(big, tmp_path / "big", "big.jsonl")
    # WHEN they are analysed (both ways, to the same answer)
    report = same_report(tmp_path / "big")
    # THEN the totals are the exact sums
    (site,) = report.kernel.sites
    assert site.bytes_req == site.bytes_alloc == (1 << 63) + (1 << 64) - 1 + 5
    done = mtrace("report", str(tmp_path / "big"), "--format", "json")
    assert done.returncode == 0 and "RuntimeWarning" not in done.stderr, done.stderr
    assert str((1 << 63) + (1 << 64) + 4) in done.stdout


@pytest.mark.parametrize(
    ("field", "value"),
    [("ptr", 1 << 64), ("cpu", -1), ("cpu", 1 << 40), ("pid", -1), ("ptr", 1.5),
     ("bytes_req", [1]), ("ptr", True), ("node", 1 << 31), ("ts_ns", "12"), ("event", "grow")],
)  # fmt: skip
def test_json_values_out_of_range_or_of_the_wrong_type_are_one_error(
    tmp_path: Path, field: str, value: object
) -> None:
    doc = json.loads(kmalloc(0, 0x1000, 64))
    doc[field] = value
    source = tmp_path / "bad.jsonl"
    source.write_text(kmalloc(1, 0x2000, 8) + "\n" + json.dumps(doc) + "\n")
    done = mtrace("convert", str(source), "--to", "kmemtrace", "-o", str(tmp_path / "out"))
    assert_one_line(done, 14, "mangles")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_deeply_nested_json_is_one_error(tmp_path: Path) -> None:
    source = tmp_path / "deep.jsonl"
    source.write_text('{"seq": ' + "[" * 100_000 + "\n")
    assert_one_line(mtrace("convert", str(source), "--to", "kmemtrace", "-o", str(tmp_path / "o")),
                    14, "not a JSON record")  # fmt: skip


@pytest.fixture
def world_readable() -> Iterator[Path]:
    """A directory any user can read (pytest's own are the running user's only)."""
    directory = Path(tempfile.mkdtemp(prefix="mtrace-live-test-"))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory)


def test_report_and_convert_work_for_a_user_who_can_write_nowhere(world_readable: Path) -> None:
    # GIVEN a record set any user can read
    cache = event(EventKind.KMEM, CACHE_ALLOC, TypeId.CACHE, [0xFFFF888000100000, 192, 192, 0, 1])
    write_set(world_readable / "set", [np.concatenate([mixed_batch(4), cache])])
    for path in (world_readable / "set").iterdir():
        path.chmod(0o644)
    (world_readable / "set").chmod(0o755)
    # WHEN a user whose HOME does not exist reads it (nothing may need to
    # be written there, nor beside a root-owned checkout)
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "NUMBA_CACHE_DIR")}
    env["HOME"] = "/nonexistent"
    report = mtrace_unprivileged("report", str(world_readable / "set"), env=env)
    convert = mtrace_unprivileged("convert", str(world_readable / "set"), "--to", "json", env=env)
    # THEN both work
    assert report.returncode == 0 and "Traceback" not in report.stderr, report.stderr
    assert "cache" in report.stdout
    assert convert.returncode == 0, convert.stderr
    records = [json.loads(line) for line in convert.stdout.splitlines()]
    # and convert wrote the records written above, in order: each round of
    # mixed_batch a kmalloc, its kfree on the other CPU and a probe record
    # (probe 2, memory_mallopt, with arguments i and 2i); then the cache's
    assert [r["seq"] for r in records] == list(range(13))
    for i in range(4):
        alloc, free, probe = records[3 * i : 3 * i + 3]
        ptr = 0xFFFF888000000000 + 64 * i
        assert (alloc["event"], alloc["type"], alloc["ptr"]) == ("alloc", "kmalloc", ptr)
        assert (alloc["bytes_req"], alloc["bytes_alloc"], alloc["gfp_flags"]) == (40, 64, 0xCC0)
        assert (alloc["cpu"], alloc["pid"], alloc["tid"]) == (i % 2, 4242, 4243)
        assert (free["event"], free["type"], free["ptr"], free["cpu"]) == (
            "free", "kmalloc", ptr, (i + 1) % 2)  # fmt: skip
        assert (probe["event"], probe["probe"], probe["args"][:2]) == (
            "probe", "memory_mallopt", [i, 2 * i])  # fmt: skip
        assert probe["call_site"] == 0x7F0000000000 + i
    assert {k: records[12][k] for k in ("event", "type", "ptr", "bytes_req", "node")} == {
        "event": "alloc", "type": "kmem_cache", "ptr": 0xFFFF888000100000, "bytes_req": 192,
        "node": 1}  # fmt: skip
    assert records[12]["symbol"] == "some_function+0x67"


def test_json_records_of_cpus_this_machine_lacks_convert_into_a_record_set(tmp_path: Path) -> None:
    # GIVEN records made on a larger machine (found by the fuzzer: a KeyError)
    docs = [json.loads(kmalloc(n, 0x1000 * (n + 1), 8)) for n in range(3)]
    for doc, cpu in zip(docs, (5, 70, 5), strict=True):
        doc["cpu"] = cpu
    source = tmp_path / "big.jsonl"
    source.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    # WHEN they are converted into a record set
    done = mtrace("convert", str(source), "--to", "kmemtrace", "-o", str(tmp_path / "set"))
    # THEN it holds a file per CPU the records name, and reads back the same
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "set" / "cpus").read_text() == "5,70\n"
    records = read_record_set(tmp_path / "set")
    assert records.records["cpu"].tolist() == [5, 70, 5]


@pytest.mark.parametrize("name", ["abi_version", "cpus", "total_overruns", "cpu_nodes"])
def test_a_header_file_that_is_a_fifo_or_too_large_is_refused_not_read(
    record_set: Path, name: str
) -> None:
    # GIVEN a header file that would block the reader (a FIFO), then one far too large
    (record_set / name).unlink(missing_ok=True)
    os.mkfifo(record_set / name)
    with pytest.raises(RecordSetError, match=f"{name}: not a regular file"):
        read_record_set(record_set)
    (record_set / name).unlink()
    (record_set / name).write_bytes(b"0" * (2 << 20))
    with pytest.raises(RecordSetError, match=f"{name}: over"):
        read_record_set(record_set)
