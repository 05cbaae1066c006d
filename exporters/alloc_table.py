"""Tables of allocations by call stack, as text: for the summary, the live
view and ``--leaks-older-than``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from mtrace_live.probes.records import UNWIND_ENDS, UnwindMisc

from .data.alloc_snapshot import (
    AllocSnapshot,
    FrameNames,
    Outstanding,
    ProcessAllocs,
    StackRow,
    function_name,
    unknown_free_origins,
)

STACK_FRAMES_SHOWN = 4


def size_text(n: float) -> str:
    """Bytes with their unit, in powers of 1024: 1023B, 1.5KiB, 12.0MiB
    (a rate reads 12.0MiB/s; never a bare 12.0M)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}TiB"  # not reached


def stack_text(names: FrameNames, tgid: int, frames: Iterable[int],
               limit: int = STACK_FRAMES_SHOWN) -> str:  # fmt: skip
    """The innermost frames, callers after callees: ``f+0x1a (a.c:3) < main+0x9``."""
    shown = list(frames)
    text = " < ".join(names.stack(tgid, shown[:limit]))
    return text + (" < ..." if len(shown) > limit else "")


def stack_label(names: FrameNames, tgid: int, frames: Sequence[int],
                limit: int = STACK_FRAMES_SHOWN) -> str:  # fmt: skip
    """Function names only, innermost first: a stable label for metrics."""
    shown = [function_name(names.resolve(tgid, a), a) for a in frames[:limit]]
    return " < ".join(shown) + (" < ..." if len(frames) > limit else "")


def other_allocators(snapshot: AllocSnapshot) -> dict[int, str]:
    """The processes whose malloc is not glibc's: pid -> its allocator, named."""
    return {proc.tgid: proc.allocator_label for proc in snapshot.processes
            if proc.allocator and proc.allocator != "glibc"}  # fmt: skip


def not_glibc_line(pid: int, label: str) -> str:
    """What the arena and contention view says of a process on another allocator."""
    return (f"pid {pid}: allocator: {label}: the arenas and their contention are glibc's "
            "malloc's, which it does not allocate from")  # fmt: skip


def provider_text(proc: ProcessAllocs, called: Sequence[tuple[str, str, int, int]]) -> str:
    """What the summary adds of the providers a process called, when they
    are more than the one its malloc binds to: ``; by provider: jemalloc
    (libjemalloc.so.2) 1200 calls, 80.0K; glibc (libc.so.6) 3 calls, 96B``."""
    if not called or (len(called) == 1 and called[0][:2] == (proc.allocator, proc.allocator_lib)):
        return ""
    return "; by provider: " + "; ".join(f"{name} ({lib}) {calls} calls, {size_text(nbytes)}"
                                         for name, lib, calls, nbytes in called)  # fmt: skip


def alloc_process_lines(snapshot: AllocSnapshot) -> list[str]:
    lines = []
    live = _live_by_process(snapshot.stacks)
    called = snapshot.by_provider()
    for proc in sorted(snapshot.processes, key=lambda p: p.tgid):
        blocks, nbytes = live.get(proc.tgid, (0, 0))
        lines.append(
            f"allocations: pid {proc.tgid}: {proc.calls} calls, {size_text(proc.bytes)}; "
            f"{proc.frees} frees{unknown_frees_text(proc, snapshot)}; {proc.failed} failed; "
            f"live {size_text(nbytes)} in {blocks} blocks"
            + (" (estimated from samples)" if snapshot.sample_bytes else "")
            + (f"; allocator: {proc.allocator_label}" if proc.allocator else "")
            + provider_text(proc, called.get(proc.tgid, []))
        )
        vm = snapshot.vm.get(proc.tgid)
        if vm:
            lines.append(f"  outside malloc: {vm_text(vm)}")
    return lines


def unknown_frees_text(proc: ProcessAllocs, snapshot: AllocSnapshot) -> str:
    """What the summary says of a process's frees of blocks not seen
    allocated: `` (N of memory allocated before the trace)`` only when
    nothing else can explain them; under ``run`` never, and a full table
    is said to be full."""
    if not proc.unknown_frees:
        return ""
    origins = unknown_free_origins(proc, snapshot)
    if origins == ("before_trace",):
        return f" ({proc.unknown_frees} of memory allocated before the trace)"
    if not origins:
        return f" ({proc.unknown_frees} of blocks not seen allocated)"
    tables = (("outstanding_full", "--max-outstanding"), ("stacks_full", "--alloc-stacks"))
    options = " and ".join(o for key, o in tables if snapshot.misc.get(key)) or tables[0][1]
    said = {"not_sampled": "not sampled", "before_trace": "allocated before the trace",
            "untracked": f"the tables were full for {proc.untracked} allocations, "
                         f"see {options}"}  # fmt: skip
    return f" ({proc.unknown_frees} of blocks not tracked: " + ", or ".join(
        said[origin] for origin in origins) + ")"  # fmt: skip


def vm_text(vm: Mapping[str, int]) -> str:
    """mmap, munmap, mremap and brk of one process, for reading."""
    return (
        f"mmap {vm['mmap_calls']} calls ({size_text(vm['mmap_bytes'])} anonymous, "
        f"{size_text(vm['mmap_file_bytes'])} of files), munmap {vm['munmap_calls']} "
        f"({size_text(vm['munmap_bytes'])}), mremap {vm['mremap_calls']} "
        f"(+{size_text(vm['mremap_grown'])} -{size_text(vm['mremap_shrunk'])}), brk "
        f"{vm['brk_calls']} (+{size_text(vm['brk_grown'])} -{size_text(vm['brk_shrunk'])})"
    )


def _live_by_process(rows: Iterable[StackRow]) -> dict[int, tuple[int, int]]:
    out: dict[int, tuple[int, int]] = {}
    for row in rows:
        blocks, nbytes = out.get(row.tgid, (0, 0))
        out[row.tgid] = (blocks + row.live_objects, nbytes + row.live_bytes)
    return out


def stack_lines(snapshot: AllocSnapshot, names: FrameNames, key: str = "live",
                limit: int = 10) -> list[str]:  # fmt: skip
    """The top rows by live bytes (``key="live"``) or bytes allocated."""
    rows = snapshot.top(key, limit)
    if not rows:
        return []
    head = f"{'LIVE':>9} {'BLOCKS':>7} {'CALLS':>8} {'BYTES':>9} {'PID':>7} {'FUNCTION':<14}"
    lines = [head + " CALL STACK"]
    for row in rows:
        lines.append(
            f"{size_text(row.live_bytes):>9} {row.live_objects:>7} {row.objects:>8} "
            f"{size_text(row.bytes):>9} {row.tgid:>7} {row.function:<14} "
            f"{stack_text(names, row.tgid, row.frames)}"
        )
    return lines


@dataclass
class LeakGroup:
    tgid: int
    function: str
    frames: tuple[int, ...]
    blocks: int = 0
    bytes: int = 0
    oldest_ns: int = 0


def leak_groups(
    held: Iterable[Outstanding], now_ns: int, older_than_s: float = 0.0
) -> list[LeakGroup]:
    """Allocations outstanding for at least ``older_than_s``, by stack, most bytes first."""
    groups: dict[tuple[int, str, tuple[int, ...]], LeakGroup] = {}
    cutoff = now_ns - int(older_than_s * 1e9)
    for item in held:
        if item.ts_ns > cutoff:
            continue
        key = (item.tgid, item.function, item.frames)
        group = groups.get(key)
        if group is None:
            group = groups[key] = LeakGroup(
                item.tgid, item.function, item.frames, oldest_ns=item.ts_ns
            )
        group.blocks += 1
        group.bytes += item.weight
        group.oldest_ns = min(group.oldest_ns, item.ts_ns)
    return sorted(groups.values(), key=lambda g: (-g.bytes, -g.blocks))


def leak_lines(snapshot: AllocSnapshot, names: FrameNames, older_than_s: float = 0.0,
               limit: int = 10) -> list[str]:  # fmt: skip
    groups = leak_groups(snapshot.outstanding, snapshot.now_ns, older_than_s)
    if not groups:
        return []
    lines = [f"{'BYTES':>9} {'BLOCKS':>7} {'OLDEST':>8} {'PID':>7} {'FUNCTION':<14} CALL STACK"]
    for group in groups[:limit]:
        age = (snapshot.now_ns - group.oldest_ns) / 1e9
        lines.append(
            f"{size_text(group.bytes):>9} {group.blocks:>7} {age:>7.1f}s {group.tgid:>7} "
            f"{group.function:<14} {stack_text(names, group.tgid, group.frames)}"
        )
    if len(groups) > limit:
        lines.append(f"({len(groups) - limit} more stacks)")
    return lines


# How a walk by CFI can end short of the outermost frame (unwind.bpf.c's unwind_misc).
CUT_WHY = {UnwindMisc.DEPTH: "at 127 frames",
           UnwindMisc.NO_CFI: "at code with no CFI and no frame pointer",
           UnwindMisc.UNREADABLE: "at an unreadable stack",
           UnwindMisc.OUT_OF_STACK: "where the rules pointed outside the stack",
           UnwindMisc.BOUNDS: "at the verifier's bounds", UnwindMisc.LOST: "lost"}  # fmt: skip


def unwind_lines(unwind: Mapping[str, int]) -> list[str]:
    """How the stacks were walked: by CFI, whole or cut and why, and the
    frames found each way (nothing when walked by frame pointers only)."""
    if not unwind:
        return []
    cut = ", ".join(f"{unwind.get(end.name.lower(), 0)} {CUT_WHY[end]}"
                    for end in UNWIND_ENDS if end != UnwindMisc.COMPLETE)  # fmt: skip
    lines = [
        f"stacks unwound by CFI: {unwind.get('stacks', 0)}, {unwind.get('complete', 0)} whole; "
        f"cut: {cut}",
    ]
    if "vma_lookups" not in unwind:  # no lookup in the kernel: a process without tables by FP
        lines.append(
            f"  frames: {unwind.get('cfi_frames', 0)} by CFI, {unwind.get('fp_frames', 0)} by "
            f"frame pointers (no CFI at the PC); {unwind.get('no_tables', 0)} stacks walked by "
            "frame pointers alone (their process's tables were not written yet); "
            f"{unwind.get('inherited', 0)} by the tables their process inherited at its fork"
        )
    else:
        lines += [
            f"  frames: {unwind.get('cfi_frames', 0)} by CFI, {unwind.get('fp_frames', 0)} by "
            f"frame pointers (no CFI at the PC); {unwind.get('unwritten', 0)} in files whose "
            "rows were not written yet (by frame pointers where they could be); stacks of "
            f"processes whose tables were not written yet: {unwind.get('no_tables', 0)}, by the "
            "mappings the kernel has; "
            f"{unwind.get('inherited', 0)} by the tables their process inherited at its fork",
            f"  mappings looked up in the kernel: {unwind.get('vma_lookups', 0)} "
            f"({unwind.get('vma_busy', 0)} refused: the process's mapping lock was taken), "
            f"{unwind.get('vma_frames', 0)} frames in the mappings found",
        ]
    if "py_frames" in unwind:
        lines.append(
            f"  Python frames in the eval loop's place: {unwind['py_frames']}; eval loop frames "
            f"kept native: {unwind.get('py_no_thread', 0)} (their thread's state unreadable); "
            f"{unwind.get('py_unreadable', 0)} walks whose Python frames ended at an unreadable "
            f"one; {unwind.get('py_stacks_lost', 0)} new stacks not said in time for their "
            "code objects to be read"
        )
    return lines + _table_lines(unwind)


def _table_lines(unwind: Mapping[str, int]) -> list[str]:
    """What the tables hold, and what they could not (tables_* counts)."""
    if "tables_files" not in unwind:
        return []
    room = unwind.get("tables_rows_room")
    of_room = f" of {room} (--unwind-rows)" if room else ""
    memory = unwind.get("tables_memory_bytes")
    in_kernel = f", {memory / (1 << 20):.0f} MiB of kernel memory" if memory else ""
    line = (f"  tables: {unwind['tables_files']} files, {unwind.get('tables_rows', 0)} rows"
            f"{of_room}{in_kernel}; {unwind.get('tables_files_without_cfi', 0)} files without "
            "CFI")  # fmt: skip
    if unwind.get("tables_files_failed", 0):
        line += (f"; {unwind['tables_files_failed']} files whose tables could not be built "
                 "(named on standard error): frame pointers there")  # fmt: skip
    if unwind.get("tables_files_evicted", 0):
        line += (f"; {unwind['tables_files_evicted']} files evicted (no process mapped them "
                 "any more), their rows given to others")  # fmt: skip
    if unwind.get("tables_files_unopened", 0):
        line += (f"; {unwind['tables_files_unopened']} files asked for by walks that could not "
                 "be opened (their process gone, the path another file): asked again by the "
                 "next walk to meet them")  # fmt: skip
    if unwind.get("tables_processes_failed", 0):
        line += (f"; {unwind['tables_processes_failed']} processes whose tables could not be "
                 "written: frame pointers there")  # fmt: skip
    full = unwind.get("tables_files_not_fitting", 0), unwind.get("tables_processes_not_fitting", 0)
    if any(full):
        line += (f"; no room for {full[0]} files ({unwind.get('tables_rows_not_fitting', 0)} "
                 f"rows) and {full[1]} processes' mappings: frame pointers there")  # fmt: skip
    return [line]


def alloc_summary_lines(snapshot: AllocSnapshot, names: FrameNames, command_ended: bool,
                  leaks_older_than: float | None = None,
                  delivered: int | None = None) -> list[str]:  # fmt: skip
    """``delivered``: the allocation events read from the ring, when an
    output asked for them."""
    lines = ["", *alloc_process_lines(snapshot)]
    misc = snapshot.misc
    if delivered is not None:
        lines.append(f"allocation events: {delivered} delivered, {misc.get('lost_events', 0)} "
                     "lost (the ring buffer had no room)")  # fmt: skip
    full = ("outstanding_full", "stacks_full", "frames_full", "lost_events")
    if any(misc.get(name) for name in full):
        lines.append(
            f"allocation tables full: {misc.get('outstanding_full', 0)} allocations not tracked "
            f"until freed (--max-outstanding), {misc.get('stacks_full', 0)} not aggregated by "
            f"stack (--alloc-stacks), {misc.get('frames_full', 0)} kept by call site alone "
            f"(no room for their stack), {misc.get('lost_events', 0)} events lost"
        )
    lines += unwind_lines(snapshot.unwind)
    if misc.get("slot_taken"):
        lines.append(
            f"allocation calls lost: {misc['slot_taken']} (two threads whose ids differ "
            "by a multiple of 65536 were inside an allocation function at once)"
        )
    top = stack_lines(snapshot, names, "live")
    if top:
        lines += ["top call stacks by live bytes:", *top]
    busiest = stack_lines(snapshot, names, "bytes", limit=5)
    if busiest:
        lines += ["top call stacks by bytes allocated:", *busiest]
    if command_ended and snapshot.outstanding_read:
        leaks = leak_lines(snapshot, names)
        if leaks:
            lines += ["never freed, by stack (the command has ended):", *leaks]
    elif leaks_older_than is not None and snapshot.outstanding_read:
        leaks = leak_lines(snapshot, names, leaks_older_than)
        lines += [f"outstanding for over {leaks_older_than:g} s, by stack:", *(leaks or ["(none)"])]
    return lines
