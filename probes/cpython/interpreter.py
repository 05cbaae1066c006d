"""A CPython 3.11-3.13 interpreter found in an ELF file (the python
executable, or libpython3.X.so.1.0 when it is linked to one), with the
``Layout`` a walk of its threads' frames needs; and the interpreters a
running process has mapped.

A file holds an interpreter when its symbols name ``_PyRuntime`` and
``_PyEval_EvalFrameDefault``. Everything is read from the file, never from
a process: the version from ``Py_Version``; 3.13's ``_Py_DebugOffsets``
from the start of ``_PyRuntime``'s initial data; the code object's fields
from ``PyCode_Type``'s member table and size; the thread-state key's place
in ``_PyRuntime`` from the code of ``PyGILState_GetThisThreadState``.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..elf.facts import file_fact, kept_type
from ..elf.file import LoadSegment, elf_failures, load_segments, needed, not_elf, open_elf
from ..elf.maps import Mapping, read_maps
from ..elf.symbols import symbols_by_name
from ..errors import NotElfError, TargetError, UnknownLayoutError
from .image import Image
from .layout import (
    CODE_UNIT,
    DEBUG_SIZE_3_13,
    FROM_DEBUG_OFFSETS,
    MEMBER_SIZE,
    MEMBER_TYPE,
    SUPPORTED,
    T_INT,
    T_OBJECT,
    TABLES,
    TSS_KEY_FIELD,
    TYPE_BASICSIZE,
    TYPE_ITEMSIZE,
    TYPE_MEMBERS,
    TYPE_NAME,
    Layout,
    debug_offsets,
    version_of,
)
from .symbolic import Loaded, Sum, Value, explore

if TYPE_CHECKING:
    from elftools.elf.elffile import ELFFile

EVAL = "_PyEval_EvalFrameDefault"
NEEDED = ("_PyRuntime", EVAL, "PyCode_Type", "PyGILState_GetThisThreadState")
CODE_MEMBERS = {  # Layout's field: (the member's name, its type)
    "code_filename": ("co_filename", T_OBJECT),
    "code_name": ("co_name", T_OBJECT),
    "code_qualname": ("co_qualname", T_OBJECT),
    "code_firstlineno": ("co_firstlineno", T_INT),
    "code_linetable": ("co_linetable", T_OBJECT),
}
MAX_MEMBERS = 64
TSS_TAKERS = ("PyThread_tss_get", "PyThread_tss_is_created")  # take a Py_tss_t *


@kept_type
@dataclass(frozen=True)
class Interpreter:
    """A CPython interpreter in an ELF file. Addresses are link-time ones:
    in a process, add the file's load bias."""

    path: Path  # the ELF file holding it (the executable or libpython3.X.so.1.0); as
    # the process names it, when found by interpreters_of
    runtime: int  # _PyRuntime
    code_type: int  # PyCode_Type
    str_type: int  # PyUnicode_Type
    bytes_type: int  # PyBytes_Type
    eval_ranges: tuple[tuple[int, int], ...]
    # [start, end) of _PyEval_EvalFrameDefault, then of its ".cold" part when the
    # file's .symtab names one (without .symtab, a stripped file, it is not found)
    layout: Layout


def find_interpreter(path: Path) -> Interpreter | None:
    """The interpreter in the ELF file at ``path``; None when the file holds
    none (no ``_PyRuntime`` or ``_PyEval_EvalFrameDefault`` among its
    symbols). UnknownLayoutError (one line) when it holds one whose layout is
    not known: 3.10 or older, a version past 3.13, a free-threaded build;
    TargetError when it cannot be opened, NotElfError when it is not ELF."""
    found, _ = interpreter_facts(path)
    if isinstance(found, str):
        raise UnknownLayoutError(f"{path}: {found}")
    return None if found is None else replace(found, path=path)


@file_fact
def interpreter_facts(path: Path) -> tuple[Interpreter | str | None, list[LoadSegment]]:
    """What a look for interpreters reads of the ELF file at ``path``, kept
    between runs (probes/elf/facts.py): a warm start that traces a Python
    process neither parses its interpreter's file nor disassembles its code.
    Its interpreter (its ``path`` left empty: the fact is the file's, whatever
    path reaches it), or why its layout is refused, or None; and its load
    segments where it has one. TargetError when it cannot be opened,
    NotElfError when it is not ELF (neither kept)."""
    kind = python_kind(path)  # (a kept fact: most files hold none, and are not opened)
    if kind == NOT_ELF:
        raise NotElfError(f"{path}: not a readable ELF file")
    if kind != INTERPRETER:
        return None, []
    with open_elf(path) as elf:
        try:
            symbols = symbols_by_name(elf)
        except elf_failures() as exc:
            raise not_elf(path, exc) from None
        try:
            interpreter = _interpreter(path, elf, symbols)
        except UnknownLayoutError as exc:  # (why, without the path it was opened by)
            return str(exc).removeprefix(f"{path}: "), []
        except elf_failures() as exc:  # an address outside the file's data, a damaged table
            return f"its CPython interpreter's data does not read as CPython's ({exc})", []
        return replace(interpreter, path=Path()), load_segments(elf)


# What a file is to CPython (python_kind)
INTERPRETER = "interpreter"  # it has _PyRuntime and the eval loop among its symbols
LINKS_LIBPYTHON = "libpython"  # it needs a libpython3 (the interpreter is there)
NO_INTERPRETER = "none"
NOT_ELF = "not ELF"


@file_fact
def python_kind(path: Path) -> str:
    """What the file at ``path`` is to CPython (INTERPRETER, LINKS_LIBPYTHON,
    NO_INTERPRETER or NOT_ELF), kept between runs (probes/elf/facts.py):
    a warm start that looks for interpreters in a process's files opens
    none of them. TargetError when the file cannot be opened."""
    try:
        with open_elf(path) as elf:
            try:
                if _may_hold_interpreter(elf):
                    symbols = symbols_by_name(elf)
                    if "_PyRuntime" in symbols and EVAL in symbols:
                        return INTERPRETER
            except elf_failures():
                return NOT_ELF
            try:
                links = any(name.startswith("libpython3") for name in needed(elf))
            except elf_failures():  # (a damaged dynamic section: no interpreter found)
                links = False
            return LINKS_LIBPYTHON if links else NO_INTERPRETER
    except NotElfError:
        return NOT_ELF


def interpreters_of(pid: int) -> list[tuple[Interpreter, int]]:
    """Each interpreter the process ``pid`` has mapped, with the file's load
    bias (an address in the process is the link-time one plus the bias), in
    the order of the maps. The files are opened through
    /proc/PID/map_files/, else /proc/PID/root/, so that a process in another
    mount namespace is read right; a mapped file that cannot be opened either
    way (``mapped_path``), or is not ELF, is passed over. TargetError when the process's maps
    cannot be read (it is gone, or not ours)."""
    proc = Path(f"/proc/{pid}")
    try:
        mappings = read_maps(proc)
    except OSError as exc:
        raise TargetError(f"process {pid}: its maps cannot be read ({exc.strerror})") from None
    firsts: dict[tuple[int, int], Mapping] = {}
    for mapping in mappings:
        if mapping.is_file and mapping.inode[1]:
            first = firsts.setdefault(mapping.inode, mapping)
            if mapping.offset < first.offset:
                firsts[mapping.inode] = mapping
    found = []
    for mapping in firsts.values():
        known = _FILES.get(mapping.inode)
        if known is None:
            try:
                known = _FILES[mapping.inode] = _file_interpreter(mapped_path(pid, mapping))
            except TargetError:
                continue  # it cannot be opened (looked at again next time)
        interpreter, segments = known
        if isinstance(interpreter, UnknownLayoutError):  # said of the file the process maps
            raise UnknownLayoutError(f"{mapping.path}: {interpreter}")
        if interpreter is None:
            continue
        bias = load_bias(segments, mapping)
        if bias is not None:
            found.append((replace(interpreter, path=Path(mapping.path)), bias))
    return found


# Each mapped file looked at, by its (device, inode): whether it holds an
# interpreter (or one whose layout is refused), and its load segments.
# Every process of a machine maps much the same files: each is read once.
_FILES: dict[tuple[int, int], tuple[Interpreter | UnknownLayoutError | None,
                                    list[LoadSegment]]] = {}  # fmt: skip


def _file_interpreter(
    opened: Path,
) -> tuple[Interpreter | UnknownLayoutError | None, list[LoadSegment]]:
    """The interpreter in a mapped file (or why its layout is refused, or
    None) and its load segments. TargetError when it cannot be opened."""
    try:
        found, segments = interpreter_facts(opened)
    except NotElfError:
        return None, []
    if isinstance(found, str):
        return UnknownLayoutError(found), []
    if found is None:
        return None, []
    return replace(found, path=opened), segments


def load_bias(segments: list[LoadSegment], mapping: Mapping, page: int = 4096) -> int | None:
    """The bias of a file one of whose mappings is ``mapping``: its start
    less the link-time address of the file offset it maps."""
    for segment in segments:
        first = segment.offset & ~(page - 1)
        if first <= mapping.offset < segment.offset + max(segment.filesz, 1):
            return mapping.start - (segment.vaddr + mapping.offset - segment.offset)
    return None


def mapped_path(pid: int, mapping: Mapping) -> Path:
    """A path that opens the file of one of process ``pid``'s mappings from
    here, whatever its mount namespace: its /proc/PID/map_files/ link when
    that opens (it needs CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE), else its
    path under /proc/PID/root/."""
    proc = Path(f"/proc/{pid}")
    link = proc / "map_files" / mapping.map_files
    try:
        os.close(os.open(link, os.O_RDONLY))
    except OSError:
        return proc / "root" / mapping.path.lstrip("/")
    return link


def _may_hold_interpreter(elf: ELFFile) -> bool:
    """A file whose string tables hold no "_PyRuntime" holds no interpreter
    (a quick look before its symbols are read)."""
    for name in (".dynstr", ".strtab"):
        section = elf.get_section_by_name(name)
        if section is not None and b"\0_PyRuntime\0" in section.data():
            return True
    return False


def _interpreter(path: Path, elf: ELFFile, symbols: dict[str, tuple[int, int]]) -> Interpreter:
    if elf["e_machine"] != "EM_X86_64":
        raise UnknownLayoutError(f"{path}: a CPython interpreter for {elf['e_machine']}, "
                                 "not x86-64: its layout is not known")  # fmt: skip
    image = Image(elf)
    if "Py_Version" not in symbols:
        raise UnknownLayoutError(f"{path}: CPython 3.10 or older (no Py_Version): only "
                                 "3.11 to 3.13 are known")  # fmt: skip
    runtime, runtime_size = symbols["_PyRuntime"]
    version = version_of(image.word(symbols["Py_Version"][0]))
    if version[:2] not in SUPPORTED:
        raise UnknownLayoutError(f"{path}: CPython {'.'.join(map(str, version))}: only "
                                 "3.11 to 3.13 are known")  # fmt: skip
    missing = [name for name in NEEDED if name not in symbols]
    if missing:
        raise UnknownLayoutError(f"{path}: CPython {version[0]}.{version[1]} without "
                                 f"{', '.join(missing)} among its symbols")  # fmt: skip
    fields: dict[str, Any] = dict(TABLES[version[:2]], version=version, free_threaded=False)
    if version >= (3, 13):
        fields.update(_from_debug_offsets(path, image, runtime, version))
    for name, value in _code_fields(path, image, symbols["PyCode_Type"][0]).items():
        if fields.setdefault(name, value) != value:
            raise UnknownLayoutError(f"{path}: PyCode_Type says {name} is {value}, "
                                     f"_Py_DebugOffsets {fields[name]}")  # fmt: skip
    fields["tss_key"] = _tss_key(path, image, symbols, runtime, runtime_size)
    return Interpreter(
        path=path,
        runtime=runtime,
        code_type=symbols["PyCode_Type"][0],
        str_type=symbols.get("PyUnicode_Type", (0, 0))[0],
        bytes_type=symbols.get("PyBytes_Type", (0, 0))[0],
        eval_ranges=_eval_ranges(symbols),
        layout=Layout(**fields),
    )


def _from_debug_offsets(path: Path, image: Image, runtime: int,
                        version: tuple[int, int, int]) -> dict[str, int]:  # fmt: skip
    """Layout's fields from 3.13's _Py_DebugOffsets at the start of _PyRuntime."""
    offsets = debug_offsets(image.read(runtime, DEBUG_SIZE_3_13))
    if offsets is None:
        raise UnknownLayoutError(f"{path}: _PyRuntime does not start with _Py_DebugOffsets")
    if version_of(offsets["version"])[:2] != version[:2]:
        raise UnknownLayoutError(f"{path}: _Py_DebugOffsets is of version "
                                 f"{offsets['version']:#x}, Py_Version {version}")  # fmt: skip
    if offsets["free_threaded"]:
        raise UnknownLayoutError(f"{path}: a free-threaded CPython (no GIL): its "
                                 "layout is not known")  # fmt: skip
    return {field: offsets[key] for field, key in FROM_DEBUG_OFFSETS.items()}


def _code_fields(path: Path, image: Image, code_type: int) -> dict[str, int]:
    """The code object's fields from PyCode_Type: its instructions follow
    its fixed part (tp_basicsize, the size of a code unit its tp_itemsize),
    and its member table gives the others."""
    if image.cstring(image.word(code_type + TYPE_NAME)) != "code":
        raise UnknownLayoutError(f"{path}: PyCode_Type is not named 'code'")
    basicsize = image.word(code_type + TYPE_BASICSIZE)
    itemsize = image.word(code_type + TYPE_ITEMSIZE)
    if itemsize != CODE_UNIT:
        raise UnknownLayoutError(f"{path}: PyCode_Type's items are {itemsize} bytes, not 2")
    members: dict[str, tuple[int, int]] = {}
    table = image.word(code_type + TYPE_MEMBERS)
    for index in range(MAX_MEMBERS):
        entry = table + index * MEMBER_SIZE
        name = image.word(entry)
        if not name:
            break
        kind, offset = struct.unpack("<i4xq", image.read(entry + MEMBER_TYPE, 16))
        members[image.cstring(name)] = kind, offset
    fields = {"code_adaptive": basicsize}
    for field, (member, kind) in CODE_MEMBERS.items():
        if members.get(member, (None,))[0] != kind:
            raise UnknownLayoutError(f"{path}: PyCode_Type has no member {member} of type {kind}")
        fields[field] = members[member][1]
    return fields


def _tss_key(path: Path, image: Image, symbols: dict[str, tuple[int, int]], runtime: int,
             runtime_size: int) -> int:  # fmt: skip
    """Where the thread-state key is in _PyRuntime, from the code of
    PyGILState_GetThisThreadState: the Py_tss_t whose address it passes to
    PyThread_tss_get (its _key is 4 bytes in), or the pthread_key_t it loads
    for pthread_getspecific. The functions it calls are read in turn, two
    deep, when its own code does not say."""
    found: set[int] = set()
    calls: list[tuple[tuple[int, int], dict[str, Value]]] = [
        (symbols["PyGILState_GetThisThreadState"], {})
    ]
    for _depth in range(3):
        further = []
        for (start, size), registers in calls:
            for exit in explore(image, start, start + (size or 256), registers):
                if exit.kind != "call" or exit.target is None:
                    continue
                callee = image.function_at(exit.target)
                argument = exit.registers.get("rdi")
                if callee in TSS_TAKERS and isinstance(argument, Sum) and argument.plain:
                    found.add(argument.const + TSS_KEY_FIELD - runtime)
                elif (callee == "pthread_getspecific" and isinstance(argument, Loaded)
                      and argument.size == 4 and argument.at.plain):  # fmt: skip
                    found.add(argument.at.const - runtime)
                elif callee is None or callee in symbols:
                    size = symbols[callee][1] if callee is not None else 0
                    further.append(((exit.target, size), exit.registers))
        inside = {offset for offset in found if 0 <= offset < runtime_size}
        if len(inside) == 1:
            return inside.pop()
        if inside:
            break
        calls = further
    raise UnknownLayoutError(f"{path}: where the thread-state key is in _PyRuntime is not "
                             "found in PyGILState_GetThisThreadState's code")  # fmt: skip


def _eval_ranges(symbols: dict[str, tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    # only .symtab names the .cold part: symbols_by_name has it when the file has one
    ranges = [symbols[EVAL], symbols.get(EVAL + ".cold")]
    return tuple((start, start + size) for start, size in filter(None, ranges))
