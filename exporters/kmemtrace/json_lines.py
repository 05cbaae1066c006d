"""kmemtrace records as JSON lines, and JSON lines back into a record set.

One object per record, in sequence order: ``seq``, ``ts_ns``, ``cpu``,
``pid``, ``tid``, ``event`` (alloc, free or probe); for allocations and
frees ``type`` (kmalloc, kmem_cache, pages, sbrk, heap, arena),
``call_site`` (and ``symbol`` for kernel ones), ``ptr``, and for
allocations ``bytes_req``, ``bytes_alloc``, ``gfp_flags`` and ``node``; for
other libc probes ``probe`` and ``args``. Reading them back rebuilds the
ring events the records came from and writes them with the same encoder as
a live trace, so a record set survives the round trip field for field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from mtrace_live.exporters.data.kallsyms import KernelSymbols
from mtrace_live.exporters.kmemtrace.abi import KERNEL_TYPES, TYPES, EventId, TypeId
from mtrace_live.exporters.kmemtrace.reader import RecordSet
from mtrace_live.exporters.kmemtrace.writer import KmemtraceWriter
from mtrace_live.probes.errors import RecordSetError
from mtrace_live.probes.records import EVENT_DTYPE, KMEM_EVENTS, MAX_ARGS, EventKind

TYPE_IDS = {info.name: type_id for type_id, info in TYPES.items()}
# (type, event) -> the kmem tracepoint or libc probe the record came from
EVENT_NAMES = {
    **{(type_id, "alloc"): info.alloc for type_id, info in TYPES.items()},
    **{(type_id, "free"): info.free for type_id, info in TYPES.items()},
}
PAGE_SHIFT = 12


def json_lines(records: RecordSet, symbols: KernelSymbols) -> Iterator[str]:
    """One JSON object per record, in sequence order."""
    probe_args = iter(records.args)
    for rec in records.records:
        event, type_id = int(rec["event_id"]), int(rec["type_id"])
        doc: dict[str, object] = {
            "seq": int(rec["seq"]), "ts_ns": int(rec["timestamp"]), "cpu": int(rec["cpu"]),
            "pid": int(rec["pid"]), "tid": int(rec["tid"]),
            "event": ("alloc", "free", "probe")[event],
        }  # fmt: skip
        if event == EventId.PROBE:
            probe = int(rec["probe"])
            doc["probe"] = records.libc_probes[probe] if probe < len(records.libc_probes) else probe
            doc["call_site"] = int(rec["call_site"])
            doc["args"] = [int(a) for a in next(probe_args)]
        else:
            doc["type"] = TYPES[TypeId(type_id)].name
            doc["call_site"] = int(rec["call_site"])
            if type_id <= TypeId.PAGES and rec["call_site"]:
                doc["symbol"] = symbols.describe(int(rec["call_site"]))
            doc["ptr"] = int(rec["ptr"])
            if event == EventId.ALLOC:
                doc.update(bytes_req=int(rec["bytes_req"]), bytes_alloc=int(rec["bytes_alloc"]),
                           gfp_flags=int(rec["gfp_flags"]), node=int(rec["target"]))  # fmt: skip
        yield json.dumps(doc)


def write_record_set(lines: Iterable[str], directory: Path, source: str) -> int:
    """Rebuild a record set from JSON lines; the number of records written."""
    docs = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            if not isinstance(doc, dict):
                raise TypeError("not an object")
            docs.append((_field_int(doc, "seq", -(1 << 63), (1 << 63) - 1), doc))
        except (ValueError, KeyError, TypeError, RecursionError):
            raise RecordSetError(
                f"{source}: line {number} is not a JSON record of a record set"
            ) from None
    docs.sort(key=lambda pair: pair[0])
    probes: list[str] = []
    rows = np.zeros(len(docs), dtype=EVENT_DTYPE)
    for row, (seq, doc) in zip(rows, docs, strict=True):
        try:
            name = _libc_name(doc)
            if name is not None and name not in probes:
                probes.append(name)
                if len(probes) > U16:
                    raise ValueError(f"'probe' (at most {U16} names)")
            _fill(row, doc, probes)
        except (KeyError, ValueError, TypeError) as exc:
            raise RecordSetError(f"{source}: record seq {seq} lacks or mangles {exc}") from None
    writer = KmemtraceWriter(directory, probes, "", cpus=rows["cpu"].tolist() or [0])
    writer.write(rows, EventKind.KMEM, EventKind.PROBE)
    writer.close(0)
    return writer.records


def _libc_name(doc: dict[str, Any]) -> str | None:
    if doc["event"] == "probe":
        if not isinstance(doc["probe"], str | int) or isinstance(doc["probe"], bool):
            raise ValueError("'probe' (a probe's name)")
        name = str(doc["probe"])
        if not name or not name.isprintable():
            raise ValueError("'probe' (a probe's name, printable)")
        return name
    type_id = TYPE_IDS[str(doc["type"])]
    return None if type_id in KERNEL_TYPES else EVENT_NAMES[(type_id, str(doc["event"]))]


U64, U32, U16 = (1 << 64) - 1, (1 << 32) - 1, (1 << 16) - 1
EVENTS = ("alloc", "free", "probe")


def _field_int(doc: dict[str, Any], key: str, low: int, high: int) -> int:
    """A field that must be a JSON integer in [low, high] (never a float,
    a boolean or a string): ValueError naming the field otherwise."""
    value = doc[key]
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"'{key}' (an integer from {low} to {high})")
    return value


def _fill(row: np.void, doc: dict[str, Any], probes: list[str]) -> None:
    row["ts"], row["cpu"] = _field_int(doc, "ts_ns", 0, U64), _field_int(doc, "cpu", 0, U16)
    row["tgid"], row["tid"] = _field_int(doc, "pid", 0, U32), _field_int(doc, "tid", 0, U32)
    args = np.zeros(6, dtype=np.uint64)
    row["ip"] = _field_int(doc, "call_site", 0, U64)
    if doc["event"] not in EVENTS:
        raise ValueError(f"'event' (one of {', '.join(EVENTS)})")
    if doc["event"] == "probe":
        row["kind"], row["probe"] = EventKind.PROBE, probes.index(str(doc["probe"]))
        values = doc["args"]
        if not isinstance(values, list) or len(values) > MAX_ARGS:
            raise ValueError(f"'args' (a list of at most {MAX_ARGS} integers)")
        args[: len(values)] = [_field_int({"args": v}, "args", 0, U64) for v in values]
        row["nargs"] = len(values)
    else:
        type_id = TYPE_IDS[str(doc["type"])]
        ptr = _field_int(doc, "ptr", 0, U64)
        alloc = doc["event"] == "alloc"
        if type_id in KERNEL_TYPES:
            row["kind"], row["site"] = EventKind.KMEM, type_id
            row["probe"] = KMEM_EVENTS.index(EVENT_NAMES[(type_id, str(doc["event"]))])
            if type_id == TypeId.PAGES and ptr % (1 << PAGE_SHIFT):
                raise ValueError("'ptr' (a page's address, a multiple of 4096)")
            args[0] = ptr >> PAGE_SHIFT if type_id == TypeId.PAGES else ptr
            if alloc:
                args[1] = _field_int(doc, "bytes_req", 0, U64)
                args[2] = _field_int(doc, "bytes_alloc", 0, U64)
                args[3] = _field_int(doc, "gfp_flags", 0, U32)
                args[4] = np.int64(_field_int(doc, "node", -(1 << 31), (1 << 31) - 1)).astype(
                    np.uint64
                )
        else:
            row["kind"], row["probe"] = (
                EventKind.PROBE,
                probes.index(EVENT_NAMES[(type_id, str(doc["event"]))]),
            )
            args[0] = ptr
            if alloc:
                args[1] = _field_int(doc, "bytes_req", 0, U64)
        row["nargs"] = 6
    row["args"] = args
