"""The Python unwinder, plugged into the trace (tracer/unwind/unwinder.py):
CPython's Python frames in the CFI walk's stacks, in the place of its eval
loop's frames (probes/bpf/python.bpf.c).

For each traced process it finds the interpreter (in the executable or in
a mapped libpython, probes/cpython/), its layout, and where the process's
libc keeps a thread's pthread key values, and writes the process's entry
of python_procs. A running interpreter's layout is checked first by walking
its threads' frames from user space: every code object must be one. A
layout that fails gets one line and native stacks, never wrong names. A
process whose interpreter has not started yet (a command just exec'd) has
its entry written at once, and is checked once its interpreter runs.

A stored Python frame is a code object's address and an instruction's
offset (probes/frame_kinds.py); it is named from the process's memory, the
code object read once (cached by address and checked by its identity).
"""

from __future__ import annotations

import contextlib
import mmap
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mtrace_live.exporters.data.alloc_snapshot import FrameNames
from mtrace_live.exporters.data.processes import proc_dir
from mtrace_live.exporters.data.symbolize import Symbol, python_symbol
from mtrace_live.probes import cpython
from mtrace_live.probes.cpython.interpreter import (
    INTERPRETER,
    LINKS_LIBPYTHON,
    NOT_ELF,
    python_kind,
)
from mtrace_live.probes.elf.lazy import lazy_module
from mtrace_live.probes.elf.maps import read_maps
from mtrace_live.probes.errors import MtraceError, UnknownLayoutError
from mtrace_live.probes.frame_kinds import KIND_PYTHON, in_python
from mtrace_live.probes.program import c_constants, part_constants
from mtrace_live.probes.records import (
    PYTHON_STACK_DTYPE,
    EventKind,
    header_path,
)
from mtrace_live.tracer.bpf.bpf_backend import BpfProgram
from mtrace_live.tracer.bpf.kernel_btf import BtfUnavailable, kernel_facts
from mtrace_live.tracer.bpf.ringbuf import RingReader
from mtrace_live.tracer.processes.providers import every_pid
from mtrace_live.tracer.processes.target import process_state
from mtrace_live.tracer.unwind.unwind_tables import PYTHON as PYTHON_SLOT

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # (at the first use: probes/elf/lazy.py)

_HEADER = c_constants(header_path().read_text())
NO_FIELD, NO_OWNER = _HEADER["PY_NO_FIELD"], _HEADER["PY_NO_OWNER"]
NO_OFFSET = _HEADER["PY_NO_OFFSET"]
MAX_PROCESSES = part_constants("common.bpf.h")["MAX_FOLLOWED"]  # python_procs' entries
# python_procs' value (PYTHON_PROC_DTYPE): eval_lo[2], eval_hi[2], tss_at,
# slot_base, slot_stride, eight field offsets (tstate_cframe ... code_adaptive),
# owner_cstack, pad[7]
_PYTHON_PROC = struct.Struct("<2Q2QQII8HB7x")


def python_defines() -> dict[str, int]:
    """WITH_PYTHON, and where the task keeps its thread pointer (its
    thread.fsbase, from the kernel's BTF); {} where that cannot be read
    (stacks keep the eval loop's frames)."""
    try:
        (thread, fsbase), _ = kernel_facts([("task_struct", "thread"), ("thread_struct", "fsbase")])
    except BtfUnavailable:
        return {}
    if thread is None or fsbase is None or fsbase[1] != 8:
        return {}
    return {"WITH_PYTHON": 1, "TASK_FSBASE_OFF": thread[0] + fsbase[0]}


def runs_python(pids: Sequence[int], argv: Sequence[str] | None) -> bool:
    """Whether one of the processes ``pids``, or the command ``argv``,
    runs a CPython interpreter (in its executable or a libpython it needs):
    its Python frames make many more distinct stacks."""
    for pid in pids:
        try:
            if cpython.interpreters_of(pid):
                return True
        except (MtraceError, OSError):
            continue
    if not argv:
        return False
    import shutil  # (a command's trace only: it imports bz2 and lzma)

    found = shutil.which(argv[0])
    for _ in range(4):  # a script's interpreter, through env and launchers (shims)
        if found is None:
            return False
        try:
            kind = python_kind(Path(found))  # (a kept fact)
            if kind == INTERPRETER:  # (one whose layout is unknown: as if none)
                return cpython.find_interpreter(Path(found)) is not None
            if kind != NOT_ELF:
                return kind == LINKS_LIBPYTHON
        except (MtraceError, OSError):
            pass
        found = _script_interpreter(found)  # not ELF: a script?
    return False


def _script_interpreter(path: str) -> str | None:
    """The program a script's ``#!`` line runs (``/usr/bin/env python3``:
    python3 found on PATH), or None."""
    try:
        with open(path, "rb") as script:
            first = script.readline(256)
    except OSError:
        return None
    words = first[2:].decode(errors="replace").split() if first.startswith(b"#!") else []
    if words and Path(words[0]).name == "env":
        words = [word for word in words[1:] if not word.startswith("-")]
    import shutil

    return shutil.which(words[0]) if words else None


@dataclass
class _Process:
    view: cpython.ProcessView
    checked: bool  # its layout held against its running interpreter
    space: int  # the process whose code objects' names it shares: its own, or its parent's
    ended: bool = False  # its memory is gone (its view closed): its names are what was read


class PythonUnwinder:
    """The Python frames of one trace's CPython processes."""

    name = "python"

    def __init__(self, program: BpfProgram, frame_names: FrameNames,
                 every_process: bool = False) -> None:  # fmt: skip
        """``every_process``: the trace covers every process (--all), whose
        walks may never ask for tables: each one is looked at as it appears
        (at the start, then once a second)."""
        self.program = program
        self.every_process = every_process
        pages = part_constants("python.bpf.c")["PYTHON_STACKS_PAGES"]
        self.stacks = RingReader(program.map_fd("python_stacks"), pages * mmap.PAGESIZE,
                                 PYTHON_STACK_DTYPE)  # fmt: skip
        # unwind_python's slot is set at the first process written (_write):
        # a trace of no Python process never asks for the program, which
        # the verifier takes most of a start's CPU to load (preload.py).
        self._slot_set = False
        frame_names.resolvers[KIND_PYTHON] = self.resolve
        self.processes: dict[int, _Process] = {}
        self.refused: set[int] = set()  # processes whose layout failed: native stacks
        self.considered: set[int] = set()  # processes looked at (each program once)
        self.own: set[int] = set()  # mtrace-live's own processes: never looked at
        self._said: set[str] = set()  # the reasons of the refusals said
        self._slots: dict[tuple[int, int], tuple[int, int]] = {}  # a libc -> its key slots
        self._names = cpython.CodeNames()
        self.counts_: dict[str, int] = {"python_processes": 0, "python_refused": 0}

    def load(self, pid: int) -> None:
        if pid in self.considered:
            return
        self.considered.add(pid)
        try:
            self._load(pid)
        except UnknownLayoutError as exc:
            self._refuse(pid, str(exc))
        except (MtraceError, OSError):  # gone already, or not ours to read: native stacks
            self._drop(pid)

    def _load(self, pid: int) -> None:
        self._drop(pid)  # (an ended one whose pid is taken again)
        found = cpython.interpreters_of(pid)
        if not found:
            return
        interpreter, bias = found[0]
        slot = self._slot(pid)
        if slot is None:
            self._refuse(pid, "its libc's thread keys are not where mtrace-live reads them")
            return
        view = cpython.ProcessView(pid, interpreter, bias)
        self.processes[pid] = _Process(view, False, pid)  # (closed with it, whatever comes)
        started = view.started()
        if started:
            why = view.check(slot)
            if why is not None:
                self._refuse(pid, why)
                return
        if not self._write(pid, interpreter, bias, slot):
            self._refuse(pid, f"no room left for it in python_procs ({MAX_PROCESSES} processes)")
            return
        self.processes[pid].checked = started
        self.counts_["python_processes"] += 1

    def _slot(self, pid: int) -> tuple[int, int] | None:
        """Where the process's libc keeps a thread's pthread key values."""
        for mapping in read_maps(proc_dir(pid)):
            if mapping.path.rsplit("/", 1)[-1].startswith("libc.so"):
                if mapping.inode not in self._slots:
                    self._slots[mapping.inode] = cpython.thread_slot(
                        cpython.mapped_path(pid, mapping)
                    )
                return self._slots[mapping.inode]
        return None

    def _write(self, pid: int, interpreter: cpython.Interpreter, bias: int,
               slot: tuple[int, int]) -> bool:  # fmt: skip
        layout = interpreter.layout
        ranges = [*interpreter.eval_ranges[:2], (0, 0), (0, 0)][:2]
        entry = _PYTHON_PROC.pack(
            *[start + bias if start else 0 for start, _ in ranges],
            *[end + bias if end else 0 for _, end in ranges],
            interpreter.runtime + bias + layout.tss_key - 4, *slot,
            NO_FIELD if layout.tstate_cframe is None else layout.tstate_cframe,
            layout.current_frame, layout.frame_code, layout.frame_previous, layout.frame_instr,
            layout.frame_owner,
            NO_FIELD if layout.frame_is_entry is None else layout.frame_is_entry,
            layout.code_adaptive, NO_OWNER if layout.owner_cstack is None else layout.owner_cstack,
        )  # fmt: skip
        if not self._slot_set:  # (before any walk can find a process to tail-call it for)
            self.program.set_tail_calls("unwind_progs", {PYTHON_SLOT: "unwind_python"})
            self._slot_set = True
        return self.program.set_entry("python_procs", struct.pack("<I", pid), entry)

    def _drop(self, pid: int) -> None:
        """A process no longer read: its view closed."""
        gone = self.processes.pop(pid, None)
        if gone is not None:
            gone.view.close()

    def _refuse(self, pid: int, why: str) -> None:
        """One line; the process's stacks stay native."""
        self.refused.add(pid)
        self._drop(pid)
        self.program.delete_entry("python_procs", struct.pack("<I", pid))
        self.counts_["python_refused"] += 1
        if why in self._said:
            return
        self._said.add(why)  # once per reason: a pre-fork server's workers say the same
        print(f"mtrace-live: warning: process {pid}'s Python frames are not shown: {why}",
              file=sys.stderr, flush=True)  # fmt: skip

    def look_around(self) -> None:
        """Every process not looked at yet (--all)."""
        for pid in every_pid() - self.considered - self.own:
            self.load(pid)

    def refresh(self) -> None:
        """The processes whose interpreter had not started: checked now it
        has; with --all, the processes started since the last look."""
        if self.every_process:
            self.look_around()
        for pid, process in list(self.processes.items()):
            if process.ended:
                continue
            if not process.view.alive():  # its names stay as they were read
                process.view.close()
                process.ended = True
                self.considered.discard(pid)  # (a process that takes its pid is looked at)
                continue
            if process.checked:
                continue
            try:
                if not process.view.started():
                    continue
                slot = self._slot(pid)
                why = process.view.check(slot) if slot is not None else "no libc mapped"
            except (MtraceError, OSError):  # gone: its names stay as they were read
                process.checked = True
                continue
            if why is not None:
                self._refuse(pid, why)
            else:
                process.checked = True

    def handle(self, records: np.ndarray, kinds: np.ndarray) -> None:
        """Each process the records come from, its interpreter looked for
        once per program (a process that asks for its tables, or, where
        the walks find mappings in the kernel and do not ask, one seen
        first): a fork's child is read as its parent (its entry was given
        in the kernel)."""
        asks = records[kinds == EventKind.UNWIND]
        execs = records["tgid"][kinds == EventKind.EXEC].tolist()
        for pid in execs:  # a new program: its entry is gone in the kernel
            self._drop(pid)
            self.refused.discard(pid)
            self.considered.discard(pid)
        forked = asks[asks["nargs"] > 0]
        for child, parent in zip(forked["tgid"].tolist(), forked["args"][:, 0].tolist(),
                                 strict=True):  # fmt: skip
            self._inherit(child, parent)
        for pid in np.unique(records["tgid"]).tolist():
            if pid not in self.considered:
                self.load(pid)
        self.pump()  # (before a process held at its exit is let go)

    def fds(self) -> list[int]:
        return [self.stacks.fd]

    def pump(self) -> None:
        """The stacks with Python frames stored since: their code objects
        read while they live."""
        new = self.stacks.read()
        if len(new):
            self._read_codes(new["tgid"].tolist(), new["stack"].tolist())

    def _inherit(self, child: int, parent: int) -> None:
        """A forked child runs its parent's interpreter at the same
        addresses (its entry was given in the kernel): read as its parent's."""
        theirs = self.processes.get(parent)
        if theirs is None or child in self.processes:
            return
        self.considered.add(child)
        view = theirs.view
        bias = view.runtime - view.interpreter.runtime
        mine = cpython.ProcessView(child, view.interpreter, bias, required=False)
        self.processes[child] = _Process(
            mine, theirs.checked, theirs.space, ended=not mine.alive()
        )  # (named as its parent)

    def _discovered(self, pid: int) -> _Process | None:
        """A process whose stacks came before its ask (or with none): read
        as its parent if that is a known interpreter's (a fork), else looked
        at as any other."""
        if pid in self.considered:
            return None
        state = process_state(pid)
        parent = state[1] if state is not None else None
        if parent in self.processes:
            self._inherit(pid, parent)
        else:
            self.load(pid)
        return self.processes.get(pid)

    def _read_codes(self, tgids: list[int], stacks: list[int]) -> None:
        """The code objects of stacks just stored, read while they live."""
        for tgid, stack in sorted(set(zip(tgids, stacks, strict=True))):
            process = self.processes.get(tgid) or self._discovered(tgid)
            if process is None or stack < 0:
                continue
            for frame in self.program.tables.stack(stack):
                where = in_python(frame)
                if where is not None:
                    self._names.get(process.view, where[0], process.space)

    def resolve(self, tgid: int, frame: int) -> Symbol | None:
        """A Python frame's name: its function's qualified name, file and line."""
        where = in_python(frame)
        process = self.processes.get(tgid)
        if where is None or process is None:
            return None
        code, offset = where
        info = self._names.get(process.view, code, process.space)
        if info is None:
            return None
        line = info.line(offset) if offset != NO_OFFSET else None
        return python_symbol(
            info.qualname, info.filename, line if line is not None else info.firstlineno
        )

    def settle(self) -> None:
        """The last stacks said: their code objects read, if they still can
        be. (The trace is ending, perhaps on a fault of its own: only these
        names are lost if this fails, never the outputs.)"""
        with contextlib.suppress(Exception):
            self.pump()

    def counts(self) -> dict[str, int]:
        return dict(self.counts_)

    def debug_lines(self) -> list[str]:
        return [f"python: {len(self.processes)} processes, {len(self.refused)} refused"]

    def close(self, rest: bool = True) -> None:
        self.stacks.close()
        for process in self.processes.values():
            process.view.close()
