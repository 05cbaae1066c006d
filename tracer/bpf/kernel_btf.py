"""The running kernel's types, from its BTF (/sys/kernel/btf/vmlinux).

bcc 0.26 compiles against kernel headers and cannot relocate field
accesses (no CO-RE), so the raw tracepoint handlers of kmem.bpf.c get the
offsets they read as compile-time constants, looked up here. The BTF is
read through libbpf's own parser (``libbpf.so.1``, which bcc's library
depends on), with ctypes: loading and searching it takes a few
milliseconds.

Four facts are read:

- a tracepoint's arguments, in order, by name: the parameters of the
  kernel's ``trace_event_raw_event_<event>`` function (its first, ``__data``,
  is not an argument);
- a struct member's offset in bytes, through anonymous structs and unions;
- the id of a tracepoint's ``btf_trace_<event>`` type, for a BTF-typed
  tracepoint program;
- whether a function is there (a BPF helper's implementation).
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mtrace_live.probes.elf.facts import file_fact

VMLINUX = Path("/sys/kernel/btf/vmlinux")

# include/uapi/linux/btf.h
_KIND_STRUCT = 4
_KIND_UNION = 5
_KIND_TYPEDEF = 8
_KIND_FUNC = 12
_KIND_FUNC_PROTO = 13
_TYPE_HEADER = 12  # struct btf_type: name_off, info, size/type
_MEMBER = 12  # struct btf_member: name_off, type, offset
_PARAM = 8  # struct btf_param: name_off, type


class BtfUnavailable(Exception):
    """The kernel's BTF cannot be read; the message says why."""


def _library() -> ctypes.CDLL:
    import ctypes.util  # (only where no fact is kept: it imports subprocess and tempfile)

    name = ctypes.util.find_library("bpf") or "libbpf.so.1"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise BtfUnavailable(f"libbpf cannot be loaded ({exc})") from None
    lib.btf__load_vmlinux_btf.restype = ctypes.c_void_p
    lib.btf__load_vmlinux_btf.argtypes = []
    lib.btf__free.argtypes = [ctypes.c_void_p]
    lib.btf__free.restype = None
    lib.btf__find_by_name_kind.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32]
    lib.btf__find_by_name_kind.restype = ctypes.c_int32
    lib.btf__type_by_id.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.btf__type_by_id.restype = ctypes.c_void_p
    lib.btf__name_by_offset.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.btf__name_by_offset.restype = ctypes.c_char_p
    lib.btf__resolve_size.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.btf__resolve_size.restype = ctypes.c_int64
    return lib


@dataclass(frozen=True)
class _Type:
    name_off: int
    kind: int
    vlen: int
    kflag: bool
    size_or_type: int
    address: int


class KernelBtf:
    """The running kernel's BTF; ``close()`` (or ``with``) frees it."""

    def __init__(self) -> None:
        if not VMLINUX.exists():
            raise BtfUnavailable(f"this kernel has no BTF ({VMLINUX} is missing)")
        self._lib = _library()
        ctypes.set_errno(0)
        handle = self._lib.btf__load_vmlinux_btf()
        if not handle:
            code = ctypes.get_errno() or errno.EINVAL
            raise BtfUnavailable(f"{VMLINUX} cannot be read ({errno.errorcode.get(code, code)})")
        self._btf: int | None = handle

    def __enter__(self) -> KernelBtf:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._btf:
            self._lib.btf__free(self._btf)
            self._btf = None

    def _handle(self) -> int:
        if not self._btf:
            raise ValueError("KernelBtf is closed")
        return self._btf

    def _find(self, name: str, kind: int) -> int | None:
        type_id = self._lib.btf__find_by_name_kind(self._handle(), name.encode(), kind)
        return type_id if type_id > 0 else None

    def _type(self, type_id: int) -> _Type:
        address = self._lib.btf__type_by_id(self._handle(), type_id)
        if not address:
            raise ValueError(f"BTF has no type {type_id}")
        name_off, info, size = (ctypes.c_uint32 * 3).from_address(address)
        return _Type(name_off, (info >> 24) & 0x1F, info & 0xFFFF, bool(info >> 31), size, address)

    def _name(self, offset: int) -> str:
        name = self._lib.btf__name_by_offset(self._handle(), offset)
        return name.decode() if name else ""

    def tracepoint_args(self, event: str) -> list[str] | None:
        """A tracepoint's arguments by name, in the order a raw tracepoint
        program sees them in ``ctx->args``; None if BTF does not know it."""
        func = self._find(f"trace_event_raw_event_{event}", _KIND_FUNC)
        if func is None:
            return None
        proto = self._type(self._type(func).size_or_type)
        if proto.kind != _KIND_FUNC_PROTO:
            return None
        words = (ctypes.c_uint32 * (2 * proto.vlen)).from_address(proto.address + _TYPE_HEADER)
        names = [self._name(words[2 * i]) for i in range(proto.vlen)]
        return names[1:]  # void *__data, the tracepoint's own cookie

    def has_function(self, name: str) -> bool:
        """The kernel has a function ``name`` (a helper's, ``bpf_find_vma``)."""
        return self._find(name, _KIND_FUNC) is not None

    def tracepoint_type_id(self, event: str) -> int | None:
        """The BTF id of the tracepoint's ``btf_trace_<event>`` typedef, which
        a BTF-typed tracepoint program (tp_btf) names when loaded; None if
        BTF does not know it."""
        return self._find(f"btf_trace_{event}", _KIND_TYPEDEF)

    def struct_size(self, struct: str) -> int | None:
        type_id = self._find(struct, _KIND_STRUCT)
        if type_id is None:
            return None
        size = self._lib.btf__resolve_size(self._handle(), type_id)
        return size if size >= 0 else None

    def member(self, struct: str, member: str) -> tuple[int, int] | None:
        """(byte offset, size in bytes) of ``struct``'s ``member``, looked
        for through its anonymous structs and unions too; None if either is
        unknown or the member is a bitfield."""
        type_id = self._find(struct, _KIND_STRUCT)
        return None if type_id is None else self._member(type_id, member, 0)

    def _member(self, type_id: int, member: str, base_bits: int) -> tuple[int, int] | None:
        aggregate = self._type(type_id)
        words = (ctypes.c_uint32 * (3 * aggregate.vlen)).from_address(
            aggregate.address + _TYPE_HEADER
        )
        for i in range(aggregate.vlen):
            name_off, member_type, offset = words[3 * i : 3 * i + 3]
            bits = offset & 0xFFFFFF if aggregate.kflag else offset
            bitfield = aggregate.kflag and offset >> 24
            name = self._name(name_off)
            if name == member:
                total = base_bits + bits
                size = self._lib.btf__resolve_size(self._handle(), member_type)
                if bitfield or total % 8 or size < 0:
                    return None
                return total // 8, size
            if not name and self._type(member_type).kind in (_KIND_STRUCT, _KIND_UNION):
                found = self._member(member_type, member, base_bits + bits)
                if found is not None:
                    return found
        return None


KernelFacts = tuple[list[tuple[int, int] | None], list[bool]]


def kernel_facts(members: Sequence[tuple[str, str]], functions: Sequence[str] = ()) -> KernelFacts:
    """Each (struct, member)'s (offset, size) or None, and whether the kernel
    has each function, from its BTF: kept between runs (probes/elf/facts.py)
    under the BTF's identity and the kernel's release. Raises BtfUnavailable."""
    return _kernel_facts(VMLINUX, os.uname().release, tuple(members), tuple(functions))


@file_fact
def _kernel_facts(path: Path, release: str, members: tuple[tuple[str, str], ...],
                  functions: tuple[str, ...]) -> KernelFacts:  # fmt: skip
    with KernelBtf() as btf:
        return [btf.member(*wanted) for wanted in members], [btf.has_function(f) for f in functions]
