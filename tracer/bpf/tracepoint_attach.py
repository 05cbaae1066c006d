"""A tracepoint's handler attached as bcc attaches it, without bcc: a perf
event of the tracepoint's id (tracefs' ``events/CATEGORY/EVENT/id``) with
the program set on it (PERF_EVENT_IOC_SET_BPF). The event's fd detaches it
when closed."""

from __future__ import annotations

import errno

from mtrace_live.tracer.bpf import uprobe_attach
from mtrace_live.tracer.bpf.tracefs import tracefs_root

PERF_TYPE_TRACEPOINT = 2
PERF_SAMPLE_RAW = 1 << 10


def attach_tracepoint(prog_fd: int, category: str, event: str) -> int:
    """Program ``prog_fd`` attached to tracepoint ``category:event``: the
    perf event's fd. Raises OSError (ENOENT: the kernel has no such
    tracepoint)."""
    path = tracefs_root() / "events" / category / event / "id"
    try:
        tracepoint_id = int(path.read_text())
    except FileNotFoundError:
        raise OSError(errno.ENOENT, f"no tracepoint {category}:{event} ({path})") from None
    except ValueError:
        raise OSError(errno.EINVAL, f"{path} holds no number") from None
    try:
        fd = uprobe_attach.open_event(PERF_TYPE_TRACEPOINT, tracepoint_id, PERF_SAMPLE_RAW)
        uprobe_attach.set_program(fd, prog_fd)  # (closes the event where it fails)
    except uprobe_attach.AttachFailure as failure:
        raise OSError(failure.errno, f"cannot attach to tracepoint {category}:{event}: "
                                     f"{failure}") from None  # fmt: skip
    return fd
