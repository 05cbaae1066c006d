"""Where a CPython interpreter keeps what a walk of a thread's Python frames
reads: ``Layout``, byte offsets into its structures (x86-64, the default
build with its global interpreter lock).

The offsets come from three places, best first (``interpreter.py`` puts
them together):

1. the interpreter's own table of offsets, ``_Py_DebugOffsets``, the first
   member of ``_PyRuntime`` from 3.13 on (``debug_offsets`` reads it by its
   3.13 field order: the struct is stable within a minor version only);
2. the interpreter's binary: ``PyCode_Type``'s member table and size (the
   code object's fields), and the code of ``PyGILState_GetThisThreadState``
   (where the thread-state key is in ``_PyRuntime``);
3. the tables below, per minor version, for what neither gives, written
   from the 3.11, 3.12 and 3.13 headers (``Include/internal/pycore_frame.h``,
   ``pycore_runtime.h``, ``pycore_interp.h``, ``Include/cpython/pystate.h``,
   ``unicodeobject.h``, ``bytesobject.h``) and checked against the DWARF of
   builds of each.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from ..elf.facts import kept_type

SUPPORTED = ((3, 11), (3, 12), (3, 13))

# PyTypeObject and PyMemberDef, as Include/cpython/object.h and descrobject.h
# lay them out in 3.11 to 3.13 (x86-64).
TYPE_NAME = 24  # tp_name
TYPE_BASICSIZE = 32  # tp_basicsize
TYPE_ITEMSIZE = 40  # tp_itemsize
TYPE_MEMBERS = 240  # tp_members
MEMBER_SIZE = 40  # {char *name; int type; Py_ssize_t offset; int flags; char *doc}
MEMBER_TYPE = 8
MEMBER_OFFSET = 16
T_INT = 1  # the member types of Include/structmember.h (descrobject.h's Py_T_*)
T_OBJECT = 6
CODE_UNIT = 2  # sizeof(_Py_CODEUNIT)
TSS_KEY_FIELD = 4  # offsetof(Py_tss_t, _key): {int _is_initialized; pthread_key_t _key;}

DEBUG_COOKIE = b"xdebugpy"


@kept_type
@dataclass(frozen=True)
class Layout:
    """Byte offsets of the fields a frame walk reads, each in the structure
    its comment names (``X -> field``: the field's offset in X)."""

    version: tuple[int, int, int]  # (major, minor, micro), from Py_Version
    free_threaded: bool  # always False: a free-threaded build is refused
    # the threads
    tss_key: int  # _PyRuntime -> autoTSSkey._key: the pthread_key_t whose per-thread
    # value is the thread's PyThreadState (3.11: _PyRuntime.gilstate.autoTSSkey)
    interpreters_head: int  # _PyRuntime -> interpreters.head (the newest interpreter)
    interpreter_next: int  # PyInterpreterState -> next
    threads_head: int  # PyInterpreterState -> threads.head (the newest thread state)
    thread_next: int  # PyThreadState -> next
    thread_id: int  # PyThreadState -> thread_id: pthread_self(), the glibc thread pointer
    tstate_cframe: int | None  # 3.11, 3.12: PyThreadState -> cframe; None in 3.13
    current_frame: int  # 3.11, 3.12: _PyCFrame -> current_frame; 3.13: PyThreadState ->
    # current_frame. The innermost _PyInterpreterFrame.
    # the frames
    frame_code: int  # _PyInterpreterFrame -> f_code (3.11, 3.12) / f_executable (3.13)
    frame_previous: int  # _PyInterpreterFrame -> previous (the caller's frame)
    frame_instr: int  # _PyInterpreterFrame -> prev_instr (3.11, 3.12) / instr_ptr (3.13):
    # the instruction the frame executes (the call, in a caller)
    frame_owner: int  # _PyInterpreterFrame -> owner (a char)
    frame_is_entry: int | None  # 3.11: _PyInterpreterFrame -> is_entry (a bool, set in
    # the first frame an eval loop runs); None after
    owner_cstack: int | None  # 3.12+: FRAME_OWNED_BY_CSTACK, the owner of the shim frame
    # each eval loop pushes at its entry (no code of its own); None in 3.11
    # the objects
    object_type: int  # PyObject -> ob_type
    code_adaptive: int  # PyCodeObject -> co_code_adaptive: the instructions, so an
    # instruction's offset in code units is (instr - (code + code_adaptive)) // 2
    code_filename: int  # PyCodeObject -> co_filename (a str)
    code_name: int  # PyCodeObject -> co_name (a str)
    code_qualname: int  # PyCodeObject -> co_qualname (a str)
    code_firstlineno: int  # PyCodeObject -> co_firstlineno (an int)
    code_linetable: int  # PyCodeObject -> co_linetable (bytes: the location table)
    unicode_length: int  # PyASCIIObject -> length (in code points)
    unicode_state: int  # PyASCIIObject -> state (32 bits: the fields below)
    unicode_kind_shift: int  # state: kind (1, 2 or 4 bytes a code point) at this bit, 3 bits
    unicode_compact_bit: int  # state: compact (the text follows the header)
    unicode_ascii_bit: int  # state: ascii (the text follows a PyASCIIObject)
    unicode_ready_bit: int | None  # 3.11 state: ready (the text is there); None after
    unicode_ascii_data: int  # sizeof(PyASCIIObject): where a compact ASCII str's text is
    unicode_compact_data: int  # sizeof(PyCompactUnicodeObject): where a compact str's is
    bytes_size: int  # PyBytesObject -> ob_size (PyVarObject's)
    bytes_data: int  # PyBytesObject -> ob_sval


# What a version's binary does not say (3.13: what _Py_DebugOffsets does not).
_COMMON: dict[str, Any] = dict(
    interpreter_next=0, thread_next=8, object_type=8, unicode_length=16, unicode_state=32,
    unicode_kind_shift=2, unicode_compact_bit=5, unicode_ascii_bit=6, bytes_size=16,
    bytes_data=32,
)  # fmt: skip
TABLES: dict[tuple[int, int], dict[str, Any]] = {
    (3, 11): dict(
        _COMMON, interpreters_head=40, threads_head=16, thread_id=152, tstate_cframe=56,
        current_frame=8, frame_code=32, frame_previous=48, frame_instr=56, frame_owner=69,
        frame_is_entry=68, owner_cstack=None, unicode_ready_bit=7, unicode_ascii_data=48,
        unicode_compact_data=72,
    ),
    (3, 12): dict(
        _COMMON, interpreters_head=40, threads_head=72, thread_id=136, tstate_cframe=56,
        current_frame=0, frame_code=0, frame_previous=8, frame_instr=56, frame_owner=70,
        frame_is_entry=None, owner_cstack=3, unicode_ready_bit=None, unicode_ascii_data=40,
        unicode_compact_data=56,
    ),
    (3, 13): dict(
        _COMMON, tstate_cframe=None, frame_is_entry=None, owner_cstack=3,
        unicode_ready_bit=None, unicode_compact_data=56,
    ),
}  # fmt: skip

# _Py_DebugOffsets of 3.13 (Include/internal/pycore_runtime.h), in its order:
# after the cookie, each a uint64_t.
DEBUG_FIELDS_3_13 = (
    ("", ("version", "free_threaded")),
    ("runtime_state", ("size", "finalizing", "interpreters_head")),
    ("interpreter_state", ("size", "id", "next", "threads_head", "gc", "imports_modules",
                           "sysdict", "builtins", "ceval_gil", "gil_runtime_state",
                           "gil_runtime_state_enabled", "gil_runtime_state_locked",
                           "gil_runtime_state_holder")),
    ("thread_state", ("size", "prev", "next", "interp", "current_frame", "thread_id",
                      "native_thread_id", "datastack_chunk", "status")),
    ("interpreter_frame", ("size", "previous", "executable", "instr_ptr", "localsplus", "owner")),
    ("code_object", ("size", "filename", "name", "qualname", "linetable", "firstlineno",
                     "argcount", "localsplusnames", "localspluskinds", "co_code_adaptive")),
    ("pyobject", ("size", "ob_type")),
    ("type_object", ("size", "tp_name", "tp_repr", "tp_flags")),
    ("tuple_object", ("size", "ob_item", "ob_size")),
    ("list_object", ("size", "ob_item", "ob_size")),
    ("dict_object", ("size", "ma_keys", "ma_values")),
    ("float_object", ("size", "ob_fval")),
    ("long_object", ("size", "lv_tag", "ob_digit")),
    ("bytes_object", ("size", "ob_size", "ob_sval")),
    ("unicode_object", ("size", "state", "length", "asciiobject_size")),
    ("gc", ("size", "collecting")),
)  # fmt: skip
DEBUG_WORDS_3_13 = sum(len(fields) for _, fields in DEBUG_FIELDS_3_13)
DEBUG_SIZE_3_13 = len(DEBUG_COOKIE) + 8 * DEBUG_WORDS_3_13

# Layout's fields from _Py_DebugOffsets' ("group.field").
FROM_DEBUG_OFFSETS = {
    "interpreters_head": "runtime_state.interpreters_head",
    "interpreter_next": "interpreter_state.next",
    "threads_head": "interpreter_state.threads_head",
    "thread_next": "thread_state.next",
    "thread_id": "thread_state.thread_id",
    "current_frame": "thread_state.current_frame",
    "frame_code": "interpreter_frame.executable",
    "frame_previous": "interpreter_frame.previous",
    "frame_instr": "interpreter_frame.instr_ptr",
    "frame_owner": "interpreter_frame.owner",
    "object_type": "pyobject.ob_type",
    "code_adaptive": "code_object.co_code_adaptive",
    "code_filename": "code_object.filename",
    "code_name": "code_object.name",
    "code_qualname": "code_object.qualname",
    "code_firstlineno": "code_object.firstlineno",
    "code_linetable": "code_object.linetable",
    "unicode_length": "unicode_object.length",
    "unicode_state": "unicode_object.state",
    "unicode_ascii_data": "unicode_object.asciiobject_size",
    "bytes_size": "bytes_object.ob_size",
    "bytes_data": "bytes_object.ob_sval",
}


def debug_offsets(data: bytes) -> dict[str, int] | None:
    """3.13's ``_Py_DebugOffsets`` in ``data`` (the start of
    ``_PyRuntime``), as {"group.field": value} ("version",
    "free_threaded" without a group); None when the cookie is not there."""
    if len(data) < DEBUG_SIZE_3_13 or not data.startswith(DEBUG_COOKIE):
        return None
    words = iter(struct.unpack_from(f"<{DEBUG_WORDS_3_13}Q", data, len(DEBUG_COOKIE)))
    return {f"{group}.{name}".lstrip("."): next(words)
            for group, fields in DEBUG_FIELDS_3_13 for name in fields}  # fmt: skip


def version_of(hexversion: int) -> tuple[int, int, int]:
    """(major, minor, micro) of a PY_VERSION_HEX."""
    return hexversion >> 24 & 0xFF, hexversion >> 16 & 0xFF, hexversion >> 8 & 0xFF
