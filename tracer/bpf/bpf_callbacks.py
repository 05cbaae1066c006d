"""Programs that hand a callback to a helper (``bpf_find_vma``; ``bpf_loop``
for the unwinders' frames), loaded with the callback's code linked in.

bcc 0.26 compiles the callback as a function of its own, and leaves the
load of its address in the program as a 64-bit load of 0 (it relocates no
function address): the verifier refuses that (``R3 type=scalar
expected=func``). So the program is loaded here, cold or warm, from the two
functions' code as bcc compiled them: the callback's appended to the
program's; the load made a ``BPF_PSEUDO_FUNC`` load, whose immediate is the
callback's first instruction counted from the load's next; and the BTF the
kernel then wants, a FUNC with its prototype for each function and the
instruction where each begins (``func_info``).

A program's callback is the function named ``<program>__callback``, with
one parameter in C (it reads the others from r2 and r3: bpf_find_vma's VMA
and context, bpf_loop's context); the program holds exactly one load of it.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

from mtrace_live.tracer.bpf import bpf_syscalls

CALLBACK_SUFFIX = "__callback"
_LD_IMM64 = 0x18
_PSEUDO_FUNC = 4
_INSN = 8

# include/uapi/linux/btf.h
_BTF_MAGIC = 0xEB9F
_KIND_INT, _KIND_PTR, _KIND_FUNC, _KIND_FUNC_PROTO = 1, 2, 12, 13
_STATIC, _GLOBAL = 0, 1  # a FUNC's linkage


def callback_of(program: str) -> str:
    return program + CALLBACK_SUFFIX


def is_callback(name: str) -> bool:
    return name.endswith(CALLBACK_SUFFIX)


def has_callback(program: str, functions: Mapping[str, object]) -> bool:
    return not is_callback(program) and callback_of(program) in functions


def link(code: bytes, callback: bytes) -> bytes:
    """``code`` with ``callback``'s appended, and its one 64-bit load of 0
    (the callback's address, as bcc left it) a BPF_PSEUDO_FUNC load of it.
    ValueError where the code holds no such load, or more than one."""
    if len(code) % _INSN or len(callback) % _INSN:
        raise ValueError("BPF code is not whole instructions")
    out = bytearray(code)
    count = len(code) // _INSN
    loads = []
    index = 0
    while index < count:
        opcode, regs, _, low = struct.unpack_from("<BBhi", out, index * _INSN)
        if opcode == _LD_IMM64:
            high = struct.unpack_from("<i", out, (index + 1) * _INSN + 4)[0]
            if regs >> 4 == 0 and low == 0 and high == 0:
                loads.append(index)
            index += 2
        else:
            index += 1
    if len(loads) != 1:
        raise ValueError(f"the program holds {len(loads)} loads of 0, not the callback's one")
    at = loads[0]
    regs = out[at * _INSN + 1]
    out[at * _INSN + 1] = (regs & 0x0F) | (_PSEUDO_FUNC << 4)
    struct.pack_into("<i", out, at * _INSN + 4, count - at - 1)
    return bytes(out) + callback


def func_btf(program: str, callback: str) -> bytes:
    """BTF of the two functions: ``long callback(void *, void *, void *)``,
    static, and ``long program(void *)``: types 4 and 6."""
    strings = bytearray(b"\0")

    def name(text: str) -> int:
        at = len(strings)
        strings.extend(text.encode() + b"\0")
        return at

    long_, arg = name("long"), name("arg")
    types = b"".join((
        struct.pack("<IIII", long_, _KIND_INT << 24, 8, (1 << 24) | 64),  # 1: long, signed
        struct.pack("<III", 0, _KIND_PTR << 24, 0),  # 2: void *
        struct.pack("<III", 0, (_KIND_FUNC_PROTO << 24) | 3, 1),  # 3: long (void *, void *, void *)
        struct.pack("<IIIIII", arg, 2, arg, 2, arg, 2),
        struct.pack("<III", name(callback), (_KIND_FUNC << 24) | _STATIC, 3),  # 4
        struct.pack("<III", 0, (_KIND_FUNC_PROTO << 24) | 1, 1),  # 5: long (void *)
        struct.pack("<II", arg, 2),
        struct.pack("<III", name(program), (_KIND_FUNC << 24) | _GLOBAL, 5),  # 6
    ))  # fmt: skip
    header = struct.pack("<HBBIIIII", _BTF_MAGIC, 1, 0, 24, 0, len(types), len(types),
                         len(strings))  # fmt: skip
    return header + types + bytes(strings)


def load_linked(functions: Mapping[str, bytes], program: str, license_: str, prog_type: int,
         attach_type: int, kern_version: int = 0) -> int:  # fmt: skip
    """``program`` loaded with its callback linked in (both from
    ``functions``, by name): its fd. Raises OSError (the verifier's
    words), ValueError where the code is not as bcc makes it."""
    callback = callback_of(program)
    code = link(functions[program], functions[callback])
    btf_fd = bpf_syscalls.load_btf(func_btf(program, callback))
    try:
        info = struct.pack("<IIII", 0, 6, len(functions[program]) // _INSN, 4)
        return bpf_syscalls.load_program(code, license_, program, prog_type, attach_type,
                                         kern_version, btf_fd=btf_fd,
                                         func_info=info)  # fmt: skip
    finally:
        bpf_syscalls.close(btf_fd)


def loaded_code(bpf: object, names: tuple[str, ...]) -> dict[str, bytes]:
    """The functions' code as bcc compiled them in this run (its map
    descriptors in it); KeyError for one it did not compile."""
    try:
        return {name: bytes(bpf.dump_func(name.encode())) for name in names}  # type: ignore[attr-defined]
    except Exception:
        raise KeyError(names) from None
