"""Record sets as JSON lines and back: every field survives the round trip."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mtrace_live.exporters.data.kallsyms import KernelSymbols
from mtrace_live.exporters.kmemtrace.abi import EventId, TypeId
from mtrace_live.exporters.kmemtrace.json_lines import json_lines, write_record_set
from mtrace_live.exporters.kmemtrace.reader import read_record_set
from mtrace_live.probes.errors import RecordSetError
from mtrace_live.probes.records import EventKind

from .cli_runs import assert_one_line, mtrace
from .test_kmemtrace_format import (
    CACHE_ALLOC,
    PAGE_ALLOC,
    PAGE_FREE,
    event,
    mixed_batch,
    write_set,
)

FIELDS = ("event_id", "type_id", "call_site", "ptr", "bytes_req", "bytes_alloc", "gfp_flags",
          "target", "timestamp", "pid", "tid", "cpu")  # fmt: skip


def every_kind() -> np.ndarray:
    """kmalloc/kfree and a probe (mixed_batch), plus a cache allocation, a
    page allocation and free, and a libc sbrk and heap free."""
    extra = [
        event(EventKind.KMEM, CACHE_ALLOC, TypeId.CACHE, [0xFFFF888000100000, 192, 192, 0x400, 1]),
        event(EventKind.KMEM, PAGE_ALLOC, TypeId.PAGES, [0x1234, 8192, 8192, 0xD20, 2**64 - 1, 1]),
        event(EventKind.KMEM, PAGE_FREE, TypeId.PAGES, [0x1234, 0, 0, 0, 0, 1], cpu=1),
        event(EventKind.PROBE, 0, 0, [0x555555560000, 135168], ip=0x7F0000001000),
        event(EventKind.PROBE, 1, 0, [0x7F0000100000], ip=0x7F0000002000, cpu=1),
    ]
    return np.concatenate([mixed_batch(20), *extra])


def test_a_record_set_survives_json_lines_field_for_field(tmp_path: Path) -> None:
    # GIVEN a record set holding every kind of record
    write_set(tmp_path / "set", [every_kind()])
    original = read_record_set(tmp_path / "set")
    # WHEN it is written as JSON lines and read back into a new record set
    lines = list(json_lines(original, KernelSymbols(original.kallsyms or "")))
    written = write_record_set(lines, tmp_path / "again", "set.jsonl")
    again = read_record_set(tmp_path / "again")
    # THEN every record has the same fields, in the same order
    assert written == len(original.records) == len(again.records) == 3 * 20 + 5
    for name in FIELDS:
        assert again.records[name].tolist() == original.records[name].tolist(), name

    # AND the probe records keep their probe (by name) and arguments
    def probes(rs):  # type: ignore[no-untyped-def]
        numbers = rs.records["probe"][rs.records["event_id"] == EventId.PROBE]
        return [rs.libc_probes[n] for n in numbers], rs.args.tolist()

    assert probes(again) == probes(original)
    # AND each JSON line says what it is
    first = json.loads(lines[0])
    assert first["event"] == "alloc" and first["type"] == "kmalloc" and first["bytes_alloc"] == 64
    assert json.loads(lines[-2])["type"] == "sbrk"


def test_json_lines_that_are_not_records_are_one_error(tmp_path: Path) -> None:
    with pytest.raises(RecordSetError, match="line 2 is not a JSON record"):
        write_record_set(['{"seq": 0, "event": "probe"}', "{not json"], tmp_path / "x", "in.jsonl")
    source = tmp_path / "in.jsonl"
    source.write_text('{"seq": 0}\n')
    assert_one_line(mtrace("convert", str(source), "--to", "kmemtrace", "-o", str(tmp_path / "d")),
                    14, "lacks or mangles")  # fmt: skip
    assert_one_line(mtrace("convert", str(source)), 2, "--to kmemtrace -o DIR")
