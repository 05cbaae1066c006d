"""mtrace-live with a fault injected, as a bug of its own would strike:

    python -m tests.privileged.faults FAULT MTRACE-LIVE-ARGS...

FAULT is ``tables`` (writing any process's unwind tables raises), ``ring``
(the third read of the ring raises) or ``sink`` (the JSON lines output
raises at its second batch). Nothing of mtrace-live is changed but the one
method; the command line is mtrace-live's own."""

from __future__ import annotations

import sys
from typing import Any

from mtrace_live.exporters.lines import JsonLines
from mtrace_live.tracer import cli
from mtrace_live.tracer.bpf.ringbuf import RingReader
from mtrace_live.tracer.unwind.unwind_tables import UnwindTables


def after(calls: int, method: Any) -> Any:
    """``method``, raising from its ``calls``-th call on."""
    made = [0]

    def faulty(*args: Any, **kwargs: Any) -> Any:
        made[0] += 1
        if made[0] >= calls:
            raise RuntimeError("a fault injected by the test")
        return method(*args, **kwargs)

    return faulty


FAULTS = {
    "tables": (UnwindTables, "_write", 1),
    "ring": (RingReader, "read", 3),
    "sink": (JsonLines, "consume", 2),
}

if __name__ == "__main__":
    owner, name, calls = FAULTS[sys.argv[1]]
    setattr(owner, name, after(calls, getattr(owner, name)))
    sys.argv = ["mtrace-live", *sys.argv[2:]]
    cli.main()
