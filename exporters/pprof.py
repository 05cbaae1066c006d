"""Allocations by call stack as a pprof profile (``--pprof FILE``), and lock
waits by call stack as a contention profile (``--pprof-mutex FILE``).

The profile is the gzipped protocol buffer of google/pprof's profile.proto,
which ``go tool pprof``, Pyroscope and Parca read. Its four sample types are
those of a Go heap profile: ``alloc_objects`` and ``alloc_space`` (count and
bytes allocated since the trace began) and ``inuse_objects`` and
``inuse_space`` (still allocated at its end); inuse_space is the default.
With sampling the values are the estimates (exporters/data/alloc_snapshot.py)
and ``period`` is the mean sampling interval in bytes.

The profile is written by the one encoder here, straight to protobuf's
wire format from profile.proto's field numbers: no message objects, no
generated code. serve's profiles (HeapEncoder) keep its tables and each
stack's encoded prefix from one profile to the next and encode the values
as arrays; a profile written once is the same encoder used once. The
tests read what it writes with protobuf's parser and go tool pprof.

Each sample is one (process, allocating function, stack) row; its first
location is the call site (the function that called malloc), then its
callers, as pprof wants the leaf first. Locations carry the function and
file:line (from the symbols and DWARF line tables), and the mapping of the
module holding them; each sample has ``pid`` and ``allocator`` labels. A
frame in JIT code is in a mapping named ``[jit]`` (the anonymous mapping's
span), its function the name the process's perf map gives it.

The contention profile is the one Go's ``/debug/pprof/mutex`` serves: two
sample types, ``contentions`` (count) and ``delay`` (nanoseconds), a period
of one contention; a sample per (process, lock, stack of the waiting
thread), labelled ``pid`` and ``lock`` (main, arena, other, unknown), whose
first location is the code that waited.
"""

from __future__ import annotations

import gzip
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from .data.alloc_snapshot import AllocSnapshot, FrameNames, StackCatalog, StackColumns, StackRow
from .data.lock_waits import LockWaits
from .data.sink import FileAtEndSink, TraceResult
from .data.symbolize import Symbol


# profile.proto (google/pprof, package perftools.profiles): the field numbers
# of the messages written, as the wire carries them.
class _Profile:
    SAMPLE_TYPE, SAMPLE, MAPPING, LOCATION, FUNCTION, STRING_TABLE = 1, 2, 3, 4, 5, 6
    TIME_NANOS, DURATION_NANOS, PERIOD_TYPE, PERIOD = 9, 10, 11, 12
    COMMENT, DEFAULT_SAMPLE_TYPE = 13, 14


class _ValueType:
    TYPE, UNIT = 1, 2


class _Sample:
    LOCATION_ID, VALUE, LABEL = 1, 2, 3


class _Label:
    KEY, STR, NUM = 1, 2, 3


class _Mapping:
    ID, MEMORY_START, MEMORY_LIMIT, FILENAME, BUILD_ID = 1, 2, 3, 5, 6
    HAS_FUNCTIONS, HAS_FILENAMES, HAS_LINE_NUMBERS = 7, 8, 9


class _Location:
    ID, MAPPING_ID, ADDRESS, LINE = 1, 2, 3, 4


class _Line:
    FUNCTION_ID, LINE = 1, 2


class _Function:
    ID, NAME, SYSTEM_NAME, FILENAME = 1, 2, 3, 4


SAMPLE_TYPES = (("alloc_objects", "count"), ("alloc_space", "bytes"),
                ("inuse_objects", "count"), ("inuse_space", "bytes"))  # fmt: skip
CONTENTION_TYPES = (("contentions", "count"), ("delay", "nanoseconds"))

_LENGTH_DELIMITED = 2  # the wire type of a message, a string and packed numbers
# the varints of 0 to 2**14 - 1 (one or two bytes): ids and string indices
_SMALL = [bytes([n]) for n in range(0x80)] + [bytes([n & 0x7F | 0x80, n >> 7])
                                              for n in range(0x80, 0x4000)]  # fmt: skip


def _varint(number: int) -> bytes:
    """A protobuf varint (an int64 below 0 as its 64-bit two's complement)."""
    if 0 <= number < 0x4000:
        return _SMALL[number]
    if number < 0:
        number += 1 << 64
    out = bytearray()
    while number >= 0x80:
        out.append(number & 0x7F | 0x80)
        number >>= 7
    out.append(number)
    return bytes(out)


def _tag(number: int) -> bytes:
    """The key of a length-delimited field."""
    return _varint(number << 3 | _LENGTH_DELIMITED)


_TAGS = [_tag(number) for number in range(16)]  # a length-delimited field's key, by number


def _framed(number: int, payload: bytes) -> bytes:
    """A length-delimited field: a message, a string or packed numbers."""
    return _TAGS[number] + _varint(len(payload)) + payload


_KEYS = [_varint(number << 3) for number in range(16)]  # a varint field's key, by number


def _numbers(*fields: tuple[int, int]) -> bytes:
    """Varint fields (number, value), each of value 0 left out as proto3
    leaves its defaults out."""
    out: list[bytes] = []
    for number, value in fields:
        if value:
            out += (_KEYS[number], _varint(value))
    return b"".join(out)


def _packed(number: int, values: Iterable[int]) -> bytes:
    """A repeated number field, packed (proto3's encoding of one)."""
    payload = b"".join(map(_varint, values))
    return _framed(number, payload) if payload else b""


def _label(key: int, text: int = 0, num: int = 0) -> bytes:
    """A Sample's label, a string (``text``, its index) or a number."""
    fields = _numbers((_Label.KEY, key), (_Label.STR, text), (_Label.NUM, num))
    return _framed(_Sample.LABEL, fields)


class _Strings:
    def __init__(self) -> None:
        self.table: list[str] = [""]
        self.index: dict[str, int] = {"": 0}
        self._encoded: list[bytes] = []  # the table's entries encoded so far

    def __call__(self, text: str) -> int:
        found = self.index.get(text)
        if found is None:
            found = self.index[text] = len(self.table)
            self.table.append(text)
        return found

    def encoded(self) -> list[bytes]:
        """The table as Profile's string_table fields, each encoded once."""
        for text in self.table[len(self._encoded) :]:
            self._encoded.append(_framed(_Profile.STRING_TABLE, text.encode()))
        return self._encoded


def _profile_fields(strings: _Strings, types: Sequence[tuple[str, str]], default: str,
                    period: tuple[str, str, int], time_ns: int, duration_ns: int,
                    comments: Sequence[str]) -> tuple[bytes, list[bytes]]:  # fmt: skip
    """A Profile's fields but its samples and tables, and the string-table
    entries of its comments, which follow the whole of ``strings``' table
    (and are not added to it: they change from one profile to the next)."""

    def value_type(kind: str, unit: str) -> bytes:
        return _numbers((_ValueType.TYPE, strings(kind)), (_ValueType.UNIT, strings(unit)))

    kind, unit, every = period
    head = [_framed(_Profile.SAMPLE_TYPE, value_type(*pair)) for pair in types]
    head.append(_framed(_Profile.PERIOD_TYPE, value_type(kind, unit)))
    head.append(_numbers((_Profile.DEFAULT_SAMPLE_TYPE, strings(default)),
                         (_Profile.PERIOD, every), (_Profile.TIME_NANOS, time_ns),
                         (_Profile.DURATION_NANOS, duration_ns)))  # fmt: skip
    first = len(strings.table)
    head.append(_packed(_Profile.COMMENT, range(first, first + len(comments))))
    return b"".join(head), [_framed(_Profile.STRING_TABLE, text.encode()) for text in comments]


def _gzipped(pieces: Iterable[bytes], level: int) -> bytes:
    """A profile's fields as its file holds them: gzipped, no time in the gzip header."""
    return gzip.compress(b"".join(pieces), compresslevel=level, mtime=0)


Labels = Callable[[int], Sequence[tuple[str, str]]]  # a process's string labels


def _no_labels(tgid: int) -> Sequence[tuple[str, str]]:
    return ()


def build_profile(snapshot: AllocSnapshot, names: FrameNames, duration_ns: int = 0,
                  comments: Sequence[str] = (), default: str = "inuse_space",
                  labels: Labels | None = None) -> bytes:  # fmt: skip
    """The profile of ``snapshot``, gzipped, as its file holds it, dated at
    the trace's start; ``labels`` gives a process's string labels beside
    ``pid``, ``allocator`` (the allocating function), ``provider`` and
    ``provider_lib``."""
    return HeapEncoder(names).encode(snapshot.stacks, labels or _no_labels, snapshot.sample_bytes,
                                     default, duration_ns, comments,
                                     time_ns=time.time_ns() - duration_ns, level=9)  # fmt: skip


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
        self.tables = _Tables(self.strings, self.names)
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
        if self.tables.count[_Profile.LOCATION] > 4 * kept + 100_000:
            self._start()

    def encode(self, rows: Sequence[StackRow], labels: Labels, sample_bytes: int,
               default: str, duration_ns: int, comments: Sequence[str],
               others: Mapping[int, Sequence[int]] | None = None,
               time_ns: int | None = None, level: int = 1) -> bytes:  # fmt: skip
        """The gzipped profile of ``rows``; ``others``: a process's stacks
        left out, summed (its four values), as one sample at the function
        OTHER_STACKS. Dated ``time_ns`` (now if not given): serve dates a
        profile when it read the tables, a delta at its end, as Go dates
        its second reading."""
        samples = self._samples(StackColumns.of(rows), labels)
        samples += self._other_samples(others or {}, labels)
        header, notes = _profile_fields(self.strings, SAMPLE_TYPES, default,
                                        ("space", "bytes", sample_bytes or 1),
                                        time.time_ns() if time_ns is None else time_ns,
                                        duration_ns, comments)  # fmt: skip
        return _gzipped([header, self.tables.encoded(), *samples, *self.strings.encoded(), *notes],
                        level)  # fmt: skip

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
        location = _framed(_Sample.LOCATION_ID, self.tables.other_location())
        return [_framed(_Profile.SAMPLE, location + _packed(_Sample.VALUE, map(int, values))
                        + self._labels_encoded(tgid, (), labels))
                for tgid, values in sorted(others.items())]  # fmt: skip

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
        """A Sample's location ids of ``frames``, encoded."""
        return self.tables.location_ids(tgid, frames)

    def _labels_encoded(self, tgid: int, function: tuple[str, ...], labels: Labels) -> bytes:
        """A Sample's labels: its process's and its allocating function's
        (the function, then the provider and its file, when told), encoded."""
        named = [*zip(("allocator", "provider", "provider_lib"), function, strict=False),
                 *labels(tgid)]  # fmt: skip
        return _label(self.strings("pid"), num=tgid) + b"".join(
            _label(self.strings(key), self.strings(value)) for key, value in named if value
        )


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
    value_tag = np.full(rows, _TAGS[_Sample.VALUE][0])
    value_heads = np.column_stack([value_tag, packed_lengths]).astype(np.uint8)
    flat, begins = _joined_rows([
        (np.full(rows, _TAGS[_Profile.SAMPLE][0], np.uint8), ones), (length, length_widths),
        (value_heads.reshape(-1), 2 * ones), (packed, packed_lengths),
    ])  # fmt: skip
    return flat.tobytes(), begins + 1 + length_widths


def build_contention_profile(waits: LockWaits, names: FrameNames, duration_ns: int = 0,
                             comments: Sequence[str] = ()) -> bytes:  # fmt: skip
    """The contention profile of ``waits``' stacks, gzipped, as its file
    holds it, dated at the trace's start."""
    strings = _Strings()
    tables = _Tables(strings, names)
    pid_key, lock_key = strings("pid"), strings("lock")
    samples = [_framed(_Profile.SAMPLE, b"".join([
        tables.location_ids(row.pid, row.frames),
        _packed(_Sample.VALUE, [row.times.count, row.times.total_ns]),
        _label(pid_key, num=row.pid), _label(lock_key, strings(row.kind))]))
        for row in waits.stacks if row.times.count]  # fmt: skip
    header, notes = _profile_fields(strings, CONTENTION_TYPES, "delay",
                                    ("contentions", "count", 1), time.time_ns() - duration_ns,
                                    duration_ns, comments)  # fmt: skip
    return _gzipped([header, tables.encoded(), *samples, *strings.encoded(), *notes], 9)


class _Tables:
    """A profile's locations, functions and mappings, each added once and
    encoded as it is added, with the ids samples refer to them by."""

    def __init__(self, strings: _Strings, names: FrameNames) -> None:
        self.strings, self.names = strings, names
        self.locations: dict[tuple[int, int], bytes] = {}  # each one's id, as a varint
        self.functions: dict[tuple[str, str], int] = {}
        self.mappings: dict[tuple[int, str, tuple[int, int] | None], int] = {}
        # by Profile's field: each entry encoded, and how many there are
        self._encoded: dict[int, list[bytes]] = {
            _Profile.MAPPING: [], _Profile.LOCATION: [], _Profile.FUNCTION: []}  # fmt: skip
        self.count = {field: 0 for field in self._encoded}
        self._joined: tuple[tuple[int, ...], bytes] = ((), b"")

    def _add(self, field: int, payload: bytes) -> None:
        self._encoded[field].append(_framed(field, payload))

    def _next_id(self, field: int) -> int:
        self.count[field] += 1
        return self.count[field]

    def encoded(self) -> bytes:
        """The mappings, locations and functions, joined again only when added to."""
        sizes = tuple(self.count.values())
        if sizes != self._joined[0]:
            joined = b"".join(e for entries in self._encoded.values() for e in entries)
            self._joined = (sizes, joined)
        return self._joined[1]

    def mapping_id(self, tgid: int, symbol: Symbol | None) -> int:
        if symbol is None or symbol.span is None:
            return 0
        key = (tgid, symbol.module, symbol.span)  # (a file's frames may be of two kinds)
        found = self.mappings.get(key)
        if found is None:
            found = self.mappings[key] = self._next_id(_Profile.MAPPING)
            start, end = symbol.span
            located = int(symbol.location is not None)
            self._add(_Profile.MAPPING, _numbers(
                (_Mapping.ID, found), (_Mapping.MEMORY_START, start), (_Mapping.MEMORY_LIMIT, end),
                (_Mapping.FILENAME, self.strings(symbol.module)),
                (_Mapping.BUILD_ID, self.strings(symbol.build_id or "")),
                (_Mapping.HAS_FUNCTIONS, 1), (_Mapping.HAS_FILENAMES, located),
                (_Mapping.HAS_LINE_NUMBERS, located)))  # fmt: skip
        return found

    def function_id(self, name: str, filename: str, system_name: str | None = None) -> int:
        key = (name, filename)
        found = self.functions.get(key)
        if found is None:
            found = self.functions[key] = self._next_id(_Profile.FUNCTION)
            self._add(_Profile.FUNCTION, _numbers(
                (_Function.ID, found), (_Function.NAME, self.strings(name)),
                (_Function.SYSTEM_NAME, self.strings(system_name or name)),
                (_Function.FILENAME, self.strings(filename))))  # fmt: skip
        return found

    def forget(self, tgids: set[int]) -> None:
        """The processes' locations and mappings are not referred to again
        (a process that reuses a pid has its own)."""
        self.locations = {key: id_ for key, id_ in self.locations.items() if key[0] not in tgids}
        self.mappings = {key: id_ for key, id_ in self.mappings.items() if key[0] not in tgids}

    def other_location(self) -> bytes:
        """The location of the stacks a bounded profile left out (no
        address, no mapping: the function OTHER_STACKS): its id's varint."""
        found = self.locations.get(_OTHER_KEY)
        if found is None:
            number = self._next_id(_Profile.LOCATION)
            line = _numbers((_Line.FUNCTION_ID, self.function_id(OTHER_STACKS, "")))
            self._add(_Profile.LOCATION, _numbers((_Location.ID, number))
                      + _framed(_Location.LINE, line))  # fmt: skip
            found = self.locations[_OTHER_KEY] = _varint(number)
        return found

    def location_ids(self, tgid: int, frames: Sequence[int]) -> bytes:
        """A Sample's location ids, those of ``frames`` (leaf first), encoded."""
        found = self.locations
        ids = [found.get((tgid, a)) or self._location(tgid, a) for a in frames]
        return _framed(_Sample.LOCATION_ID, b"".join(ids)) if ids else b""

    def _location(self, tgid: int, address: int) -> bytes:
        """A location added: its id's varint."""
        number = self._next_id(_Profile.LOCATION)
        symbol = self.names.resolve(tgid, address)
        fields = _numbers((_Location.ID, number),
                          (_Location.MAPPING_ID, self.mapping_id(tgid, symbol)),
                          (_Location.ADDRESS, address))  # fmt: skip
        if symbol is not None and symbol.function is not None:
            filename, line = _place(symbol.location)
            function = self.function_id(symbol.function, filename, symbol.system_name)
            fields += _framed(_Location.LINE, _numbers((_Line.FUNCTION_ID, function),
                                                       (_Line.LINE, line)))  # fmt: skip
        self._add(_Profile.LOCATION, fields)
        found = self.locations[tgid, address] = _varint(number)
        return found


def _place(location: str | None) -> tuple[str, int]:
    if not location:
        return "", 0
    filename, _, line = location.rpartition(":")
    return (filename, int(line)) if line.isdigit() else (location, 0)


class PprofSink(FileAtEndSink):
    """``--pprof FILE``: allocations by call stack, written when the trace ends."""

    def content(self, result: TraceResult) -> bytes | None:
        if result.allocations is None:
            return None
        allocs = result.allocations
        return build_profile(allocs, result.frame_names, int(result.duration_s * 1e9),
                             ["mtrace-live: allocations by call stack",
                              *allocs.allocator_lines()])  # fmt: skip


class ContentionSink(FileAtEndSink):
    """``--pprof-mutex FILE``: lock waits by the waiting thread's stack,
    written when the trace ends."""

    def content(self, result: TraceResult) -> bytes | None:
        if result.lock_waits is None:
            return None
        waits = result.lock_waits
        comment = f"mtrace-live: waits in {waits.function}, by the waiting thread's stack"
        return build_contention_profile(waits, result.frame_names, int(result.duration_s * 1e9),
                                        [comment])  # fmt: skip
