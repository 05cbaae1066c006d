"""CPython interpreters found in their files and read from outside
(probes/cpython/): the layout against the DWARF of the builds that have it,
and against what a child interpreter prints of its own frames; the libc's
key slots against its debug information; the location table against
CPython's own decoder. The children are this test's own (same user): no
root needed."""

from __future__ import annotations

import contextlib
import dataclasses
import dis
import itertools
import os
import shutil
import struct
import subprocess
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from elftools.dwarf.die import DIE
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection
from hypothesis import given
from hypothesis import strategies as st
from mtrace_live.probes.cpython.interpreter import find_interpreter, interpreters_of
from mtrace_live.probes.cpython.layout import Layout
from mtrace_live.probes.cpython.linetable import line_of
from mtrace_live.probes.cpython.process import CodeInfo, CodeNames, ProcessView
from mtrace_live.probes.cpython.threads import thread_slot
from mtrace_live.probes.elf.debug import build_id_path
from mtrace_live.probes.elf.file import build_id_of
from mtrace_live.probes.elf.maps import read_maps
from mtrace_live.probes.errors import UnknownLayoutError

from .needs import needs

PYENV = Path("/root/.pyenv/versions")
# name: (the program, the ELF file that holds its interpreter)
INTERPRETERS = {
    "debian-3.11": (Path("/usr/bin/python3.11"), Path("/usr/bin/python3.11")),
    "pyenv-3.11.7": (PYENV / "3.11.7/bin/python3.11", PYENV / "3.11.7/lib/libpython3.11.so.1.0"),
    "pyenv-3.12.1": (PYENV / "3.12.1/bin/python3.12", PYENV / "3.12.1/lib/libpython3.12.so.1.0"),
    "pyenv-3.13.0": (PYENV / "3.13.0/bin/python3.13", PYENV / "3.13.0/lib/libpython3.13.so.1.0"),
}
WITH_DWARF = ["pyenv-3.11.7", "pyenv-3.12.1", "pyenv-3.13.0"]  # Debian's has none installed
PYTHON_3_10 = PYENV / "3.10.13/lib/libpython3.10.so.1.0"
LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")


def interpreter_files(name: str) -> tuple[Path, Path]:
    program, file = INTERPRETERS[name]
    needs(program.is_file() and file.is_file(), f"{program} and {file} ({name})")
    return program, file


# ---- a child interpreter, blocked in a known chain of frames ----------------

# Each thread writes its own frames (innermost first) in one write, then
# blocks in C on the same line (os.write, then the blocking call): its frames
# and their lines stay what it wrote.
CHILD = """\
import ctypes
import os
import sys
import threading
import types


def describe(frame, who):
    lines = []
    while frame is not None:
        code = frame.f_code
        lines.append(f"{who} {id(code)} {frame.f_lineno} {code.co_qualname}\\t{code.co_filename}")
        frame = frame.f_back
    return "".join(line + "\\n" for line in lines)


held = threading.Lock()
held.acquire()


def worker():
    os.write(1, (describe(sys._getframe(), "thread") + "end thread\\n").encode()); held.acquire()


class Walker:
    def method(self):
        yield from self.deeper(5)

    def deeper(self, depth):
        if depth:
            yield from self.deeper(depth - 1)
        else:
            yield café()


# names of 1, 2 and 4 bytes a character (str's kinds)
def café():
    return 名前()


def 名前():
    return 𠀀()


def 𠀀():
    return report()


def report():
    os.write(1, (describe(sys._getframe(), "main") + "end main\\n").encode()); sys.stdin.readline()
    return 0


def main():
    runtime = ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))
    print("version", *sys.version_info[:3], flush=True)
    print("objects", runtime, id(types.CodeType), id(str), id(bytes), flush=True)
    print("ident main", threading.get_ident(), flush=True)
    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    print("ident thread", thread.ident, flush=True)
    for _ in Walker().method():
        pass


main()
"""


@dataclass
class Child:
    """A child interpreter blocked in CHILD, and what it printed."""

    name: str
    process: subprocess.Popen[str]
    file: Path  # the ELF file holding its interpreter
    version: tuple[int, int, int]
    objects: dict[str, int]  # _PyRuntime, PyCode_Type, PyUnicode_Type, PyBytes_Type
    idents: dict[str, int]  # threading ident by thread ("main", "thread")
    frames: dict[str, list[tuple[int, int, str, str]]]  # (id(code), f_lineno, qualname, file)

    @property
    def pid(self) -> int:
        return self.process.pid


def read_child(name: str, process: subprocess.Popen[str], file: Path) -> Child:
    assert process.stdout is not None
    child = Child(name, process, file, (0, 0, 0), {}, {}, {"main": [], "thread": []})
    ended: set[str] = set()
    while ended != {"main", "thread"}:
        line = process.stdout.readline()
        assert line, f"{name}: the child ended early"
        head, rest = line.rstrip("\n").split(" ", 1)
        if head == "version":
            child.version = tuple(int(part) for part in rest.split())  # type: ignore[assignment]
        elif head == "objects":
            values = [int(part) for part in rest.split()]
            child.objects = dict(zip(("runtime", "code", "str", "bytes"), values, strict=True))
        elif head == "ident":
            who, ident = rest.split()
            child.idents[who] = int(ident)
        elif head == "end":
            ended.add(rest)
        else:
            code, lineno, names = rest.split(" ", 2)
            qualname, filename = names.split("\t")
            child.frames[head].append((int(code), int(lineno), qualname, filename))
    return child


@contextlib.contextmanager
def launched(program: Path, script: Path) -> Iterator[subprocess.Popen[str]]:
    """``program`` running ``script``, its standard input and output piped;
    killed at the end."""
    with subprocess.Popen([str(program), str(script)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, encoding="utf-8") as process:  # fmt: skip
        try:
            yield process
        finally:
            process.kill()


@pytest.fixture(scope="module", params=list(INTERPRETERS))
def child(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:  # fmt: skip
    program, file = interpreter_files(request.param)
    script = tmp_path_factory.mktemp("cpython") / "chain.py"
    script.write_text(CHILD, encoding="utf-8")
    with launched(program, script) as process:
        yield read_child(request.param, process, file)


def libc_of(pid: int) -> Path:
    """The libc the process maps, opened through its /proc directory."""
    mapping = next(m for m in read_maps(Path(f"/proc/{pid}")) if "/libc.so" in m.path)
    return Path(f"/proc/{pid}/root{mapping.path}")


def test_the_child_s_interpreter_is_found_where_it_really_is(child: Child) -> None:
    # WHEN the child's mappings are searched for interpreters
    found = interpreters_of(child.pid)
    # THEN there is one, in the file that holds it, of the version it runs
    assert [str(interpreter.path) for interpreter, _ in found] == [str(child.file)]
    interpreter, bias = found[0]
    assert interpreter.layout.version == child.version
    # AND its objects, moved by the load bias, are where the child has them
    assert {"runtime": interpreter.runtime + bias, "code": interpreter.code_type + bias,
            "str": interpreter.str_type + bias, "bytes": interpreter.bytes_type + bias,
            } == child.objects  # fmt: skip
    # AND the file, read by its own path, gives the same interpreter
    assert find_interpreter(child.file) == interpreter


def test_the_layout_checks_out_against_the_child(child: Child) -> None:
    # GIVEN the child's interpreter and where its libc keeps key values
    [(interpreter, bias)] = interpreters_of(child.pid)
    slot = thread_slot(libc_of(child.pid))
    # WHEN the layout is checked against its memory
    with ProcessView(child.pid, interpreter, bias) as view:
        problem = view.check(slot)
        # THEN it holds
        assert problem is None
        # AND each thread state names its thread by the ident the child printed
        assert set(child.idents.values()) <= {thread for _, thread in view.thread_states()}


def test_a_layout_that_does_not_hold_is_said_in_one_line(child: Child) -> None:
    # GIVEN the child's interpreter and where its libc keeps key values
    [(interpreter, bias)] = interpreters_of(child.pid)
    base, stride = thread_slot(libc_of(child.pid))
    wrong_frames = dataclasses.replace(interpreter, layout=dataclasses.replace(
        interpreter.layout, frame_code=interpreter.layout.frame_previous))  # fmt: skip
    # WHEN the check is made with the key's slot one word off, or with the
    # frame's caller taken for its code object
    with ProcessView(child.pid, interpreter, bias) as view:
        off_slot = view.check((base + 8, stride))
    with ProcessView(child.pid, wrong_frames, bias) as view:
        off_code = view.check((base, stride))
    # THEN each says what failed, in one line
    assert off_slot is not None and "\n" not in off_slot and "thread-state key" in off_slot
    assert off_code is not None and "\n" not in off_code and "not a code object" in off_code


def test_each_thread_s_frames_are_those_the_child_printed(child: Child) -> None:
    # GIVEN the child's thread states, by thread
    [(interpreter, bias)] = interpreters_of(child.pid)
    with ProcessView(child.pid, interpreter, bias) as view:
        states = {thread: tstate for tstate, thread in view.thread_states()}
        for who in ("main", "thread"):
            # WHEN a thread's frames are walked and named
            frames = view.frames(states[child.idents[who]])
            named = []
            for code, offset in frames:
                info = view.code(code)
                assert info is not None, f"{who}: {code:#x} is not named"
                named.append((code, info.line(offset), info.qualname, info.filename))
            # THEN they are the frames the thread printed, innermost first:
            # the same code objects (their ids), on the same lines
            assert named == child.frames[who]
    # AND the chain is the one the child builds (the generator's recursion, 6 deep)
    assert [qualname for _, _, qualname, _ in child.frames["main"]] == [
        "report", "\U00020000", "名前", "café", *["Walker.deeper"] * 6, "Walker.method", "main",
        "<module>"]  # fmt: skip
    assert child.frames["thread"][0][2] == "worker"


def test_code_names_are_kept_and_read_once(child: Child) -> None:
    # GIVEN the code object of the child's innermost frame
    [(interpreter, bias)] = interpreters_of(child.pid)
    code = child.frames["main"][0][0]
    names = CodeNames()
    with ProcessView(child.pid, interpreter, bias) as view:
        # WHEN it is named twice
        first, second = names.get(view, code), names.get(view, code)
        # THEN it is named as the child printed it, the second time from the cache
        assert first is not None and first.qualname == "report"
        assert second is first
        # AND an address that holds no code object is not named
        assert names.get(view, interpreter.runtime + bias) is None


class ReusedAddress(ProcessView):
    """A process view whose code object at every address is ``current``
    (no process behind it)."""

    def __init__(self, current: tuple[tuple[int, ...], CodeInfo]) -> None:
        self.pid = 1
        self.current = current
        self.reads = 0

    def identity(self, address: int) -> tuple[int, ...] | None:
        return self.current[0]

    def code(self, address: int) -> CodeInfo | None:
        self.reads += 1
        return self.current[1]


def test_a_code_object_that_took_a_freed_one_s_address_is_named_anew() -> None:
    # GIVEN a code object named once
    old = CodeInfo("old", "a.py", 1, b"")
    new = CodeInfo("new", "b.py", 7, b"")
    view = ReusedAddress(((1, 2, 3, 4, 1), old))
    names = CodeNames()
    assert names.get(view, 0x1000) is old
    assert names.get(view, 0x1000) is old and view.reads == 1
    # WHEN another code object takes its address (other names, other first line)
    view.current = ((1, 5, 6, 4, 7), new)
    # THEN it is read and named as itself
    assert names.get(view, 0x1000) is new and view.reads == 2


# ---- the layout against DWARF ---------------------------------------------


class Types:
    """The types of the compilation unit holding ``function``, from its
    file's DWARF (pyelftools): structures and typedefs by name, enumerators."""

    def __init__(self, debug: Path, function: str, symbols: Path | None = None) -> None:
        with (symbols or debug).open("rb") as stream:
            table = ELFFile(stream).get_section_by_name(".dynsym")
            assert isinstance(table, SymbolTableSection)
            address = table.get_symbol_by_name(function)[0]["st_value"]
        self.stream = debug.open("rb")
        info = ELFFile(self.stream).get_dwarf_info()
        unit = info.get_CU_at(info.get_aranges().cu_offset_at_addr(address))
        self.named: dict[str, DIE] = {}
        self.enumerators: dict[str, int] = {}
        for die in unit.iter_DIEs():
            name = die.attributes.get("DW_AT_name")
            if die.tag == "DW_TAG_enumerator":
                self.enumerators[name.value.decode()] = die.attributes["DW_AT_const_value"].value
            elif (die.tag in ("DW_TAG_structure_type", "DW_TAG_typedef") and name
                  and "DW_AT_declaration" not in die.attributes):  # fmt: skip
                self.named.setdefault(name.value.decode(), die)

    def close(self) -> None:
        self.stream.close()

    @staticmethod
    def _struct(die: DIE) -> DIE:
        while die.tag in ("DW_TAG_typedef", "DW_TAG_const_type", "DW_TAG_volatile_type"):
            die = die.get_DIE_from_attribute("DW_AT_type")
        return die

    def _member(self, struct: DIE, name: str) -> DIE | None:
        for member in self._struct(struct).iter_children():
            named = member.attributes.get("DW_AT_name")
            if named is not None and named.value == name.encode():
                return member
        return None

    def offset(self, type_name: str, *path: str) -> int | None:
        """The byte offset of member ``path`` (nested) in ``type_name``;
        None when it has no such member."""
        die, total = self.named[type_name], 0
        for name in path:
            member = self._member(die, name)
            if member is None:
                return None
            total += member.attributes["DW_AT_data_member_location"].value
            die = member.get_DIE_from_attribute("DW_AT_type")
        return total

    def bit(self, type_name: str, field: str, name: str) -> int | None:
        """The bit offset of bit-field ``name`` in member ``field``."""
        holder = self._member(self.named[type_name], field)
        assert holder is not None
        member = self._member(holder.get_DIE_from_attribute("DW_AT_type"), name)
        return None if member is None else member.attributes["DW_AT_data_bit_offset"].value

    def size(self, type_name: str) -> int:
        return int(self._struct(self.named[type_name]).attributes["DW_AT_byte_size"].value)


def dwarf_layout(types: Types) -> dict[str, Any]:
    """Layout's fields as the build's DWARF has them (its headers' names)."""

    def either(type_name: str, *names: str) -> int | None:
        """The offset of the first of ``names`` the type has (a member renamed)."""
        offsets = [types.offset(type_name, name) for name in names]
        return next((offset for offset in offsets if offset is not None), None)

    cframe = types.offset("_ts", "cframe")
    tss = types.offset("pyruntimestate", "autoTSSkey")
    if tss is None:  # 3.11: in the GIL state
        tss = types.offset("pyruntimestate", "gilstate", "autoTSSkey")
    assert tss is not None
    frame = "_PyInterpreterFrame"
    return {
        "tss_key": tss + (types.offset("_Py_tss_t", "_key") or 0),
        "interpreters_head": types.offset("pyruntimestate", "interpreters", "head"),
        "interpreter_next": types.offset("_is", "next"),
        "threads_head": types.offset("_is", "threads", "head"),
        "thread_next": types.offset("_ts", "next"),
        "thread_id": types.offset("_ts", "thread_id"),
        "tstate_cframe": cframe,
        "current_frame": types.offset("_ts" if cframe is None else "_PyCFrame", "current_frame"),
        "frame_code": either(frame, "f_code", "f_executable"),
        "frame_previous": types.offset(frame, "previous"),
        "frame_instr": either(frame, "prev_instr", "instr_ptr"),
        "frame_owner": types.offset(frame, "owner"),
        "frame_is_entry": types.offset(frame, "is_entry"),
        "owner_cstack": types.enumerators.get("FRAME_OWNED_BY_CSTACK"),
        "object_type": types.offset("_object", "ob_type"),
        "code_adaptive": types.offset("PyCodeObject", "co_code_adaptive"),
        "code_filename": types.offset("PyCodeObject", "co_filename"),
        "code_name": types.offset("PyCodeObject", "co_name"),
        "code_qualname": types.offset("PyCodeObject", "co_qualname"),
        "code_firstlineno": types.offset("PyCodeObject", "co_firstlineno"),
        "code_linetable": types.offset("PyCodeObject", "co_linetable"),
        "unicode_length": types.offset("PyASCIIObject", "length"),
        "unicode_state": types.offset("PyASCIIObject", "state"),
        "unicode_kind_shift": types.bit("PyASCIIObject", "state", "kind"),
        "unicode_compact_bit": types.bit("PyASCIIObject", "state", "compact"),
        "unicode_ascii_bit": types.bit("PyASCIIObject", "state", "ascii"),
        "unicode_ready_bit": types.bit("PyASCIIObject", "state", "ready"),
        "unicode_ascii_data": types.size("PyASCIIObject"),
        "unicode_compact_data": types.size("PyCompactUnicodeObject"),
        "bytes_size": types.offset("PyBytesObject", "ob_base", "ob_size"),
        "bytes_data": types.offset("PyBytesObject", "ob_sval"),
    }  # fmt: skip


@pytest.mark.parametrize("name", WITH_DWARF)
def test_every_offset_is_the_one_the_build_s_dwarf_gives(name: str) -> None:
    # GIVEN a build with DWARF, and the types of its Python/pystate.c
    _, file = interpreter_files(name)
    types = Types(file, "PyGILState_GetThisThreadState")
    try:
        expected = dwarf_layout(types)
    finally:
        types.close()
    # WHEN its interpreter is found (no DWARF is read for it)
    interpreter = find_interpreter(file)
    assert interpreter is not None
    # THEN every offset of its layout is the DWARF's (3.13's tss_key is 2160 + 4)
    fields = {field.name for field in dataclasses.fields(Layout)} - {"version", "free_threaded"}
    assert set(expected) == fields
    assert {field: getattr(interpreter.layout, field) for field in fields} == expected
    assert not interpreter.layout.free_threaded


@pytest.mark.parametrize("name", list(INTERPRETERS))
def test_the_eval_loop_s_ranges_are_its_symbols(name: str) -> None:
    # GIVEN the interpreter's file, its symbols parsed one by one by pyelftools
    _, file = interpreter_files(name)
    with file.open("rb") as stream:
        elf = ELFFile(stream)
        symbols = {}
        for section_name in (".dynsym", ".symtab"):
            section = elf.get_section_by_name(section_name)
            if isinstance(section, SymbolTableSection):
                for symbol in section.iter_symbols():
                    symbols[symbol.name] = (symbol["st_value"], symbol["st_size"])
    # WHEN its interpreter is found
    interpreter = find_interpreter(file)
    assert interpreter is not None
    # THEN its eval ranges are _PyEval_EvalFrameDefault, and its .cold part if named
    parts = ["_PyEval_EvalFrameDefault", "_PyEval_EvalFrameDefault.cold"]
    assert interpreter.eval_ranges == tuple(
        (symbols[part][0], symbols[part][0] + symbols[part][1]) for part in parts if part in symbols
    )
    assert interpreter.runtime == symbols["_PyRuntime"][0]
    assert interpreter.code_type == symbols["PyCode_Type"][0]


# ---- the libc's key slots ---------------------------------------------------


def test_a_key_s_slot_is_where_the_libc_s_debug_info_puts_it(tmp_path: Path) -> None:
    # GIVEN the machine's libc
    needs(LIBC.is_file(), str(LIBC))
    # WHEN pthread_getspecific's code is read for where a key's value is
    base, stride = thread_slot(LIBC)
    build = build_id_of(LIBC)
    debug = build_id_path(build) if build else None
    if debug is not None and debug.is_file():
        # THEN it is struct pthread's specific_1stblock[key].data (libc6-dbg's DWARF)
        types = Types(debug, "pthread_getspecific", symbols=LIBC)
        try:
            block = types.offset("pthread", "specific_1stblock")
            data = types.offset("pthread_key_data", "data")
            size = types.size("pthread_key_data")
        finally:
            types.close()
        assert block is not None and data is not None
        assert (base, stride) == (block + data, size)
        return
    # THEN (no debug file) a live interpreter's threads find their states there
    program, _ = interpreter_files("debian-3.11")
    script = tmp_path / "chain.py"
    script.write_text(CHILD, encoding="utf-8")
    with launched(program, script) as process:
        live = read_child("debian-3.11", process, program)
        [(interpreter, bias)] = interpreters_of(live.pid)
        with ProcessView(live.pid, interpreter, bias) as view:
            key = struct.unpack("<I", view.read(view.runtime + interpreter.layout.tss_key, 4))[0]
            for tstate, thread in view.thread_states():
                assert view.pointer(thread + base + key * stride) == tstate


def test_a_file_without_pthread_getspecific_is_refused_in_one_line() -> None:
    with pytest.raises(UnknownLayoutError, match=r"^[^\n]*pthread_getspecific[^\n]*$"):
        thread_slot(Path("/bin/true"))


# ---- files without a known interpreter ------------------------------------


def test_a_file_without_an_interpreter_holds_none() -> None:
    assert find_interpreter(Path("/bin/true")) is None
    needs(LIBC.is_file(), str(LIBC))
    assert find_interpreter(LIBC) is None


def test_an_interpreter_older_than_3_11_is_refused_in_one_line() -> None:
    needs(PYTHON_3_10.is_file(), str(PYTHON_3_10))
    with pytest.raises(UnknownLayoutError, match=r"^[^\n]*3\.10 or older[^\n]*$"):
        find_interpreter(PYTHON_3_10)


def patched(source: Path, target: Path, symbol: str, at: int, value: int) -> Path:
    """A copy of ``source`` with the 8 bytes ``at`` into ``symbol``'s data
    set to ``value`` (the file offset found by pyelftools)."""
    shutil.copyfile(source, target)
    with source.open("rb") as stream:
        elf = ELFFile(stream)
        table = elf.get_section_by_name(".dynsym")
        assert isinstance(table, SymbolTableSection)
        address = table.get_symbol_by_name(symbol)[0]["st_value"] + at
        offset = next(o for o in elf.address_offsets(address))
    with target.open("r+b") as stream:
        stream.seek(offset)
        stream.write(struct.pack("<Q", value))
    return target


@pytest.mark.parametrize(("symbol", "at", "value", "said"), [
    ("_PyRuntime", 16, 1, "free-threaded"),  # _Py_DebugOffsets.free_threaded
    ("Py_Version", 0, 0x030E00F0, "3.14.0"),
])  # fmt: skip
def test_a_3_13_build_it_cannot_read_is_refused_in_one_line(
    tmp_path: Path, symbol: str, at: int, value: int, said: str
) -> None:
    # GIVEN 3.13's libpython made free-threaded, or of version 3.14
    _, file = interpreter_files("pyenv-3.13.0")
    made_up = patched(file, tmp_path / file.name, symbol, at, value)
    # THEN finding its interpreter fails, saying why in one line
    with pytest.raises(UnknownLayoutError, match=rf"^[^\n]*{said}[^\n]*$"):
        find_interpreter(made_up)


# ---- the location table against CPython's own decoder ------------------------


def code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from code_objects(constant)


STDLIB = Path(os.__file__).parent
MODULES = ["argparse.py", "dataclasses.py", "asyncio/base_events.py", "json/decoder.py"]


def test_every_instruction_s_line_is_the_one_cpython_gives() -> None:
    # GIVEN the code objects of a few stdlib modules, compiled here
    checked, no_line, backwards = 0, 0, 0
    for module in MODULES:
        top = compile((STDLIB / module).read_text(), str(STDLIB / module), "exec")
        for code in code_objects(top):
            positions = list(code.co_positions())
            assert len(positions) == len(code.co_code) // 2
            # THEN each instruction's line is what co_positions() says
            lines = [line_of(code.co_linetable, code.co_firstlineno, i)
                     for i in range(len(positions))]  # fmt: skip
            assert lines == [position[0] for position in positions], code.co_qualname
            # AND what co_lines() says of each range
            for start, end, line in code.co_lines():
                assert lines[start // 2 : end // 2] == [line] * ((end - start) // 2)
            # AND past the last instruction there is no line
            assert line_of(code.co_linetable, code.co_firstlineno, len(positions)) is None
            checked += len(positions)
            no_line += lines.count(None)
            known = [line for line in lines if line is not None]
            backwards += sum(b < a for a, b in itertools.pairwise(known))
    # AND the cases that matter were met: instructions with no line, lines going back
    assert checked > 10_000 and no_line > 0 and backwards > 0


def test_an_offset_before_the_first_instruction_is_on_the_first_line() -> None:
    def function() -> int:
        return 1

    code = function.__code__
    assert line_of(code.co_linetable, code.co_firstlineno, -1) == code.co_firstlineno
    assert line_of(b"", 10, 0) is None


def signed_varint(value: int) -> bytes:
    return varint((-value << 1) | 1 if value < 0 else value << 1)


def varint(value: int) -> bytes:
    out = bytearray()
    while value >= 64:
        out.append(64 | value & 63)
        value >>= 6
    out.append(value)
    return bytes(out)


# One entry of a location table: (code, length in code units, line delta, column)
ENTRY = st.tuples(st.integers(0, 15), st.integers(1, 8), st.integers(-300, 300), st.integers(0, 60))


def encoded(code: int, length: int, delta: int, column: int) -> bytes:
    """An entry as Objects/locations.md lays it out (the delta is used by
    codes 13 and 14 only; codes 10-12 move the line by code - 10)."""
    header = bytes([0x80 | code << 3 | (length - 1)])
    if code == 15:
        return header
    if code == 14:
        return header + signed_varint(delta) + varint(0) + varint(column + 1) + varint(column + 2)
    if code == 13:
        return header + signed_varint(delta)
    if code >= 10:
        return header + bytes([column, column + 1])
    return header + bytes([(column & 7) << 4 | 1])


@given(st.lists(ENTRY, max_size=40))
def test_any_location_table_reads_as_cpython_reads_it(entries: list[tuple[int, ...]]) -> None:
    # GIVEN a code object whose location table is made of these entries
    table = b"".join(encoded(*entry) for entry in entries)
    units = sum(length for _, length, _, _ in entries)
    nop = bytes([dis.opmap["NOP"], 0])
    code = (lambda: None).__code__.replace(co_code=nop * units, co_linetable=table,
                                           co_firstlineno=20_000)  # fmt: skip
    # THEN each instruction's line is the one CPython decodes
    expected = [position[0] for position in code.co_positions()]
    assert [line_of(table, 20_000, i) for i in range(units)] == expected
    assert line_of(table, 20_000, units) is None
