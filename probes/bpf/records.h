/* The records and table layouts that the trace program and user space share: the
 * one definition of each. probes/records.py holds the same layouts as numpy
 * dtypes and Python enums, and tests/unit/test_record_layout.py parses this
 * file and compares every field's offset and size, and every enumerator,
 * with them.
 *
 * Only types and constants live here: bcc rewrites map calls only in the
 * main source file. */
#ifndef MTRACE_RECORDS_H
#define MTRACE_RECORDS_H

#define MAX_ARGS 6

/* Where a site's argument lives (probes/locations.py: ArgKind). */
enum arg_kind {
    ARG_NONE = 0,      /* not recorded: the note's operand is not understood */
    ARG_CONST = 1,     /* $value */
    ARG_REG = 2,       /* %reg */
    ARG_DEREF_REG = 3, /* value(%reg) */
    ARG_DEREF_IP = 4,  /* memory at (site's ip + value), from sym+off(%rip) */
};

enum event_kind {
    EV_PROBE = 0,
    EV_EXEC = 1, /* a followed process exec'd; args[0] = its pid before exec */
    EV_EXIT = 2, /* a followed process's group leader exited */
    EV_KMEM = 3, /* a kmem tracepoint; probe = enum kmem_event, site = enum kmem_type */
    EV_ALLOC = 4, /* an allocation function returned a pointer; probe = enum alloc_fn,
                   * ip = the call site (return address), args = enum alloc_arg */
    EV_FREE = 5,  /* free (or realloc's release of its old pointer); the same args */
    EV_HELD = 6,  /* a process mtrace-live started called _exit and is stopped (HOLD_AT_EXIT) */
    EV_LOCK_WAIT = 7, /* a wait in the libc's lock-wait slow path ended (LOCK_EVENTS): ts = its
                       * end, ip = its caller, args[0] = the futex, args[1] = the wait in ns */
    EV_UNWIND = 8, /* a process wants its unwind tables (one mtrace-live started is
                    * stopped until they are written: HOLDS) */
    EV_RETARGET = 9, /* the thread the uprobes are attached for calls pthread_exit (one
                      * mtrace-live started is stopped until they are attached for another) */
    EV_UNWIND_VMA = 10, /* a walk found a mapping of its process in the kernel (UNWIND_VMA):
                         * args = its start, end, page offset, its file's device (the
                         * kernel's encoding: major << 20 | minor) and inode (0, 0: no
                         * file), and 1 where the file's rows were never asked for */
};

/* The slots of hold_counts (common.bpf.h), written by the guardian
 * (tracer/processes/holds.py): the processes it continued. */
enum hold_count {
    HC_PAST_BOUND = 0, /* held longer than the bound: let go, the tracer still there */
    HC_TRACER_GONE = 1, /* held when the tracer ended without continuing them */
};

/* One record of the `events` ring buffer. */
struct event {
    u64 ts;       /* CLOCK_MONOTONIC ns: exact, or to the tick (PROBE_EXACT_TIME 0) */
    u64 ip;       /* the site's address in the process */
    u32 tgid;
    u32 tid;
    u16 cpu;
    u16 probe;    /* probe slot, in user space's order */
    u16 site;
    u8 kind;      /* enum event_kind */
    u8 nargs;
    u64 args[MAX_ARGS]; /* sign- or zero-extended to 64 bits */
    s32 ustack;   /* stack id in `stacks`, or < 0: none (-errno when the map refused it) */
    s32 kstack;
};

/* proc_hits: hits per (process, probe slot). */
struct proc_key {
    u32 tgid;
    u32 probe;
};

struct proc_hit {
    u64 count;
    char comm[16]; /* of the thread that hit first: names processes gone before user space looked */
};

/* The kmem tracepoints, in the order of the kmem_hits array. */
enum kmem_event {
    KM_KMALLOC,
    KM_KFREE,
    KM_KMEM_CACHE_ALLOC,
    KM_KMEM_CACHE_FREE,
    KM_MM_PAGE_ALLOC,
    KM_MM_PAGE_FREE,
    KM_MM_PAGE_FREE_BATCHED,
    KM_COUNT,
};

/* kmemtrace type ids (Documentation/ABI/testing/debugfs-kmemtrace). */
enum kmem_type {
    KT_KMALLOC = 0,
    KT_CACHE = 1,
    KT_PAGES = 2,
};

/* The kmem_misc array. */
enum kmem_misc {
    KX_OBJECTS_UNTRACKED, /* live_objects was full */
    KX_SITES_DROPPED,     /* kmem_sites was full */
    KX_LOST_ALLOCS,       /* allocation events the ring had no room for */
    KX_LOST_FREES,        /* free events the ring had no room for */
    KX_COUNT,
};

/* kmem_sites: per (call site, type). */
struct site_key {
    u64 call_site;
    u32 type;
    u32 pad;
};

struct site_stats {
    u64 allocs;
    u64 bytes_req;
    u64 bytes_alloc;
    u64 failed;           /* allocations that returned NULL */
    u64 cross_node;       /* allocations asked of another NUMA node */
    u64 frees;            /* of this site's objects, matched by pointer */
    u64 bytes_freed;
    u64 cross_cpu_frees;  /* freed on another CPU than allocated on */
    u64 mismatched_frees; /* kfree of a cache object, or the reverse */
    u64 unknown_frees;    /* frees at this site of pointers not seen allocated */
};

/* page_orders: per page order. */
struct order_stats {
    u64 allocs;
    u64 frees;
};

/* ---- the allocation functions (WITH_ALLOCS) ---- */

/* The functions probed, in the alloc_calls array's order. */
enum alloc_fn {
    AF_MALLOC,
    AF_CALLOC,
    AF_REALLOC,
    AF_REALLOCARRAY,
    AF_FREE,
    AF_MEMALIGN,
    AF_POSIX_MEMALIGN,
    AF_ALIGNED_ALLOC,
    AF_VALLOC,
    AF_PVALLOC,
    AF_COUNT,
};

/* Where an argument of an allocation function is at its uprobe site, when
 * not in the calling convention's register: the instructions before the
 * site moved it (mimalloc's mi_malloc copies the size from rdi to rsi). Four
 * bits per argument in the site's BPF cookie, from bit SITE_REG_SHIFT:
 * probes/alloc_sites.py writes them, allocs.bpf.c's site_arg reads them. */
enum site_reg {
    SR_STANDARD, /* where the calling convention puts it */
    SR_RDI,
    SR_RSI,
    SR_RDX,
    SR_RCX,
    SR_R8,
    SR_R9,
    SR_RAX,
    SR_R10,
    SR_R11,
    SR_RBX,
    SR_RBP,
    SR_R12,
    SR_R13,
    SR_R14,
    SR_R15,
};
#define SITE_REG_SHIFT 32 /* below: the uprobe's generation (common.bpf.h) */
#define SITE_REG_BITS 4
/* The cookie's top bits: the provider (the allocator's file) the site is in,
 * numbered by user space (0: the libc) and kept in each allocation's key. */
#define SITE_PROVIDER_SHIFT 48

/* The args of an EV_ALLOC or EV_FREE event. */
enum alloc_arg {
    AA_PTR = 0,     /* the pointer returned, or freed */
    AA_SIZE = 1,    /* bytes asked for; for a free, of the matched allocation (0: unknown) */
    AA_AUX = 2,     /* realloc: the old pointer; memalign & co: the alignment */
    AA_WEIGHT = 3,  /* bytes this sample stands for (= size when every call is kept) */
    AA_BORN = 4,    /* a free: when the matched allocation was made (0: unknown) */
    AA_SITE = 5,    /* a free: the matched allocation's call site (0: unknown) */
};

/* The alloc_misc array. */
enum alloc_misc {
    AX_OUTSTANDING_FULL,  /* allocations the outstanding map had no room for */
    AX_STACKS_FULL,       /* allocations alloc_stacks had no room for */
    AX_LOST_EVENTS,       /* events the ring had no room for */
    AX_NESTED,            /* calls made inside another allocation function (not counted again) */
    AX_NULL_FREES,        /* free(NULL) */
    AX_SLOT_TAKEN,        /* calls lost: a thread whose id shares the pending slot took it */
    AX_FRAMES_FULL,       /* allocations whose stack alloc_frames had no room for (call site kept) */
    AX_COUNT,
};

/* alloc_stacks: per (process, stack). */
/* Stack ids of allocations start here: they index alloc_frames, not the
 * kernel's stack map `stacks` that probe and kmem events use. */
#define ALLOC_FRAMES_BASE 0x40000000

struct alloc_key {
    u64 call_site; /* the return address into the caller */
    u32 tgid;
    s32 stack;     /* ALLOC_FRAMES_BASE + row of alloc_frames, or -1: not walked or no room */
    u16 fn;        /* enum alloc_fn */
    u16 provider;  /* which file's function was called: the site's cookie from bit SITE_PROVIDER_SHIFT */
    u32 incarnation; /* the process's alloc_procs row's: a pid reused is another process */
};

struct alloc_stats {
    u64 calls;        /* kept allocations (every one, without sampling) */
    u64 bytes;        /* bytes they stand for (weights, with sampling) */
    u64 sizes;        /* bytes they asked for */
    u64 frees;        /* of them, freed */
    u64 bytes_freed;  /* weights of those */
    u64 sizes_freed;
    u64 last_ts;      /* the newest allocation's time */
};

/* A row of alloc_stacks, an open-addressed table in an array: tag is the
 * key's 64-bit hash (0: a free row), set before the key is written. */
struct alloc_stack_row {
    u64 tag;
    struct alloc_key key;
    struct alloc_stats stats;
};

/* alloc_procs: per process, every call (sampled or not). */
struct alloc_proc { /* without sampling, only what alloc_stacks rows do not count (allocs.bpf.c) */
    u64 calls;         /* allocations that returned a pointer */
    u64 bytes;         /* the bytes they asked for */
    u64 frees;         /* free() of a non-NULL pointer, and realloc's releases */
    u64 unknown_frees; /* of pointers not seen allocated (before attaching, or not kept) */
    u64 failed;        /* allocations that returned NULL */
    u64 untracked;     /* allocations kept but not tracked until freed: no room in outstanding
                        * (or, without sampling, in alloc_stacks); their frees are unknown */
    u64 booked_freed;  /* without sampling: of those, booked as freed in their stack's row */
    u32 incarnation;   /* this row's number, never 0: its process's stack rows carry it */
    u32 pad;
    char comm[16];     /* the process's name when its row was made: it may be gone when read */
};

/* vm_procs: per process, the memory system calls that bypass malloc
 * (WITH_ALLOCS): mmap, munmap, mremap and brk, counted when they return. */
struct vm_proc {
    u64 mmap_calls;      /* that succeeded */
    u64 mmap_bytes;      /* of anonymous mappings */
    u64 mmap_file_bytes; /* of file mappings */
    u64 munmap_calls;
    u64 munmap_bytes;
    u64 mremap_calls;
    u64 mremap_grown;    /* bytes mappings grew by */
    u64 mremap_shrunk;
    u64 brk_calls;       /* that moved the break */
    u64 brk_grown;
    u64 brk_shrunk;
};

/* outstanding: allocations not yet freed, by (process, pointer). */
struct outstanding {
    struct alloc_key key;
    u64 size;
    u64 weight;
    u64 ts;
    u32 tid;
    u32 stack_row; /* the row of alloc_stacks that counts it */
};

struct outstanding_row {
    u64 tag; /* 0: free; 1: freed since; else the allocation's (allocs.bpf.c) */
    u64 ptr;
    u32 tgid;
    u32 pad;
    struct outstanding value;
};

/* lock_times and lock_stack_times (locks.bpf.c): the waits in the libc's
 * lock-wait slow path, per (process, futex) and per (process, futex, stack).
 * Bucket 0 of a histogram counts waits of at most 1 ns, bucket k > 0 those
 * of more than 2^(k-1) and at most 2^k ns, the last one every longer wait. */
#define LOCK_BUCKETS 40

struct lock_key {
    u64 futex;
    u32 tgid;
    s32 stack; /* ALLOC_FRAMES_BASE + row of alloc_frames, or -1 (and always -1 in lock_times) */
};

struct lock_time {
    u64 count;
    u64 total_ns;
    u64 max_ns;
    u64 hist[LOCK_BUCKETS];
};

struct lock_stack_time {
    u64 count;
    u64 total_ns;
    u64 max_ns;
};

/* thread_starts and thread_times (locks.bpf.c): each traced thread's start
 * (when it was made, or when user space saw it at attach), and per process
 * the time of its threads that have exited: the whole of its threads' time
 * is done_ns plus, for each thread still there, now - start. */
struct thread_start {
    u64 start;
    u32 tgid;
    u32 pad;
};

struct thread_time {
    u64 done_ns;      /* the time of the threads that exited */
    u64 exited;       /* threads that exited */
    u64 first_ns;     /* when the process was made (0: it was there at attach) */
    u64 last_exit_ns; /* when its last thread to exit did */
};

/* The lock_misc array. */
enum lock_misc {
    LX_NO_ROW,        /* waits lock_times had no room for */
    LX_NO_STACK_ROW,  /* waits lock_stack_times had no room for (counted in lock_times) */
    LX_FRAMES_FULL,   /* waits whose stack alloc_frames had no room for (caller kept) */
    LX_PENDING_FULL,  /* waits not timed: lock_pending had no room */
    LX_ABANDONED,     /* waits that never returned: the thread exited or exec'd in them */
    LX_LOST_EVENTS,   /* waits the ring had no room for (LOCK_EVENTS) */
    LX_NO_THREAD_ROW, /* threads thread_starts or thread_times had no room for */
    LX_COUNT,
};


/* The CFI unwinder's tables (unwind.bpf.c), written by user space
 * (tracer/unwind/unwind_tables.py). unwind_rows: each mapped file's rows, by
 * link-time address (probes/elf/cfi.py says what the kinds mean). */
enum unwind_cfa { UC_NONE, UC_RSP, UC_RBP, UC_END, UC_OTHER };
enum unwind_rbp { UR_SAME, UR_AT, UR_LOST };

struct unwind_row {
    u32 pc;      /* link-time address from which the row holds */
    s32 cfa_off; /* the CFA: %rsp or %rbp (cfa) plus this */
    s16 rbp_off; /* UR_AT: the caller's %rbp is at CFA plus this */
    u8 cfa;      /* enum unwind_cfa */
    u8 rbp;      /* enum unwind_rbp */
};

/* One executable mapping of a process: [start, end), its link-time
 * address is pc - bias, its file's rows are unwind_rows[first, first + count)
 * (count 0: no rows, the frame pointers are followed there). Its file's
 * page index: unwind_pages[pages + k] is the row (from first) in force at
 * link-time address page_base + k * 4096, for k < page_count, so that a
 * search starts within one page's rows. file: the file's number (0: none
 * yet), which its frames carry (FRAME_KIND_FILE below). */
struct unwind_map {
    u64 start;
    u64 end;
    u64 bias;
    u32 first;
    u32 count;
    u32 pages;
    u32 page_count;
    u32 page_base;
    u32 pad;
    u32 file;
    u32 spare;
};

/* ---- frame kinds --------------------------------------------------------------
 * A frame of a user stack walked by CFI is a u64 whose top bits give its
 * kind. FRAME_KIND_ADDRESS (0): an address in its process (named by the
 * process's mappings; what a frame found by frame pointers, or in a file
 * with no number, is). FRAME_KIND_FILE: a return address in a file, by the
 * file's number (user space's, never reused in a trace; unwind_map.file)
 * and its link-time address there: it names itself, whatever became of
 * its process, and is the same in every process (one stored stack for a
 * program run a thousand times). FRAME_KIND_PYTHON: a Python function's
 * frame, by its code object's address (>> 3, from FRAME_PYTHON_SHIFT: the
 * 47 bits of user space at the objects' 8-byte alignment) and the offset of
 * its instruction there (in code units, below), named from the code object
 * (never by the process's mappings, and never a stack's cut). Other kinds
 * are free for frames of other sorts. */
#define FRAME_KIND_SHIFT 60
#define FRAME_KIND_ADDRESS 0
#define FRAME_KIND_FILE 1
#define FRAME_KIND_PYTHON 2
#define FRAME_PYTHON_SHIFT 16 /* the code object above, the instruction's offset below */
#define FRAME_FILE_SHIFT 36 /* the file's number above, its link-time address below */
#define FRAME_FILE_NUMBERS (1 << 24)
#define FRAME_KERNEL_NUMBERS (1 << 23) /* numbers below: given at a walk's ask (unwind_vma.bpf.c) */

/* A process's mappings: unwind_maps[first, first + count), by start.
 * inherited: 1 while they are its parent's (parent), given at its fork in
 * the kernel (the same block: user space frees a block only when no entry
 * names it); 2 once it has asked user space for its own. */
struct unwind_proc {
    u32 first;
    u32 count;
    u32 inherited;
    u32 parent;
};

/* A file's rows, for a mapping the walk finds in the kernel (UNWIND_VMA),
 * by the file's device (the kernel's encoding) and inode. written: 0 while
 * asked for and not written yet (its frames are stepped by frame pointers
 * meanwhile); then its rows (count 0: none) and its executable segment:
 * file offsets [seg_start, seg_end), at link-time addresses seg_start +
 * seg_delta on; its number, once the trace gave it one. */
struct unwind_file_key {
    u64 dev;
    u64 ino;
};
struct unwind_file {
    u32 first;
    u32 count;
    u32 pages;
    u32 page_count;
    u32 page_base;
    u32 written;
    u64 seg_start;
    u64 seg_end;
    u64 seg_delta;
    u32 number; /* the file's number (unwind_map.file; 0: none yet) */
    u32 pad;
};

/* A process's mappings found in the kernel, the last UNWIND_VMA_SLOTS
 * (unwind.bpf.c), as unwind_map; pad is 0, or for a mapping of a file
 * whose rows were not written yet, unwind_files_gen + 1 when it was found:
 * it holds until user space writes a file. */
#define UNWIND_VMA_SLOTS 4
struct unwind_vmas {
    struct unwind_map maps[UNWIND_VMA_SLOTS];
    u32 next;
    u32 pad;
};

/* A process's CPython interpreter, for its Python frames (python.bpf.c),
 * written by user space (tracer/unwind/python.py) from the interpreter's
 * layout (probes/cpython/). eval_lo/eval_hi: the eval loop's code, in the
 * process, and its cold part's (0, 0: none known). tss_at: the
 * interpreter's thread-state key (a Py_tss_t: whether it was made, then
 * the pthread key) in the process; a thread's value of a pthread key k
 * below PY_KEYS is at its thread pointer + slot_base + k * slot_stride (the
 * libc's layout). Then the members read, in bytes: PY_NO_FIELD where the
 * version has none. owner_cstack: the owner of the frame that an eval
 * loop's entry pushes (3.12 on), PY_NO_OWNER where none is. */
#define PY_NO_FIELD 65535
#define PY_NO_OWNER 255
#define PY_KEYS 32
#define PY_FRAME_BYTES 80 /* of a _PyInterpreterFrame read at once: every member read is in them */
#define PY_NO_OFFSET 65535 /* a Python frame's instruction offset, where it is unknown */
struct python_proc {
    u64 eval_lo[2];
    u64 eval_hi[2];
    u64 tss_at;
    u32 slot_base;
    u32 slot_stride;
    u16 tstate_cframe;  /* PyThreadState -> cframe (3.11, 3.12) */
    u16 current_frame;  /* the cframe's (or the thread state's, 3.13) current_frame */
    u16 frame_code;     /* _PyInterpreterFrame -> f_code (f_executable, 3.13) */
    u16 frame_previous;
    u16 frame_instr;    /* ... -> prev_instr (3.11, 3.12), instr_ptr (3.13) */
    u16 frame_owner;
    u16 frame_is_entry; /* 3.11 */
    u16 code_adaptive;  /* PyCodeObject -> co_code_adaptive: the instructions */
    u8 owner_cstack;
    u8 pad[7];
};

/* A record of the python_stacks ring (python.bpf.c): a stack with Python
 * frames stored for the first time, for user space to read its code objects
 * while its process lives. */
struct python_stack {
    u32 tgid;
    s32 stack; /* its id */
};

/* The unwind_misc array. */
enum unwind_misc {
    UX_STACKS,      /* stacks unwound */
    UX_COMPLETE,    /* ... to their outermost frame (the CFI's end, or a return address of 0) */
    UX_DEPTH,       /* ... cut at FRAME_DEPTH frames */
    UX_NO_CFI,      /* ... ended at a PC no CFI covers, with no frame pointer to follow */
    UX_UNREADABLE,  /* ... ended at a read of the stack that failed */
    UX_OUT_OF_STACK,/* ... ended where the rules pointed outside the stack (refused, not read) */
    UX_BOUNDS,      /* ... ended at the verifier's bounds (searches, tail calls) */
    UX_NO_TABLES,   /* stacks of processes with no tables yet: walked by frame pointers */
    UX_CFI_FRAMES,  /* frames found by the CFI */
    UX_FP_FRAMES,   /* frames found by frame pointers (no CFI at the PC) */
    UX_LOST,        /* kept calls whose resumption after the walk failed (not counted) */
    UX_INHERITED,   /* stacks walked by the tables a process inherited at its fork */
    UX_VMA_LOOKUPS, /* PCs in no mapping of the process's tables: looked up in the kernel */
    UX_VMA_BUSY,    /* ... where the kernel's lookup could not take the mapping lock */
    UX_UNWRITTEN,   /* frames in a file whose rows were not written yet: by frame pointers */
    UX_VMA_FRAMES,  /* frames whose mapping came from the kernel, not the process's tables */
    UX_PY_FRAMES,   /* Python frames stored in the place of the eval loop's (WITH_PYTHON) */
    UX_PY_NO_THREAD,/* eval loop frames whose thread state could not be read: kept native */
    UX_PY_UNREADABLE, /* ... whose Python frames ended at a read that failed */
    UX_PY_STACKS_LOST, /* new stacks with Python frames the python_stacks ring had no room for */
    UX_COUNT,
};

#endif
