"""The records the BPF program writes, as user space reads them.

``bpf/records.h`` defines each layout once for the C side; these are the
same layouts as numpy dtypes and Python enums. tests/unit/test_record_layout.py
parses the header and compares every field's offset and size, and every
enumerator, with what is here.
"""

from __future__ import annotations

from enum import IntEnum
from pathlib import Path

from .elf import cfi
from .elf.lazy import lazy_dtype

MAX_ARGS = 6  # struct event's args[]
FRAME_DEPTH = 128  # frames kept of a stack walked by CFI (the call site and 127 callers)

# struct event: one record of the ``events`` ring buffer.
EVENT_DTYPE = lazy_dtype(
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
    ALLOC = 4  # an allocation function returned: probe = AllocFn, args = AllocArg
    FREE = 5  # free, or realloc's release of its old pointer
    HELD = 6  # a process mtrace-live started called _exit and waits, stopped, to be continued
    LOCK_WAIT = 7  # a wait in the libc's lock-wait slow path ended: args = futex, ns
    UNWIND = 8  # a process wants its unwind tables (one mtrace-live started: stopped till then)
    RETARGET = 9  # the thread the uprobes are attached for calls pthread_exit
    UNWIND_VMA = 10  # a walk found a mapping in the kernel: args = start, end, pgoff, dev, ino, ask


class HoldCount(IntEnum):
    """enum hold_count: the slots of hold_counts, the guardian's."""

    PAST_BOUND = 0
    TRACER_GONE = 1


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


class AllocFn(IntEnum):
    """enum alloc_fn: the allocation functions, in the alloc_calls array's order."""

    MALLOC = 0
    CALLOC = 1
    REALLOC = 2
    REALLOCARRAY = 3
    FREE = 4
    MEMALIGN = 5
    POSIX_MEMALIGN = 6
    ALIGNED_ALLOC = 7
    VALLOC = 8
    PVALLOC = 9


ALLOC_FN_NAMES = tuple(fn.name.lower() for fn in AllocFn)


class AllocArg(IntEnum):
    """enum alloc_arg: the args of an ALLOC or FREE event."""

    PTR = 0
    SIZE = 1
    AUX = 2
    WEIGHT = 3
    BORN = 4
    SITE = 5


class SiteReg(IntEnum):
    """enum site_reg: where an allocation function's argument is at its
    uprobe site, four bits per argument in the site's cookie from bit
    SITE_REG_SHIFT (STANDARD: the calling convention's register)."""

    STANDARD = 0
    RDI = 1
    RSI = 2
    RDX = 3
    RCX = 4
    R8 = 5
    R9 = 6
    RAX = 7
    R10 = 8
    R11 = 9
    RBX = 10
    RBP = 11
    R12 = 12
    R13 = 13
    R14 = 14
    R15 = 15


SITE_REG_SHIFT = 32  # records.h's; the bits below hold the uprobe's generation
SITE_REG_BITS = 4
SITE_PROVIDER_SHIFT = 48  # the cookie's top bits: the site's provider, kept in alloc_key


class AllocMisc(IntEnum):
    """enum alloc_misc: the slots of the alloc_misc array."""

    OUTSTANDING_FULL = 0
    STACKS_FULL = 1
    LOST_EVENTS = 2
    NESTED = 3
    NULL_FREES = 4
    SLOT_TAKEN = 5
    FRAMES_FULL = 6


# struct proc_key and struct proc_hit (proc_hits), struct site_key, struct
# site_stats (kmem_sites) and struct order_stats (page_orders).
PROC_KEY_DTYPE = lazy_dtype([("tgid", "<u4"), ("probe", "<u4")])
PROC_HIT_DTYPE = lazy_dtype([("count", "<u8"), ("comm", "S16")])
SITE_KEY_DTYPE = lazy_dtype([("call_site", "<u8"), ("type", "<u4"), ("pad", "<u4")])
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
SITE_STATS_DTYPE = lazy_dtype([(name, "<u8") for name in SITE_FIELDS])
ORDER_STATS_DTYPE = lazy_dtype([("allocs", "<u8"), ("frees", "<u8")])

# Stack ids of allocations from here on index alloc_frames, not `stacks`.
ALLOC_FRAMES_BASE = 0x40000000

# struct alloc_key, struct alloc_stats and struct alloc_stack_row
# (alloc_stacks), struct alloc_proc (alloc_procs), struct outstanding and
# struct outstanding_row (outstanding).
ALLOC_KEY_DTYPE = lazy_dtype(
    [
        ("call_site", "<u8"),
        ("tgid", "<u4"),
        ("stack", "<i4"),
        ("fn", "<u2"),
        ("provider", "<u2"),
        ("incarnation", "<u4"),
    ]
)
ALLOC_STATS_FIELDS = ("calls", "bytes", "sizes", "frees", "bytes_freed", "sizes_freed", "last_ts")
ALLOC_STATS_DTYPE = lazy_dtype([(name, "<u8") for name in ALLOC_STATS_FIELDS])
ALLOC_PROC_FIELDS = ("calls", "bytes", "frees", "unknown_frees", "failed", "untracked",
                     "booked_freed")  # fmt: skip
ALLOC_PROC_DTYPE = lazy_dtype(
    [
        *((name, "<u8") for name in ALLOC_PROC_FIELDS),
        ("incarnation", "<u4"),
        ("pad", "<u4"),
        ("comm", "S16"),
    ]
)
VM_PROC_FIELDS = ("mmap_calls", "mmap_bytes", "mmap_file_bytes", "munmap_calls", "munmap_bytes",
                  "mremap_calls", "mremap_grown", "mremap_shrunk", "brk_calls", "brk_grown",
                  "brk_shrunk")  # fmt: skip
VM_PROC_DTYPE = lazy_dtype([(name, "<u8") for name in VM_PROC_FIELDS])
ALLOC_STACK_ROW_DTYPE = lazy_dtype(
    [("tag", "<u8"), ("key", ALLOC_KEY_DTYPE), ("stats", ALLOC_STATS_DTYPE)]
)
OUTSTANDING_DTYPE = lazy_dtype(
    [
        ("key", ALLOC_KEY_DTYPE),
        ("size", "<u8"),
        ("weight", "<u8"),
        ("ts", "<u8"),
        ("tid", "<u4"),
        ("stack_row", "<u4"),
    ]
)
OUTSTANDING_ROW_DTYPE = lazy_dtype(
    [("tag", "<u8"), ("ptr", "<u8"), ("tgid", "<u4"), ("pad", "<u4"), ("value", OUTSTANDING_DTYPE)]
)
OUTSTANDING_FREE_TAGS = (0, 1)  # a row never used, a row freed since

# struct lock_key, struct lock_time (lock_times) and struct lock_stack_time
# (lock_stack_times): the lock waits, timed (locks.bpf.c).
LOCK_BUCKETS = 40
LOCK_KEY_DTYPE = lazy_dtype([("futex", "<u8"), ("tgid", "<u4"), ("stack", "<i4")])
LOCK_TIME_DTYPE = lazy_dtype(
    [("count", "<u8"), ("total_ns", "<u8"), ("max_ns", "<u8"), ("hist", "<u8", (LOCK_BUCKETS,))]
)
LOCK_STACK_TIME_DTYPE = lazy_dtype([("count", "<u8"), ("total_ns", "<u8"), ("max_ns", "<u8")])


class LockMisc(IntEnum):
    """enum lock_misc: the slots of the lock_misc array."""

    NO_ROW = 0
    NO_STACK_ROW = 1
    FRAMES_FULL = 2
    PENDING_FULL = 3
    ABANDONED = 4
    LOST_EVENTS = 5
    NO_THREAD_ROW = 6


UNWIND_ROW_DTYPE = cfi.ROW  # struct unwind_row: probes/elf/cfi.py makes them
UNWIND_MAP_DTYPE = lazy_dtype([("start", "<u8"), ("end", "<u8"), ("bias", "<u8"), ("first", "<u4"),
                             ("count", "<u4"), ("pages", "<u4"), ("page_count", "<u4"),
                             ("page_base", "<u4"), ("pad", "<u4"), ("file", "<u4"),
                             ("spare", "<u4")])  # fmt: skip
UNWIND_PROC_DTYPE = lazy_dtype([("first", "<u4"), ("count", "<u4"), ("inherited", "<u4"),
                              ("parent", "<u4")])  # fmt: skip
UNWIND_FILE_KEY_DTYPE = lazy_dtype([("dev", "<u8"), ("ino", "<u8")])
UNWIND_FILE_DTYPE = lazy_dtype([("first", "<u4"), ("count", "<u4"), ("pages", "<u4"),
                              ("page_count", "<u4"), ("page_base", "<u4"), ("written", "<u4"),
                              ("seg_start", "<u8"), ("seg_end", "<u8"),
                              ("seg_delta", "<u8"), ("number", "<u4"), ("pad", "<u4")])  # fmt: skip
PYTHON_STACK_DTYPE = lazy_dtype([("tgid", "<u4"), ("stack", "<i4")])
PYTHON_PROC_DTYPE = lazy_dtype([("eval_lo", "<u8", (2,)), ("eval_hi", "<u8", (2,)),
                              ("tss_at", "<u8"), ("slot_base", "<u4"),
                              ("slot_stride", "<u4"), ("tstate_cframe", "<u2"),
                              ("current_frame", "<u2"), ("frame_code", "<u2"),
                              ("frame_previous", "<u2"), ("frame_instr", "<u2"),
                              ("frame_owner", "<u2"), ("frame_is_entry", "<u2"),
                              ("code_adaptive", "<u2"), ("owner_cstack", "u1"),
                              ("pad", "u1", (7,))])  # fmt: skip
UNWIND_VMAS_DTYPE = lazy_dtype([("maps", UNWIND_MAP_DTYPE, (4,)), ("next", "<u4"), ("pad", "<u4")])


class UnwindMisc(IntEnum):
    """enum unwind_misc: the slots of the unwind_misc array."""

    STACKS = 0
    COMPLETE = 1
    DEPTH = 2
    NO_CFI = 3
    UNREADABLE = 4
    OUT_OF_STACK = 5
    BOUNDS = 6
    NO_TABLES = 7
    CFI_FRAMES = 8
    FP_FRAMES = 9
    LOST = 10
    INHERITED = 11
    VMA_LOOKUPS = 12
    VMA_BUSY = 13
    UNWRITTEN = 14
    VMA_FRAMES = 15
    PY_FRAMES = 16
    PY_NO_THREAD = 17
    PY_UNREADABLE = 18
    PY_STACKS_LOST = 19


# How a walk by CFI ends: whole, or cut short of the outermost frame.
UNWIND_ENDS = (UnwindMisc.COMPLETE, UnwindMisc.DEPTH, UnwindMisc.NO_CFI, UnwindMisc.UNREADABLE,
               UnwindMisc.OUT_OF_STACK, UnwindMisc.BOUNDS, UnwindMisc.LOST)  # fmt: skip
# The slots counted only where Python frames are walked (WITH_PYTHON).
UNWIND_PYTHON_COUNTS = frozenset({UnwindMisc.PY_FRAMES, UnwindMisc.PY_NO_THREAD,
                                  UnwindMisc.PY_UNREADABLE, UnwindMisc.PY_STACKS_LOST})  # fmt: skip
# The slots counted only where walks look mappings up in the kernel (UNWIND_VMA).
UNWIND_VMA_COUNTS = frozenset({UnwindMisc.VMA_LOOKUPS, UnwindMisc.VMA_BUSY,
                               UnwindMisc.UNWRITTEN, UnwindMisc.VMA_FRAMES})  # fmt: skip


THREAD_START_DTYPE = lazy_dtype([("start", "<u8"), ("tgid", "<u4"), ("pad", "<u4")])
THREAD_TIME_DTYPE = lazy_dtype(
    [("done_ns", "<u8"), ("exited", "<u8"), ("first_ns", "<u8"), ("last_exit_ns", "<u8")]
)


# Each C struct of records.h and its dtype here.
LAYOUTS = {
    "event": EVENT_DTYPE,
    "proc_key": PROC_KEY_DTYPE,
    "proc_hit": PROC_HIT_DTYPE,
    "site_key": SITE_KEY_DTYPE,
    "site_stats": SITE_STATS_DTYPE,
    "order_stats": ORDER_STATS_DTYPE,
    "alloc_key": ALLOC_KEY_DTYPE,
    "alloc_stats": ALLOC_STATS_DTYPE,
    "alloc_stack_row": ALLOC_STACK_ROW_DTYPE,
    "alloc_proc": ALLOC_PROC_DTYPE,
    "vm_proc": VM_PROC_DTYPE,
    "outstanding": OUTSTANDING_DTYPE,
    "outstanding_row": OUTSTANDING_ROW_DTYPE,
    "lock_key": LOCK_KEY_DTYPE,
    "lock_time": LOCK_TIME_DTYPE,
    "lock_stack_time": LOCK_STACK_TIME_DTYPE,
    "thread_start": THREAD_START_DTYPE,
    "thread_time": THREAD_TIME_DTYPE,
    "unwind_row": UNWIND_ROW_DTYPE,
    "unwind_map": UNWIND_MAP_DTYPE,
    "unwind_proc": UNWIND_PROC_DTYPE,
    "python_proc": PYTHON_PROC_DTYPE,
    "python_stack": PYTHON_STACK_DTYPE,
    "unwind_file_key": UNWIND_FILE_KEY_DTYPE,
    "unwind_file": UNWIND_FILE_DTYPE,
    "unwind_vmas": UNWIND_VMAS_DTYPE,
}


def header_path() -> Path:
    return Path(__file__).resolve().parent / "bpf" / "records.h"
