"""The floor of section 8: programs that do nothing, attached where
mtrace-live attaches for a pid's allocation functions (the same entry sites,
the same return probes), so that what remains is the kernel's own cost of
the probes. Prints "ready" once attached; runs until SIGINT.

    python bench/alloc_floor.py PID
"""

from __future__ import annotations

import signal
import sys

from mtrace_live.tracer.allocs import RETURNS_POINTER, plan
from mtrace_live.tracer.target import mapped_libc

EMPTY = "int empty(struct pt_regs *ctx) { return 0; }"


def main(pid: int) -> None:
    import bcc

    chosen = plan(mapped_libc(pid))
    program = bcc.BPF(text=EMPTY)
    for name, site in chosen.sites.items():
        program.attach_uprobe(name=str(chosen.libc), addr=site.file_offset, fn_name="empty",
                              pid=pid)  # fmt: skip
        if name in RETURNS_POINTER:
            entry = site.file_offset - site.offset
            program.attach_uretprobe(name=str(chosen.libc), addr=entry, fn_name="empty", pid=pid)
    print("ready", flush=True)
    signal.sigwait([signal.SIGINT, signal.SIGTERM])


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT, signal.SIGTERM])
    main(int(sys.argv[1]))
