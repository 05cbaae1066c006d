"""The trace program's configuration, and the one text bcc compiles.

The trace program is in parts under ``bpf/``, one concern each (``PARTS``).
bcc rewrites map calls only in the main source file, so the loader joins the
parts into one file (``main_file``) instead of #including them; the headers beside them
(``records.h``, ``set_table.h``) hold no maps and are #included.

``ProgramConfig`` holds every switch of the program. The live trace and
``count`` both build one, and it gives the parts and the settings. Those
``runtime.h`` names are run-time values, written into the code at each load
(tracer/bpf/bpf_cache.py ``specialize``), and the tables' sizes
(``RUNTIME_SIZES``) are the sizes the loader makes the maps at; the others
are ``-D`` defines. The program cache's key covers the joined text, every
header and the defines, not the run-time values or sizes: one compiled
program serves them all.
"""

from __future__ import annotations

import functools
import mmap
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

# In the order they are joined: the common header first, then each concern.
PARTS = (
    "common.bpf.h",  # settings, shared maps, process filter and lifecycle
    "sdt.bpf.c",  # the libc's SDT sites
    "derived.bpf.c",  # memory_* probes derived from system calls
    "kmem.bpf.c",  # the kmem tracepoints
    "frames.bpf.c",  # the stacks the handlers walk themselves
    "unwind.bpf.c",  # ... by the mapped files' CFI
    "unwind_dlopen.bpf.c",  # ... and its tables again when a library is mapped
    "unwind_vma.bpf.c",  # ... where the process's tables lack a mapping: the kernel's VMA
    "python.bpf.c",  # ... with the Python frames of CPython's eval loop in its place
    "allocs.bpf.c",  # the allocation functions
    "holds.bpf.c",  # processes stopped until user space has done its part
    "locks.bpf.c",  # the waits in the libc's lock-wait slow path, timed
    "vm.bpf.c",  # mmap, munmap, mremap, brk (and the handlers shared with derived)
)
PAGE_SHIFT = mmap.PAGESIZE.bit_length() - 1


def bpf_directory() -> Path:
    # (the package's own directory: importlib.resources, which the package's
    # files being plain files does not need, imports tempfile and zipfile:
    # 6 ms of every start)
    return Path(__file__).resolve().parent / "bpf"


# ``#define NAME 12``, ``#define NAME (8 << 20)``, a comment after it or not
_DEFINE = re.compile(
    r"^#define[ \t]+(\w+)[ \t]+\(?(\d+)(?:[ \t]*<<[ \t]*(\d+))?\)?[ \t]*(?:/\*.*)?$", re.MULTILINE
)


def c_constants(text: str) -> dict[str, int]:
    """The whole-number ``#define``s of C ``text``; a name defined with two
    values (under two ``#if`` branches) is left out."""
    found: dict[str, set[int]] = {}
    for name, value, shift in _DEFINE.findall(text):
        found.setdefault(name, set()).add(int(value) << int(shift or 0))
    return {name: values.pop() for name, values in found.items() if len(values) == 1}


@functools.cache
def part_constants(part: str) -> dict[str, int]:
    """The constants a part of the program (``bpf/<part>``) defines, read
    from its C: the one place of each constant user space shares with it
    (a tail-call slot, a table's default size), so the two cannot drift."""
    return c_constants((bpf_directory() / part).read_text())


# ``#define NAME MTL_RUNTIME(0x6d746c72000000NN, fallback)`` (runtime.h)
_RUNTIME = re.compile(r"^#define[ \t]+(\w+)[ \t]+MTL_RUNTIME\((0x[0-9a-fA-F]+),[ \t]*(-?\d+)\)",
                      re.MULTILINE)  # fmt: skip


# The maps made at the run's size, not the compile's: map -> (the setting
# that sizes it, the bytes of its unit). bcc declares each at the setting's
# default in the C; the loader makes it at the run's (max_entries).
RUNTIME_SIZES = {
    "events": ("RINGBUF_PAGES", mmap.PAGESIZE),
    "outstanding": ("ALLOC_OUT_ROWS", 1),
    "alloc_stacks": ("ALLOC_STACK_ROWS", 1),
    "alloc_frames": ("FRAME_ROWS", 1),
    "alloc_frame_claims": ("FRAME_ROWS", 1),
    "lock_times": ("LOCK_ROWS", 1),
    "lock_stack_times": ("LOCK_STACK_ROWS", 1),
    "unwind_rows": ("UNWIND_ROWS", 1),
    "unwind_maps": ("UNWIND_MAPS", 1),
    "unwind_pages": ("UNWIND_PAGES", 1),
    "pending": ("PENDING_SLOTS", 1),
    "alloc_procs": ("ALLOC_PROCS", 1),
    "vm_procs": ("ALLOC_PROCS", 1),
    "vm_brk": ("ALLOC_PROCS", 1),
    "vm_pending": ("VM_PENDING", 1),
}
# Run-time values that are a sized table's rows less one: the masks of the
# open-addressed tables' indexes (their rows a power of two)
RUNTIME_MASKS = {"ALLOC_OUT_MASK": "ALLOC_OUT_ROWS", "ALLOC_STACK_MASK": "ALLOC_STACK_ROWS",
                 "FRAME_MASK": "FRAME_ROWS", "PENDING_MASK": "PENDING_SLOTS"}  # fmt: skip
# The allocation functions' handlers (allocs.bpf.c, holds.bpf.c, and those of
# vm.bpf.c's system calls it alone uses), left out of the load of a run that
# does not trace them, with its tables at one entry (ALLOCS_OFF); and the
# handlers of the system calls it shares with the derived probes, left out
# where neither is there. A name ending in * stands for every one it begins.
_SYSCALL = "tracepoint__syscalls__sys_"
_ALLOC_SYSCALLS = ("exit_mmap", "exit_munmap", "enter_mremap", "exit_mremap")
ALLOC_HANDLERS = ("alloc_*", *(_SYSCALL + call for call in _ALLOC_SYSCALLS))
_SHARED_SYSCALLS = ("enter_mmap", "enter_munmap", "enter_brk", "exit_brk")
SHARED_SYSCALL_HANDLERS = tuple(_SYSCALL + call for call in _SHARED_SYSCALLS)
ALLOCS_OFF = {"WITH_ALLOCS": 0, "ALLOC_OUT_ROWS": 1, "ALLOC_STACK_ROWS": 1, "PENDING_SLOTS": 1,
              "ALLOC_PROCS": 1, "VM_PENDING": 1}  # fmt: skip


@dataclass(frozen=True)
class Runtime:
    """A run-time value of the program: the mark its code loads, and the
    value where the run gives none."""

    mark: int
    fallback: int


@functools.cache
def runtime_values() -> dict[str, Runtime]:
    """The program's run-time values (runtime.h), by name."""
    text = (bpf_directory() / "runtime.h").read_text()
    return {name: Runtime(int(mark, 16), int(fallback))
            for name, mark, fallback in _RUNTIME.findall(text)}  # fmt: skip


@dataclass(frozen=True)
class ProgramSource:
    """A BPF program as bcc gets it: a name, its parts and its defines."""

    name: str
    parts: tuple[Path, ...]
    defines: Mapping[str, int] = field(default_factory=dict)
    absent: tuple[str, ...] = ()  # handlers this run leaves out of the load (ALLOC_HANDLERS)

    @property
    def directory(self) -> Path:
        """Where its headers are found."""
        return self.parts[0].parent

    def text(self) -> str:
        """The parts joined, each under a line that names it."""
        return "".join(f"/* ==== {part.name} ==== */\n{part.read_text()}" for part in self.parts)

    def main_file(self, scratch: Path, text: str) -> Path:
        """The file bcc compiles as its main file: the one part itself, or
        ``text`` (the parts joined) written in ``scratch``."""
        if len(self.parts) == 1:
            return self.parts[0]
        joined = scratch / f"{self.name}.bpf.c"
        joined.write_text(text)
        return joined

    def headers(self) -> list[Path]:
        return sorted(self.directory.glob("*.h"))

    def cflags(self) -> list[str]:
        """The compile-time defines (the run-time values and sizes are not:
        ``values``, ``sizes``)."""
        runtime = runtime_values().keys() | {setting for setting, _ in RUNTIME_SIZES.values()}
        # (sorted: two runs that set the same defines in another order compile alike)
        return [f"-D{key}={value}" for key, value in sorted(self.defines.items())
                if key not in runtime]  # fmt: skip

    def values(self) -> dict[int, int]:
        """Each run-time value's mark -> this run's value (its fallback
        where the defines do not give it)."""
        masks = {mask: self.defines[rows] - 1
                 for mask, rows in RUNTIME_MASKS.items() if rows in self.defines}  # fmt: skip
        given = {**self.defines, **masks}
        return {value.mark: int(given.get(name, value.fallback))
                for name, value in runtime_values().items()}  # fmt: skip

    def sizes(self) -> dict[str, int]:
        """The maps made at this run's size: map -> max_entries (those whose
        setting the defines give)."""
        sized = {map_: size for map_, size in RUNTIME_SIZES.items() if size[0] in self.defines}
        return {name: self.defines[setting] * unit for name, (setting, unit) in sized.items()}


# common.bpf.h's defaults of the settings below that user space also names
_COMMON = part_constants("common.bpf.h")


@dataclass(frozen=True)
class ProgramConfig:
    """Every switch of the trace program (common.bpf.h's settings).

    The mappings come from the modules that know them: the SDT sites'
    handlers (tracer/loop/usdt.py), the derived probes' (probes/derived.py), the
    kmem tracepoints' variants and raw handlers (tracer/bpf/tracefs.py,
    tracer/bpf/kmem_attach.py), the allocation functions' tables
    (tracer/loop/alloc_probes.py), the lock waits' (tracer/loop/lock_waits.py)."""

    events: bool = True  # stream records through the ring (else: counts only)
    filter_pids: bool = True  # the followed table decides
    follow_forks: bool = True
    first_tgid: bool = False  # the process asked for is named in first_target
    comm: tuple[int, int] | None = None  # follow processes of this name (two u64)
    cgroup: tuple[int, int] | None = None  # (id, level) of a cgroup v2
    ring_pages: int = _COMMON["RINGBUF_PAGES"]
    exact_times: bool = True  # probe events timed to the ns (else: to the tick)
    sites: Mapping[str, int] = field(default_factory=dict)
    derived: Mapping[str, int] = field(default_factory=dict)
    kmem: Mapping[str, int] | None = None  # None: no kmem tracepoints
    kmem_events: bool = False  # kmem events through the ring too
    page_shift: int = PAGE_SHIFT
    stack_depth: int = 0  # > 0: a stack id on each probe and kmem event
    stack_entries: int = _COMMON["STACK_ENTRIES"]
    allocs: Mapping[str, int] | None = None  # None: no allocation functions
    locks: Mapping[str, int] | None = None  # None: lock waits are not timed
    unwind: Mapping[str, int] | None = None  # None: stacks are walked by frame pointers only
    holds: bool = False  # processes mtrace-live started may be stopped (HOLDS, common.bpf.h)
    exit_group_dead: bool = False  # sched_process_exit has group_dead (Linux 6.14 and later)
    # the per-process and per-thread tables' entries allocated as their keys
    # come, not all at their creation (PROC_TABLES_ON_DEMAND, common.bpf.h)
    tables_on_demand: bool = False
    site_registers: bool = False  # a uprobe's cookie reaches its handler (site_cookie.h)

    def defines(self) -> dict[str, int]:
        defines = {
            "FILTER_PIDS": int(self.filter_pids),
            "FOLLOW_FORKS": int(self.follow_forks),
            "WITH_EVENTS": int(self.events),
            "RINGBUF_PAGES": self.ring_pages,
            "PROBE_EXACT_TIME": int(self.exact_times),
            **self.sites,
            **self.derived,
            "WITH_KMEM": int(self.kmem is not None),
            "KMEM_EVENTS": int(self.kmem_events),
            "PAGE_SHIFT_": self.page_shift,
            "WITH_STACKS": int(self.stack_depth > 0),
            "STACK_DEPTH": max(self.stack_depth, 1),
            "STACK_ENTRIES": self.stack_entries,
            "HOLDS": int(self.holds and self.filter_pids and self.events),
            "EXIT_GROUP_DEAD": int(self.exit_group_dead),
            "PROC_TABLES_ON_DEMAND": int(self.tables_on_demand),
            "SITE_REGISTERS": int(self.site_registers),
        }
        if self.comm is not None:
            defines.update({"FILTER_COMM": 1, "COMM_LO": self.comm[0], "COMM_HI": self.comm[1]})
        if self.cgroup is not None:
            defines.update({"FILTER_CGROUP": 1, "CGROUP_ID": self.cgroup[0],
                            "CGROUP_LEVEL": self.cgroup[1]})  # fmt: skip
        defines.update(self.kmem or {})
        if self.first_tgid:
            defines["FIRST_TGID"] = 1
        defines.update(self.locks or {})
        walks = (self.allocs or {}).get("ALLOC_WALK", 0) or (self.locks or {}).get("LOCK_STACKS", 0)
        defines["WITH_FRAMES"] = int(bool(walks))
        # (without them, the part as a run with them compiles it: its walk where frames are)
        defines.update(self.allocs if self.allocs is not None
                       else {**ALLOCS_OFF, "ALLOC_WALK": int(bool(walks))})  # fmt: skip
        if walks and self.unwind is not None:
            defines.update(self.unwind)
        return defines

    def absent(self) -> tuple[str, ...]:
        """The handlers this run leaves out of the load (ALLOC_HANDLERS)."""
        if self.allocs is not None:
            return ()
        derived = bool(self.derived.get("DERIVED_SYSCALLS", 0))
        return ALLOC_HANDLERS if derived else (*ALLOC_HANDLERS, *SHARED_SYSCALL_HANDLERS)

    def source(self) -> ProgramSource:
        directory = bpf_directory()
        return ProgramSource("trace", tuple(directory / part for part in PARTS), self.defines(),
                             self.absent())  # fmt: skip
