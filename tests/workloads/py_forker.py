"""A Python master that forks workers, as pre-forking servers do: each
worker allocates a known number of blocks from its own Python functions and
ends; then the master allocates its own. For tracing a process and its
children, and checking each one's Python frames.

    python3 py_forker.py WORKERS LEDGER

Each worker makes WORKER_CALLS bytearray(WORKER_SIZE - 1) in worker_leaf
(malloc(WORKER_SIZE) each: a bytearray of n bytes asks for n + 1, above
pymalloc's 512), then leaves with os._exit(0) (its blocks never freed); the
master then makes MASTER_CALLS bytearray(MASTER_SIZE - 1) in master_leaf and
writes its ledger to the file LEDGER, one line of JSON: the workers' pids,
each leaf's line and Python functions (leaf first), the sizes and the calls.
"""

import json
import os
import sys

WORKER_SIZE = 51_001
WORKER_CALLS = 23
MASTER_SIZE = 52_001
MASTER_CALLS = 17


def worker_leaf(keep):
    for _ in range(WORKER_CALLS):
        keep.append(bytearray(WORKER_SIZE - 1))  # the worker's line


def worker():
    keep = []
    worker_leaf(keep)
    os._exit(0)


def master_leaf(keep):
    for _ in range(MASTER_CALLS):
        keep.append(bytearray(MASTER_SIZE - 1))  # the master's line


def master(workers):
    pids = []
    for _ in range(workers):
        pid = os.fork()
        if pid == 0:
            worker()
        pids.append(pid)
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise SystemExit(f"py_forker: worker {pid} ended with status {status}")
    keep = []
    master_leaf(keep)
    return pids, keep


def line_of(function, mark):
    """The line of ``function`` that holds the comment ``mark``."""
    code = function.__code__
    with open(code.co_filename) as source:
        lines = source.read().splitlines()
    return next(n for n, text in enumerate(lines, 1) if n >= code.co_firstlineno and mark in text)


def main():
    workers, ledger = int(sys.argv[1]), sys.argv[2]
    pids, _ = master(workers)
    with open(ledger, "w") as out:
        out.write(json.dumps({
        "master": os.getpid(),
        "workers": pids,
        "file": worker_leaf.__code__.co_filename,
        "worker": {"size": WORKER_SIZE, "calls": WORKER_CALLS,
                   "line": line_of(worker_leaf, "# the worker's line"),
                   "python_stack": ["worker_leaf", "worker", "master", "main", "<module>"]},
        "master_blocks": {"size": MASTER_SIZE, "calls": MASTER_CALLS,
                          "line": line_of(master_leaf, "# the master's line"),
                          "python_stack": ["master_leaf", "master", "main", "<module>"]},
    }))  # fmt: skip


if __name__ == "__main__":
    main()
