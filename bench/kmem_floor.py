"""Floors of section 2, compiled by bcc itself as any bcc tool is
(bench/bpf/kmem_empty.bpf.c):

- ``count``: the least a pid-filtered aggregation does at each kmem event,
  compare the event's process with the traced one and count those that
  match (PID_FILTER);
- ``match``: that, and the least a tracer that knows which objects are live
  does besides (MATCH_FREES): a traced allocation puts its pointer in a
  table, and every free, whoever frees, looks it up there and takes it out.

Runs the command as the traced process: it is forked, named to the
handlers, and only then executed, so no event of its own goes unfiltered.
Exits with the command's exit status.

    python bench/kmem_floor.py count|match PAGE_FREE_BATCHED -- COMMAND...
"""

from __future__ import annotations

import os
import sys

import bcc
from common import FLOORS
from mtrace_live.probes.program import bpf_directory
from mtrace_live.tracer.bpf.kmem_attach import kmem_attach
from mtrace_live.tracer.bpf.tracefs import kmem_defines, tracepoint_format

SLAB_EVENTS = ("KMALLOC", "KFREE", "CACHE_ALLOC", "CACHE_FREE")


def pointer_arguments() -> list[str]:
    """Each slab event's pointer argument, as mtrace-live finds it in BTF;
    the ``match`` floor needs all four events raw."""
    defines = kmem_attach(kmem_defines(tracepoint_format)).defines
    missing = [event for event in SLAB_EVENTS if not defines.get(f"RAW_{event}")]
    if missing:
        raise SystemExit(f"kmem floor: {', '.join(missing)} not raw on this kernel")
    return [f"-D{event}_ARG_PTR={defines[f'{event}_ARG_PTR']}" for event in SLAB_EVENTS]


def main(kind: str, page_free_batched: int, argv: list[str]) -> int:
    cflags = ["-DRAW_SLAB=1", f"-DPAGE_FREE_BATCHED={page_free_batched}", "-DPID_FILTER=1"]
    if kind == "match":
        cflags += ["-DMATCH_FREES=1", *pointer_arguments()]
    source = FLOORS / "kmem_empty.bpf.c"
    cflags.append(f"-I{bpf_directory()}")  # set_table.h, the program's own
    program = bcc.BPF(src_file=str(source), cflags=cflags)
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
    said = f"kmem floor: {matched} events of pid {pid} matched"
    if kind == "match":
        said += (f", {program['freed'].sum(0).value} frees found live, "
                 f"{program['full'].sum(0).value} allocations in a full bucket")  # fmt: skip
    print(said, file=sys.stderr, flush=True)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    split = sys.argv.index("--")
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[split + 1 :]))
