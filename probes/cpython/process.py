"""A running CPython process read from outside, through /proc/PID/mem,
without stopping it: its thread states, each thread's Python frames (as the
kernel's walk will find them: code object and instruction offset), the
layout checked against what is really there, and the code objects named.

The process keeps running while it is read, so a walk may meet a frame
being pushed or popped: the walks are bounded, stop at a loop, and read
each structure whole in one read.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from ..errors import TargetError
from .interpreter import Interpreter
from .linetable import line_of
from .threads import FIRST_BLOCK

MAX_FRAMES = 1024  # a thread's frames walked, at most
MAX_THREADS = 4096  # thread states, over all interpreters
MAX_INTERPRETERS = 256
MAX_TEXT = 1 << 16  # code points of a name read, at most
MAX_LINETABLE = 1 << 20  # bytes of a location table read, at most


@dataclass(frozen=True)
class CodeInfo:
    """What names a code object's frames."""

    qualname: str  # co_qualname, "Class.method"
    filename: str  # co_filename
    firstlineno: int  # co_firstlineno
    linetable: bytes  # co_linetable, the location table

    def line(self, offset_units: int) -> int | None:
        """The line of the instruction at ``offset_units`` code units."""
        return line_of(self.linetable, self.firstlineno, offset_units)


class ProcessView:
    """The memory of process ``pid``, whose ``interpreter`` is loaded with
    ``bias`` (as ``interpreters_of`` gives them). TargetError when its
    memory cannot be opened (gone, or not ours to read). Close it, or use it
    as a context manager."""

    def __init__(self, pid: int, interpreter: Interpreter, bias: int,
                 required: bool = True) -> None:  # fmt: skip
        """``required`` False: a process whose memory cannot be opened (it
        ended) gives a view that reads nothing, not TargetError."""
        self.pid = pid
        self.interpreter = interpreter
        self.layout = interpreter.layout
        self.runtime = interpreter.runtime + bias
        self.code_type = interpreter.code_type + bias
        self.str_type = interpreter.str_type + bias if interpreter.str_type else 0
        self.bytes_type = interpreter.bytes_type + bias if interpreter.bytes_type else 0
        try:
            self._memory = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            if not required:
                self._memory = -1
                return
            raise TargetError(f"process {pid}: its memory cannot be opened "
                              f"({exc.strerror})") from None  # fmt: skip

    def alive(self) -> bool:
        """Whether the process it was opened on still has its memory (a
        process that ended reads nothing, whoever has its pid since)."""
        try:
            return self._memory >= 0 and len(os.pread(self._memory, 1, self.runtime)) == 1
        except OSError:
            return False

    def close(self) -> None:
        if self._memory >= 0:
            os.close(self._memory)
            self._memory = -1

    def __enter__(self) -> ProcessView:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ---- memory --------------------------------------------------------

    def read(self, address: int, size: int) -> bytes:
        """``size`` bytes at ``address``; TargetError when they cannot be read."""
        try:
            data = os.pread(self._memory, size, address)
        except (OSError, OverflowError, ValueError) as exc:
            raise TargetError(f"process {self.pid}: {address:#x} cannot be read "
                              f"({getattr(exc, 'strerror', None) or exc})") from None  # fmt: skip
        if len(data) != size:
            raise TargetError(f"process {self.pid}: {address:#x} cannot be read (cut short)")
        return data

    def pointer(self, address: int) -> int:
        value: int = struct.unpack("<Q", self.read(address, 8))[0]
        return value

    # ---- threads and frames --------------------------------------------

    def thread_states(self) -> list[tuple[int, int]]:
        """(address, thread_id) of each thread state of each interpreter,
        newest first. TargetError when the memory cannot be read."""
        layout = self.layout
        found: list[tuple[int, int]] = []
        interpreters: set[int] = set()
        interpreter = self.pointer(self.runtime + layout.interpreters_head)
        while interpreter and interpreter not in interpreters:
            interpreters.add(interpreter)
            if len(interpreters) > MAX_INTERPRETERS:
                break
            tstate = self.pointer(interpreter + layout.threads_head)
            seen: set[int] = set()
            while tstate and tstate not in seen and len(found) < MAX_THREADS:
                seen.add(tstate)
                found.append((tstate, self.pointer(tstate + layout.thread_id)))
                tstate = self.pointer(tstate + layout.thread_next)
            interpreter = self.pointer(interpreter + layout.interpreter_next)
        return found

    def started(self) -> bool:
        """The interpreter has a thread state: it has been initialised (a
        command just exec'd, or a program that maps libpython without running
        it, has none yet). TargetError when the memory cannot be read."""
        return bool(self.thread_states())

    def frames(self, tstate: int) -> list[tuple[int, int]]:
        """(code object's address, instruction offset in code units) of each
        Python frame of the thread state at ``tstate``, innermost first; the
        shim frames an eval loop pushes at its entry (3.12+) are left out.
        At most 1024; a chain that loops is followed once. TargetError when
        the memory cannot be read."""
        return self._walk(tstate)[0]

    def _walk(self, tstate: int) -> tuple[list[tuple[int, int]], str | None]:
        """The frames, and what stopped the walk short (None: its end)."""
        layout = self.layout
        if layout.tstate_cframe is not None:
            cframe = self.pointer(tstate + layout.tstate_cframe)
            frame = self.pointer(cframe + layout.current_frame) if cframe else 0
        else:
            frame = self.pointer(tstate + layout.current_frame)
        size = max(layout.frame_code, layout.frame_previous, layout.frame_instr,
                   layout.frame_owner) + 8  # fmt: skip
        found: list[tuple[int, int]] = []
        seen: set[int] = set()
        while frame:
            if frame in seen:
                return found, f"the frames of thread state {tstate:#x} loop at {frame:#x}"
            if len(seen) == MAX_FRAMES:
                return found, f"thread state {tstate:#x} has over {MAX_FRAMES} frames"
            seen.add(frame)
            data = self.read(frame, size)
            if data[layout.frame_owner] != layout.owner_cstack:
                code, instr = (
                    _pointer_in(data, layout.frame_code),
                    _pointer_in(data, layout.frame_instr),
                )
                found.append((code, (instr - code - layout.code_adaptive) // 2))
            frame = _pointer_in(data, layout.frame_previous)
        return found, None

    def check(self, slot: tuple[int, int]) -> str | None:
        """None when the layout holds for this process: every thread state's
        thread finds it under the thread-state key (at ``thread_id + base +
        key * stride``, ``slot`` being the libc's ``(base, stride)``), and
        every frame of every thread names a code object. Else one line that
        says what failed. A thread state no thread has taken yet (thread_id
        0) is passed over."""
        base, stride = slot
        layout = self.layout
        try:
            states = self.thread_states()
            if not states:
                return f"process {self.pid}: no thread state under _PyRuntime at {self.runtime:#x}"
            key = struct.unpack("<I", self.read(self.runtime + layout.tss_key, 4))[0]
            if key >= FIRST_BLOCK:
                return (f"process {self.pid}: the thread-state key is {key}, past the "
                        f"{FIRST_BLOCK} a thread keeps in place")  # fmt: skip
            for tstate, thread in states:
                if not thread:
                    continue
                held = self.pointer(thread + base + key * stride)
                if held != tstate:
                    return (f"process {self.pid}: thread {thread:#x} holds {held:#x} under "
                            f"the thread-state key {key}, not its thread state "
                            f"{tstate:#x}")  # fmt: skip
                frames, stopped = self._walk(tstate)
                if stopped:
                    return f"process {self.pid}: {stopped}"
                for code, _ in frames:
                    kind = self.pointer(code + layout.object_type)
                    if kind != self.code_type:
                        return (f"process {self.pid}: a frame of thread {thread:#x} has "
                                f"{code:#x}, of type {kind:#x}, not a code object "
                                f"(PyCode_Type is at {self.code_type:#x})")  # fmt: skip
        except TargetError as exc:
            return str(exc)
        return None

    # ---- code objects ----------------------------------------------------

    def identity(self, address: int) -> tuple[int, ...] | None:
        """The words that tell one code object from another at the same
        address: its type, name, qualname, filename and location table
        (their addresses) and its first line; None when unreadable or not a
        code object."""
        layout = self.layout
        try:
            data = self.read(address, layout.code_adaptive)
        except TargetError:
            return None
        if _pointer_in(data, layout.object_type) != self.code_type:
            return None
        return (
            *(_pointer_in(data, offset) for offset in (layout.code_name, layout.code_qualname,
                                                 layout.code_filename, layout.code_linetable)),
            struct.unpack_from("<i", data, layout.code_firstlineno)[0],
        )  # fmt: skip

    def code(self, address: int) -> CodeInfo | None:
        """The code object at ``address`` named; None when it is not a code
        object, or cannot be read."""
        layout = self.layout
        try:
            data = self.read(address, layout.code_adaptive)
            if _pointer_in(data, layout.object_type) != self.code_type:
                return None
            qualname = self._str(_pointer_in(data, layout.code_qualname))
            filename = self._str(_pointer_in(data, layout.code_filename))
            linetable = self._bytes(_pointer_in(data, layout.code_linetable))
        except TargetError:
            return None
        if qualname is None or filename is None or linetable is None:
            return None
        firstlineno = struct.unpack_from("<i", data, layout.code_firstlineno)[0]
        return CodeInfo(qualname, filename, firstlineno, linetable)

    def _str(self, address: int) -> str | None:
        """A compact str's text (every name a code object holds is one)."""
        layout = self.layout
        header = self.read(address, layout.unicode_ascii_data)
        if self.str_type and _pointer_in(header, layout.object_type) != self.str_type:
            return None
        state = struct.unpack_from("<I", header, layout.unicode_state)[0]
        length = struct.unpack_from("<q", header, layout.unicode_length)[0]
        kind = state >> layout.unicode_kind_shift & 7
        ready = layout.unicode_ready_bit is None or state >> layout.unicode_ready_bit & 1
        if not (state >> layout.unicode_compact_bit & 1 and ready) or not 0 <= length <= MAX_TEXT:
            return None
        if state >> layout.unicode_ascii_bit & 1:
            return self.read(address + layout.unicode_ascii_data, length).decode("ascii", "replace")
        encoding = {1: "latin-1", 2: "utf-16-le", 4: "utf-32-le"}.get(kind)
        if encoding is None:
            return None
        text = self.read(address + layout.unicode_compact_data, length * kind)
        try:
            return text.decode(encoding, "surrogatepass")
        except UnicodeDecodeError:  # not a str's text (freed and reused meanwhile)
            return text.decode(encoding, "replace")

    def _bytes(self, address: int) -> bytes | None:
        layout = self.layout
        header = self.read(address, layout.bytes_data)
        if self.bytes_type and _pointer_in(header, layout.object_type) != self.bytes_type:
            return None
        size = struct.unpack_from("<q", header, layout.bytes_size)[0]
        if not 0 <= size <= MAX_LINETABLE:
            return None
        return self.read(address + layout.bytes_data, size)


class CodeNames:
    """Code objects named once: CodeInfo by (pid, address), kept while the
    object there has the same identity (``ProcessView.identity``), so that
    an address a freed code object's successor took is named anew. At most
    ``limit`` kept; the oldest go first."""

    def __init__(self, limit: int = 1 << 16) -> None:
        self.limit = limit
        self._kept: dict[tuple[int, int], tuple[tuple[int, ...], CodeInfo]] = {}

    def get(self, view: ProcessView, address: int, space: int | None = None) -> CodeInfo | None:
        """The code object at ``address`` in ``view``'s process, named; as
        named before where it cannot be read now (the process ended, or
        the object was freed since its frames were stored). ``space``: the
        process whose names it shares (a forked child's code objects are
        its parent's, at the same addresses), else its own."""
        identity = view.identity(address)
        key = (view.pid if space is None else space, address)
        kept = self._kept.get(key)
        if kept is not None and (identity is None or kept[0] == identity):
            return kept[1]
        if identity is None:
            return None
        info = view.code(address)
        if info is None or view.identity(address) != identity:
            self._kept.pop(key, None)  # gone, or changed while read
            return info
        if key not in self._kept and len(self._kept) >= self.limit:
            del self._kept[next(iter(self._kept))]
        self._kept[key] = (identity, info)
        return info


def _pointer_in(data: bytes, offset: int) -> int:
    value: int = struct.unpack_from("<Q", data, offset)[0]
    return value
