"""probes/bpf/records.h is the one definition of the records C and Python
share: each struct's fields, in order, at the offsets and sizes of the numpy
dtypes in probes/records.py, and each enum's enumerators equal to the Python
enum's members. The header is parsed with pycparser (after the C
preprocessor), and the offsets are also asserted to gcc itself."""

from __future__ import annotations

import subprocess
from enum import IntEnum
from pathlib import Path

import numpy as np
import pytest
from mtrace_live.probes import records
from mtrace_live.probes.elf import cfi
from mtrace_live.probes.locations import ArgKind
from mtrace_live.tracer.unwind import file_server, unwind_rows, unwind_tables
from mtrace_live.tracer.unwind import python as python_frames
from pycparser import c_ast, parse_file

# The kernel's fixed-width types, as bcc's headers define them.
TYPES = {"u8": ("unsigned char", 1), "u16": ("unsigned short", 2), "u32": ("unsigned int", 4),
         "u64": ("unsigned long long", 8), "s16": ("short", 2), "s32": ("int", 4),
         "char": ("char", 1)}  # fmt: skip
CPP_ARGS = ["-E", *(f"-D{name}={c}" for name, (c, _) in TYPES.items() if name != "char")]

# enum in records.h -> (Python enum, prefix of its enumerators, renamed members)
ENUMS: dict[str, tuple[type[IntEnum], str, dict[str, str]]] = {
    "event_kind": (records.EventKind, "EV_", {}),
    "kmem_event": (records.KmemEvent, "KM_", {}),
    "kmem_type": (records.KmemType, "KT_", {}),
    "kmem_misc": (records.KmemMisc, "KX_", {}),
    "alloc_fn": (records.AllocFn, "AF_", {}),
    "alloc_arg": (records.AllocArg, "AA_", {}),
    "alloc_misc": (records.AllocMisc, "AX_", {}),
    "site_reg": (records.SiteReg, "SR_", {}),
    "lock_misc": (records.LockMisc, "LX_", {}),
    "unwind_misc": (records.UnwindMisc, "UX_", {}),
    "hold_count": (records.HoldCount, "HC_", {}),
    "unwind_cfa": (cfi.Cfa, "UC_", {}),
    "unwind_rbp": (cfi.Rbp, "UR_", {}),
    "arg_kind": (ArgKind, "ARG_", {"NONE": "UNREADABLE"}),
}

# #define in records.h -> the Python constant that must equal it
DEFINES = {
    "ALLOC_FRAMES_BASE": records.ALLOC_FRAMES_BASE,
    "MAX_ARGS": records.MAX_ARGS,
    "SITE_REG_SHIFT": records.SITE_REG_SHIFT,
    "SITE_REG_BITS": records.SITE_REG_BITS,
    "SITE_PROVIDER_SHIFT": records.SITE_PROVIDER_SHIFT,
}


class Field:
    def __init__(
        self, name: str, type_name: str, count: int, size: int = 0, align: int = 0
    ) -> None:
        """A scalar of TYPES, or (with ``size`` and ``align``) a struct field."""
        self.name, self.type_name, self.count = name, type_name, count
        self.size = (size or TYPES[type_name][1]) * count
        self.align = align or TYPES[type_name][1]


@pytest.fixture(scope="module")
def header() -> c_ast.FileAST:
    path = records.header_path()
    assert path.is_file()
    return parse_file(str(path), use_cpp=True, cpp_path="gcc", cpp_args=CPP_ARGS)


def structs(ast: c_ast.FileAST) -> dict[str, list[Field]]:
    found: dict[str, list[Field]] = {}
    for node in ast.ext:
        kind = getattr(node, "type", None)
        if isinstance(kind, c_ast.Struct) and kind.decls:
            found[kind.name] = [_field(decl, found) for decl in kind.decls]
    return found


def _field(decl: c_ast.Decl, earlier: dict[str, list[Field]]) -> Field:
    count = 1
    kind = decl.type
    if isinstance(kind, c_ast.ArrayDecl):
        count = int(kind.dim.value)
        kind = kind.type
    if isinstance(kind.type, c_ast.Struct):  # a struct defined before, embedded
        inner = earlier[kind.type.name]
        _, size = layout(inner)
        return Field(decl.name, kind.type.name, count, size, max(f.align for f in inner))
    names = kind.type.names
    # after the preprocessor, "u64" reads "unsigned long long": map it back
    spelled = " ".join(names)
    type_name = next(name for name, (c, _) in TYPES.items() if c == spelled or name == spelled)
    return Field(decl.name, type_name, count)


def layout(fields: list[Field]) -> tuple[dict[str, tuple[int, int]], int]:
    """Each field's (offset, size) by C's natural alignment, and the struct's size."""
    offset, align, out = 0, 1, {}
    for field in fields:
        offset = -(-offset // field.align) * field.align
        out[field.name] = (offset, field.size)
        offset += field.size
        align = max(align, field.align)
    return out, -(-offset // align) * align


def dtype_layout(dtype: np.dtype) -> dict[str, tuple[int, int]]:
    assert dtype.fields is not None
    return {name: (offset, sub.itemsize) for name, (sub, offset) in dtype.fields.items()}


def enums(ast: c_ast.FileAST) -> dict[str, dict[str, int]]:
    found: dict[str, dict[str, int]] = {}
    for node in ast.ext:
        kind = getattr(node, "type", None)
        if isinstance(kind, c_ast.Enum) and kind.values:
            value, members = -1, {}
            for item in kind.values.enumerators:
                value = int(item.value.value) if item.value is not None else value + 1
                members[item.name] = value
            found[kind.name] = members
    return found


def test_every_shared_struct_has_a_dtype_with_its_fields_offsets_and_sizes(
    header: c_ast.FileAST,
) -> None:
    # GIVEN the structs the header defines
    defined = structs(header)
    # THEN they are exactly the ones probes/records.py lays out
    assert set(defined) == set(records.LAYOUTS)
    for name, dtype in records.LAYOUTS.items():
        fields, size = layout(defined[name])
        # each field in the same order, at the same offset, of the same size
        assert list(fields) == list(dtype.names or ()), name
        assert fields == dtype_layout(dtype), name
        assert size == dtype.itemsize, name
    assert records.EVENT_DTYPE["args"].shape == (records.MAX_ARGS,)


def test_every_enum_matches_its_python_enum(header: c_ast.FileAST) -> None:
    defined = enums(header)
    assert set(defined) == set(ENUMS)
    for name, (python, prefix, renamed) in ENUMS.items():
        members = {
            renamed.get(c_name[len(prefix) :], c_name[len(prefix) :]): value
            for c_name, value in defined[name].items()
            if c_name != f"{prefix}COUNT"
        }
        assert members == {member.name: member.value for member in python}, name
        count = defined[name].get(f"{prefix}COUNT")
        if count is not None:
            assert count == len(python), name
    kmem_events = [m[3:].lower() for m in defined["kmem_event"] if m != "KM_COUNT"]
    assert list(records.KMEM_EVENTS) == kmem_events


def test_gcc_agrees_with_the_dtypes_and_constants(tmp_path: Path) -> None:
    # GIVEN a C file that asserts every dtype offset and size to the compiler
    lines = ["#include <stddef.h>", *(f"typedef {c} {n};" for n, (c, _) in TYPES.items()
             if n != "char"), f'#include "{records.header_path()}"']  # fmt: skip
    for name, dtype in records.LAYOUTS.items():
        lines.append(f'_Static_assert(sizeof(struct {name}) == {dtype.itemsize}, "{name}");')
        for field, (offset, size) in dtype_layout(dtype).items():
            lines.append(
                f'_Static_assert(offsetof(struct {name}, {field}) == {offset}, "{name}.{field}");'
                f'_Static_assert(sizeof(((struct {name} *)0)->{field}) == {size}, "{field}");'
            )
    lines += [f'_Static_assert({name} == {value}, "{name}");' for name, value in DEFINES.items()]
    source = tmp_path / "layout.c"
    source.write_text("\n".join(lines) + "\n")
    # WHEN gcc compiles it, THEN every assertion holds
    done = subprocess.run(["gcc", "-fsyntax-only", str(source)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_changed_field_is_seen() -> None:
    # GIVEN a struct whose first field is 4 bytes wide where the dtype has 8
    fields = [Field("tgid", "u32", 1), Field("ts", "u64", 1), Field("cpu", "u16", 1)]
    offsets, size = layout(fields)
    # THEN the C layout pads it, and it differs from the dtype's
    assert offsets == {"tgid": (0, 4), "ts": (8, 8), "cpu": (16, 2)} and size == 24
    dtype = np.dtype([("tgid", "<u8"), ("ts", "<u8"), ("cpu", "<u2")])
    assert offsets != dtype_layout(dtype)


def test_the_values_written_and_read_as_raw_bytes_have_their_dtypes_layouts() -> None:
    # GIVEN the values the trace writes before its line with struct, not
    # numpy (tracer/unwind), and the asks the file server reads so: a value
    # for each field, distinct from every other
    def filled(dtype: np.dtype) -> list[int]:
        """A distinct value that fits each scalar of ``dtype`` (arrays flattened)."""
        values = []
        for name in dtype.names or ():
            base, shape = dtype[name].base, dtype[name].shape
            for _ in range(int(np.prod(shape)) if shape else 1):
                values.append((len(values) + 1) % (1 << (8 * base.itemsize - 1)))
        return values

    def fields_of(raw: bytes, dtype: np.dtype) -> list[int]:
        (record,) = np.frombuffer(raw, dtype=dtype)
        return [int(v) for name in dtype.names or () for v in np.ravel(record[name])]

    # WHEN each is packed with its struct and read back with its dtype
    packed = {
        "unwind_file": (unwind_rows._FILE, records.UNWIND_FILE_DTYPE),
        "unwind_file_key": (unwind_rows._FILE_KEY, records.UNWIND_FILE_KEY_DTYPE),
        "unwind_map": (unwind_tables._MAP_ENTRY, records.UNWIND_MAP_DTYPE),
    }
    for name, (layout_struct, dtype) in packed.items():
        values = filled(dtype)
        # THEN every field is where the dtype (and so records.h) has it
        assert layout_struct.size == dtype.itemsize, name
        assert fields_of(layout_struct.pack(*values), dtype) == values, name
    # (the rows' and page entries' sizes the file server writes with)
    assert (cfi.ROW.itemsize, 4) == (unwind_rows.ROW_SIZE, unwind_rows.PAGE_SIZE)
    # (python_procs' value: its trailing pad is the struct's own zeros)
    values = filled(records.PYTHON_PROC_DTYPE)[:-7]
    raw = python_frames._PYTHON_PROC.pack(*values)
    assert len(raw) == records.PYTHON_PROC_DTYPE.itemsize
    assert fields_of(raw, records.PYTHON_PROC_DTYPE) == [*values, *[0] * 7]
    # AND an ask written as struct event gives the server its tgid and args
    event = np.zeros(1, dtype=records.EVENT_DTYPE)
    event["tgid"], event["args"], event["tid"], event["ustack"] = 4321, [[1, 2, 3, 4, 5, 6]], 9, -1
    tgid, *args = file_server._ASK.unpack(event.tobytes())
    assert (tgid, args) == (4321, [1, 2, 3, 4, 5, 6])
