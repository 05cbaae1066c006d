"""The records the BPF program writes, as user space reads them.

``bpf/records.h`` defines each layout once for the C side; these are the
same layouts as numpy dtypes and Python enums. tests/unit/test_record_layout.py
parses the header and compares every field's offset and size, and every
enumerator, with what is here.
"""

from __future__ import annotations

from enum import IntEnum
from importlib.resources import files
from pathlib import Path

import numpy as np

MAX_ARGS = 6  # struct event's args[]

# struct event: one record of the ``events`` ring buffer.
EVENT_DTYPE = np.dtype(
    [
        ("ts", "<u8"),
        ("ip", "<u8"),
        ("tgid", "<u4"),
        ("tid", "<u4"),
        ("cpu", "<u2"),
        ("probe", "<u2"),
        ("site", "<u2"),
        ("kind", "u1"),
        ("nargs", "u1"),
        ("args", "<u8", (MAX_ARGS,)),
        ("ustack", "<i4"),  # stack ids (WITH_STACKS), < 0 for none
        ("kstack", "<i4"),
    ]
)


class EventKind(IntEnum):
    """enum event_kind."""

    PROBE = 0
    EXEC = 1
    EXIT = 2
    KMEM = 3  # a kmem tracepoint: probe = KmemEvent, site = KmemType


class KmemEvent(IntEnum):
    """enum kmem_event: the kmem tracepoints, in the kmem_hits array's order."""

    KMALLOC = 0
    KFREE = 1
    KMEM_CACHE_ALLOC = 2
    KMEM_CACHE_FREE = 3
    MM_PAGE_ALLOC = 4
    MM_PAGE_FREE = 5
    MM_PAGE_FREE_BATCHED = 6


KMEM_EVENTS = tuple(event.name.lower() for event in KmemEvent)
KMEM_FREE_EVENTS = frozenset(event.value for event in KmemEvent if "FREE" in event.name)


class KmemType(IntEnum):
    """enum kmem_type: kmemtrace's type ids (Documentation/ABI/testing/debugfs-kmemtrace)."""

    KMALLOC = 0
    CACHE = 1
    PAGES = 2


class KmemMisc(IntEnum):
    """enum kmem_misc: the slots of the kmem_misc array."""

    OBJECTS_UNTRACKED = 0
    SITES_DROPPED = 1
    LOST_ALLOCS = 2
    LOST_FREES = 3


# struct proc_key and struct proc_hit (proc_hits), struct site_key, struct
# site_stats (kmem_sites) and struct order_stats (page_orders).
PROC_KEY_DTYPE = np.dtype([("tgid", "<u4"), ("probe", "<u4")])
PROC_HIT_DTYPE = np.dtype([("count", "<u8"), ("comm", "S16")])
SITE_KEY_DTYPE = np.dtype([("call_site", "<u8"), ("type", "<u4"), ("pad", "<u4")])
SITE_FIELDS = (
    "allocs",
    "bytes_req",
    "bytes_alloc",
    "failed",
    "cross_node",
    "frees",
    "bytes_freed",
    "cross_cpu_frees",
    "mismatched_frees",
    "unknown_frees",
)
SITE_STATS_DTYPE = np.dtype([(name, "<u8") for name in SITE_FIELDS])
ORDER_STATS_DTYPE = np.dtype([("allocs", "<u8"), ("frees", "<u8")])

# Each C struct of records.h and its dtype here.
LAYOUTS = {
    "event": EVENT_DTYPE,
    "proc_key": PROC_KEY_DTYPE,
    "proc_hit": PROC_HIT_DTYPE,
    "site_key": SITE_KEY_DTYPE,
    "site_stats": SITE_STATS_DTYPE,
    "order_stats": ORDER_STATS_DTYPE,
}


def header_path() -> Path:
    return Path(str(files("mtrace_live.probes") / "bpf" / "records.h"))
