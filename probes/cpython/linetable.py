"""The line of an instruction, from a code object's location table
(``co_linetable``, CPython 3.11 and later; the format is
Objects/locations.md in CPython's sources, the codes
``_PyCodeLocationInfoKind`` in Include/cpython/code.h).

The table is a run of entries, each for 1 to 8 code units. An entry's first
byte has bit 7 set, a 4-bit code in bits 3-6 and the number of code units
less one in bits 0-2; the bytes after it, up to the next byte with bit 7 set,
are the code's data. The codes, as far as lines go:

* 15: no location (the line is None); the running line stays;
* 14 (long form) and 13 (no columns): the line moves by a signed varint;
* 10, 11, 12 (one line): the line moves by 0, 1, 2;
* 0 to 9 (short forms): the same line.

A varint is 6-bit chunks, the least significant first, bit 6 set in each
chunk but the last; a signed varint is ``v >> 1``, negated when ``v & 1``.
The running line starts at ``co_firstlineno``.
"""

from __future__ import annotations

NO_LOCATION = 15
LONG = 14
NO_COLUMNS = 13
ONE_LINE_0 = 10
ONE_LINE_2 = 12


def line_of(linetable: bytes, firstlineno: int, offset_units: int) -> int | None:
    """The line of the instruction at ``offset_units`` code units into the
    code (what ``frame.f_lineno`` says of a frame there): None for an
    instruction with no line, past the table, or in a damaged table. An
    offset below 0 (a frame that has not run its first instruction) is on
    the first line, as CPython has it."""
    if offset_units < 0:
        return firstlineno
    line = firstlineno
    start = 0
    at = 0
    try:
        while at < len(linetable):
            header = linetable[at]
            if not header & 0x80:
                return None
            code = header >> 3 & 15
            end = start + (header & 7) + 1
            at += 1
            if code in (LONG, NO_COLUMNS):
                delta, at = _signed_varint(linetable, at)
                line += delta
            elif ONE_LINE_0 <= code <= ONE_LINE_2:
                line += code - ONE_LINE_0
            if start <= offset_units < end:
                return None if code == NO_LOCATION else line
            start = end
            while at < len(linetable) and not linetable[at] & 0x80:
                at += 1
    except IndexError:
        return None  # a varint cut off
    return None


def _signed_varint(data: bytes, at: int) -> tuple[int, int]:
    """The signed varint at ``at``, and where the data after it starts."""
    byte = data[at]
    at += 1
    value = byte & 63
    shift = 0
    while byte & 64:
        byte = data[at]
        at += 1
        shift += 6
        value |= (byte & 63) << shift
    return (-(value >> 1) if value & 1 else value >> 1), at
