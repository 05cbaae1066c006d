"""kmemtrace records: the byte layout of every record type, the round trip
through a record set directory, and the reader on damaged input."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mtrace_live.exporters.kmemtrace import abi
from mtrace_live.exporters.kmemtrace.abi import ABI_VERSION, EventId, TypeId
from mtrace_live.exporters.kmemtrace.reader import read_record_set
from mtrace_live.exporters.kmemtrace.writer import KmemtraceWriter, encode
from mtrace_live.probes.errors import RecordSetError
from mtrace_live.probes.records import EVENT_DTYPE, EventKind

from .cli_runs import assert_one_line, mtrace

KMALLOC, KFREE, CACHE_ALLOC, CACHE_FREE, PAGE_ALLOC, PAGE_FREE = range(6)
LIBC_PROBES = ["memory_sbrk_more", "memory_heap_free", "memory_mallopt"]
KERNEL = 0xFFFFFFFF81234567
TASK = struct.Struct("=HBBIIIQ")  # the task feature block


def event(kind: int, probe: int, site: int, args: list[int], *, cpu: int = 0, ip: int = KERNEL,
          tgid: int = 4242, tid: int = 4243, ts: int = 123456789) -> np.ndarray:  # fmt: skip
    row = np.zeros(1, dtype=EVENT_DTYPE)
    row["ts"], row["ip"], row["tgid"], row["tid"], row["cpu"] = ts, ip, tgid, tid, cpu
    row["probe"], row["site"], row["kind"], row["nargs"] = probe, site, kind, len(args)
    row["args"][0, : len(args)] = args
    return row


def test_each_record_type_has_the_size_of_its_blocks() -> None:
    # GIVEN the ABI's blocks: the core (id 1, type 1, size 2, sequence 4,
    # caller 8, pointer 8), an allocation's (requested 8, allocated 8, flags 4,
    # target CPU 4), a probe's (80 with the core), the task and user features (24)
    core, alloc, task, user = 1 + 1 + 2 + 4 + 8 + 8, 8 + 8 + 4 + 4, 24, 24
    # THEN each record type is its blocks, byte for byte
    assert (abi.FREE_RECORD.itemsize, abi.ALLOC_RECORD.itemsize) == (core, core + alloc)
    assert (abi.PROBE_RECORD.itemsize, abi.PROBE_SIZE) == (80, 80)
    assert abi.FREE_TASK_RECORD.itemsize == core + task
    assert abi.ALLOC_TASK_RECORD.itemsize == core + alloc + task
    assert abi.PROBE_TASK_RECORD.itemsize == 80 + task
    assert abi.USER_ALLOC_RECORD.itemsize == core + alloc + task + user == 96
    assert abi.USER_FREE_RECORD.itemsize == core + task + user == 72
    assert (task, user) == (abi.TASK_FEATURE_SIZE, abi.USER_FEATURE_SIZE)


def one_record(row: np.ndarray, seq: int = 7) -> bytes:
    encoded = encode(row, seq, LIBC_PROBES, EventKind.KMEM, EventKind.PROBE)
    (data,) = encoded.per_cpu.values()
    return data


def task(tgid: int = 4242, tid: int = 4243, ts: int = 123456789) -> bytes:
    return TASK.pack(24, 1, 0, tgid, tid, 0, ts)


def test_kmalloc_allocation_is_the_2008_core_and_alloc_fields_then_the_task_feature() -> None:
    row = event(EventKind.KMEM, KMALLOC, TypeId.KMALLOC,
                [0xFFFF888001234500, 100, 128, 0xCC0, -1 & (2**64 - 1)])  # fmt: skip
    expected = struct.pack("=BBHiQQ", 0, 0, 72, 7, KERNEL, 0xFFFF888001234500)
    expected += struct.pack("=QQIi", 100, 128, 0xCC0, -1) + task()
    assert one_record(row) == expected


def test_cache_free_is_the_core_then_the_task_feature() -> None:
    row = event(EventKind.KMEM, CACHE_FREE, TypeId.CACHE, [0xFFFF888001234500])
    expected = struct.pack("=BBHiQQ", 1, 1, 48, 7, KERNEL, 0xFFFF888001234500) + task()
    assert one_record(row) == expected


def test_cache_allocation_carries_the_node_as_target() -> None:
    row = event(EventKind.KMEM, CACHE_ALLOC, TypeId.CACHE, [0xFFFF888000000040, 64, 64, 0x400, 0])
    expected = struct.pack("=BBHiQQQQIi", 0, 1, 72, 7, KERNEL, 0xFFFF888000000040, 64, 64, 0x400, 0)
    assert one_record(row) == expected + task()


def test_pages_are_type_2_with_the_physical_address_of_the_pfn() -> None:
    alloc = event(
        EventKind.KMEM,
        PAGE_ALLOC,
        TypeId.PAGES,
        [0x1234, 16384, 16384, 0xCC0, -1 & (2**64 - 1), 2],
        ip=0,
    )
    free = event(EventKind.KMEM, PAGE_FREE, TypeId.PAGES, [0x1234, 0, 0, 0, 0, 2], ip=0)
    assert one_record(alloc) == struct.pack("=BBHiQQQQIi", 0, 2, 72, 7, 0, 0x1234 << 12,
                                            16384, 16384, 0xCC0, -1) + task()  # fmt: skip
    assert one_record(free) == struct.pack("=BBHiQQ", 1, 2, 48, 7, 0, 0x1234 << 12) + task()


def test_libc_sbrk_and_heap_become_allocation_and_free_records_with_new_type_ids() -> None:
    user = 0x7F0000001234
    sbrk = event(EventKind.PROBE, 0, 0, [0x55550000, 135168], ip=user)
    heap_free = event(EventKind.PROBE, 1, 0, [0x7F1000000000, 1 << 20], ip=user)
    assert one_record(sbrk) == struct.pack("=BBHiQQQQIi", 0, TypeId.SBRK, 72, 7, user,
                                           0x55550000, 135168, 135168, 0, -1) + task()  # fmt: skip
    assert one_record(heap_free) == struct.pack("=BBHiQQ", 1, TypeId.HEAP, 48, 7, user,
                                                0x7F1000000000) + task()  # fmt: skip


def test_other_libc_probes_are_event_id_2_with_their_arguments() -> None:
    user = 0x7F0000005678
    mallopt = event(EventKind.PROBE, 2, 0, [2**64 - 3, 65536], ip=user)  # M_MMAP_THRESHOLD
    expected = struct.pack("=BBHiQQ", 2, TypeId.LIBC_PROBE, 104, 7, user, 0)
    expected += struct.pack("=HBBI6Q", 2, 2, 0, 0, 2**64 - 3, 65536, 0, 0, 0, 0) + task()
    assert one_record(mallopt) == expected


def test_exec_and_exit_events_are_not_records() -> None:
    lifecycle = np.concatenate([event(EventKind.EXEC, 0, 0, [1]), event(EventKind.EXIT, 0, 0, [0])])
    assert encode(lifecycle, 0, [], EventKind.KMEM, EventKind.PROBE).records == 0


def write_set(directory: Path, batches: list[np.ndarray]) -> KmemtraceWriter:
    writer = KmemtraceWriter(directory, LIBC_PROBES, "ffffffff81234500 T some_function\n")
    for batch in batches:
        writer.write(batch, EventKind.KMEM, EventKind.PROBE)
    writer.close(overrun_bytes=48)
    return writer


def mixed_batch(n: int) -> np.ndarray:
    rows = []
    for i in range(n):
        ptr = 0xFFFF888000000000 + 64 * i
        rows.append(
            event(EventKind.KMEM, KMALLOC, TypeId.KMALLOC, [ptr, 40, 64, 0xCC0, 0], cpu=i % 2)
        )
        rows.append(event(EventKind.KMEM, KFREE, TypeId.KMALLOC, [ptr], cpu=(i + 1) % 2))
        rows.append(event(EventKind.PROBE, 2, 0, [i, i * 2], ip=0x7F0000000000 + i, cpu=i % 2))
    return np.concatenate(rows)


def test_round_trip_reads_back_every_record_in_sequence_order(tmp_path: Path) -> None:
    # GIVEN two batches written across both CPU files
    write_set(tmp_path / "set", [mixed_batch(50), mixed_batch(30)])
    # WHEN the set is read back
    rs = read_record_set(tmp_path / "set")
    # THEN every record is there, ordered by sequence number across files
    recs = rs.records
    assert len(recs) == 3 * 80
    assert recs["seq"].tolist() == list(range(240))
    assert recs["event_id"][:3].tolist() == [EventId.ALLOC, EventId.FREE, EventId.PROBE]
    assert recs["cpu"][:3].tolist() == [0, 1, 0]
    assert recs["bytes_req"][0] == 40 and recs["bytes_alloc"][0] == 64
    assert recs["ptr"][3] == 0xFFFF888000000040
    assert len(rs.args) == 80 and rs.args[1, :2].tolist() == [1, 2]  # the probe records, in order
    assert (recs["pid"] == 4242).all() and (recs["timestamp"] == 123456789).all()
    assert rs.abi_version == ABI_VERSION and rs.total_overruns == 48
    assert rs.libc_probes == LIBC_PROBES
    assert rs.kallsyms and "some_function" in rs.kallsyms
    assert not rs.damage and not rs.skipped


def test_sequence_numbers_wrapping_past_2_to_the_31_keep_their_order(tmp_path: Path) -> None:
    # GIVEN records numbered across the signed 32-bit wraparound, split over two files
    directory = tmp_path / "set"
    directory.mkdir()
    (directory / "abi_version").write_text("1\n")
    seqs = [2**31 - 3, 2**31 - 2, 2**31 - 1, -(2**31), -(2**31) + 1, -(2**31) + 2]
    files: dict[int, bytes] = {0: b"", 1: b""}
    for i, seq in enumerate(seqs):
        files[i % 2] += struct.pack("=BBHiQQ", 1, 0, 24, seq, KERNEL, 0x1000 + i)
    for cpu, data in files.items():
        (directory / f"cpu{cpu}").write_bytes(data)
    # WHEN read
    rs = read_record_set(directory)
    # THEN they come out in the order they were numbered
    assert rs.records["ptr"].tolist() == [0x1000 + i for i in range(6)]
    assert np.all(np.diff(rs.records["seq"]) == 1)


def test_the_one_unwrapping_of_sequence_numbers() -> None:
    from mtrace_live.exporters.kmemtrace.reader import unwrap

    # a file's numbers across the signed 32-bit wraparound, as decode() sign-extends them
    assert unwrap(np.array([2**31 - 1, -(2**31), -(2**31) + 5])).tolist() == [
        2**31 - 1, 2**31, 2**31 + 5]  # fmt: skip
    # a file's first number against another file's first (already unwrapped) one
    assert unwrap(np.array([5]), 2**32 + 3).tolist() == [2**32 + 5]
    assert unwrap(np.array([-(2**31) + 1]), 2**31).tolist() == [2**31 + 1]
    assert unwrap(np.array([7]), 2**32 + 10).tolist() == [2**32 + 7]  # a little behind it
    assert unwrap(np.zeros(0, np.int64)).tolist() == []


def v1_set(tmp_path: Path, data: bytes, abi: str | None = "1\n") -> Path:
    directory = tmp_path / "set"
    directory.mkdir(exist_ok=True)
    if abi is not None:
        (directory / "abi_version").write_text(abi)
    (directory / "cpu0").write_bytes(data)
    return directory


GOOD = struct.pack("=BBHiQQQQIi", 0, 0, 48, 0, KERNEL, 0xFFFF888000001000, 8, 8, 0, -1)


def test_a_truncated_record_keeps_the_records_before_it_and_names_the_offset(
    tmp_path: Path,
) -> None:
    rs = read_record_set(v1_set(tmp_path, GOOD * 3 + GOOD[:30]))
    assert len(rs.records) == 3
    assert rs.damage == [f"{tmp_path}/set/cpu0: truncated record at offset 144 (30 bytes left); "
                         "the 3 records before it were read"]  # fmt: skip


@pytest.mark.parametrize("size", [0, 1, 23])
def test_an_event_size_below_the_core_stops_the_walk_there(tmp_path: Path, size: int) -> None:
    bad = struct.pack("=BBHiQQ", 1, 0, size, 1, KERNEL, 0)
    rs = read_record_set(v1_set(tmp_path, GOOD * 2 + bad + GOOD))
    assert len(rs.records) == 2
    assert "event size below 24 at offset 96" in rs.damage[0]


def test_unknown_event_and_type_ids_are_skipped_by_their_size_and_counted(tmp_path: Path) -> None:
    unknown_event = struct.pack("=BBHiQQ", 9, 0, 32, 1, KERNEL, 0) + b"\0" * 8
    unknown_type = struct.pack("=BBHiQQ", 1, 77, 24, 2, KERNEL, 0)
    rs = read_record_set(v1_set(tmp_path, unknown_event + GOOD + unknown_type + GOOD))
    assert len(rs.records) == 2 and not rs.damage
    assert rs.skipped == {"unknown event id": 1, "unknown type id": 1}


@pytest.mark.parametrize(
    ("abi", "words"),
    [
        (None, "abi_version is missing"),
        ("7\n", "ABI version 7 is unknown"),
        ("two\n", "is not an ABI version"),
    ],
)
def test_a_missing_or_unknown_abi_version_is_refused(
    tmp_path: Path, abi: str | None, words: str
) -> None:
    with pytest.raises(RecordSetError, match=words):
        read_record_set(v1_set(tmp_path, GOOD, abi))


def test_a_missing_cpu_file_is_named(tmp_path: Path) -> None:
    directory = v1_set(tmp_path, GOOD)
    (directory / "cpu2").write_bytes(GOOD)
    with pytest.raises(RecordSetError, match="lacks the file cpu1"):
        read_record_set(directory)


def test_a_directory_that_is_not_a_record_set_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(RecordSetError, match="not a kmemtrace record set"):
        read_record_set(tmp_path)


def test_report_exit_codes_are_one_line_each(tmp_path: Path) -> None:
    assert_one_line(mtrace("report", str(tmp_path)), 14, "not a kmemtrace record set")
    directory = v1_set(tmp_path, GOOD * 2 + GOOD[:10])
    damaged = mtrace("report", str(directory))
    assert_one_line(damaged, 15, "truncated record at offset 96")
    assert "2 records" in damaged.stdout  # what was read is still reported


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.binary(max_size=600),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=8),
)
def test_the_reader_never_crashes_on_damaged_bytes(
    tmp_path: Path, data: bytes, flips: list[tuple[int, int]]
) -> None:
    # GIVEN valid records followed by arbitrary bytes, with some bytes overwritten
    blob = bytearray(GOOD * 4 + data)
    for where, value in flips:
        blob[where % len(blob)] = value
    directory = v1_set(tmp_path, bytes(blob))
    # WHEN read, THEN it returns what it could walk and says why it stopped
    rs = read_record_set(directory)
    assert len(rs.records) <= len(blob) // 24
    assert len(rs.damage) <= 1
    if not rs.damage:
        assert sum(rs.skipped.values()) + len(rs.records) >= 1


def test_a_writer_refuses_to_mix_into_an_existing_record_set(tmp_path: Path) -> None:
    write_set(tmp_path / "set", [mixed_batch(1)])
    with pytest.raises(RecordSetError, match="already holds a record set"):
        KmemtraceWriter(tmp_path / "set", [], "")


def test_the_c_walker_decodes_into_the_decoded_layout() -> None:
    # GIVEN the walker's record struct, as the compiler laid it out
    from mtrace_live.exporters.kmemtrace._walker import record_layout
    from mtrace_live.exporters.kmemtrace.abi import DECODED

    layout = record_layout()
    # THEN every field of DECODED is at the same offset with the same size, and no other
    assert set(layout) == set(DECODED.names)
    for name in DECODED.names:
        dtype, offset = DECODED.fields[name][:2]
        assert layout[name] == (offset, dtype.itemsize), name
    assert max(o + s for o, s in layout.values()) == DECODED.itemsize
