"""The floor of section 8: a program that does nothing (bench/bpf/empty.bpf.c),
attached where mtrace-live attaches the allocation functions' handlers (the
same entry sites, the same return probes, for that one process, as
mtrace-live attaches them for --pid alone), so that what remains is the
kernel's own cost of the probes. With --every-process, attached for every
process mapping the libc, as for --all and --follow-forks; with
--allocator, on the sites of the allocator the process's malloc binds to
(jemalloc, tcmalloc, mimalloc: tracer/processes/providers.py) instead of the libc's.
Prints "ready" once attached; runs until SIGINT or SIGTERM.

    python bench/alloc_floor.py PID [--every-process] [--allocator]
"""

from __future__ import annotations

import signal
import sys

from common import floor_source
from mtrace_live.tracer.bpf.bpf_backend import BpfProgram
from mtrace_live.tracer.loop.alloc_probes import RETURNS_POINTER, plan_sites
from mtrace_live.tracer.processes.providers import of_process
from mtrace_live.tracer.processes.target import mapped_libc


def main(pid: int, every_process: bool, allocator: bool) -> None:
    binding = of_process(pid).binding if allocator else None
    if allocator and binding is None:
        raise SystemExit(f"process {pid}'s malloc binds to no known allocator")
    chosen = (plan_sites(binding.path, binding.allocator, binding.tables) if binding is not None
              else plan_sites(mapped_libc(pid)))  # fmt: skip
    scope = -1 if every_process else pid
    program = BpfProgram(floor_source("empty"))
    try:
        for site in chosen.sites.values():
            program.attach_uprobe(chosen.libc, site.file_offset, "empty", scope)
            if site.handler in RETURNS_POINTER:  # at the site, as mtrace-live attaches it
                program.attach_uretprobe(chosen.libc, site.file_offset, "empty", scope)
        print("ready", flush=True)
        signal.sigwait([signal.SIGINT, signal.SIGTERM])
    finally:
        program.close()


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT, signal.SIGTERM])
    main(int(sys.argv[1]), "--every-process" in sys.argv[2:], "--allocator" in sys.argv[2:])
