"""The summary printed when a live trace ends: hits and losses per probe,
each process's allocator (arenas, heaps, sbrk, retries, settings), and the
kernel's top call sites. ``--output summary`` prints only this."""

from __future__ import annotations

import sys
from typing import TextIO

from . import alloc_table
from .contention import arena_waits, duration_text, process_contention_lines
from .data.allocator_state import ProcessState, SettingChange
from .data.events import format_value
from .data.kallsyms import KernelSymbols
from .data.kmem import name_sites
from .data.lock_waits import LockWaits
from .data.processes import described
from .data.sink import KmemResult, Sink, TraceResult
from .kmem_table import render_table


class SummarySink(Sink):
    """No per-event output: the summary, on standard output, at the end."""

    def finish(self, result: TraceResult) -> None:
        print_summary(result, sys.stdout)


class StopLine(Sink):
    """No report at the end, one line on standard error (``serve``)."""

    def finish(self, result: TraceResult) -> None:
        print(
            f"mtrace-live: stopped after {result.duration_s:.1f} s ({result.ended_by or 'ended'}); "
            f"{result.total_hits} libc probe hits, {result.total_lost} events lost",
            file=sys.stderr,
            flush=True,
        )


def print_summary(result: TraceResult, stream: TextIO) -> None:
    stream.write("\n".join(summary_lines(result)) + "\n")
    stream.flush()


def summary_lines(result: TraceResult) -> list[str]:
    ended = f"ended by {result.ended_by}" if result.ended_by else "ended"
    if result.exit_code is not None:
        ended += f", command exit code {result.exit_code}"
    lines = [f"mtrace-live: {result.duration_s:.1f} s, {ended}"]
    if result.probes:
        lines.append(f"events: {result.total_hits} in the kernel, {result.delivered} delivered, "
                     f"{result.total_lost} lost")  # fmt: skip
    if result.lock_delivered is not None and result.lock_waits is not None:
        lines.append(f"lock wait events: {result.lock_delivered} delivered, "
                     f"{result.lock_waits.misc.get('lost_events', 0)} lost")  # fmt: skip
    if result.lost_lifecycle:
        lines.append(f"exec/exit records lost: {result.lost_lifecycle}")
    if any(result.stacks_lost):
        user, kernel = result.stacks_lost
        lines.append(
            f"stacks not stored (stack map full or colliding): {user} user, {kernel} kernel"
        )
    if result.missed:
        lines.append(
            "runs the kernel skipped (another BPF program, or a BPF map system call, was active "
            "on that CPU): " + ", ".join(f"{k} {v}" for k, v in sorted(result.missed.items()))
        )
    hit = sorted(
        ((name, n) for name, n in result.kernel_hits.items() if n),
        key=lambda kv: (-kv[1], kv[0]),
    )
    if hit:
        width = max(len(name) for name, _ in hit)
        lines.append(f"{'probe':<{width}}  {'hits':>10}  {'lost':>8}")
        lines += [f"{name:<{width}}  {n:>10}  {result.lost[name]:>8}" for name, n in hit]
    silent = len(result.kernel_hits) - len(hit)
    if silent:
        lines.append(f"({silent} more probes attached, not hit)")
    waits = result.lock_waits
    inflated = result.allocations is not None
    allocs = result.allocations
    others = alloc_table.other_allocators(allocs) if allocs is not None else {}
    for state in sorted(result.model.processes.values(), key=lambda p: p.pid):
        if state.pid in others:  # glibc's arenas, which it does not use: one line
            lines.append(alloc_table.not_glibc_line(state.pid, others[state.pid]))
            continue
        lines += process_lines(state, waits)
        if waits is not None and (state.pid in waits.threads or waits.of(state.pid).count):
            lines += process_contention_lines(waits, state, state.pid, result.frame_names, inflated)
    for pid in waits.processes() if waits is not None else ():
        if waits is not None and pid not in result.model.processes:
            lines.append(f"pid {pid}:")
            lines += process_contention_lines(waits, None, pid, result.frame_names, inflated)
    if result.kmem is not None:
        lines += kmem_lines(result.kmem)
    if result.allocations is not None:
        command_ended = result.exit_code is not None or result.ended_by == "exit"
        lines += alloc_table.alloc_summary_lines(
            result.allocations, result.frame_names, command_ended, result.leaks_older_than,
            result.alloc_delivered if result.alloc_delivered else None,
        )  # fmt: skip
    return lines


def kmem_lines(kmem: KmemResult, limit: int = 10) -> list[str]:
    totals = kmem.totals
    name_sites(totals.sites, KernelSymbols.load())
    hits = sum(totals.hits.values())
    lines = ["", f"kmem: {hits} tracepoint hits in the kernel; top call sites by bytes allocated:"]
    lines += render_table(totals, limit)
    if totals.untracked or totals.sites_dropped:
        lines.append(f"kmem tables full: {totals.untracked} objects not tracked by pointer, "
                     f"{totals.sites_dropped} updates of call sites dropped")  # fmt: skip
    if kmem.directory is not None:
        lines.append(
            f"kmemtrace: {kmem.records_written} records in {kmem.directory} "
            f"({kmem.delivered} kmem events delivered, {kmem.lost} lost; "
            f"total_overruns {kmem.overrun_bytes} bytes)"
        )
    return lines


def arena_lines(state: ProcessState, waits: LockWaits | None) -> list[str]:
    """Each arena: how it was used, its lock waits (counted by the probe,
    and in time where timed), its threads."""
    timed = arena_waits(waits, state.pid)
    found = sum(1 for a in state.arenas.values() if a.found_at_attach)
    lines = [
        f"  arenas: {len(state.arenas)} seen, "
        f"{sum(1 for a in state.arenas.values() if a.created_ns)} created, "
        f"{found} read from memory at attach; contention waits {state.contention_waits}",
        f"    {'arena':<18} {'reused':>7} {'free-list':>9} {'reuse-waits':>11} "
        f"{'lock-waits':>10} {'retries':>7} {'threads':>7} {'wait time':>10} {'timed':>8}",
    ]
    for arena in sorted(state.arenas.values(), key=lambda a: (not a.main, a.address)):
        label = f"{arena.address:#x}" + (" main" if arena.main else "")
        threads = "?" if arena.attached_threads is None else str(arena.attached_threads)
        times = timed.get(arena.address)
        wait = duration_text(times.total_ns) if times else "-"
        lines.append(
            f"    {label:<18} {arena.reused:>7} {arena.free_list:>9} {arena.reuse_waits:>11} "
            f"{state.arena_lock_waits(arena):>10} {arena.retries:>7} {threads:>7} {wait:>10} "
            f"{times.count if times else 0:>8}"
        )
    return lines


def setting_change(change: SettingChange) -> str:
    """``old -> new`` for the probes that report both, ``= new`` for mallopt()."""
    new = "?" if change.new is None else str(change.new)
    return f"= {new}" if change.old is None else f"{change.old} -> {new}"


def process_lines(state: ProcessState, waits: LockWaits | None = None) -> list[str]:
    lines = [described(state.pid, state.comm, state.ns_pid) + ":"]
    if state.arenas:
        lines += arena_lines(state, waits)
    if state.heaps or state.heap_bytes_grown:
        lines.append(
            f"  mmapped heaps: {len(state.heaps)} live, {state.heap_bytes} bytes; "
            f"grown {state.heap_bytes_grown}, released {state.heap_bytes_released}"
        )
    if state.sbrk_grown or state.sbrk_shrunk or state.sbrk_failed:
        lines.append(
            f"  sbrk: grown {state.sbrk_grown} bytes, shrunk {state.sbrk_shrunk}, "
            f"failed {state.sbrk_failed}"
        )
    if state.retries:
        lines.append(
            "  retries: " + ", ".join(f"{k} {v}" for k, v in sorted(state.retries.items()))
        )
    if state.double_free_checks:
        shown = ", ".join(
            f"{format_value(c.pointer, 'address')} (bin {c.tcache_bin})"
            for c in state.double_frees[:5]
        )
        lines.append(f"  tcache double-free checks: {state.double_free_checks}: {shown}")
    setjmps, longjmps = state.jumps
    if setjmps or longjmps:
        lines.append(f"  setjmp {setjmps}, longjmp {longjmps}")
    for change in state.settings:
        at = (change.ts_ns - state.first_ns) / 1e9 if state.first_ns else 0.0
        lines.append(f"  setting +{at:.3f}s {change.setting}: {setting_change(change)}")
    if state.execs:
        lines.append(f"  exec'd {state.execs} times")
    return lines
