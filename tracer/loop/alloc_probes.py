"""The allocation functions: which sites to attach, attaching them, and
reading what allocs.bpf.c (WITH_ALLOCS) aggregated.

Each function gets an entry uprobe at the site probes/alloc_sites.py chose
and, if it returns a pointer, a return probe at its entry (where the kernel
hijacks the return address). Two functions need no probe of their own:
one at the same address as another (glibc 2.36's aligned_alloc is memalign)
fires with it, and one that ends in a jump to another (its reallocarray
multiplies, then jumps to realloc) is seen as that one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mtrace_live.exporters.data.alloc_snapshot import (
    AllocSnapshot,
    Outstanding,
    ProcessAllocs,
    StackCatalog,
    StackColumns,
)
from mtrace_live.probes.alloc_sites import AllocSite, alloc_sites
from mtrace_live.probes.allocators import GLIBC, Allocator
from mtrace_live.probes.elf.file import elf_failures, not_elf
from mtrace_live.probes.elf.lazy import lazy_module
from mtrace_live.probes.elf.symbols import exported_offset
from mtrace_live.probes.errors import NoProbesError
from mtrace_live.probes.frame_kinds import in_file
from mtrace_live.probes.program import part_constants
from mtrace_live.probes.records import (
    ALLOC_FN_NAMES,
    ALLOC_PROC_DTYPE,
    ALLOC_STACK_ROW_DTYPE,
    ALLOC_STATS_FIELDS,
    OUTSTANDING_FREE_TAGS,
    OUTSTANDING_ROW_DTYPE,
    SITE_PROVIDER_SHIFT,
    UNWIND_PYTHON_COUNTS,
    UNWIND_VMA_COUNTS,
    VM_PROC_DTYPE,
    VM_PROC_FIELDS,
    AllocFn,
    AllocMisc,
    UnwindMisc,
)
from mtrace_live.tracer.bpf import bpf_syscalls
from mtrace_live.tracer.bpf.bpf_backend import BpfProgram
from mtrace_live.tracer.bpf.trace_tables import TraceTables

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # (at the first use: probes/elf/lazy.py)

# the handlers whose call's end is read (alloc_return): what it returned
# (xallocx: the size the block has now, which it resized in place)
RETURNS_POINTER = frozenset(fn.name.lower() for fn in AllocFn) - {"free"} | {"xallocx"}
# the size of allocs.bpf.c's table of exponential intervals, read from its C
SAMPLE_QUANTILES = part_constants("allocs.bpf.c")["SAMPLE_QUANTILES"]
STACK_DEPTH = 32  # frames kept of each allocation's stack, as bcc's memleak
EXIT_FUNCTION = "_exit"  # every exit() passes it: processes are held there (hold_at_exit)


@dataclass(frozen=True)
class AllocPlan:
    """What is attached in one libc."""

    libc: Path
    sites: Mapping[str, AllocSite]  # function -> its site, for those probed
    seen_as: Mapping[str, str]  # function -> the probed one it is seen as
    exit_offset: int | None  # file offset of _exit, where processes are held
    thread_exit_offset: int | None = None  # of pthread_exit (one process's uprobes move on)
    allocator: str = "glibc"  # whose entry points (probes/allocators.py)

    @property
    def stepped(self) -> list[str]:
        """Functions whose site is single-stepped (no emulated instruction found)."""
        return [name for name, site in self.sites.items() if not site.emulated]


def plan_sites(libc: Path, allocator: Allocator = GLIBC,
               tables: tuple[str, ...] = (".dynsym",)) -> AllocPlan:  # fmt: skip
    """The sites to attach in ``libc`` (or another ``allocator``'s file,
    its entry points found in ``tables``); NotElfError (exit 9) for a file
    that is not a readable ELF file."""
    try:
        return _plan_sites(libc, allocator, tables)
    except elf_failures() as exc:
        raise not_elf(libc, exc) from None


def _plan_sites(libc: Path, allocator: Allocator, tables: tuple[str, ...]) -> AllocPlan:
    # a site past moved arguments needs its cookie read by the handler
    found = alloc_sites(
        libc, allocator.symbols, tables, bpf_syscalls.attach_cookies(), allocator.symbol_registers
    )
    sites: dict[str, AllocSite] = {}
    seen_as: dict[str, str] = {}
    for name, site in found.items():
        target = found.get(site.tail_calls) if site.tail_calls is not None else None
        if target is not None and _counted_alike(site, target):
            seen_as[name] = target.function
            continue
        alias = next((other for other in site.aliases if other in sites), None)
        if alias is not None:
            seen_as[name] = alias
            continue
        sites[name] = site
    if allocator is not GLIBC:  # processes are held in glibc's _exit, with glibc's plan
        return AllocPlan(libc, sites, seen_as, None, None, allocator.name)
    exit_offset = exported_offset(libc, EXIT_FUNCTION)
    return AllocPlan(libc, sites, seen_as, exit_offset, exported_offset(libc, "pthread_exit"))


def _counted_alike(site: AllocSite, target: AllocSite) -> bool:
    """A function that jumps to ``target`` is seen as it when the target's
    handler reads the same call: one kind, or glibc's reallocarray jumping to
    realloc with the product as the size. Otherwise (mimalloc's mi_memalign
    jumps to mi_malloc_aligned, its arguments swapped) it has its own probe,
    and the target's hit, at the same stack pointer, is nested in it."""
    return site.handler == target.handler or (site.handler, target.handler) == (
        "reallocarray",
        "realloc",
    )


def defines(sample_bytes: int, events: bool, walk: bool, outstanding: int, stacks: int,
            hold: bool, one_process: bool) -> dict[str, int]:  # fmt: skip
    """``one_process``: the probes are attached for one process only (see
    ``attach``), which the kernel then filters: the handlers ask nothing."""
    return {
        "WITH_ALLOCS": 1,
        "ALLOC_ONE_PROCESS": int(one_process),
        "UPROBE_MOVES": int(one_process),
        "SITE_REGISTERS": int(bpf_syscalls.attach_cookies()),
        "ALLOC_EVENTS": int(events),
        "ALLOC_WALK": int(walk),
        "FRAME_DEPTH": STACK_DEPTH,
        "FRAME_ROWS": _open_rows(stacks),
        "ALLOC_OUT_ROWS": _open_rows(outstanding),
        "ALLOC_STACK_ROWS": _open_rows(stacks),
        "SAMPLE_BYTES": sample_bytes,
        "HOLD_AT_EXIT": int(hold),
    }


def _open_rows(entries: int) -> int:
    """Rows of an open-addressed table in allocs.bpf.c meant to hold
    ``entries``: twice as many, rounded up to a power of two."""
    return 1 << (2 * entries - 1).bit_length()


def attach_allocs(program: BpfProgram, chosen: AllocPlan, sample_bytes: int, hold: bool,
                  pid: int = -1, provider: int = 0) -> None:  # fmt: skip
    """Attach the handlers in every process that maps the libc, or, with
    ``pid``, in that process alone: then no other process on the machine
    takes a breakpoint on each malloc and free. ``provider``: the file's
    number, in its sites' cookies (0: the libc), which each allocation's
    stack row keeps (StackReader.providers names it)."""
    number = provider << SITE_PROVIDER_SHIFT if bpf_syscalls.attach_cookies() else 0
    for site in chosen.sites.values():
        handler = f"alloc_{site.handler}"
        program.attach_uprobe(chosen.libc, site.file_offset, handler, pid, site.cookie | number)
        if site.handler in RETURNS_POINTER:
            # At the site itself, not the entry: nothing before the site
            # moves rsp (probes/alloc_sites.py), so the return address is
            # still at the top of the stack for the kernel to replace, and
            # the two handlers share one breakpoint instead of taking two
            # (the entry's, single-stepped where it is an endbr64, and the site's).
            program.attach_uretprobe(chosen.libc, site.file_offset, "alloc_return", pid)
    if hold and chosen.exit_offset is not None:
        program.attach_uprobe(chosen.libc, chosen.exit_offset, "alloc_exit", pid)
    if (pid >= 0 and chosen.thread_exit_offset is not None and program.has_table("alloc_target")
            and program.uprobes_move):  # fmt: skip
        program.fill_array("alloc_target", [pid])
        program.attach_uprobe(chosen.libc, chosen.thread_exit_offset, "alloc_thread_exit", pid)
    if sample_bytes > 0:
        program.fill_array("sample_quantiles", sample_intervals(sample_bytes))


def sample_intervals(sample_bytes: int) -> list[int]:
    """SAMPLE_QUANTILES equally likely intervals of an exponential law of
    mean ``sample_bytes`` (the midpoints of its quantiles): drawn uniformly,
    they make the countdown a Poisson process over the bytes allocated."""
    n = SAMPLE_QUANTILES
    return [max(1, round(-sample_bytes * math.log1p(-(i + 0.5) / n))) for i in range(n)]


class StackReader:
    """alloc_stacks read into columns (StackColumns). A slot's key is worked
    out (its stack's frames read, the key numbered in the catalog) when the
    slot is new or its key changed, and again until its frames read the
    same twice (the kernel may be writing them); after that a read takes
    the slot's values only. The catalog starts again once it holds many
    more keys than the table has rows (processes gone)."""

    def __init__(self) -> None:
        # each provider's (allocator, file), by the number its sites' cookies
        # carry (0: the libc); the trace appends one as it attaches it
        self.providers: list[tuple[str, str]] = []
        self.catalog = StackCatalog()
        # by slot, made at the first read (numpy): see _slots
        self._keys: np.ndarray
        self._numbers: np.ndarray
        self._settled: np.ndarray
        self._made = False

    def _start(self) -> None:
        self.catalog = StackCatalog()
        self._slots()

    def _slots(self) -> None:
        self._made = True
        self._keys = np.zeros(0, ALLOC_STACK_ROW_DTYPE[["tag", "key"]])  # by slot
        self._numbers = np.zeros(0, np.int64)  # by slot: its key's number; -1 none
        self._settled = np.zeros(0, bool)  # by slot: its frames read the same twice

    def read(self, tables: TraceTables, slots: np.ndarray, table: np.ndarray) -> StackColumns:
        """The rows ``table`` (alloc_stacks rows at ``slots``) as columns."""
        if not self._made:
            self._slots()
        elif len(self.catalog) > 4 * len(table) + 100_000:
            self._start()
        self._grow(int(slots.max()) + 1 if len(slots) else 0)
        keys = table[["tag", "key"]]
        same = self._keys[slots] == keys
        fresh = np.flatnonzero(~self._settled[slots] | ~same)
        frames_of: dict[int, tuple[int, ...]] = {}
        numbers = []
        for call_site, tgid, stack, fn, provider, _ in table["key"][fresh].tolist():
            frames = _frames(tables, stack, call_site, frames_of)
            name, lib = self.providers[provider] if provider < len(self.providers) else ("", "")
            numbers.append(self.catalog.number((tgid, _fn_name(fn), call_site, frames, name, lib)))
        changed = slots[fresh]
        found = np.array(numbers, np.int64)
        # settled: walked by no frames, or numbered alike twice running
        self._settled[changed] = (table["key"]["stack"][fresh] < 0) | (
            same[fresh] & (self._numbers[changed] == found)
        )
        self._keys[changed] = keys[fresh]
        self._numbers[changed] = found
        # (numpy.lib.recfunctions would do it too, but imports numpy.ma: 8 ms of a start)
        stats = table["stats"]
        values = np.stack([stats[name].astype(np.int64) for name in ALLOC_STATS_FIELDS], axis=1)
        return StackColumns(self.catalog, self._numbers[slots], values)

    def _grow(self, slots: int) -> None:
        more = slots - len(self._numbers)
        if more > 0:
            self._keys = np.concatenate([self._keys, np.zeros(more, self._keys.dtype)])
            self._numbers = np.concatenate([self._numbers, np.full(more, -1, np.int64)])
            self._settled = np.concatenate([self._settled, np.zeros(more, bool)])


def read_snapshot(program: BpfProgram, sample_bytes: int, started_ns: int,
                  outstanding: bool = False,
                  reader: StackReader | None = None) -> AllocSnapshot:  # fmt: skip
    """The kernel's tables now; the outstanding allocations only when asked
    (there may be hundreds of thousands). ``reader`` keeps what it worked
    out of the stack rows from one read to the next."""
    pkeys, pvalues = program.read_table("alloc_procs", "<u4", ALLOC_PROC_DTYPE)
    present = _incarnations(pkeys, pvalues["incarnation"])
    table = program.array_copy("alloc_stacks", ALLOC_STACK_ROW_DTYPE)  # every row
    if table is None:  # (a map that cannot be mapped: read through the kernel)
        slots, table = program.read_table("alloc_stacks", "<u4", ALLOC_STACK_ROW_DTYPE)
    else:
        slots = np.arange(len(table), dtype=np.uint32)
    # claimed rows whose key is written (a CPU writes it just after its claim),
    # of the processes whose alloc_procs row they were made under: every one
    # has its row from its first call until serve retires it when it is gone,
    # and a process that reuses its pid has a row of another incarnation
    kept = ((table["tag"] != 0) & (table["key"]["call_site"] != 0)
            & np.isin(_incarnations(table["key"]["tgid"], table["key"]["incarnation"]),
                      present))  # fmt: skip
    stacks = (reader or StackReader()).read(program.tables, slots[kept], table[kept])
    processes = _processes(pkeys, pvalues, None if sample_bytes else stacks)
    vkeys, vvalues = program.read_table("vm_procs", "<u4", VM_PROC_DTYPE)
    vm = {int(tgid): dict(zip(VM_PROC_FIELDS, row, strict=True))
          for tgid, row in zip(vkeys.tolist(), vvalues.tolist(), strict=True)}  # fmt: skip
    calls = program.percpu_array_totals("alloc_calls")
    misc = program.percpu_array_totals("alloc_misc")
    held: list[Outstanding] = []
    frames_of: dict[int, tuple[int, ...]] = {}
    if outstanding:
        rows = program.array_copy("outstanding", OUTSTANDING_ROW_DTYPE,
                                  ("tag", OUTSTANDING_FREE_TAGS))  # fmt: skip
        if rows is None:  # (a map that cannot be mapped: read through the kernel)
            _, rows = program.read_table("outstanding", "<u4", OUTSTANDING_ROW_DTYPE)
        keys = rows["value"]["key"]
        theirs = np.isin(_incarnations(keys["tgid"], keys["incarnation"]), present)
        rows = rows[~np.isin(rows["tag"], OUTSTANDING_FREE_TAGS) & theirs]
        for _, ptr, tgid, _, (key, size, weight, ts, tid, _) in rows.tolist():
            call_site, _, stack, fn, _, _ = key
            frames = _frames(program.tables, stack, call_site, frames_of)
            held.append(Outstanding(tgid, ptr, size, weight, ts, tid, _fn_name(fn), call_site,
                                    frames))  # fmt: skip
    return AllocSnapshot(
        stacks=stacks,
        processes=tuple(processes),
        calls={name: calls[fn] for fn, name in enumerate(ALLOC_FN_NAMES)},
        misc={m.name.lower(): misc[m] for m in AllocMisc},
        sample_bytes=sample_bytes,
        now_ns=time.monotonic_ns(),
        started_ns=started_ns,
        outstanding=tuple(held),
        outstanding_read=outstanding,
        vm=vm,
        unwind=unwind_counts(program),
    )


def unwind_counts(program: BpfProgram) -> dict[str, int]:
    """How the stacks were walked (unwind.bpf.c's unwind_misc); {} when they
    are walked by frame pointers only."""
    if not program.has_table("unwind_misc"):
        return {}
    counts = program.percpu_array_totals("unwind_misc")
    looked_up = program.has_table("unwind_files")  # UNWIND_VMA: mappings found in the kernel
    python = program.has_table("python_procs")  # WITH_PYTHON: Python frames in the walks
    return {m.name.lower(): counts[m] for m in UnwindMisc
            if (looked_up or m not in UNWIND_VMA_COUNTS)
            and (python or m not in UNWIND_PYTHON_COUNTS)}  # fmt: skip


def _processes(tgids: np.ndarray, rows: np.ndarray,
               stacks: StackColumns | None) -> list[ProcessAllocs]:  # fmt: skip
    """Each process's calls. Without sampling (``stacks`` given) the kernel
    counts in alloc_procs only what no alloc_stacks row has, and the rest is
    the sums of the process's rows; an allocation booked as freed because
    ``outstanding`` was full (``booked_freed``) is not one of its frees."""
    sums = (
        {} if stacks is None else stacks.by_process(stacks.values[:, [0, 2, 3]])
    )  # calls, sizes, frees
    out = []
    for tgid, (calls, nbytes, frees, unknown, failed, untracked, booked, _, _, comm) in zip(
        tgids.tolist(), rows.tolist(), strict=True
    ):
        add_calls, add_bytes, add_frees = sums.get(tgid, [0, 0, 0])
        out.append(ProcessAllocs(int(tgid), calls + add_calls, nbytes + add_bytes,
                                 frees + add_frees - booked, unknown, failed,
                                 comm.decode(errors="replace"), untracked=untracked))  # fmt: skip
    return out


def _incarnations(tgids: np.ndarray, incarnations: np.ndarray) -> np.ndarray:
    """Each (process, incarnation of its alloc_procs row) as one number."""
    return (tgids.astype(np.uint64) << np.uint64(32)) | incarnations.astype(np.uint64)


def _fn_name(fn: int) -> str:
    return ALLOC_FN_NAMES[fn] if fn < len(ALLOC_FN_NAMES) else f"fn{fn}"


def _frames(tables: TraceTables, stack: int, call_site: int,
            cache: dict[int, tuple[int, ...]]) -> tuple[int, ...]:  # fmt: skip
    """The call site, then its callers from the stack walk (whose first
    frame is the call site itself: the walk starts at the return address),
    as the walk stored it: in its file, where the walk numbered that
    (probes/frame_kinds.py), else the address."""
    if stack < 0:
        return (call_site,)
    walked = cache.get(stack)
    if walked is None:
        walked = cache[stack] = tuple(tables.stack(stack))
    if walked and (walked[0] == call_site or in_file(walked[0]) is not None):
        return walked
    return (call_site, *walked)


def check_attachable(chosen: AllocPlan, sdt_problem: str | None) -> None:
    """Refuse a library with nothing to trace: no allocation function (and,
    as ``sdt_problem`` says, no SDT probes either)."""
    if not chosen.sites:
        why = f"; and {sdt_problem}" if sdt_problem else ""
        raise NoProbesError(f"{chosen.libc} exports none of the allocation functions{why}")
