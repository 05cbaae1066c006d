"""A floor of section 2: the least a pid-filtered aggregation does at each
kmem event, empty handlers that compare the event's process with the traced
one and count those that match (probes/bpf/kmem_empty.bpf.c, PID_FILTER),
compiled by bcc itself as any bcc tool is. Runs the command as the traced
process: it is forked, named to the handlers, and only then executed, so no
event of its own goes unfiltered. Exits with the command's exit status.

    python bench/kmem_floor.py RAW_SLAB PAGE_FREE_BATCHED -- COMMAND...
"""

from __future__ import annotations

import os
import sys

import bcc
from mtrace_live.probes import bpf_source


def main(raw: int, page_free_batched: int, argv: list[str]) -> int:
    cflags = [f"-DRAW_SLAB={raw}", f"-DPAGE_FREE_BATCHED={page_free_batched}", "-DPID_FILTER=1"]
    program = bcc.BPF(src_file=str(bpf_source("kmem_empty")), cflags=cflags)
    go_read, go_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(go_write)
        os.read(go_read, 1)  # until the parent has named this process
        try:
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    os.close(go_read)
    target = program["target"]
    target[target.Key(0)] = target.Leaf(pid)
    os.write(go_write, b"x")
    os.close(go_write)
    _, status = os.waitpid(pid, 0)
    matched = program["matched"].sum(0).value
    print(f"kmem floor: {matched} events of pid {pid} matched", file=sys.stderr, flush=True)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    split = sys.argv.index("--")
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[split + 1 :]))
