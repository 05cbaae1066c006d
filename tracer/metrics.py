"""What a scrape reads from a running trace, and the bookkeeping that keeps
a long-running exporter's counters right and its tables bounded.

``MetricsSource.snapshot`` runs on the HTTP server's threads: it reads the
BPF maps (through their file descriptors, so it works after privileges are
dropped) and the allocator model under the model's lock.

``MetricsSource.housekeep`` runs on the tracing loop every few seconds. A
process that has exited (seen gone twice in a row, so that its last events
are drained first) or that exec'd another program is retired: its per-process
hit counts are taken out of the BPF table and its model state dropped, and
what they counted is kept under its name, so counters by process name never
go down and the tables do not fill up with the dead.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict

from mtrace_live.exporters.prometheus import ProcessFigures, Snapshot

from . import bpf_syscalls, package_version
from .kallsyms import KernelSymbols
from .kmem import read_kernel_totals
from .live import LiveTrace
from .model import ProcessState
from .target import process_name

HOUSEKEEPING_S = 5.0


class MetricsSource:
    def __init__(
        self,
        trace: LiveTrace,
        symbols: KernelSymbols,
        bpf_stats_fd: int | None = None,
        read_interval: float = 0.5,
    ) -> None:
        self.trace = trace
        self.read_interval = read_interval
        self._read_lock = threading.Lock()
        self._last: tuple[float, Snapshot] | None = None
        self.program = trace.program
        self.probes = trace.selection.probes
        self.symbols = symbols
        self._functions: dict[int, str] = {}
        self._names: dict[int, str] = {}  # pid -> the name its counts are kept under
        self._retired: dict[str, ProcessFigures] = defaultdict(ProcessFigures)
        self._gone_before: set[int] = set()
        self._last_housekeeping = time.monotonic()
        self._bpf_stats_fd = bpf_stats_fd
        self.started = time.time()
        self._tracepoints = sum(
            1 for name in self.program.program_fds() if name.startswith("tracepoint__")
        )
        self._build = {
            "version": package_version(),
            "bcc": _bcc_version(),
            "kernel": os.uname().release,
        }

    # ---- the tracing loop's side ---------------------------------------
    def tick(self) -> None:
        now = time.monotonic()
        if now - self._last_housekeeping >= HOUSEKEEPING_S:
            self._last_housekeeping = now
            self.housekeep()

    def housekeep(self) -> None:
        model = self.trace.model
        libc = self.trace.request.libc_probes
        with model.lock:
            rows = self.program.process_hits() if libc else []
            hints = {row.tgid: row.comm for row in rows}
            retire: dict[int, str] = {}
            gone = set()
            for pid in set(model.processes) | set(hints):
                name = self._name(pid, hints.get(pid, ""))
                if not os.path.exists(f"/proc/{pid}"):
                    gone.add(pid)
                    if pid in self._gone_before:
                        retire[pid] = name
                    continue
                current = process_name(pid)
                renamed = bool(current) and current != name
                if renamed:  # exec'd: what it did so far stays with the old name
                    retire[pid] = name
            self._gone_before = gone - set(retire)
            if not retire:
                return
            for row in self.program.process_hits(set(retire), take=True) if libc else []:
                if row.probe < len(self.probes):
                    self._retired[retire[row.tgid]].hits[self.probes[row.probe]] += row.hits
            for pid, name in retire.items():
                state = model.processes.pop(pid, None)
                if state is not None:
                    self._retired[name].arena_lock_waits += _arena_lock_waits(state)
                self._names.pop(pid, None)

    def _name(self, pid: int, hint: str = "") -> str:
        """The name a process's counts are kept under, fixed at first sight:
        its name when the model saw it, else now, else the name of the
        thread that hit a probe first (the process may be gone already)."""
        name = self._names.get(pid)
        if name is None:
            state = self.trace.model.processes.get(pid)
            name = (
                (state.comm if state is not None else "") or process_name(pid) or hint or "unknown"
            )
            self._names[pid] = name
        return name

    # ---- the scrape's side -----------------------------------------------
    def snapshot(self) -> Snapshot:
        """The numbers now, or the last reading if it is younger than the
        read interval: every map read holds off the kernel's BPF programs on
        its CPU for a moment (their runs there are skipped and counted as
        missed), so a storm of scrapes must not become a storm of reads."""
        with self._read_lock:
            now = time.monotonic()
            if self._last is None or now - self._last[0] >= self.read_interval:
                self._last = (now, self._read())
            return self._last[1]

    def _read(self) -> Snapshot:
        trace = self.trace
        libc = trace.request.libc_probes
        processes: dict[str, ProcessFigures] = {}
        if libc:
            with trace.model.lock:
                for name, figures in self._retired.items():
                    processes[name] = _copy(figures)
                live: dict[int, ProcessFigures] = defaultdict(ProcessFigures)
                hints = {}
                for row in self.program.process_hits():
                    if row.probe < len(self.probes):
                        live[row.tgid].hits[self.probes[row.probe]] += row.hits
                        hints[row.tgid] = row.comm
                for pid, state in trace.model.processes.items():
                    figures = live[pid]
                    figures.arena_lock_waits = _arena_lock_waits(state)
                    figures.arenas = len(state.arenas)
                    figures.heap_bytes = state.heap_bytes
                    figures.sbrk_bytes = state.sbrk_grown - state.sbrk_shrunk
                for pid, figures in live.items():
                    figures.live = 1
                    processes.setdefault(self._name(pid, hints.get(pid, "")), ProcessFigures()).add(
                        figures
                    )
        hits = self.program.percpu_array_totals("hits") if libc else []
        lost = self.program.percpu_array_totals("lost") if libc else []
        kmem = None
        processed = {"libc": trace.delivered} if libc else {}
        events_lost = {"libc": sum(lost[: len(self.probes)])} if libc else {}
        if trace.request.filtered_by_pid:
            events_lost["lifecycle"] = self.program.percpu_array_totals("lost_lifecycle")[0]
        if trace.kmem:
            kmem = read_kernel_totals(self.program)
            for site in kmem.sites:
                site.symbol = self._function(site.address)
            processed["kmem"] = sum(kmem.hits.values())
            events_lost["kmem"] = kmem.lost_allocs + kmem.lost_frees
        bpf_runs, misses = self._program_stats()
        if libc:
            events_lost["libc_missed"] = sum(
                n for label, n in misses.items() if label.startswith("usdt:")
            )
        if trace.kmem:
            events_lost["kmem_missed"] = sum(
                n for label, n in misses.items() if label.startswith("tracepoint:kmem:")
            )
        return Snapshot(
            libc=libc,
            probe_hits={name: hits[slot] for slot, name in enumerate(self.probes)},
            probe_lost={name: lost[slot] for slot, name in enumerate(self.probes)},
            processes=processes,
            process_hits_dropped=self.program.percpu_array_totals("proc_hits_dropped")[0]
            if libc
            else 0,
            kmem=kmem,
            events_processed=processed,
            events_lost=events_lost,
            probes_attached=self._attached(),
            bpf_runs=bpf_runs,
            bpf_misses=misses,
            started=self.started,
            build=self._build,
        )

    def _function(self, address: int) -> str:
        name = self._functions.get(address)
        if name is None:
            found = self.symbols.function(address)
            name = self._functions[address] = found[0] if found else "unknown"
        return name

    def _attached(self) -> dict[str, int]:
        attached = {"tracepoint": self._tracepoints}
        if self.trace.request.libc_probes:
            attached["usdt_probe"] = len(self.probes)
            attached["usdt_site"] = len(self.trace.selection.layouts)
        return attached

    def _program_stats(self) -> tuple[dict[str, tuple[int, int]] | None, dict[str, int]]:
        """Run time and runs (None unless the kernel counts them), and runs
        the kernel skipped, by what each handler traces."""
        stats = self.trace.program_stats()
        timed = self._bpf_stats_fd is not None or bpf_syscalls.sysctl_enabled()
        runs = {label: (s.run_time_ns, s.run_cnt) for label, s in stats.items()} if timed else None
        return runs, {label: s.misses for label, s in stats.items()}

    def close(self) -> None:
        bpf_syscalls.close(self._bpf_stats_fd)
        self._bpf_stats_fd = None


def _arena_lock_waits(state: ProcessState) -> int:
    return sum(state.arena_lock_waits(arena) for arena in state.arenas.values())


def _copy(figures: ProcessFigures) -> ProcessFigures:
    copy = ProcessFigures()
    copy.add(figures)
    return copy


def _bcc_version() -> str:
    try:
        import bcc

        return str(getattr(bcc, "__version__", "unknown"))
    except ImportError:
        return "unknown"
