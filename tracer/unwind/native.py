"""The native unwinder, plugged into the trace (tracer/unwind/unwinder.py):
stacks walked by the mapped files' call-frame information in the kernel
(probes/bpf/unwind.bpf.c), over the tables of tracer/unwind/unwind_tables.py.

It owns the unwinder's programs in their tail-call slots (the consumers'
resumptions among them), the ring of the mappings the walks found in the
kernel (UNWIND_VMA) and the file server that answers those asks, and keeps
the frames' names in step with the tables: a fork named by its parent's
maps, an exec by its own, a mapping found in the kernel named even once
its process is gone.
"""

from __future__ import annotations

import functools
import mmap
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mtrace_live.exporters.data.alloc_snapshot import FrameNames
from mtrace_live.probes.elf.lazy import lazy_module
from mtrace_live.probes.program import part_constants
from mtrace_live.probes.records import EVENT_DTYPE, EventKind
from mtrace_live.tracer.bpf.bpf_backend import BpfProgram
from mtrace_live.tracer.bpf.ringbuf import RingReader
from mtrace_live.tracer.processes.holds import Holds
from mtrace_live.tracer.unwind.file_server import MAPS, FileServer, region
from mtrace_live.tracer.unwind.unwind_tables import (
    RESUME_ALLOC,
    RESUME_LOCK,
    STEP,
    VMA_LOOKUP,
    UnwindTables,
    attach_dlopen,
    own_loader,
)

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # (at the first use: probes/elf/lazy.py)

# the consumers' resumptions, by the slot unwind.bpf.c resumes them at
RESUMPTIONS = {"allocs": (RESUME_ALLOC, "alloc_resume"), "locks": (RESUME_LOCK, "lock_resume")}


class NativeUnwinder:
    """The CFI unwinder of one trace: its programs set, its tables written
    as the processes come, its asks served."""

    name = "native"
    found_ring: RingReader | None = None
    file_server: FileServer | None = None

    def __init__(self, program: BpfProgram, defines: dict[str, int], libc: Path,
                 consumers: list[str], holds: Holds | None, frame_names: FrameNames,
                 written: Callable[[int], None], pid: int = -1,
                 notices: list[str] | None = None) -> None:  # fmt: skip
        """``consumers``: the parts whose handlers start walks ("allocs",
        "locks"); ``written``: called with a process whose tables were
        written (its names and allocator are read while it lives);
        ``pid``: the one process the dlopen probes are for (-1: any)."""
        self.frame_names = frame_names
        slots = {STEP: "unwind_step"}
        if defines.get("UNWIND_VMA"):
            slots[VMA_LOOKUP] = "unwind_vma"
        slots.update(RESUMPTIONS[each] for each in consumers)
        program.set_tail_calls("unwind_progs", slots)
        attach_dlopen(program, libc, pid)
        # the tables' sizes, as the program has them (--unwind-rows)
        sizes = functools.partial(UnwindTables, program, rows=defines["UNWIND_ROWS"],
                                  maps=defines["UNWIND_MAPS"], pages=defines["UNWIND_PAGES"],
                                  holds=holds, written=written)  # fmt: skip
        # A process's maps are read for its names whenever its tables are
        # written (its first call, a dlopen, a change seen each second): a
        # process that was never held is named after it is gone from those.
        if not defines.get("UNWIND_VMA"):
            self.tables = sizes()
        else:
            try:
                self.tables = self._serving(program, defines, libc, sizes, notices)
            except BaseException:
                if self.file_server is not None:
                    self.file_server.close()
                raise
        frame_names.files = self.tables.file_frames

    def _serving(self, program: BpfProgram, defines: dict[str, int], libc: Path,
                 sizes: Callable[..., UnwindTables],
                 notices: list[str] | None) -> UnwindTables:  # fmt: skip
        """The tables, with the ring of the mappings the walks find in the
        kernel and the file server that writes the files they ask for."""
        pages = part_constants("unwind_vma.bpf.c")["UNWIND_FOUND_PAGES"]
        self.found_ring = RingReader(program.map_fd("unwind_found"),
                                     pages * mmap.PAGESIZE, EVENT_DTYPE)  # fmt: skip
        rows, page_entries = region(defines["UNWIND_ROWS"]), region(defines["UNWIND_PAGES"])
        tables = sizes(found=self.found_ring.read, server_rows=rows[1] - rows[0],
                       server_pages=page_entries[1] - page_entries[0])  # fmt: skip
        for path in (libc, *own_loader()):  # in most stacks: written before any walk asks
            tables.publish_path(path)
        try:
            self.file_server = FileServer({name: program.map_fd(name) for name in MAPS},
                                          rows, page_entries)  # fmt: skip
            tables.server = self.file_server.alive
        except OSError as exc:  # the trace's own threads serve every ask, in all the room
            tables.rows_room.grow(rows[1])
            tables.pages_room.grow(page_entries[1])
            if notices is not None:
                notices.append(
                    f"the file server could not be started ({exc.strerror}): "
                    "files asked for by stack walks are written by the trace"
                )
        tables.serve_in_background(self.found_ring.fd)
        return tables

    def load(self, pid: int) -> None:
        self.tables.load(pid)

    def refresh(self) -> None:
        self.tables.refresh()

    def handle(self, records: np.ndarray, kinds: np.ndarray) -> None:
        """The processes that asked for their unwind tables: written. One
        forked with its parent's tables says which parent (named by its maps
        if it is gone before its own are read); a new program (an exec) asks
        with none: its maps are its own."""
        if self.tables.failure is not None:  # a serving thread's: the trace ends on it
            raise self.tables.failure
        self._mappings_learned()
        asks = records[kinds == EventKind.UNWIND]
        forked = asks[asks["nargs"] > 0]
        parents = forked["args"][:, 0].tolist()
        for child, parent in zip(forked["tgid"].tolist(), parents, strict=True):
            self.frame_names.inherit(child, parent)
        anew = asks["tgid"][asks["nargs"] == 0].tolist()
        self.frame_names.disinherit(anew + records["tgid"][kinds == EventKind.EXEC].tolist())
        self.tables.tables_wanted(sorted(set(asks["tgid"].tolist())))

    def fds(self) -> list[int]:
        return []  # (its ring is read by the tables' serving thread)

    def pump(self) -> None:
        pass

    def _mappings_learned(self) -> None:
        """The mappings the walks found in the kernel: each names its
        process's frames there if it is gone before its maps are read."""
        learned = self.tables.learned
        while learned:
            found, path = learned.popleft()
            self.frame_names.learn(found.pid, found.mapping(path))

    def settle(self) -> None:
        """The last mappings found, for the names."""
        self.tables.stop_serving()
        self._mappings_learned()

    def counts(self) -> dict[str, int]:
        return self.tables.table_counts()

    def debug_lines(self) -> list[str]:
        files, rows = self.tables.counts["files"], self.tables.rows_room.used
        return [f"unwind tables: {files} files, {rows} rows, written in "
                f"{self.tables.load_s:.3f} s"]  # fmt: skip

    def close(self, rest: bool = True) -> None:
        self.tables.stop_serving(rest=rest)
        if self.file_server is not None:
            self.file_server.close()
