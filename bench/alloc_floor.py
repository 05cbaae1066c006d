"""The floor of section 8: a program that does nothing (probes/bpf/empty.bpf.c),
attached where mtrace-live attaches the allocation functions' handlers (the
same entry sites, the same return probes, for that one process, as
mtrace-live attaches them for --pid alone), so that what remains is the
kernel's own cost of the probes. With --every-process, attached for every
process mapping the libc, as for --all and --follow-forks. Prints "ready"
once attached; runs until SIGINT or SIGTERM.

    python bench/alloc_floor.py PID [--every-process]
"""

from __future__ import annotations

import signal
import sys

from mtrace_live.probes.program import ProgramSource
from mtrace_live.tracer.alloc_probes import RETURNS_POINTER, plan_sites
from mtrace_live.tracer.bpf_backend import BpfProgram
from mtrace_live.tracer.target import mapped_libc


def main(pid: int, every_process: bool) -> None:
    chosen = plan_sites(mapped_libc(pid))
    scope = -1 if every_process else pid
    program = BpfProgram(ProgramSource.single("empty"))
    try:
        for name, site in chosen.sites.items():
            program.attach_uprobe(chosen.libc, site.file_offset, "empty", scope)
            if name in RETURNS_POINTER:
                program.attach_uretprobe(
                    chosen.libc, site.file_offset - site.offset, "empty", scope
                )
        print("ready", flush=True)
        signal.sigwait([signal.SIGINT, signal.SIGTERM])
    finally:
        program.close()


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT, signal.SIGTERM])
    main(int(sys.argv[1]), "--every-process" in sys.argv[2:])
