"""A cached program's maps, read and written without bcc
(tracer/bpf/map_table.py), hold what bpftool (the peer) dumps of them:
real maps made in the kernel, a hash, an array and per-CPU arrays, each
written through the table and read back by bpftool, and the reverse; and an
mmapable array copied from its memory as bpftool dumps it."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from mtrace_live.tracer.bpf import bpf_syscalls, map_table
from mtrace_live.tracer.bpf.bpf_syscalls import MapInfo

MMAPABLE = 1 << 10  # BPF_F_MMAPABLE


class Entry(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("count", ctypes.c_ulonglong), ("name", ctypes.c_char * 8)]


def made(kind: int, name: str, key: object, leaf: object, entries: int) -> map_table.Table:
    info = MapInfo(kind, ctypes.sizeof(key), ctypes.sizeof(leaf), entries, 0, name)  # type: ignore[arg-type]
    fd = bpf_syscalls.create_map(info)
    assert fd is not None, os.strerror(ctypes.get_errno())
    return map_table.Table(fd, kind, entries, key, leaf)


@pytest.fixture
def tables() -> Iterator[list[map_table.Table]]:
    made_here: list[map_table.Table] = []
    yield made_here
    for table in made_here:
        os.close(table.map_fd)


def dump(name: str) -> list[dict[str, object]]:
    """bpftool's dump of the map named ``name`` (the one this test made)."""
    listed = json.loads(subprocess.run(["bpftool", "-j", "map", "show"], capture_output=True,
                                       text=True, check=True).stdout)  # fmt: skip
    ids = [entry["id"] for entry in listed if entry.get("name") == name]
    assert len(ids) == 1, listed
    got: list[dict[str, object]] = json.loads(subprocess.run(
        ["bpftool", "-j", "map", "dump", "id", str(ids[0])], capture_output=True, text=True,
        check=True).stdout)  # fmt: skip
    return got


def raw(hexes: object) -> bytes:
    assert isinstance(hexes, list)
    return bytes(int(h, 16) for h in hexes)


def test_a_hash_holds_what_was_written_and_loses_what_was_deleted(
    tables: list[map_table.Table],
) -> None:
    # GIVEN a hash map of u32 keys and packed structs, written through a table
    table = made(map_table.HASH, "mtl_test_hash", ctypes.c_uint, Entry, 16)
    tables.append(table)
    for key, count, name in ((3, 30, b"three"), (7, 70, b"seven"), (9, 90, b"nine")):
        table[table.Key(key)] = table.Leaf(count, name)
    del table[table.Key(9)]
    # THEN bpftool dumps the two entries left, byte for byte
    dumped = {int.from_bytes(raw(e["key"]), "little"): raw(e["value"])
              for e in dump("mtl_test_hash")}  # fmt: skip
    assert dumped == {3: bytes(Entry(30, b"three")), 7: bytes(Entry(70, b"seven"))}
    # AND the table reads them back, counts them, and misses the deleted one
    assert table[table.Key(7)].count == 70 and table[table.Key(7)].name == b"seven"
    assert len(table) == 2
    assert sorted((k.value, v.count) for k, v in table.items()) == [(3, 30), (7, 70)]
    assert table.Key(9) not in table and table.Key(3) in table
    with pytest.raises(KeyError):
        table[table.Key(9)]
    with pytest.raises(KeyError):
        del table[table.Key(9)]


def test_an_array_is_indexed_by_integers_and_zeroed_by_a_delete(
    tables: list[map_table.Table],
) -> None:
    # GIVEN an array of 4 u64 values, written by index (a negative one too)
    table = made(map_table.ARRAY, "mtl_test_array", ctypes.c_uint, ctypes.c_ulonglong, 4)
    tables.append(table)
    table[0] = table.Leaf(11)
    table[table.Key(1)] = table.Leaf(22)
    table[-1] = table.Leaf(44)
    table[2] = table.Leaf(33)
    del table[2]
    # THEN bpftool dumps those values at those indexes, the deleted one 0
    dumped = {int.from_bytes(raw(e["key"]), "little"): int.from_bytes(raw(e["value"]), "little")
              for e in dump("mtl_test_array")}  # fmt: skip
    assert dumped == {0: 11, 1: 22, 2: 0, 3: 44}
    # AND the table has every index, and none past its end
    assert len(table) == 4
    assert [v.value for _, v in table.items()] == [11, 22, 0, 44]
    assert table[0].value == 11
    with pytest.raises(IndexError):
        table[4]


@pytest.mark.parametrize("value", [ctypes.c_ulonglong, ctypes.c_uint])
def test_a_per_cpu_array_has_a_value_for_each_possible_cpu(
    tables: list[map_table.Table], value: object
) -> None:
    # GIVEN a per-CPU array (u64 values, or u32 ones the kernel keeps in 8 bytes)
    name = f"mtl_pcpu_{ctypes.sizeof(value)}"  # type: ignore[arg-type]
    table = made(map_table.PERCPU_ARRAY, name, ctypes.c_uint, value, 2)
    tables.append(table)
    cpus = table.total_cpu
    # WHEN index 1 is given a value per CPU
    table[1] = table.Leaf(*(100 + cpu for cpu in range(cpus)))
    # THEN bpftool dumps that value on each CPU, and 0 at index 0
    dumped = {int.from_bytes(raw(e["key"]), "little"):
              [int.from_bytes(raw(v["value"]), "little") for v in e["values"]]  # type: ignore[attr-defined]
              for e in dump(name)}  # fmt: skip
    assert dumped == {0: [0] * cpus, 1: [100 + cpu for cpu in range(cpus)]}
    # AND the table reads them back as the value's own type, one per CPU
    assert list(table[1]) == [100 + cpu for cpu in range(cpus)]
    assert table.sLeaf is value and sum(table[1]) == sum(100 + cpu for cpu in range(cpus))
    # (the CPUs the kernel keeps values for are the possible ones: "0-1", "0,2-3")
    possible = Path("/sys/devices/system/cpu/possible").read_text().strip().split(",")
    ranges = [[int(n) for n in part.split("-")] for part in possible]
    assert cpus == sum(r[-1] - r[0] + 1 for r in ranges)


class Row(ctypes.Structure):  # 80 bytes, as the outstanding table's rows
    _pack_ = 1
    _fields_ = [("tag", ctypes.c_ulonglong), ("words", ctypes.c_ulonglong * 9)]


ROW = np.dtype([("tag", "<u8"), ("words", "<u8", (9,))])


def test_an_mmapable_array_is_copied_from_its_memory_with_only_the_rows_in_use(
    tables: list[map_table.Table],
) -> None:
    # GIVEN an array made mmapable (BPF_F_MMAPABLE) of 1000 rows of 80 bytes
    # (not a whole number of pages), whose tag 0 or 1 says unused, some
    # written through the table
    info = MapInfo(map_table.ARRAY, 4, ctypes.sizeof(Row), 1000, MMAPABLE, "mtl_mapped")
    fd = bpf_syscalls.create_map(info)
    assert fd is not None, os.strerror(ctypes.get_errno())
    table = map_table.Table(fd, map_table.ARRAY, 1000, ctypes.c_int, Row)
    tables.append(table)
    written = {5: 7, 300: 2, 999: 99, 17: 1}  # (17: tag 1, unused)
    for index, tag in written.items():
        table[index] = Row(tag, (ctypes.c_ulonglong * 9)(*range(index, index + 9)))
    # WHEN it is mapped and copied
    mapped = map_table.MappedArray.of(fd, 1000, ctypes.sizeof(Row), ROW)
    assert mapped is not None
    try:
        whole, used = mapped.copy(), mapped.copy(("tag", (0, 1)))
    finally:
        mapped.close()
    # THEN the whole copy has every row as bpftool dumps it, and the rows in
    # use are those written with a tag past 1, in index order
    dumped = [raw(e["value"]) for e in dump("mtl_mapped")]
    assert [row.tobytes() for row in whole] == dumped
    assert [int.from_bytes(dumped[i][:8], "little") for i in sorted(written)] == [
        written[i] for i in sorted(written)
    ]
    assert used["tag"].tolist() == [7, 2, 99]
    assert used["words"][2].tolist() == list(range(999, 1008))


def test_an_array_not_made_mmapable_or_of_other_rows_is_not_mapped(
    tables: list[map_table.Table],
) -> None:
    # an array made without the flag
    table = made(map_table.ARRAY, "mtl_not_mapped", ctypes.c_uint, Row, 16)
    tables.append(table)
    assert map_table.MappedArray.of(table.map_fd, 16, ctypes.sizeof(Row), ROW) is None
    # an mmapable one read as rows of another size (its values would be misread)
    info = MapInfo(map_table.ARRAY, 4, ctypes.sizeof(Row), 16, MMAPABLE, "mtl_other_rows")
    fd = bpf_syscalls.create_map(info)
    assert fd is not None
    tables.append(map_table.Table(fd, map_table.ARRAY, 16, ctypes.c_int, Row))
    assert map_table.MappedArray.of(fd, 16, ctypes.sizeof(Row), np.dtype("<u8")) is None
    assert map_table.MappedArray.of(fd, 16, ctypes.sizeof(Row), ROW) is not None


# A row of 12 bytes, as unwind_rows' (the kernel keeps each in 16)
TWELVE = np.dtype([("pc", "<u4"), ("off", "<i4"), ("a", "<i2"), ("b", "u1"), ("c", "u1")])


@pytest.mark.parametrize("flags", [MMAPABLE, 0], ids=["mapped", "not mmapable"])
def test_a_run_of_rows_written_through_a_mapping_is_what_bpftool_dumps(
    tables: list[map_table.Table], flags: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN an array of 1000 rows of 12 bytes (made mmapable, or not: then
    # written by the batched update), every row 0
    name = f"mtl_write_{flags}"
    info = MapInfo(map_table.ARRAY, 4, TWELVE.itemsize, 1000, flags, name)
    fd = bpf_syscalls.create_map(info)
    assert fd is not None, os.strerror(ctypes.get_errno())
    tables.append(map_table.Table(fd, map_table.ARRAY, 1000, ctypes.c_int, ctypes.c_char * 12))
    if flags:  # (mapped: the kernel's batched update is never asked)

        def refused(*args: object) -> None:
            raise AssertionError("written by BPF_MAP_UPDATE_BATCH")

        monkeypatch.setattr(bpf_syscalls, "update_array", refused)
    # WHEN a run of 300 rows is written from index 250 (its slots cross
    # pages: 16 bytes each, 256 a page), and one row at the last index
    run = np.zeros(300, dtype=TWELVE)
    run["pc"] = np.arange(1000, 1300)
    run["off"], run["a"], run["b"], run["c"] = -8, -16, 1, 2
    map_table.write_mapped(fd, 250, map_table.slots(run), TWELVE.itemsize)
    map_table.write_mapped(fd, 999, map_table.slots(run[:1]), TWELVE.itemsize)
    map_table.write_mapped(fd, 0, map_table.slots(run[:0]), TWELVE.itemsize)  # (nothing)
    # THEN bpftool dumps exactly those rows there, and zeros elsewhere
    dumped = {int.from_bytes(raw(entry["key"]), "little"): raw(entry["value"])
              for entry in dump(name)}  # fmt: skip
    expected = {index: bytes(12) for index in range(1000)}
    expected.update({250 + i: run[i].tobytes() for i in range(300)})
    expected[999] = run[0].tobytes()
    assert dumped == expected
