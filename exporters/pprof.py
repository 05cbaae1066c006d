"""Allocations by call stack as a pprof profile (``--pprof FILE``), and lock
waits by call stack as a contention profile (``--pprof-mutex FILE``).

The profile is the gzipped protocol buffer of google/pprof's profile.proto,
which ``go tool pprof``, Pyroscope and Parca read. Its four sample types are
those of a Go heap profile: ``alloc_objects`` and ``alloc_space`` (count and
bytes allocated since the trace began) and ``inuse_objects`` and
``inuse_space`` (still allocated at its end); inuse_space is the default.
With sampling the values are the estimates (exporters/data/alloc_snapshot.py)
and ``period`` is the mean sampling interval in bytes.

The messages are encoded by the protobuf library from a descriptor built
here from profile.proto's field numbers, so no generated code is kept.

Each sample is one (process, allocating function, stack) row; its first
location is the call site (the function that called malloc), then its
callers, as pprof wants the leaf first. Locations carry the function and
file:line (from the symbols and DWARF line tables), and the mapping of the
module holding them; each sample has ``pid`` and ``allocator`` labels.

The contention profile is the one Go's ``/debug/pprof/mutex`` serves: two
sample types, ``contentions`` (count) and ``delay`` (nanoseconds), a period
of one contention; a sample per (process, lock, stack of the waiting
thread), labelled ``pid`` and ``lock`` (main, arena, other, unknown), whose
first location is the code that waited.
"""

from __future__ import annotations

import gzip
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from .data.alloc_snapshot import AllocSnapshot, FrameNames, StackCatalog, StackColumns, StackRow
from .data.lock_waits import LockWaits
from .data.sink import FileAtEndSink, TraceResult, write_file
from .data.symbolize import Symbol

# profile.proto (package perftools.profiles): message -> [(field, number, type, repeated, message)]
_I64, _U64, _BOOL, _STR, _MSG = "int64", "uint64", "bool", "string", "message"
SCHEMA: dict[str, list[tuple[str, int, str, bool, str]]] = {
    "Profile": [
        ("sample_type", 1, _MSG, True, "ValueType"), ("sample", 2, _MSG, True, "Sample"),
        ("mapping", 3, _MSG, True, "Mapping"), ("location", 4, _MSG, True, "Location"),
        ("function", 5, _MSG, True, "Function"), ("string_table", 6, _STR, True, ""),
        ("drop_frames", 7, _I64, False, ""), ("keep_frames", 8, _I64, False, ""),
        ("time_nanos", 9, _I64, False, ""), ("duration_nanos", 10, _I64, False, ""),
        ("period_type", 11, _MSG, False, "ValueType"), ("period", 12, _I64, False, ""),
        ("comment", 13, _I64, True, ""), ("default_sample_type", 14, _I64, False, ""),
    ],
    "ValueType": [("type", 1, _I64, False, ""), ("unit", 2, _I64, False, "")],
    "Sample": [("location_id", 1, _U64, True, ""), ("value", 2, _I64, True, ""),
               ("label", 3, _MSG, True, "Label")],
    "Label": [("key", 1, _I64, False, ""), ("str", 2, _I64, False, ""),
              ("num", 3, _I64, False, ""), ("num_unit", 4, _I64, False, "")],
    "Mapping": [("id", 1, _U64, False, ""), ("memory_start", 2, _U64, False, ""),
                ("memory_limit", 3, _U64, False, ""), ("file_offset", 4, _U64, False, ""),
                ("filename", 5, _I64, False, ""), ("build_id", 6, _I64, False, ""),
                ("has_functions", 7, _BOOL, False, ""), ("has_filenames", 8, _BOOL, False, ""),
                ("has_line_numbers", 9, _BOOL, False, ""),
                ("has_inline_frames", 10, _BOOL, False, "")],
    "Location": [("id", 1, _U64, False, ""), ("mapping_id", 2, _U64, False, ""),
                 ("address", 3, _U64, False, ""), ("line", 4, _MSG, True, "Line"),
                 ("is_folded", 5, _BOOL, False, "")],
    "Line": [("function_id", 1, _U64, False, ""), ("line", 2, _I64, False, "")],
    "Function": [("id", 1, _U64, False, ""), ("name", 2, _I64, False, ""),
                 ("system_name", 3, _I64, False, ""), ("filename", 4, _I64, False, ""),
                 ("start_line", 5, _I64, False, "")],
}  # fmt: skip
PACKAGE = "perftools.profiles"
SAMPLE_TYPES = (("alloc_objects", "count"), ("alloc_space", "bytes"),
                ("inuse_objects", "count"), ("inuse_space", "bytes"))  # fmt: skip

_CLASSES: dict[str, Any] = {}


def message_class(name: str) -> Any:
    """The class of one profile.proto message, built once."""
    if not _CLASSES:
        types = descriptor_pb2.FieldDescriptorProto
        kinds = {_I64: types.TYPE_INT64, _U64: types.TYPE_UINT64, _BOOL: types.TYPE_BOOL,
                 _STR: types.TYPE_STRING, _MSG: types.TYPE_MESSAGE}  # fmt: skip
        file = descriptor_pb2.FileDescriptorProto(
            name="mtrace_live_profile.proto", package=PACKAGE, syntax="proto3"
        )
        for message, fields in SCHEMA.items():
            proto = file.message_type.add(name=message)
            for field, number, kind, repeated, of in fields:
                entry = proto.field.add(name=field, number=number, type=kinds[kind])
                entry.label = types.LABEL_REPEATED if repeated else types.LABEL_OPTIONAL
                if of:
                    entry.type_name = f".{PACKAGE}.{of}"
        pool = descriptor_pool.DescriptorPool()
        pool.Add(file)
        for message in SCHEMA:
            found = pool.FindMessageTypeByName(f"{PACKAGE}.{message}")
            _CLASSES[message] = message_factory.GetMessageClass(found)
    return _CLASSES[name]


class _Strings:
    def __init__(self) -> None:
        self.table: list[str] = [""]
        self.index: dict[str, int] = {"": 0}

    def __call__(self, text: str) -> int:
        found = self.index.get(text)
        if found is None:
            found = self.index[text] = len(self.table)
            self.table.append(text)
        return found


def _new_profile(strings: _Strings, types: Sequence[tuple[str, str]], default: str,
                 period: tuple[str, str, int], duration_ns: int,
                 comments: Sequence[str]) -> Any:  # fmt: skip
    profile = message_class("Profile")()
    for kind, unit in types:
        profile.sample_type.add(type=strings(kind), unit=strings(unit))
    profile.default_sample_type = strings(default)
    profile.period_type.type = strings(period[0])
    profile.period_type.unit = strings(period[1])
    profile.period = period[2]
    profile.time_nanos = time.time_ns() - duration_ns
    profile.duration_nanos = duration_ns
    for text in comments:
        profile.comment.append(strings(text))
    return profile


Labels = Callable[[int], Sequence[tuple[str, str]]]  # a process's string labels


def build_profile(snapshot: AllocSnapshot, names: FrameNames, duration_ns: int = 0,
                  comments: Sequence[str] = (), default: str = "inuse_space",
                  labels: Labels | None = None) -> Any:  # fmt: skip
    """The Profile message of ``snapshot``; ``labels`` gives a process's
    string labels beside ``pid``, ``allocator`` (the allocating function),
    ``provider`` and ``provider_lib`` (serve's profiles)."""
    strings = _Strings()
    profile = _new_profile(strings, SAMPLE_TYPES, default,
                           ("space", "bytes", snapshot.sample_bytes or 1), duration_ns,
                           comments)  # fmt: skip
    tables = _Tables(profile, strings, names)
    pid_key, allocator_key = strings("pid"), strings("allocator")
    extra: dict[int, list[tuple[int, int]]] = {}
    for row in snapshot.stacks:
        values = row.heap_values
        if not any(values):
            continue
        sample = profile.sample.add()
        sample.location_id.extend(tables.location_id(row.tgid, address) for address in row.frames)
        sample.value.extend(values)
        sample.label.add(key=pid_key, num=row.tgid)
        sample.label.add(key=allocator_key, str=strings(row.function))
        for name, text in (("provider", row.provider), ("provider_lib", row.provider_lib)):
            if text:
                sample.label.add(key=strings(name), str=strings(text))
        if labels is not None:
            if row.tgid not in extra:
                extra[row.tgid] = [(strings(k), strings(v)) for k, v in labels(row.tgid) if v]
            for key, value in extra[row.tgid]:
                sample.label.add(key=key, str=value)
    profile.string_table.extend(strings.table)
    return profile


_SMALL = [bytes([n]) for n in range(0x80)]
_SAMPLE_TAG, _VALUE_TAG, _STRING_TAG = (
    b"\x12",
    b"\x12",
    b"\x32",
)  # Profile.sample, Sample.value, Profile.string_table


def _varint(number: int) -> bytes:
    """A protobuf varint (an int64 below 0 as its 64-bit two's complement)."""
    if number < 0:
        number += 1 << 64
    if number < 0x80:
        return _SMALL[number]
    out = bytearray()
    while number >= 0x80:
        out.append(number & 0x7F | 0x80)
        number >>= 7
    out.append(number)
    return bytes(out)


def _framed(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


class HeapEncoder:
    """Heap profiles (``build_profile``'s, for serve) encoded against tables
    kept from one profile to the next: each string, function, mapping and
    location is added once, and each stack key's location ids and labels
    (its prefix) are encoded once, by the key's number in the rows'
    catalog. A profile then encodes its rows' values as arrays and joins
    them to the prefixes. A process's prefixes go when it is gone or its
    labels change; the tables start again once they hold many more
    locations than the prefixes kept refer to."""

    def __init__(self, names: FrameNames) -> None:
        self.names = names
        self._start()

    def _start(self) -> None:
        self.strings = _Strings()
        self._dictionary = message_class("Profile")()  # locations, functions, mappings
        self.tables = _Tables(self._dictionary, self.strings, self.names)
        self._dictionary_bytes = (0, 0, 0, b"")
        self._encoded_strings: list[bytes] = []
        self._catalog: StackCatalog | None = None
        self._prefixes: list[bytes | None] = []  # by key number: location ids and labels, encoded
        self._labels: dict[int, bytes] = {}  # by (process, function) pair: its labels, encoded

    def retain(self, tgids: set[int]) -> None:
        """Keep the prefixes of these processes only (the others are gone);
        the locations of those gone go when the tables start again."""
        gone = {pair >> _PAIR_BITS for pair in self._labels} - tgids
        if not gone or self._catalog is None:
            return
        self._labels = {pair: text for pair, text in self._labels.items()
                        if pair >> _PAIR_BITS not in gone}  # fmt: skip
        for number in np.flatnonzero(np.isin(self._catalog.tgids(), list(gone))).tolist():
            if number < len(self._prefixes):
                self._prefixes[number] = None
        self.tables.forget(gone)
        kept = sum(prefix is not None for prefix in self._prefixes)
        if len(self._dictionary.location) > 4 * kept + 100_000:
            self._start()

    def encode(self, rows: Sequence[StackRow], labels: Labels, sample_bytes: int,
               default: str, duration_ns: int, comments: Sequence[str],
               others: Mapping[int, Sequence[int]] | None = None,
               ended_ns: int | None = None) -> bytes:  # fmt: skip
        """The gzipped profile of ``rows``, as ``build_profile`` makes it;
        ``others``: a process's stacks left out, summed (its four values),
        as one sample at the function OTHER_STACKS. Dated ``ended_ns`` (the
        time the tables were read; now if not given): a delta's end, as Go
        dates its second reading."""
        samples = self._samples(StackColumns.of(rows), labels)
        samples += self._other_samples(others or {}, labels)
        header = message_class("Profile")()
        for kind, unit in SAMPLE_TYPES:
            header.sample_type.add(type=self.strings(kind), unit=self.strings(unit))
        header.default_sample_type = self.strings(default)
        header.period_type.type = self.strings("space")
        header.period_type.unit = self.strings("bytes")
        header.period = sample_bytes or 1
        header.time_nanos = time.time_ns() if ended_ns is None else ended_ns
        header.duration_nanos = duration_ns
        self._encode_strings()
        extra = [_framed(_STRING_TAG, text.encode()) for text in comments]
        header.comment.extend(range(len(self.strings.table), len(self.strings.table) + len(extra)))
        raw = b"".join([header.SerializeToString(), self._dictionary_encoded(), *samples,
                        *self._encoded_strings, *extra])  # fmt: skip
        return gzip.compress(raw, compresslevel=1, mtime=0)

    def _samples(self, rows: StackColumns, labels: Labels) -> list[bytes]:
        """The rows' Samples (but those whose values are all 0), each framed
        as a field of Profile, in pieces to be joined."""
        values = rows.heap_values()
        nonzero = np.flatnonzero(values.any(axis=1))
        rows, values = rows.select(nonzero), values[nonzero]
        if not len(rows):
            return []
        prefixes = self._prefixes_of(rows, labels)
        glue, cuts = _sample_frames(np.array([len(p) for p in prefixes], np.int64), values)
        ends = cuts.tolist()
        pieces: list[bytes] = [b""] * (2 * len(prefixes) + 1)
        pieces[0::2] = [glue[a:b] for a, b in zip([0, *ends], [*ends, len(glue)], strict=True)]
        pieces[1::2] = prefixes
        return pieces

    def _other_samples(self, others: Mapping[int, Sequence[int]], labels: Labels) -> list[bytes]:
        """A sample per process of ``others``: its summed values at the one
        location of OTHER_STACKS, and its process's labels."""
        if not others:
            return []
        location = self.tables.other_location()
        framed = []
        for tgid, values in sorted(others.items()):
            sample = message_class("Sample")()
            sample.location_id.append(location)
            sample.value.extend(int(v) for v in values)
            head = bytes(sample.SerializeToString())
            framed.append(_framed(_SAMPLE_TAG, head + self._labels_encoded(tgid, (), labels)))
        return framed

    def _prefixes_of(self, rows: StackColumns, labels: Labels) -> list[bytes]:
        """Each row's prefix, those of keys not seen before (or whose labels
        changed) encoded now."""
        catalog = rows.catalog
        if catalog is not self._catalog:  # numbered anew: the functions' codes too
            self._catalog, self._prefixes, self._labels = catalog, [], {}
        self._prefixes.extend([None] * (len(catalog) - len(self._prefixes)))
        pairs = rows.tgids() << _PAIR_BITS | catalog.codes()[rows.ids]
        names = {code: name for name, code in catalog.functions.items()}
        changed = []
        for pair in np.unique(pairs).tolist():
            text = self._labels_encoded(pair >> _PAIR_BITS, names[pair & _PAIR_MASK], labels)
            if self._labels.get(pair) != text:
                self._labels[pair] = text
                changed.append(pair)
        for number in np.unique(rows.ids[np.isin(pairs, changed)]).tolist():
            self._prefixes[number] = None
        prefixes = self._prefixes
        numbers = rows.ids.tolist()
        for number in {n for n in numbers if prefixes[n] is None}:
            key = catalog.keys[number]
            tgid, frames = key[0], key[3]
            pair = tgid << _PAIR_BITS | catalog.functions[key[1:2] + key[4:]]
            prefixes[number] = self._locations(tgid, frames) + self._labels[pair]
        return [prefixes[number] for number in numbers]

    def _locations(self, tgid: int, frames: Sequence[int]) -> bytes:
        """A Sample holding the location ids of ``frames``, encoded."""
        sample = message_class("Sample")()
        sample.location_id.extend(self.tables.location_id(tgid, a) for a in frames)
        return bytes(sample.SerializeToString())

    def _labels_encoded(self, tgid: int, function: tuple[str, ...], labels: Labels) -> bytes:
        """A Sample holding a process's labels and its allocating function's
        (the function, then the provider and its file, when told), encoded."""
        sample = message_class("Sample")()
        sample.label.add(key=self.strings("pid"), num=tgid)
        for key, value in zip(("allocator", "provider", "provider_lib"), function, strict=False):
            if value:
                sample.label.add(key=self.strings(key), str=self.strings(value))
        for key, value in labels(tgid):
            if value:
                sample.label.add(key=self.strings(key), str=self.strings(value))
        return bytes(sample.SerializeToString())

    def _dictionary_encoded(self) -> bytes:
        """The locations, functions and mappings, encoded again only when added to."""
        sizes = (len(self._dictionary.location), len(self._dictionary.function),
                 len(self._dictionary.mapping))  # fmt: skip
        if sizes != self._dictionary_bytes[:3]:
            self._dictionary_bytes = (*sizes, self._dictionary.SerializeToString())
        return self._dictionary_bytes[3]

    def _encode_strings(self) -> None:
        for text in self.strings.table[len(self._encoded_strings) :]:
            self._encoded_strings.append(_framed(_STRING_TAG, text.encode()))


# The function of the one sample per process that sums the stacks a
# bounded profile (serve's max_samples) left out, and its location's key.
OTHER_STACKS = "(other)"
_OTHER_KEY = (-1, 0)
_PAIR_BITS = 8  # a (process, allocating function) pair: tgid << 8 | the function's code
_PAIR_MASK = (1 << _PAIR_BITS) - 1
_SHIFTS = np.arange(10, dtype=np.uint64) * np.uint64(7)
_LIMITS = np.uint64(1) << _SHIFTS[1:]


def _varints(numbers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``numbers`` (int64) as protobuf varints, one after the other (a
    number below 0 as its 64-bit two's complement), and each one's width."""
    unsigned = numbers.astype(np.int64).view(np.uint64)
    widths = 1 + (unsigned[:, None] >= _LIMITS[None, :]).sum(axis=1)
    columns = int(widths.max()) if len(widths) else 1
    places = np.arange(columns)
    digits = ((unsigned[:, None] >> _SHIFTS[None, :columns]) & np.uint64(0x7F)).astype(np.uint8)
    digits[places[None, :] < widths[:, None] - 1] |= 0x80
    return digits[places[None, :] < widths[:, None]], widths


def _joined_rows(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Row by row, the row's piece of each part one after the other: a part
    is its pieces' bytes (in row order) and each piece's length. Returns
    the bytes and where each row begins."""
    lengths = np.column_stack([length for _, length in parts])
    totals = lengths.sum(axis=1)
    begins = np.cumsum(totals) - totals
    starts = begins[:, None] + np.cumsum(lengths, axis=1) - lengths
    out = np.empty(int(totals.sum()), np.uint8)
    for index, (flat, length) in enumerate(parts):
        source = np.cumsum(length) - length
        out[np.repeat(starts[:, index] - source, length) + np.arange(len(flat))] = flat
    return out, begins


def _sample_frames(prefix_lengths: np.ndarray, values: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Each sample but its prefix, row after row: Profile.sample's tag and
    the sample's length, then Sample.value's tag, length and packed values;
    and where in those bytes each row's prefix goes (after its length)."""
    rows = len(prefix_lengths)
    packed, widths = _varints(values.reshape(-1))
    packed_lengths = widths.reshape(rows, -1).sum(axis=1)
    length, length_widths = _varints(prefix_lengths + 2 + packed_lengths)
    ones = np.ones(rows, np.int64)
    value_heads = np.column_stack([np.full(rows, _VALUE_TAG[0]), packed_lengths]).astype(np.uint8)
    flat, begins = _joined_rows([
        (np.full(rows, _SAMPLE_TAG[0], np.uint8), ones), (length, length_widths),
        (value_heads.reshape(-1), 2 * ones), (packed, packed_lengths),
    ])  # fmt: skip
    return flat.tobytes(), begins + 1 + length_widths


CONTENTION_TYPES = (("contentions", "count"), ("delay", "nanoseconds"))


def build_contention_profile(waits: LockWaits, names: FrameNames, duration_ns: int = 0,
                             comments: Sequence[str] = ()) -> Any:  # fmt: skip
    """The contention Profile message of ``waits``' stacks."""
    strings = _Strings()
    profile = _new_profile(strings, CONTENTION_TYPES, "delay", ("contentions", "count", 1),
                           duration_ns, comments)  # fmt: skip
    tables = _Tables(profile, strings, names)
    pid_key, lock_key = strings("pid"), strings("lock")
    for row in waits.stacks:
        if not row.times.count:
            continue
        sample = profile.sample.add()
        sample.location_id.extend(tables.location_id(row.pid, address) for address in row.frames)
        sample.value.extend([row.times.count, row.times.total_ns])
        sample.label.add(key=pid_key, num=row.pid)
        sample.label.add(key=lock_key, str=strings(row.kind))
    profile.string_table.extend(strings.table)
    return profile


class _Tables:
    """A profile's locations, functions and mappings, each added once, with
    the ids samples refer to them by."""

    def __init__(self, profile: Any, strings: _Strings, names: FrameNames) -> None:
        self.profile, self.strings, self.names = profile, strings, names
        self.locations: dict[tuple[int, int], int] = {}
        self.functions: dict[tuple[str, str], int] = {}
        self.mappings: dict[tuple[int, str], int] = {}

    def mapping_id(self, tgid: int, symbol: Symbol | None) -> int:
        if symbol is None or symbol.span is None:
            return 0
        key = (tgid, symbol.module)
        found = self.mappings.get(key)
        if found is None:
            found = self.mappings[key] = len(self.profile.mapping) + 1
            start, end = symbol.span
            self.profile.mapping.add(id=found, memory_start=start, memory_limit=end,
                                     filename=self.strings(symbol.module),
                                     build_id=self.strings(symbol.build_id or ""),
                                     has_functions=True,
                                     has_filenames=symbol.location is not None,
                                     has_line_numbers=symbol.location is not None)  # fmt: skip
        return found

    def function_id(self, name: str, filename: str, system_name: str | None = None) -> int:
        key = (name, filename)
        found = self.functions.get(key)
        if found is None:
            found = self.functions[key] = len(self.profile.function) + 1
            self.profile.function.add(id=found, name=self.strings(name),
                                      system_name=self.strings(system_name or name),
                                      filename=self.strings(filename))  # fmt: skip
        return found

    def forget(self, tgids: set[int]) -> None:
        """The processes' locations and mappings are not referred to again
        (a process that reuses a pid has its own)."""
        self.locations = {key: id_ for key, id_ in self.locations.items() if key[0] not in tgids}
        self.mappings = {key: id_ for key, id_ in self.mappings.items() if key[0] not in tgids}

    def other_location(self) -> int:
        """The location of the stacks a bounded profile left out (no
        address, no mapping: the function OTHER_STACKS)."""
        found = self.locations.get(_OTHER_KEY)
        if found is None:
            found = self.locations[_OTHER_KEY] = len(self.profile.location) + 1
            location = self.profile.location.add(id=found)
            location.line.add(function_id=self.function_id(OTHER_STACKS, ""))
        return found

    def location_id(self, tgid: int, address: int) -> int:
        key = (tgid, address)
        found = self.locations.get(key)
        if found is None:
            found = self.locations[key] = len(self.profile.location) + 1
            symbol = self.names.resolve(tgid, address)
            mapping = self.mapping_id(tgid, symbol)
            location = self.profile.location.add(id=found, address=address, mapping_id=mapping)
            if symbol is not None and symbol.function is not None:
                filename, line = _place(symbol.location)
                function = self.function_id(symbol.function, filename, symbol.system_name)
                location.line.add(function_id=function, line=line)
        return found


def _place(location: str | None) -> tuple[str, int]:
    if not location:
        return "", 0
    filename, _, line = location.rpartition(":")
    return (filename, int(line)) if line.isdigit() else (location, 0)


def profile_bytes(profile: Any) -> bytes:
    """The profile as its file holds it: gzipped, without a time in the header."""
    return gzip.compress(profile.SerializeToString(), mtime=0)


def write_profile(path: Path, profile: Any) -> None:
    write_file(path, profile_bytes(profile))


class _ProfileSink(FileAtEndSink):
    """A profile written to a file when the trace ends."""

    def profile(self, result: TraceResult) -> Any:
        """The Profile message, or None when the trace has nothing for it."""
        raise NotImplementedError

    def content(self, result: TraceResult) -> bytes | None:
        profile = self.profile(result)
        return None if profile is None else profile_bytes(profile)


class PprofSink(_ProfileSink):
    """``--pprof FILE``: allocations by call stack."""

    def profile(self, result: TraceResult) -> Any:
        if result.allocations is None:
            return None
        allocs = result.allocations
        return build_profile(allocs, result.frame_names, int(result.duration_s * 1e9),
                             ["mtrace-live: allocations by call stack",
                              *allocs.allocator_lines()])  # fmt: skip


class ContentionSink(_ProfileSink):
    """``--pprof-mutex FILE``: lock waits by the waiting thread's stack."""

    def profile(self, result: TraceResult) -> Any:
        if result.lock_waits is None:
            return None
        waits = result.lock_waits
        comment = f"mtrace-live: waits in {waits.function}, by the waiting thread's stack"
        return build_contention_profile(waits, result.frame_names, int(result.duration_s * 1e9),
                                        [comment])  # fmt: skip
