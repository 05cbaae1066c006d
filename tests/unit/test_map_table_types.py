"""A cached program's map types, decoded without bcc
(tracer/bpf/map_table.py), are laid out as bcc's own decoder lays them out
(bcc.BPF._decode_table_type, the peer): each field's name, offset and size,
and the whole type's size, for every shape bcc's descriptions take."""

from __future__ import annotations

import ctypes
import json
from typing import Any

import pytest
from mtrace_live.tracer.bpf.map_table import UnknownType, decode_type

# descriptions as bcc wrote them for the trace program's maps (bpf_cache keeps them)
DESCRIPTIONS = [
    '"unsigned long long"',
    '"int"',
    '["proc_key", [["tgid","unsigned int"], ["probe","unsigned int"] ], "struct_packed"]',
    '["proc_hit", [["count","unsigned long long"], ["comm","char", [16]] ], "struct_packed"]',
    '["unwind_row", [["pc","unsigned int"], ["cfa_off","int"], ["rbp_off","short"], '
    '["cfa","unsigned char"], ["rbp","unsigned char"] ], "struct_packed"]',
    '["alloc_stack_row", [["tag","unsigned long long"], ["key",["alloc_key", '
    '[["call_site","unsigned long long"], ["tgid","unsigned int"], ["stack","int"], '
    '["fn","unsigned short"], ["provider","unsigned short"], ["__pad_1","char",[4]]], '
    '"struct_packed"]]], "struct_packed"]',
    '["grid", [["cells","unsigned int", [12]], ["flag","_Bool"]], "struct"]',
    '["bits", [["low","unsigned int", 3], ["high","unsigned int", 29]], "struct"]',
    '["either", [["word","unsigned long long"], ["bytes","unsigned char", [8]]], "union"]',
    '["outer", [["", [["a","int"], ["b","int"]], "struct"], ["c","long"]], "struct_packed"]',
    '["wide", [["v","unsigned __int128"], ["d","double"], ["l","long"]], "struct"]',
]


def layout(kind: Any) -> Any:
    """Size, and each field's (name, offset, size, layout of its type)."""
    if isinstance(kind, type) and issubclass(kind, ctypes.Array):
        return ("array", kind._length_, layout(kind._type_), ctypes.sizeof(kind))
    if isinstance(kind, type) and issubclass(kind, (ctypes.Structure, ctypes.Union)):
        fields = []
        for name, field_type, *bits in kind._fields_:
            described = getattr(kind, name)
            fields.append((name, described.offset, described.size, layout(field_type), bits))
        return (kind.__name__, ctypes.sizeof(kind), fields)
    return (ctypes.sizeof(kind), kind._type_)


@pytest.mark.parametrize("text", DESCRIPTIONS)
def test_a_type_is_laid_out_as_bccs_decoder_lays_it_out(text: str) -> None:
    import bcc  # (pure: bcc imports without root; make setup installs it)

    # GIVEN a type description as bcc writes it
    desc = json.loads(text)
    # WHEN it is decoded by mtrace-live and by bcc
    ours, theirs = decode_type(desc), bcc.BPF._decode_table_type(desc)
    # THEN both types have the same size and fields at the same places
    assert layout(ours) == layout(theirs)


@pytest.mark.parametrize("text", ['"unsigned whatever"', '["s", [["a"]], "struct"]',
                                  '["s", [["a","int"]], "class"]', '42'])  # fmt: skip
def test_a_description_it_does_not_know_is_refused(text: str) -> None:
    with pytest.raises(UnknownType):
        decode_type(json.loads(text))
