"""A map of a program loaded from the cache, as a table of ctypes keys and
values, made without bcc.

bcc describes each map's key and value types in JSON as it compiles (a
C type's name, or ``[name, fields, "struct_packed"]`` with fields
``[name, type]``, ``[name, type, [count]]``, ``[name, type, bits]`` or a
nested aggregate's own description); the cache keeps those
descriptions (tracer/bpf/bpf_cache.py). ``decode_type`` makes the same
ctypes types from them that bcc makes, and ``Table`` reads and writes the
map through the project's own system calls with the part of bcc's table
interface the tracer uses: ``Key`` and ``Leaf``, lookups, updates and
deletes by key (an array's by index), ``items()``, ``len()``, ``map_fd``
and ``max_entries``; a per-CPU map's ``sLeaf`` and ``total_cpu``. So a
warm start never loads bcc, whose library brings LLVM and clang with it.

``MappedArray``: an array the program made mmapable, read as memory;
``write_mapped``: a run of rows written into one so.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from mtrace_live.tracer.bpf import bpf_syscalls

if TYPE_CHECKING:
    import numpy as np

# enum bpf_map_type
HASH, ARRAY, PROG_ARRAY, PERCPU_HASH, PERCPU_ARRAY, LRU_HASH, LRU_PERCPU_HASH = 1, 2, 3, 5, 6, 9, 10
_ARRAYS = frozenset({ARRAY, PROG_ARRAY, PERCPU_ARRAY})
_PER_CPU = frozenset({PERCPU_HASH, PERCPU_ARRAY, LRU_PERCPU_HASH})
# the maps whose key and value sizes are their types' (a ring's are 0)
SIZED = frozenset({HASH, ARRAY, PROG_ARRAY, LRU_HASH, 7, *_PER_CPU})  # (7: a stack trace map)

# C type names as clang writes them in bcc's descriptions
C_TYPES: dict[str, Any] = {
    "_Bool": ctypes.c_bool,
    "char": ctypes.c_char,
    "unsigned char": ctypes.c_ubyte,
    "signed char": ctypes.c_byte,
    "short": ctypes.c_short,
    "unsigned short": ctypes.c_ushort,
    "int": ctypes.c_int,
    "unsigned int": ctypes.c_uint,
    "long": ctypes.c_long,
    "unsigned long": ctypes.c_ulong,
    "long long": ctypes.c_longlong,
    "unsigned long long": ctypes.c_ulonglong,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
    "__int128": ctypes.c_int64 * 2,
    "unsigned __int128": ctypes.c_uint64 * 2,
}
_AGGREGATES = {"struct": ctypes.Structure, "struct_packed": ctypes.Structure, "union": ctypes.Union}


class UnknownType(ValueError):
    """A type description this decoder does not know."""


def decode_type(desc: Any) -> Any:
    """The ctypes type of a bcc type description (UnknownType otherwise)."""
    if isinstance(desc, str):
        if desc not in C_TYPES:
            raise UnknownType(f"unknown C type {desc!r}")
        return C_TYPES[desc]
    if not isinstance(desc, list) or len(desc) < 2 or not isinstance(desc[1], list):
        raise UnknownType(f"unknown type description {desc!r}")
    kind = desc[2] if len(desc) > 2 else "struct"
    if kind not in _AGGREGATES:
        raise UnknownType(f"unknown aggregate {kind!r}")
    fields: list[tuple[Any, ...]] = []
    anonymous: list[str] = []
    for field in desc[1]:
        if not isinstance(field, list) or len(field) not in (2, 3):
            raise UnknownType(f"unknown field description {field!r}")
        name = field[0]
        if len(field) == 2:
            fields.append((name, decode_type(field[1])))
        elif isinstance(field[2], list) and len(field[2]) == 1:  # an array: [count]
            fields.append((name, decode_type(field[1]) * int(field[2][0])))
        elif isinstance(field[2], int):  # a bit field
            fields.append((name, decode_type(field[1]), field[2]))
        elif field[2] in _AGGREGATES:  # a nested struct or union, named or not
            if name == "":
                name = f"__anon{len(anonymous)}"
                anonymous.append(name)
            fields.append((name, decode_type(field)))
        else:
            raise UnknownType(f"unknown field description {field!r}")
    namespace: dict[str, Any] = {"_fields_": fields, "_anonymous_": anonymous}
    if kind == "struct_packed":
        namespace["_pack_"] = 1
    return type(str(desc[0]), (_AGGREGATES[kind],), namespace)


@functools.cache
def possible_cpu_count() -> int:
    """How many CPUs the kernel keeps a per-CPU map's value for."""
    from mtrace_live.exporters.kmemtrace.abi import possible_cpus

    return len(possible_cpus())


class Table:
    """One map, by its descriptor: bcc's table interface, on bpf(2)."""

    def __init__(self, map_fd: int, kind: int, max_entries: int, key: Any, leaf: Any) -> None:
        self.map_fd, self.ttype, self.max_entries = map_fd, kind, max_entries
        self.Key, self.Leaf = key, leaf
        self._array = kind in _ARRAYS
        self._widened = False  # a per-CPU u32 or int kept in 8 bytes a CPU
        if kind in _PER_CPU:
            self.sLeaf, self.total_cpu = leaf, possible_cpu_count()
            if ctypes.sizeof(leaf) % 8 == 0:
                self.Leaf = leaf * self.total_cpu
            elif leaf in (ctypes.c_uint, ctypes.c_int):
                wide = ctypes.c_uint64 if leaf is ctypes.c_uint else ctypes.c_int64
                self.Leaf, self._widened = wide * self.total_cpu, True
            else:
                raise UnknownType("a per-CPU value must be 8-byte aligned")

    def _key(self, key: Any) -> Any:
        if not self._array:
            return key
        if isinstance(key, int):
            key = self.Key(key + self.max_entries if key < 0 else key)
        if not isinstance(key, ctypes._SimpleCData):
            raise IndexError("an array's index must be an integer")
        if not 0 <= key.value < self.max_entries:
            raise IndexError("array index out of range")
        return key

    def __getitem__(self, key: Any) -> Any:
        key = self._key(key)
        leaf = self.Leaf()
        if not bpf_syscalls.lookup_into(self.map_fd, key, leaf):
            raise KeyError(key)
        if self._widened:
            narrow = (self.sLeaf * self.total_cpu)()
            for cpu in range(self.total_cpu):
                narrow[cpu] = leaf[cpu]
            return narrow
        return leaf

    def __setitem__(self, key: Any, leaf: Any) -> None:
        key = self._key(key)
        if self.ttype == PROG_ARRAY and hasattr(leaf, "fd"):  # a loaded program
            leaf = leaf.fd
        if isinstance(leaf, int):
            leaf = self.Leaf(leaf)
        if not bpf_syscalls.update_from(self.map_fd, key, leaf):
            error = ctypes.get_errno()
            raise OSError(error, f"cannot update map: {os.strerror(error)}")

    def __delitem__(self, key: Any) -> None:
        key = self._key(key)
        if self._array and self.ttype != PROG_ARRAY:  # an array's entries are zeroed
            self[key] = self.Leaf()
        elif not bpf_syscalls.delete_at(self.map_fd, key):
            raise KeyError(key)

    def __contains__(self, key: Any) -> bool:
        try:
            self[key]
        except (KeyError, IndexError):
            return False
        return True

    def __len__(self) -> int:
        if self._array:
            return self.max_entries
        return sum(1 for _ in self.keys())

    def keys(self) -> Iterator[Any]:
        if self._array:
            yield from (self.Key(index) for index in range(self.max_entries))
            return
        key = None
        while True:
            following = self.Key()
            if not bpf_syscalls.next_key_into(self.map_fd, key, following):
                return
            yield following
            key = following

    def __iter__(self) -> Iterator[Any]:
        return self.keys()

    def items(self) -> list[tuple[Any, Any]]:
        """Each (key, value); an entry deleted meanwhile is left out."""
        found = []
        for key in self.keys():
            try:
                found.append((key, self[key]))
            except KeyError:
                continue
        return found


class MappedArray:
    """An array map made BPF_F_MMAPABLE, mapped into this process's memory
    (read-only): read whole with a copy of memory, where a batched read
    costs the kernel a lookup a row (0.22 s for 524,288 rows of 80 bytes)."""

    def __init__(self, mapped: mmap.mmap, entries: int, rows: np.dtype) -> None:
        self._mapped, self._entries, self._rows = mapped, entries, rows

    @classmethod
    def of(cls, map_fd: int, max_entries: int, value_size: int,
           dtype: Any) -> MappedArray | None:  # fmt: skip
        """The array's rows of ``dtype``, mapped; None where the map cannot
        be (not made mmapable), or where ``dtype`` is not the map's value of
        ``value_size`` bytes (a multiple of 8: the kernel pads the others)."""
        import numpy as np

        rows = np.dtype(dtype)
        size = max_entries * rows.itemsize
        if rows.itemsize != value_size or value_size % 8 or not size:
            return None
        try:
            mapped = mmap.mmap(map_fd, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE, mmap.MAP_SHARED,
                               mmap.PROT_READ)  # fmt: skip
        except (OSError, ValueError):
            return None
        return cls(mapped, max_entries, rows)

    def copy(self, unused: tuple[str, Sequence[int]] | None = None) -> np.ndarray:
        """The rows now; with ``unused`` (a field, and its values in a row
        not in use), only the rows in use. A row may change while it is
        copied: the caller checks what it reads."""
        import numpy as np

        view = np.frombuffer(self._mapped, dtype=self._rows, count=self._entries)
        if unused is None:
            return np.array(view)
        field, values = unused
        # the field read once, in one pass over the mapping, then compared
        # value by value (np.isin took 9 ms over 524,288 rows, this 2.4)
        column = np.ascontiguousarray(view[field])
        in_use = np.ones(len(column), dtype=bool)
        for value in values:
            in_use &= column != value
        used: np.ndarray = view[in_use]  # (a mask indexes a copy)
        return used

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # (a copy being made: unmapped at exit)
            self._mapped.close()


def slot_size(value_size: int) -> int:
    """The bytes an array map keeps a value of ``value_size`` in: whole 8-byte units."""
    return -(-value_size // 8) * 8


def slots(values: np.ndarray) -> bytes:
    """``values`` laid out as an array map's memory holds them, each in a
    slot of ``slot_size`` bytes (the input of ``write_mapped``)."""
    import numpy as np

    size = values.dtype.itemsize
    if slot_size(size) == size:
        return np.ascontiguousarray(values).tobytes()
    pad = f"V{slot_size(size) - size}"
    padded = np.zeros(len(values), dtype=[("value", values.dtype), ("pad", pad)])
    padded["value"] = values
    return padded.tobytes()


def write_mapped(map_fd: int, first: int, data: bytes | memoryview, value_size: int) -> None:
    """``data`` (a run of the array's values of ``value_size`` bytes, each
    in its slot as ``slots`` lays them out) written at indexes ``first``...
    of an array made BPF_F_MMAPABLE, through a shared mapping of just the
    pages they fall in: one copy of memory, with no numpy, where a batched
    update costs the kernel an update a row (5 to 6 ms for a libc's 31,000
    rows and their page index). Where the array cannot be mapped so, by
    BPF_MAP_UPDATE_BATCH. OSError with the kernel's errno when it refuses."""
    slot = slot_size(value_size)
    count, partial = divmod(len(data), slot)
    if partial:
        raise ValueError(f"{len(data)} bytes are no whole number of {slot}-byte slots")
    if count == 0:
        return
    start = first * slot
    offset = start - start % mmap.PAGESIZE
    try:
        window = mmap.mmap(map_fd, start + count * slot - offset, mmap.MAP_SHARED,
                           mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)  # fmt: skip
    except (OSError, ValueError):
        view = memoryview(data)
        packed = view if slot == value_size else b"".join(
            view[i : i + value_size] for i in range(0, count * slot, slot))  # fmt: skip
        bpf_syscalls.update_array(map_fd, first, packed, count)
        return
    try:
        window[start - offset : start - offset + count * slot] = data
    finally:
        window.close()
