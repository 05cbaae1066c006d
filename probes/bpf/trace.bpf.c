/* mtrace-live's one BPF program: libc USDT sites, read per their ELF notes,
 * counted in the kernel and (WITH_EVENTS) streamed through a ring buffer;
 * optionally (WITH_KMEM) the kmem tracepoints, aggregated per call site in
 * the kernel and (KMEM_EVENTS) streamed through the same ring.
 *
 * User space attaches SDT site i to handler site_<i> and writes, at index i
 * of the `sites` array, which probe slot the site belongs to and where each
 * argument lives (register, register + displacement, or an address at a
 * constant distance from the site's instruction pointer: the rip-relative
 * operands). One handler body serves every site, inlined into each (bcc
 * 0.26 cannot load BPF-to-BPF calls).
 *
 * Process filter (FILTER_PIDS): `followed` holds the tgids to trace. With
 * FOLLOW_FORKS every process a followed one forks is added before it can run
 * an instruction (task_newtask fires in copy_process, ahead of
 * wake_up_new_task). Exec and exit of a followed process are sent as events.
 *
 * Two more filters, for `serve`: FILTER_COMM (with FILTER_PIDS) follows a
 * process from the exec that gives it the name COMM_LO/COMM_HI (the 16 bytes
 * of the kernel's comm, as two little-endian u64) and forgets it when it
 * exec's another program; FILTER_CGROUP keeps the tasks whose cgroup v2
 * ancestor at CGROUP_LEVEL has id CGROUP_ID (the cgroup and its children).
 *
 * bcc only rewrites map calls in the main source file, so every map is in
 * this one; the layouts user space reads are in records.h. */
#include <uapi/linux/ptrace.h>

#include "records.h"
#include "set_table.h"

#ifndef DERIVED_SYSCALLS
#define DERIVED_SYSCALLS 0 /* derive memory_sbrk_* and memory_heap_* from syscalls (probes/derived.py) */
#endif
#ifndef FILTER_PIDS
#define FILTER_PIDS 1
#endif
#ifndef FOLLOW_FORKS
#define FOLLOW_FORKS 1
#endif
#ifndef WITH_EVENTS
#define WITH_EVENTS 1
#endif
#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 2048 /* 8 MiB with 4 KiB pages; a power of two */
#endif
#ifndef SITE_COUNT
#define SITE_COUNT 0 /* how many site_<n> handlers to build, at most 128 */
#endif
#ifndef WITH_KMEM
#define WITH_KMEM 0
#endif
#ifndef HAVE_CACHE_NAME
#define HAVE_CACHE_NAME 0
#endif
#ifndef KMEM_EVENTS
#define KMEM_EVENTS 0 /* send kmem events through the ring too (kmemtrace records) */
#endif
/* Tracepoint variants, set by user space from tracefs (tracer/tracefs.py). */
#ifndef KMALLOC_HAS_NODE
#define KMALLOC_HAS_NODE 0 /* Linux >= 6.1 merged kmalloc_node into kmalloc */
#endif
#ifndef CACHE_ALLOC_HAS_NODE
#define CACHE_ALLOC_HAS_NODE 0
#endif
#ifndef HAVE_KMALLOC_NODE
#define HAVE_KMALLOC_NODE 0 /* the separate *_node tracepoints of Linux < 6.1 */
#endif
#ifndef HAVE_CACHE_ALLOC_NODE
#define HAVE_CACHE_ALLOC_NODE 0
#endif
#ifndef HAVE_PAGE_FREE_BATCHED
#define HAVE_PAGE_FREE_BATCHED 0
#endif
#ifndef PAGE_SHIFT_
#define PAGE_SHIFT_ 12
#endif
#ifndef FILTER_COMM
#define FILTER_COMM 0
#endif
#ifndef FILTER_CGROUP
#define FILTER_CGROUP 0
#endif
#ifndef WITH_STACKS
#define WITH_STACKS 0 /* a user (and, for kmem, kernel) stack id on each event */
#endif
#ifndef STACK_DEPTH
#define STACK_DEPTH 32 /* frames kept per stack */
#endif
#ifndef STACK_ENTRIES
#define STACK_ENTRIES 16384 /* distinct stacks the map holds */
#endif
#ifndef WITH_ALLOCS
#define WITH_ALLOCS 0 /* the allocation functions (malloc, free, ...) */
#endif
#ifndef ALLOC_EVENTS
#define ALLOC_EVENTS 0 /* send each kept allocation and free through the ring */
#endif
#ifndef ALLOC_ONE_PROCESS
#define ALLOC_ONE_PROCESS 0 /* the uprobes are attached for one process: the kernel filters */
#endif
#ifndef ALLOC_OUT_ROWS
#define ALLOC_OUT_ROWS 524288 /* rows of `outstanding` (a power of two): twice --max-outstanding */
#endif
#ifndef ALLOC_FRAME_ROWS
#define ALLOC_FRAME_ROWS 32768 /* rows of alloc_frames (a power of two): twice --alloc-stacks */
#endif
#ifndef ALLOC_STACK_ROWS
#define ALLOC_STACK_ROWS 32768 /* rows of alloc_stacks (a power of two): twice --alloc-stacks */
#endif
#ifndef ALLOC_WALK
#define ALLOC_WALK 1 /* walk the user stack of kept allocations (else: call site only) */
#endif
#ifndef ALLOC_DEPTH
#define ALLOC_DEPTH 32 /* frames kept above an allocation's call site (a power of two) */
#endif
#ifndef SAMPLE_BYTES
#define SAMPLE_BYTES 0
#endif
#ifndef HOLD_AT_EXIT
#define HOLD_AT_EXIT 0 /* stop a followed process in _exit until user space has read its maps */
#endif
#ifndef KMEM_OBJECTS
#define KMEM_OBJECTS 262144 /* live objects tracked by pointer */
#endif
#ifndef KMEM_SITES
#define KMEM_SITES 16384 /* call sites aggregated */
#endif

#ifndef FIRST_TGID
#define FIRST_TGID 0 /* 1: user space names the process asked for in first_target (followed without a hash lookup) */
#endif

#define MAX_FOLLOWED 65536
#define MAX_PROC_COUNTERS 65536
#define MAX_SITES 128
#define MAX_PROBES MAX_SITES
#define MTRACE_CLONE_THREAD 0x00010000 /* include/uapi/linux/sched.h */

BPF_HASH(followed, u32, u8, MAX_FOLLOWED);
#if FIRST_TGID
/* The process asked for, written by user space once the program is loaded
 * (a value, not a compile-time constant, so that the compiled program does
 * not depend on the pid and can be kept between runs: tracer/bpf_cache.py).
 * live is 0 until then and once it has exited: its pid may be reused. */
struct first_target {
    u32 tgid;
    u32 live;
};
BPF_ARRAY(first_target, struct first_target, 1);
#endif
#define STACK_MAP WITH_STACKS
#if STACK_MAP
struct stack_frames {
    u64 ip[STACK_DEPTH];
};
BPF_TABLE("stacktrace", int, struct stack_frames, stacks, STACK_ENTRIES);
BPF_PERCPU_ARRAY(stack_errors, u64, 2);           /* [0] user, [1] kernel: stacks not stored */
#endif
BPF_PERCPU_ARRAY(hits, u64, MAX_PROBES);          /* every hit that passed the filter */
BPF_HASH(proc_hits, struct proc_key, struct proc_hit, MAX_PROC_COUNTERS);
BPF_PERCPU_ARRAY(proc_hits_dropped, u64, 1);      /* hits proc_hits had no room for */
#if WITH_EVENTS
/* control[0] != 0 while tracing. Unregistering a uprobe takes the kernel
 * about 0.1 s per site, so at the end user space closes the gate, reads
 * everything, and only then detaches. */
BPF_ARRAY(control, u32, 1);
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_PERCPU_ARRAY(lost, u64, MAX_PROBES);          /* hits the ring buffer had no room for */
BPF_PERCPU_ARRAY(lost_lifecycle, u64, 1);         /* exec/exit events without room */
#endif

static __always_inline int tgid_is_followed(u32 tgid)
{
#if FILTER_CGROUP
    return bpf_get_current_ancestor_cgroup_id(CGROUP_LEVEL) == CGROUP_ID;
#elif FILTER_PIDS
#if FIRST_TGID
    /* Most events of a traced process are its own: a compare instead of a
     * hash lookup (an array lookup is inlined by the verifier). */
    u32 first = 0;
    struct first_target *target = first_target.lookup(&first);
    if (target && tgid == target->tgid && target->live)
        return 1;
#endif
    return followed.lookup(&tgid) != NULL;
#else
    return 1;
#endif
}

static __always_inline s32 walk_stack(void *ctx, u64 flags, u32 slot)
{
#if STACK_MAP
    int id = stacks.get_stackid(ctx, flags);
    if (id < 0)
        stack_errors.increment(slot);
    return id;
#else
    return -1;
#endif
}

/* A stack on each probe and kmem event (WITH_STACKS). */
static __always_inline s32 stack_id(void *ctx, u64 flags, u32 slot)
{
#if WITH_STACKS
    int id = stacks.get_stackid(ctx, flags);
    if (id < 0)
        stack_errors.increment(slot);
    return id;
#else
    return -1;
#endif
}

/* ---- process lifecycle ---------------------------------------------------*/
#if DERIVED_SYSCALLS
/* The break each process last had, as its brk calls returned it, and the
 * break each thread's brk call in flight asked for. */
BPF_HASH(brk_last, u32, u64, 16384);
BPF_HASH(brk_asked, u32, u64, 16384);
#endif

#if (FILTER_PIDS && FOLLOW_FORKS) || DERIVED_SYSCALLS
TRACEPOINT_PROBE(task, task_newtask)
{
    /* Threads share their parent's tgid and need no entry of their own. */
    if (args->clone_flags & MTRACE_CLONE_THREAD)
        return 0;
    u32 parent = bpf_get_current_pid_tgid() >> 32;
    if (!tgid_is_followed(parent))
        return 0;
    u32 child = args->pid;
#if FILTER_PIDS && FOLLOW_FORKS
    u8 one = 1;
    followed.update(&child, &one);
#endif
#if DERIVED_SYSCALLS
    /* A forked child has its parent's break, and its libc knows it: it
     * will not ask the kernel again before growing. */
    u64 *brk = brk_last.lookup(&parent);
    if (brk) {
        u64 inherited = *brk;
        brk_last.update(&child, &inherited);
    }
#endif
    return 0;
}
#endif

#if FILTER_PIDS

#if WITH_EVENTS
static __always_inline void lifecycle_event(u32 tgid, u8 kind, u64 arg)
{
    struct event *e = events.ringbuf_reserve(sizeof(struct event));
    if (!e) {
        lost_lifecycle.increment(0);
        return;
    }
    u64 id = bpf_get_current_pid_tgid();
    __builtin_memset(e, 0, sizeof(*e));
    e->ts = bpf_ktime_get_ns();
    e->tgid = tgid;
    e->tid = (u32)id;
    e->cpu = bpf_get_smp_processor_id();
    e->kind = kind;
    e->nargs = 1;
    e->args[0] = arg;
    e->ustack = e->kstack = -1;
    events.ringbuf_submit(e, 0);
}

TRACEPOINT_PROBE(sched, sched_process_exec)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (tgid_is_followed(tgid))
        lifecycle_event(tgid, EV_EXEC, args->old_pid);
#if FILTER_COMM
    /* The comm is the new program's by now (begin_new_exec set it). */
    u64 comm[2] = {};
    bpf_get_current_comm(comm, sizeof(comm));
    if (comm[0] == COMM_LO && comm[1] == COMM_HI) {
        u8 one = 1;
        followed.update(&tgid, &one);
    } else {
        followed.delete(&tgid);
    }
#endif
    return 0;
}
#endif

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if ((u32)id != tgid || !tgid_is_followed(tgid))
        return 0; /* only the group leader's exit ends a process */
#if WITH_EVENTS
    /* No exit code: task_struct's layout in the build headers need not be
     * the running kernel's. */
    lifecycle_event(tgid, EV_EXIT, 0);
#endif
    followed.delete(&tgid); /* the pid may be reused by an unrelated process */
#if FIRST_TGID
    u32 first = 0;
    struct first_target *target = first_target.lookup(&first);
    if (target && tgid == target->tgid)
        target->live = 0;
#endif
    return 0;
}
#endif

/* ---- reading arguments ---------------------------------------------------*/
#define PT_REGS_SLOTS (sizeof(struct pt_regs) / sizeof(u64))

static __always_inline u64 extend(u64 v, u8 size, u8 is_signed)
{
    switch (size) {
    case 1: return is_signed ? (u64)(s64)(s8)v : (u8)v;
    case 2: return is_signed ? (u64)(s64)(s16)v : (u16)v;
    case 4: return is_signed ? (u64)(s64)(s32)v : (u32)v;
    }
    return v;
}

/* Where each site's arguments are is known before this program is compiled,
 * so user space defines them as constants (see SITE below): `packed` is
 * kind | size << 8 | is_signed << 16 | pt_regs slot << 24, and `value` the
 * constant, displacement or distance from the site's ip. Once inlined, every
 * test here is decided by the compiler, and a register argument is one load
 * at a fixed offset of the context: no copy of the registers, no descriptor
 * to look up. */
static __always_inline u64 load_arg(struct pt_regs *ctx, const u32 packed, const s64 value)
{
    const u8 kind = packed & 0xff;
    const u8 size = (packed >> 8) & 0xff;
    const u8 is_signed = (packed >> 16) & 0xff;
    const u32 slot = packed >> 24;
    u64 *regs = (u64 *)ctx;
    u64 v = 0;
    u64 addr;
    if (kind == ARG_CONST) {
        v = value;
    } else if (kind == ARG_REG) {
        if (slot < PT_REGS_SLOTS)
            v = regs[slot];
    } else if (kind == ARG_DEREF_REG || kind == ARG_DEREF_IP) {
        if (kind == ARG_DEREF_IP)
            addr = PT_REGS_IP(ctx) + value;
        else
            addr = (slot < PT_REGS_SLOTS ? regs[slot] : 0) + value;
        if (bpf_probe_read_user(&v, size & 0x8 ? 8 : size & 0x7, (void *)addr))
            v = 0;
    } else {
        return 0;
    }
    return extend(v, size, is_signed);
}

/* ---- clocks ----------------------------------------------------------------*/
/* A time that no output shows to the nanosecond: the clock read once a tick
 * per CPU, less than a tick (jiffy) behind. Reading the clock at every hit
 * cost 20-40 ns of a 400-600 ns uprobe hit here (a paravirtual clock read
 * under KVM); bpf_jiffies64 and a per-CPU array cost a few. */
struct tick_clock {
    u64 jiffies;
    u64 ns;
};
BPF_PERCPU_ARRAY(tick_clocks, struct tick_clock, 1);

static __always_inline u64 tick_now(void)
{
    u32 zero = 0;
    struct tick_clock *clock = tick_clocks.lookup(&zero);
    if (!clock)
        return bpf_ktime_get_ns();
    u64 tick = bpf_jiffies64();
    if (clock->jiffies != tick) {
        clock->jiffies = tick;
        clock->ns = bpf_ktime_get_ns();
    }
    return clock->ns;
}

#ifndef PROBE_EXACT_TIME
#define PROBE_EXACT_TIME 1 /* 0: no output shows a probe event's time to the ns */
#endif

/* ---- one body for every site ---------------------------------------------*/
/* proc_hits' row of (tgid, probe), made with the current task's name if new. */
static __always_inline struct proc_hit *process_row(u32 tgid, const u32 probe)
{
    struct proc_key key = {.tgid = tgid, .probe = probe};
    struct proc_hit fresh = {};
    struct proc_hit *n = proc_hits.lookup_or_try_init(&key, &fresh);
    if (!n)
        proc_hits_dropped.increment(0);
    else if (!n->comm[0]) /* two first hits at once both write a name: harmless */
        bpf_get_current_comm(n->comm, sizeof(n->comm));
    return n;
}

#if WITH_EVENTS
/* With the event stream, user space counts each process's hits from the
 * records it reads (tracer/counters.py): proc_hits counts only the hits
 * whose record the ring had no room for (probe_record), and names each
 * process once, in a row of its first probe. A CPU remembers the process it
 * named last, so a hit costs an array lookup here, not a hash lookup and an
 * atomic add. */
BPF_PERCPU_ARRAY(named_tgid, u32, 1);

static __always_inline void name_process(u32 tgid, const u32 probe)
{
    u32 first = 0;
    u32 *named = named_tgid.lookup(&first);
    if (!named || *named == tgid)
        return;
    if (process_row(tgid, probe))
        *named = tgid;
}
#endif

/* Counts a hit of `probe` by the current task if it is traced: 1 if so. */
static __always_inline int admit(u32 tgid, const u32 probe)
{
#if WITH_EVENTS
    u32 first = 0;
    u32 *open = control.lookup(&first);
    if (!open || !*open)
        return 0;
#endif
    if (!tgid_is_followed(tgid))
        return 0;
    hits.increment(probe);
#if WITH_EVENTS
    name_process(tgid, probe);
#else
    struct proc_hit *n = process_row(tgid, probe);
    if (n)
        __sync_fetch_and_add(&n->count, 1);
#endif
    return 1;
}

#if WITH_EVENTS
/* A probe record with its header filled, or NULL (counted as lost). */
static __always_inline struct event *probe_record(u64 ip, u64 id, const u32 site,
                                                  const u32 probe, const u32 nargs)
{
    struct event *e = events.ringbuf_reserve(sizeof(struct event));
    if (!e) {
        lost.increment(probe);
        struct proc_hit *n = process_row(id >> 32, probe);
        if (n)
            __sync_fetch_and_add(&n->count, 1);
        return NULL;
    }
    e->ts = PROBE_EXACT_TIME ? bpf_ktime_get_ns() : tick_now();
    e->ip = ip;
    e->tgid = id >> 32;
    e->tid = (u32)id;
    e->cpu = bpf_get_smp_processor_id();
    e->probe = probe;
    e->site = site;
    e->kind = EV_PROBE;
    e->nargs = nargs;
    e->kstack = -1;
    return e;
}
#endif

static __always_inline int on_site(struct pt_regs *ctx, const u32 site, const u32 probe,
                                   const u32 nargs, const u32 a0, const s64 v0,
                                   const u32 a1, const s64 v1, const u32 a2, const s64 v2,
                                   const u32 a3, const s64 v3, const u32 a4, const s64 v4,
                                   const u32 a5, const s64 v5)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!admit(id >> 32, probe))
        return 0;
#if WITH_EVENTS
    struct event *e = probe_record(PT_REGS_IP(ctx), id, site, probe, nargs);
    if (!e)
        return 0;
    e->args[0] = load_arg(ctx, a0, v0);
    e->args[1] = load_arg(ctx, a1, v1);
    e->args[2] = load_arg(ctx, a2, v2);
    e->args[3] = load_arg(ctx, a3, v3);
    e->args[4] = load_arg(ctx, a4, v4);
    e->args[5] = load_arg(ctx, a5, v5);
    e->ustack = stack_id(ctx, BPF_F_USER_STACK, 0);
    events.ringbuf_submit(e, 0);
#endif
    return 0;
}

/* site_0 ... site_<SITE_COUNT - 1>, in blocks of ten: site_0 ... site_9,
 * then a tens digit pasted onto 0..9 (site_10 ... site_119), then 120..127.
 * Only the blocks user space needs are compiled: each handler inlines the
 * whole body, and compile time is most of the start-up time. */
/* SP<n> is site n's probe slot, SN<n> its argument count, SA<n>_<i> and
 * SV<n>_<i> its argument i (load_arg): defined by user space for every
 * handler compiled. */
#define SITE(n) int site_##n(struct pt_regs *ctx) { return on_site(ctx, n, SP##n, SN##n, \
    SA##n##_0, SV##n##_0, SA##n##_1, SV##n##_1, SA##n##_2, SV##n##_2, \
    SA##n##_3, SV##n##_3, SA##n##_4, SV##n##_4, SA##n##_5, SV##n##_5); }
#define SITES_OF_TENS(t) \
    SITE(t##0) SITE(t##1) SITE(t##2) SITE(t##3) SITE(t##4) \
    SITE(t##5) SITE(t##6) SITE(t##7) SITE(t##8) SITE(t##9)

#if SITE_COUNT > 0
SITE(0) SITE(1) SITE(2) SITE(3) SITE(4) SITE(5) SITE(6) SITE(7) SITE(8) SITE(9)
#endif
#if SITE_COUNT > 10
SITES_OF_TENS(1)
#endif
#if SITE_COUNT > 20
SITES_OF_TENS(2)
#endif
#if SITE_COUNT > 30
SITES_OF_TENS(3)
#endif
#if SITE_COUNT > 40
SITES_OF_TENS(4)
#endif
#if SITE_COUNT > 50
SITES_OF_TENS(5)
#endif
#if SITE_COUNT > 60
SITES_OF_TENS(6)
#endif
#if SITE_COUNT > 70
SITES_OF_TENS(7)
#endif
#if SITE_COUNT > 80
SITES_OF_TENS(8)
#endif
#if SITE_COUNT > 90
SITES_OF_TENS(9)
#endif
#if SITE_COUNT > 100
SITES_OF_TENS(10)
#endif
#if SITE_COUNT > 110
SITES_OF_TENS(11)
#endif
#if SITE_COUNT > 120
SITE(120) SITE(121) SITE(122) SITE(123) SITE(124) SITE(125) SITE(126) SITE(127)
#endif

/* ---- memory_* probes derived from system calls (probes/derived.py) -------
 * D_<PROBE> is the probe's slot, or -1 when it is not traced; D_<PROBE>_SITE
 * the index of the site entry that names its arguments for user space.
 * HEAP_MAX is glibc's HEAP_MAX_SIZE; HEAP_SIZE_OFF and HEAP_MPROTECT_OFF are
 * the offsets of heap_info's size and mprotect_size. */
#if DERIVED_SYSCALLS
#define MTRACE_PROT_WRITE 0x2   /* include/uapi/asm-generic/mman-common.h */
#define MTRACE_MADV_DONTNEED 4

static __always_inline void derived_event(void *ctx, const s32 probe, const u32 site,
                                          u64 a0, u64 a1)
{
    if (probe < 0)
        return;
    u64 id = bpf_get_current_pid_tgid();
    if (!admit(id >> 32, probe))
        return;
#if WITH_EVENTS
    struct event *e = probe_record(0, id, site, probe, 2);
    if (!e)
        return;
    e->args[0] = a0;
    e->args[1] = a1;
    e->args[2] = e->args[3] = e->args[4] = e->args[5] = 0;
    e->ustack = stack_id(ctx, BPF_F_USER_STACK, 0);
    events.ringbuf_submit(e, 0);
#endif
}

/* A field of a heap's heap_info, read from the process; 0 if unreadable. */
static __always_inline u64 heap_field(u64 heap, u64 offset)
{
    u64 value = 0;
    if (bpf_probe_read_user(&value, sizeof(value), (void *)(heap + offset)))
        return 0;
    return value;
}

static __always_inline void derived_enter_brk(u64 asked)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!tgid_is_followed(id >> 32))
        return;
    u32 tid = (u32)id;
    brk_asked.update(&tid, &asked);
}

static __always_inline void derived_exit_brk(void *args, u64 now)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id, tgid = id >> 32;
    u64 *asked = brk_asked.lookup(&tid);
    if (!asked)
        return;
    u64 want = *asked;
    brk_asked.delete(&tid);
    u64 *last = brk_last.lookup(&tgid);
    /* brk(0) only asks where the break is, as sbrk does first in a new
     * program: it sets the break known, and sends nothing. */
    if (last && want) {
        u64 old = *last;
        if (now > old)
            derived_event(args, D_SBRK_MORE, D_SBRK_MORE_SITE, old, now - old);
        else if (now < old)
            derived_event(args, D_SBRK_LESS, D_SBRK_LESS_SITE, now, old - now);
        else if (want > old) /* a failed growth: sysmalloc's probe fires with NULL */
            derived_event(args, D_SBRK_MORE, D_SBRK_MORE_SITE, 0, want - old);
    }
    brk_last.update(&tgid, &now);
}

/* Whether the current process is traced, before a heap header is read. */
static __always_inline int derived_traced(void)
{
    return tgid_is_followed(bpf_get_current_pid_tgid() >> 32);
}

TRACEPOINT_PROBE(syscalls, sys_enter_mprotect)
{
    if (!(args->prot & MTRACE_PROT_WRITE) || !derived_traced())
        return 0;
    u64 start = args->start;
    u64 heap = start & ~((u64)HEAP_MAX - 1);
    if (start == heap) { /* alloc_new_heap opens a new heap's first pages */
        derived_event(args, D_HEAP_NEW, D_HEAP_NEW_SITE, start, args->len);
        return 0;
    }
#if D_HEAP_MORE >= 0
    /* grow_heap opens pages from the heap's mprotect_size on */
    if (heap_field(heap, HEAP_MPROTECT_OFF) == start - heap)
        derived_event(args, D_HEAP_MORE, D_HEAP_MORE_SITE, heap, start + args->len - heap);
#endif
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_madvise)
{
    if (args->behavior != MTRACE_MADV_DONTNEED || D_HEAP_LESS < 0 || !derived_traced())
        return 0;
    u64 start = args->start;
    u64 heap = start & ~((u64)HEAP_MAX - 1);
    /* shrink_heap releases the top of the heap, up to its size */
    if (start != heap && heap + heap_field(heap, HEAP_SIZE_OFF) == start + args->len_in)
        derived_event(args, D_HEAP_LESS, D_HEAP_LESS_SITE, heap, start - heap);
    return 0;
}

static __always_inline void derived_enter_munmap(void *args, u64 heap, u64 len)
{
    if (len != HEAP_MAX || (heap & ((u64)HEAP_MAX - 1)) || D_HEAP_FREE < 0 || !derived_traced())
        return;
    /* heap_trim unmaps a whole heap; its header is still there to read (an
     * unused reservation is PROT_NONE, and unreadable) */
    u64 size = heap_field(heap, HEAP_SIZE_OFF);
    if (size)
        derived_event(args, D_HEAP_FREE, D_HEAP_FREE_SITE, heap, size);
}
#endif

/* ---- kmem tracepoints ----------------------------------------------------
 * The tracepoint structs are generated by bcc from the running kernel's
 * tracefs formats; the variant defines above come from the same files.
 *
 * Aggregation per (call site, type) happens here, per CPU. Allocations are
 * filtered by tgid. Frees are matched by pointer, whoever frees: memory the
 * traced process allocated and an RCU callback or softirq frees still counts
 * for its allocating call site. A free of an unknown pointer counts (for the
 * freeing call site) only when the freeing task is traced. */
#if WITH_KMEM

#define CACHE_NAME_LEN 32
#define MAX_ORDER_SLOTS 16

#ifndef RAW_KMALLOC
#define RAW_KMALLOC 0 /* raw tracepoints (tracer/kmem_attach.py), with each argument's index */
#endif
#ifndef RAW_KFREE
#define RAW_KFREE 0
#endif
#ifndef RAW_CACHE_ALLOC
#define RAW_CACHE_ALLOC 0 /* with CACHE_SIZE_OFF, CACHE_OBJECT_SIZE_OFF (and CACHE_NAME_OFF), CACHE_SPAN_* */
#endif
#ifndef RAW_CACHE_FREE
#define RAW_CACHE_FREE 0
#endif
#ifndef BTF_CACHE_ALLOC
#define BTF_CACHE_ALLOC 0 /* 1: kmem_cache_alloc's raw handler also as a BTF-typed one (tp_btf__) */
#endif

/* A live object in one word: its bytes, its call site's slot in the site
 * table plus one (0: the site table had no room), and the CPU and type
 * (KT_*) it was allocated with. The free goes straight to the site's
 * statistics by the slot, without looking its call site up again. */
_Static_assert(KMEM_SITES < 0xffff, "a live object holds its site's slot + 1 in 16 bits");
#define LIVE_SITE_SHIFT 32
#define LIVE_CPU_SHIFT 48
#define LIVE_TYPE_SHIFT 62
static __always_inline u64 live_word(u64 bytes, u32 site, u32 cpu, u32 type)
{
    /* An allocation is at most 2^(MAX_PAGE_ORDER + PAGE_SHIFT) bytes: 32
     * bits hold it; the CPU takes 14 bits (NR_CPUS is at most 8192). */
    return (bytes > 0xffffffffULL ? 0xffffffffULL : bytes) | (u64)(site & 0xffff) << LIVE_SITE_SHIFT |
           (u64)(cpu & 0x3fff) << LIVE_CPU_SHIFT | (u64)(type & 3) << LIVE_TYPE_SHIFT;
}
#define LIVE_BYTES(w) ((w) & 0xffffffffULL)
#define LIVE_SITE(w) ((u32)((w) >> LIVE_SITE_SHIFT) & 0xffff)
#define LIVE_CPU(w) ((u32)((w) >> LIVE_CPU_SHIFT) & 0x3fff)
#define LIVE_TYPE(w) ((u32)((w) >> LIVE_TYPE_SHIFT))

/* The live objects, by pointer: a set-associative table in an array. A
 * pointer's home is one bucket of TABLE_WAYS slots, its pointers in one
 * cache line and their live_word()s in the next; when that is full it goes
 * in the next bucket and the home counts it in live_spilled, so a lookup
 * reads a second bucket only when something spilled. A slot is claimed
 * with a compare-and-swap of its pointer (0: free) and freed by swapping it
 * back to 0. An object cannot be freed while its allocation is still being
 * recorded, so the entry's word needs no lock. Array lookups are inlined by
 * the verifier: a free costs a multiply and a scan of eight words, where a
 * BPF hash map's lookup and delete took a bucket lock and an element from
 * its free list (docs/performance.md, section 2). */
#define LIVE_BUCKETS (KMEM_OBJECTS / TABLE_WAYS) /* KMEM_OBJECTS is a power of two */
struct live_bucket {
    u64 ptr[TABLE_WAYS];
    u64 object[TABLE_WAYS]; /* live_word()s */
};

BPF_PERCPU_ARRAY(kmem_hits, u64, KM_COUNT);
BPF_PERCPU_ARRAY(kmem_misc, u64, KX_COUNT);
/* The call sites, in the same kind of table. A site's slot numbers come
 * from site_count, in order, so user space reads only the slots used:
 * site_keys and kmem_sites (per CPU) are indexed by slot, and site_index
 * finds a key's slot by its tag, a one-to-one function of the key. A way
 * is claimed with its tag before its slot is known (slot + 1; 0 until
 * then); a lookup that meets such a way goes on, and at worst one key gets
 * two slots, which user space adds up. */
#define SITE_BUCKETS (2 * KMEM_SITES / TABLE_WAYS) /* KMEM_SITES is a power of two */
struct site_bucket {
    u64 tag[TABLE_WAYS];
    u32 slot[TABLE_WAYS];
};
BPF_ARRAY(site_index, struct site_bucket, SITE_BUCKETS);
BPF_ARRAY(site_keys, struct site_key, KMEM_SITES);
BPF_PERCPU_ARRAY(kmem_sites, struct site_stats, KMEM_SITES);
BPF_ARRAY(site_count, u64, 1); /* slots handed out (u64: bcc's LLVM swaps 64 bits only) */
BPF_ARRAY(live_objects, struct live_bucket, LIVE_BUCKETS);
BPF_ARRAY(live_spilled, u64, LIVE_BUCKETS);
BPF_PERCPU_ARRAY(page_orders, struct order_stats, MAX_ORDER_SLOTS);
#if HAVE_CACHE_NAME && RAW_CACHE_ALLOC
/* Allocations per cache, keyed by the struct kmem_cache pointer the raw
 * tracepoint gets (and its name's), in the same kind of table: cache_keys
 * holds each slot's key, cache_names its name and cache_counts its per-CPU
 * count. (Three
 * maps, not one of structs: bcc 0.26 mistakes a two-dimensional char
 * array's size.) */
#define CACHE_BUCKETS 128
struct cache_bucket {
    u64 cache[TABLE_WAYS];
};
struct cache_key {
    char name[CACHE_NAME_LEN];
};
BPF_ARRAY(cache_keys, struct cache_bucket, CACHE_BUCKETS);
BPF_ARRAY(cache_names, struct cache_key, CACHE_BUCKETS * TABLE_WAYS);
BPF_PERCPU_ARRAY(cache_counts, u64, CACHE_BUCKETS * TABLE_WAYS);
#elif HAVE_CACHE_NAME
struct cache_key {
    char name[CACHE_NAME_LEN];
};
BPF_HASH(cache_allocs, struct cache_key, u64, 1024);
#endif

/* ptr's home bucket, and its index in `home`. */
static __always_inline struct live_bucket *live_home(u64 ptr, u32 *home)
{
    *home = table_bucket(ptr, LIVE_BUCKETS);
    return live_objects.lookup(home);
}

/* Records a live object (a live_word); 0 if the table had no room for it. */
static __always_inline int live_put(u64 ptr, u64 object)
{
    u32 home;
    struct live_bucket *b = live_home(ptr, &home);
    if (!b)
        return 0;
    /* A pointer whose free was not seen (freed before the trace) is reused. */
    int way = way_of(b->ptr, ptr);
    if (way < 0)
        way = claim_way(b->ptr, ptr);
    if (way >= 0) {
        b->object[way & (TABLE_WAYS - 1)] = object;
        return 1;
    }
    u32 next = (home + 1) & (LIVE_BUCKETS - 1);
    struct live_bucket *n = live_objects.lookup(&next);
    u64 *spilled = live_spilled.lookup(&home);
    if (!n || !spilled)
        return 0;
    way = claim_way(n->ptr, ptr);
    if (way < 0)
        return 0;
    n->object[way & (TABLE_WAYS - 1)] = object;
    __sync_fetch_and_add(spilled, 1);
    return 1;
}

/* Takes ptr's live object (a live_word) out of the table; 0 if it was not there. */
static __always_inline int live_take(u64 ptr, u64 *object)
{
    u32 home;
    struct live_bucket *b = live_home(ptr, &home);
    if (!b)
        return 0;
    int way = way_of(b->ptr, ptr);
    u64 *spilled = NULL;
    if (way < 0) {
        spilled = live_spilled.lookup(&home);
        if (!spilled || !*spilled)
            return 0;
        u32 next = (home + 1) & (LIVE_BUCKETS - 1);
        b = live_objects.lookup(&next);
        if (!b)
            return 0;
        way = way_of(b->ptr, ptr);
        if (way < 0)
            return 0;
    }
    way &= TABLE_WAYS - 1;
    *object = b->object[way];
    if (__sync_val_compare_and_swap(&b->ptr[way], ptr, 0) != ptr)
        return 0;
    if (spilled)
        __sync_fetch_and_add(spilled, -1);
    return 1;
}

static __always_inline int kmem_gate_closed(void)
{
#if WITH_EVENTS
    u32 first = 0;
    u32 *open = control.lookup(&first);
    return !open || !*open;
#else
    return 0;
#endif
}

/* Whether an allocation by the current task is counted. */
static __always_inline int kmem_alloc_traced(void)
{
    return !kmem_gate_closed() && tgid_is_followed(bpf_get_current_pid_tgid() >> 32);
}

/* key's slot + 1 if bucket b holds its tag, else 0. A tag stands for one
 * key (site_tag), so the key itself is not compared. */
static __always_inline u32 site_in(struct site_bucket *b, u64 tag)
{
#pragma unroll
    for (int i = 0; i < TABLE_WAYS; i++) {
        u32 slot = b->slot[i];
        if (b->tag[i] == tag && slot)
            return slot;
    }
    return 0;
}

/* A new slot for the key, in bucket b: its number + 1, or 0 if b or the
 * slots are full. */
static __always_inline u32 site_new(struct site_bucket *b, u64 tag, u64 call_site, u32 type)
{
    u32 first = 0;
    u64 *count = site_count.lookup(&first);
    if (!count || *count >= KMEM_SITES)
        return 0;
    int way = claim_way(b->tag, tag);
    if (way < 0)
        return 0;
    /* A slot number, by compare-and-swap (bcc's LLVM cannot use the value
     * an atomic add returns); four tries, as new sites come rarely. */
    u32 slot = KMEM_SITES;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        u64 seen = *count;
        if (__sync_val_compare_and_swap(count, seen, seen + 1) == seen) {
            slot = (u32)seen;
            break;
        }
    }
    struct site_key *k = site_keys.lookup(&slot);
    if (!k) /* slot >= KMEM_SITES: the way stays claimed and unused */
        return 0;
    k->call_site = call_site;
    k->type = type;
    b->slot[way & (TABLE_WAYS - 1)] = slot + 1;
    return slot + 1;
}

/* The key's slot + 1, made if new; 0 if the site table has no room. */
static __always_inline u32 site_slot_of(u64 call_site, u32 type)
{
    /* Multiplying by an odd number permutes the 64-bit words, so two keys
     * never share a tag; it is 0, a free way, only for a call site at the
     * last addresses of the address space (~type), where no code is. */
    u64 tag = (((call_site ^ type) + 1) * 0x9E3779B97F4A7C15ULL);
    u32 home = table_bucket(tag, SITE_BUCKETS);
    struct site_bucket *b = site_index.lookup(&home);
    if (!b)
        return 0;
    u32 slot = site_in(b, tag);
    if (slot)
        return slot;
    if (!b->tag[TABLE_WAYS - 1]) { /* ways are claimed in order and never given back */
        slot = site_new(b, tag, call_site, type);
    } else {
        u32 next = (home + 1) & (SITE_BUCKETS - 1);
        struct site_bucket *n = site_index.lookup(&next);
        if (n) {
            slot = site_in(n, tag);
            if (!slot)
                slot = site_new(n, tag, call_site, type);
        }
    }
    if (!slot)
        kmem_misc.increment(KX_SITES_DROPPED);
    return slot;
}

/* The statistics of a slot + 1 from site_slot_of; NULL for 0. */
static __always_inline struct site_stats *site_stats_at(u32 slot)
{
    if (!slot)
        return NULL;
    u32 index = slot - 1;
    return kmem_sites.lookup(&index);
}

static __always_inline struct site_stats *site_stats_of(u64 call_site, u32 type)
{
    return site_stats_at(site_slot_of(call_site, type));
}

static __always_inline void kmem_event(void *ctx, u32 event, u32 type, u64 call_site, u64 ptr, u64 req,
                                       u64 alloc, u64 gfp, s64 node, u64 extra, int freed)
{
#if WITH_EVENTS && KMEM_EVENTS
    struct event *e = events.ringbuf_reserve(sizeof(struct event));
    if (!e) {
        kmem_misc.increment(freed ? KX_LOST_FREES : KX_LOST_ALLOCS);
        return;
    }
    u64 id = bpf_get_current_pid_tgid();
    e->ts = bpf_ktime_get_ns();
    e->ip = call_site;
    e->tgid = id >> 32;
    e->tid = (u32)id;
    e->cpu = bpf_get_smp_processor_id();
    e->probe = event;
    e->site = type;
    e->kind = EV_KMEM;
    e->nargs = 6;
    e->args[0] = ptr;
    e->args[1] = req;
    e->args[2] = alloc;
    e->args[3] = gfp;
    e->args[4] = (u64)node;
    e->args[5] = extra;
    e->ustack = stack_id(ctx, BPF_F_USER_STACK, 0);
    e->kstack = stack_id(ctx, 0, 1);
    events.ringbuf_submit(e, 0);
#endif
}

static __always_inline void count_order(u32 order, int freed)
{
    struct order_stats *o = page_orders.lookup(&order);
    if (!o)
        return;
    if (freed)
        o->frees++;
    else
        o->allocs++;
}

/* An allocation that kmem_alloc_traced() let through. ptr is the object,
 * or for pages the pfn (user space writes pfn << PAGE_SHIFT); order is
 * counted per order for pages. */
static __always_inline int count_kmem_alloc(void *ctx, u32 event, u32 type, u64 call_site, u64 ptr,
                                            u64 req, u64 alloc, u64 gfp, s64 node, u64 order)
{
    kmem_hits.increment(event);
    u32 slot = site_slot_of(call_site, type);
    struct site_stats *s = site_stats_at(slot);
    if (s) {
        s->allocs++;
        s->bytes_req += req;
        s->bytes_alloc += alloc;
        if (!ptr)
            s->failed++;
        if (node >= 0 && node != bpf_get_numa_node_id())
            s->cross_node++;
    }
    if (type == KT_PAGES)
        count_order(order, 0);
    if (ptr) {
        if (!live_put(ptr, live_word(alloc, slot, bpf_get_smp_processor_id(), type)))
            kmem_misc.increment(KX_OBJECTS_UNTRACKED);
    }
    kmem_event(ctx, event, type, call_site, ptr, req, alloc, gfp, node, order, 0);
    return 0;
}

static __always_inline int on_kmem_alloc(void *ctx, u32 event, u32 type, u64 call_site, u64 ptr, u64 req,
                                         u64 alloc, u64 gfp, s64 node, u64 order)
{
    if (!kmem_alloc_traced())
        return 0;
    return count_kmem_alloc(ctx, event, type, call_site, ptr, req, alloc, gfp, node, order);
}

/* For pages (type KT_PAGES), order is counted per order too. */
static __always_inline int on_kmem_free(void *ctx, u32 event, u32 type, u64 call_site, u64 ptr, u64 order)
{
    if (kmem_gate_closed())
        return 0;
    u64 known;
    if (ptr && live_take(ptr, &known)) {
        struct site_stats *s = site_stats_at(LIVE_SITE(known));
        if (s) {
            s->frees++;
            s->bytes_freed += LIVE_BYTES(known);
            if (LIVE_CPU(known) != (bpf_get_smp_processor_id() & 0x3fff))
                s->cross_cpu_frees++;
            if (LIVE_TYPE(known) != type)
                s->mismatched_frees++;
        }
    } else {
        if (!tgid_is_followed(bpf_get_current_pid_tgid() >> 32))
            return 0;
        if (ptr) {
            struct site_stats *s = site_stats_of(call_site, type);
            if (s)
                s->unknown_frees++;
        }
    }
    if (type == KT_PAGES)
        count_order(order, 1);
    kmem_hits.increment(event);
    kmem_event(ctx, event, type, call_site, ptr, 0, 0, 0, -1, order, 1);
    return 0;
}

/* A raw tracepoint's arguments are each widened to u64 from an unsigned type
 * of its own size: an int node of -1 arrives as 0xffffffff. */
#define RAW_ARG(prefix, name) (ctx->args[prefix##_ARG_##name])
#define RAW_NODE(prefix) (prefix##_ARG_NODE >= 0 ? (s64)(s32)ctx->args[prefix##_ARG_NODE & 7] : -1)

/* The allocation tracepoints share their fields; node is the variant's. */
#define ALLOC_FROM_ARGS(event, type, node)                                                    \
    on_kmem_alloc(args, event, type, args->call_site, (u64)args->ptr, args->bytes_req,           \
                  args->bytes_alloc, args->gfp_flags, node, 0)
#if KMALLOC_HAS_NODE
#define KMALLOC_NODE args->node
#else
#define KMALLOC_NODE -1
#endif
#if CACHE_ALLOC_HAS_NODE
#define CACHE_ALLOC_NODE args->node
#else
#define CACHE_ALLOC_NODE -1
#endif

#if RAW_KMALLOC
RAW_TRACEPOINT_PROBE(kmalloc)
{
    return on_kmem_alloc(ctx, KM_KMALLOC, KT_KMALLOC, RAW_ARG(KMALLOC, CALL_SITE), RAW_ARG(KMALLOC, PTR),
                         RAW_ARG(KMALLOC, BYTES_REQ), RAW_ARG(KMALLOC, BYTES_ALLOC),
                         (u32)RAW_ARG(KMALLOC, GFP_FLAGS), RAW_NODE(KMALLOC), 0);
}
#else
TRACEPOINT_PROBE(kmem, kmalloc)
{
    return ALLOC_FROM_ARGS(KM_KMALLOC, KT_KMALLOC, KMALLOC_NODE);
}
#endif

#if HAVE_KMALLOC_NODE
TRACEPOINT_PROBE(kmem, kmalloc_node)
{
    return ALLOC_FROM_ARGS(KM_KMALLOC, KT_KMALLOC, args->node);
}
#endif

#if RAW_KFREE
RAW_TRACEPOINT_PROBE(kfree)
{
    return on_kmem_free(ctx, KM_KFREE, KT_KMALLOC, RAW_ARG(KFREE, CALL_SITE), RAW_ARG(KFREE, PTR), 0);
}
#else
TRACEPOINT_PROBE(kmem, kfree)
{
    return on_kmem_free(args, KM_KFREE, KT_KMALLOC, args->call_site, (u64)args->ptr, 0);
}
#endif

#if HAVE_CACHE_NAME && RAW_CACHE_ALLOC
/* Counts an allocation of a cache, known by the address of its name
 * (kstrdup_const'd when the cache was made) and its sizes, so that a cache
 * destroyed and another made with its name at the same address is another
 * key unless it is alike; the name string is read once per key. (Not by
 * the struct kmem_cache pointer: a BTF-typed program may only load through
 * it.) Caches are shown by name, so two keys of one name add up. */
static __always_inline void count_cache(u64 name, u32 size, u32 object_size)
{
    u64 tag = ((name * 0x9E3779B97F4A7C15ULL) ^ ((u64)size << 32 | object_size)) | 1;
    u32 home = table_bucket(tag, CACHE_BUCKETS);
    struct cache_bucket *b = cache_keys.lookup(&home);
    if (!b)
        return;
    int way = way_of(b->cache, tag);
    if (way < 0) {
        way = claim_way(b->cache, tag);
        if (way < 0)
            return; /* CACHE_BUCKETS * TABLE_WAYS caches in all, and this bucket is full */
        u32 slot = home * TABLE_WAYS + (way & (TABLE_WAYS - 1));
        struct cache_key *named = cache_names.lookup(&slot);
        if (named)
            bpf_probe_read_kernel_str(named->name, CACHE_NAME_LEN, (const void *)name);
    }
    u32 slot = home * TABLE_WAYS + (way & (TABLE_WAYS - 1));
    cache_counts.increment(slot);
}
#endif

#if RAW_CACHE_ALLOC
/* The classic record's bytes_req and bytes_alloc are the cache's object_size
 * and size, read from its struct kmem_cache with the name's address. */
static __always_inline int cache_alloc(struct bpf_raw_tracepoint_args *ctx, u32 size,
                                       u32 object_size, u64 name)
{
#if HAVE_CACHE_NAME
    count_cache(name, size, object_size);
#endif
    return count_kmem_alloc(ctx, KM_KMEM_CACHE_ALLOC, KT_CACHE, RAW_ARG(CACHE_ALLOC, CALL_SITE),
                            RAW_ARG(CACHE_ALLOC, PTR), object_size, size,
                            (u32)RAW_ARG(CACHE_ALLOC, GFP_FLAGS), RAW_NODE(CACHE_ALLOC), 0);
}

/* A raw program copies the span of struct kmem_cache that holds the three
 * (CACHE_SPAN_OFF, CACHE_SPAN_LEN) with bpf_probe_read_kernel. Where BTF
 * names the tracepoint's type (BTF_CACHE_ALLOC), tracer/bpf_backend.py
 * loads tp_btf__kmem_cache_alloc instead, as a BTF-typed tracepoint: the
 * verifier knows the argument is a struct kmem_cache and lets the program
 * load its members directly (a fault loads 0), without a helper call; and
 * keeps this one, then named rawtp__kmem_cache_alloc, for a kernel that
 * refuses it. */
#define CACHE_FIELD(type, off) (*(const type *)((const u8 *)span + (off) - CACHE_SPAN_OFF))
static __always_inline int cache_alloc_copied(struct bpf_raw_tracepoint_args *ctx)
{
    if (!kmem_alloc_traced())
        return 0;
    const char *cache = (const char *)RAW_ARG(CACHE_ALLOC, S);
    u64 span[CACHE_SPAN_LEN / 8];
    if (bpf_probe_read_kernel(span, sizeof(span), cache + CACHE_SPAN_OFF))
        __builtin_memset(span, 0, sizeof(span));
    u64 name = 0;
#if HAVE_CACHE_NAME
    name = CACHE_FIELD(u64, CACHE_NAME_OFF);
#endif
    return cache_alloc(ctx, CACHE_FIELD(u32, CACHE_SIZE_OFF), CACHE_FIELD(u32, CACHE_OBJECT_SIZE_OFF), name);
}

#if BTF_CACHE_ALLOC
#define MTRACE_TEXT_(x) #x
#define MTRACE_TEXT(x) MTRACE_TEXT_(x)
/* out = *(width *)(cache + off), as written: bcc would turn a dereference
 * in C into bpf_probe_read_kernel. */
#define CACHE_LOAD(width, cache, off, out) \
    asm volatile("%0 = *(" #width " *)(%1 + " MTRACE_TEXT(off) ")" : "=r"(out) : "r"(cache))

int tp_btf__kmem_cache_alloc(struct bpf_raw_tracepoint_args *ctx)
{
    if (!kmem_alloc_traced())
        return 0;
    const void *cache = (const void *)RAW_ARG(CACHE_ALLOC, S);
    u32 size, object_size;
    u64 name = 0;
    CACHE_LOAD(u32, cache, CACHE_SIZE_OFF, size);
    CACHE_LOAD(u32, cache, CACHE_OBJECT_SIZE_OFF, object_size);
#if HAVE_CACHE_NAME
    CACHE_LOAD(u64, cache, CACHE_NAME_OFF, name);
#endif
    return cache_alloc(ctx, size, object_size, name);
}

int rawtp__kmem_cache_alloc(struct bpf_raw_tracepoint_args *ctx)
{
    return cache_alloc_copied(ctx);
}
#else
RAW_TRACEPOINT_PROBE(kmem_cache_alloc)
{
    return cache_alloc_copied(ctx);
}
#endif
#else
TRACEPOINT_PROBE(kmem, kmem_cache_alloc)
{
#if HAVE_CACHE_NAME
    /* Not every kernel's format has the "name" field (6.18 has it). */
    if (kmem_alloc_traced()) {
        struct cache_key key = {};
        TP_DATA_LOC_READ_STR(key.name, name, sizeof(key.name));
        cache_allocs.increment(key);
    }
#endif
    return ALLOC_FROM_ARGS(KM_KMEM_CACHE_ALLOC, KT_CACHE, CACHE_ALLOC_NODE);
}
#endif

#if HAVE_CACHE_ALLOC_NODE
TRACEPOINT_PROBE(kmem, kmem_cache_alloc_node)
{
    return ALLOC_FROM_ARGS(KM_KMEM_CACHE_ALLOC, KT_CACHE, args->node);
}
#endif

#if RAW_CACHE_FREE
RAW_TRACEPOINT_PROBE(kmem_cache_free)
{
    return on_kmem_free(ctx, KM_KMEM_CACHE_FREE, KT_CACHE, RAW_ARG(CACHE_FREE, CALL_SITE),
                        RAW_ARG(CACHE_FREE, PTR), 0);
}
#else
TRACEPOINT_PROBE(kmem, kmem_cache_free)
{
    return on_kmem_free(args, KM_KMEM_CACHE_FREE, KT_CACHE, args->call_site, (u64)args->ptr, 0);
}
#endif

/* Pages have no call site in their tracepoints; they are keyed by pfn. */
TRACEPOINT_PROBE(kmem, mm_page_alloc)
{
    u64 pfn = args->pfn;
    u32 order = args->order;
    u64 bytes = (u64)1 << (PAGE_SHIFT_ + (order & 31));
    if (pfn == (u64)-1)
        pfn = 0; /* a failed allocation */
    return on_kmem_alloc(args, KM_MM_PAGE_ALLOC, KT_PAGES, 0, pfn, bytes, bytes, args->gfp_flags, -1,
                         order);
}

TRACEPOINT_PROBE(kmem, mm_page_free)
{
    return on_kmem_free(args, KM_MM_PAGE_FREE, KT_PAGES, 0, args->pfn, args->order);
}

#if HAVE_PAGE_FREE_BATCHED
TRACEPOINT_PROBE(kmem, mm_page_free_batched)
{
    return on_kmem_free(args, KM_MM_PAGE_FREE_BATCHED, KT_PAGES, 0, args->pfn, 0);
}
#endif
#endif

/* ---- the allocation functions --------------------------------------------
 * Uprobes on malloc, calloc, realloc, reallocarray, free, memalign,
 * posix_memalign, aligned_alloc, valloc and pvalloc, found in the libc's
 * dynamic symbol table (probes/alloc_sites.py chooses each site), and one
 * return probe at the entry of each allocating function.
 *
 * The entry handlers keep the arguments per thread in `pending`, an array
 * indexed by the thread id's low bits (a hash map would cost a hash and a
 * lock per call: measured, about 0.3 us of each malloc+free pair); the return
 * handler accounts the call: per (process, stack) in alloc_stacks, per
 * process in alloc_procs, and each pointer in `outstanding` until it is
 * freed. A call made inside another allocation function (glibc's realloc of
 * NULL calls malloc, its realloc to 0 bytes calls free, its memalign of a
 * small alignment calls malloc) is the outer call's business: it is seen
 * as nested because its stack pointer is below the pending call's, and is
 * not counted again.
 *
 * SAMPLE_BYTES > 0: byte-based sampling. A per-CPU countdown of bytes is
 * reloaded from exponentially distributed intervals of mean SAMPLE_BYTES
 * (a Poisson process over the bytes allocated); an allocation is kept when
 * the countdown runs out inside it, and stands for SAMPLE_BYTES times the
 * number of times it did: an unbiased estimate of its bytes. Only kept
 * allocations get a stack walk, an outstanding entry and an event. */
#if WITH_ALLOCS

/* Without sampling every allocation has its alloc_stacks row, so a
 * process's allocations, bytes and frees of known pointers are the sums of
 * its rows, and alloc_procs counts only what no row has: frees of unknown
 * pointers, failed calls, allocations alloc_stacks had no room for. With
 * sampling alloc_procs counts every call. (tracer/allocs.py adds them up.) */
#define EXACT_STACKS (SAMPLE_BYTES == 0)
#define SAMPLE_QUANTILES 1024 /* a power of two */
#define MAX_CROSSINGS 32

#define PENDING_SLOTS 65536 /* a power of two: threads whose ids differ by a multiple share one */

struct pending_call {
    u64 sp;    /* the stack pointer at the site: deeper calls are nested */
    u64 size;
    u64 aux;   /* realloc's old pointer, posix_memalign's pointer's address, the alignment */
    u32 fn;
    u32 depth; /* 1 + nested calls not yet returned; 0: the slot is free */
    u32 tid;   /* whose call it is */
    u32 proc_tgid; /* the process whose alloc_procs row this slot's thread has made */
};

BPF_ARRAY(pending, struct pending_call, PENDING_SLOTS);
#if ALLOC_WALK
/* The allocations' own stacks (not `stacks`): the frames above each call
 * site, stored once, at the row of alloc_frames that their 64-bit hash
 * picks (the next free of FRAME_PROBES rows on a collision). The first CPU
 * to store a stack claims its row in alloc_frame_claims, writes the frames,
 * then the hash. Ids in keys and events are ALLOC_FRAMES_BASE + row. */
#define FRAME_PROBES 8
struct alloc_frames_row {
    u64 hash; /* 0: free, or not written yet */
    u64 ip[ALLOC_DEPTH];
};
BPF_ARRAY(alloc_frames, struct alloc_frames_row, ALLOC_FRAME_ROWS);
BPF_HASH(alloc_frame_claims, u32, u64, ALLOC_FRAME_ROWS);
BPF_PERCPU_ARRAY(alloc_walk, struct alloc_frames_row, 1);
#endif
/* The outstanding allocations: an open-addressed table in an array, so that
 * an allocation and its free cost an array access and a compare-and-swap
 * each, not a hash map's insert and delete with their bucket locks (about
 * 0.1 us a call here, docs/allocations.md). A row is claimed by swapping its
 * tag from free (0) or deleted (1) to the allocation's own; a free marks
 * it deleted. Up to OUT_PROBES rows from the one the tag hashes to. */
#define OUT_PROBES 16
#define OUT_DELETED 1
BPF_ARRAY(outstanding, struct outstanding_row, ALLOC_OUT_ROWS);
/* Per (process, function, stack): an open-addressed table in an array, so
 * that the free of a block finds its stack's row by the index its
 * outstanding row keeps, not by hashing the key again. A row is claimed by
 * swapping its tag from 0 to the key's 64-bit hash; the tag alone then
 * names the key (two keys of one hash among some thousands: about one
 * chance in 2^40). Up to STACK_PROBES rows from the one the hash picks. */
#define STACK_PROBES 8
BPF_ARRAY(alloc_stacks, struct alloc_stack_row, ALLOC_STACK_ROWS);
BPF_HASH(alloc_procs, u32, struct alloc_proc, MAX_FOLLOWED);
BPF_PERCPU_ARRAY(alloc_calls, u64, AF_COUNT); /* every hit, nested ones included */
BPF_PERCPU_ARRAY(alloc_misc, u64, AX_COUNT);
#if SAMPLE_BYTES > 0
BPF_ARRAY(sample_quantiles, u64, SAMPLE_QUANTILES); /* SAMPLE_BYTES * -ln(1 - (i + 0.5) / N) */
BPF_PERCPU_ARRAY(sample_left, s64, 1);
#endif

static __always_inline int allocs_gate_closed(void)
{
#if WITH_EVENTS
    u32 first = 0;
    u32 *open = control.lookup(&first);
    return !open || !*open;
#else
    return 0;
#endif
}

/* Attached for one process alone (ALLOC_ONE_PROCESS), the uprobes fire in
 * no other: the kernel filters, and the followed table need not be asked. */
static __always_inline int alloc_followed(u32 tgid)
{
#if ALLOC_ONE_PROCESS
    return 1;
#else
    return tgid_is_followed(tgid);
#endif
}

static __always_inline u64 alloc_now(void)
{
#if ALLOC_EVENTS
    return bpf_ktime_get_ns(); /* events show it, and order by it */
#else
    /* the ages of live blocks and the stacks' last allocations are read
     * in seconds (docs/allocations.md) */
    return tick_now();
#endif
}

static __always_inline struct alloc_proc *alloc_proc_of(u32 tgid)
{
    struct alloc_proc zero = {};
    return alloc_procs.lookup_or_try_init(&tgid, &zero);
}

static __always_inline struct pending_call *slot_of(u32 tid)
{
    u32 slot = tid & (PENDING_SLOTS - 1);
    return pending.lookup(&slot);
}

/* The pending call of this thread, if the slot holds one. */
static __always_inline struct pending_call *pending_of(struct pending_call *p, u32 tid)
{
    return p && p->depth && p->tid == tid ? p : NULL;
}

/* The pending call of this thread that the call at `sp` is nested in, if any. */
static __always_inline struct pending_call *enclosing(struct pending_call *slot, u32 tid, u64 sp)
{
    struct pending_call *p = pending_of(slot, tid);
    if (p && sp <= p->sp) /* equal: a tail call (reallocarray jumps to realloc) */
        return p;
    return NULL; /* none, or left over from a call that never returned */
}

static __always_inline int on_alloc_entry(struct pt_regs *ctx, u32 fn, u64 size, u64 aux)
{
    if (allocs_gate_closed())
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    if (!alloc_followed(id >> 32))
        return 0;
    alloc_calls.increment(fn);
    u32 tid = (u32)id;
    u64 sp = PT_REGS_SP(ctx);
    struct pending_call *slot = slot_of(tid);
    if (!slot)
        return 0;
    struct pending_call *outer = enclosing(slot, tid, sp);
    if (outer) {
        outer->depth++;
        alloc_misc.increment(AX_NESTED);
        return 0;
    }
    if (slot->depth && slot->tid != tid) /* another thread's call, in flight: it loses it */
        alloc_misc.increment(AX_SLOT_TAKEN);
    slot->sp = sp;
    slot->size = size;
    slot->aux = aux;
    slot->fn = fn;
    slot->tid = tid;
    slot->depth = 1;
    return 0;
}

static __always_inline void alloc_event(u8 kind, u32 fn, u32 tgid, u32 tid, u64 call_site, u64 ptr,
                                        u64 size, u64 aux, u64 weight, u64 born, u64 site, s32 stack)
{
#if WITH_EVENTS && ALLOC_EVENTS
    struct event *e = events.ringbuf_reserve(sizeof(struct event));
    if (!e) {
        alloc_misc.increment(AX_LOST_EVENTS);
        return;
    }
    e->ts = bpf_ktime_get_ns();
    e->ip = call_site;
    e->tgid = tgid;
    e->tid = tid;
    e->cpu = bpf_get_smp_processor_id();
    e->probe = fn;
    e->site = 0;
    e->kind = kind;
    e->nargs = 6;
    e->args[AA_PTR] = ptr;
    e->args[AA_SIZE] = size;
    e->args[AA_AUX] = aux;
    e->args[AA_WEIGHT] = weight;
    e->args[AA_BORN] = born;
    e->args[AA_SITE] = site;
    e->ustack = stack;
    e->kstack = -1;
    events.ringbuf_submit(e, 0);
#endif
}

/* An allocation's tag: never 0 or 1 (user pointers are below 2^47 and
 * aligned); rows also hold the pointer and process in full. */
static __always_inline u64 outstanding_tag(u64 ptr, u32 tgid)
{
    return ptr ^ ((u64)tgid << 47);
}

static __always_inline u32 outstanding_home(u64 tag)
{
    return (u32)((tag * 0x9e3779b97f4a7c15ull) >> 32) & (ALLOC_OUT_ROWS - 1);
}

static __always_inline struct outstanding_row *outstanding_find(u64 ptr, u32 tgid)
{
    u64 tag = outstanding_tag(ptr, tgid);
    u32 home = outstanding_home(tag);
    for (u32 i = 0; i < OUT_PROBES; i++) {
        u32 index = (home + i) & (ALLOC_OUT_ROWS - 1);
        struct outstanding_row *row = outstanding.lookup(&index);
        if (!row || !row->tag)
            return NULL; /* a free row ends the search */
        if (row->tag == tag && row->ptr == ptr && row->tgid == tgid)
            return row;
    }
    return NULL;
}

/* 0, or -1 when no row near its home was free. */
static __always_inline int outstanding_add(u64 ptr, u32 tgid, struct outstanding *o)
{
    u64 tag = outstanding_tag(ptr, tgid);
    u32 home = outstanding_home(tag);
    for (u32 i = 0; i < OUT_PROBES; i++) {
        u32 index = (home + i) & (ALLOC_OUT_ROWS - 1);
        struct outstanding_row *row = outstanding.lookup(&index);
        if (!row)
            return -1;
        u64 seen = row->tag;
        if (seen > OUT_DELETED)
            continue;
        if (__sync_val_compare_and_swap(&row->tag, seen, tag) != seen)
            continue; /* taken by another CPU meanwhile */
        row->ptr = ptr;
        row->tgid = tgid;
        row->value = *o;
        return 0;
    }
    return -1;
}

static __always_inline u64 alloc_key_hash(const struct alloc_key *key)
{
    u64 h = (key->call_site ^ 0x84222325cbf29ce4ull) * 0x9e3779b97f4a7c15ull;
    h = (h ^ (h >> 29) ^ ((u64)key->tgid << 32 | (u32)key->stack)) * 0x9e3779b97f4a7c15ull;
    h = (h ^ (h >> 29) ^ key->fn) * 0x9e3779b97f4a7c15ull;
    return h | 1; /* never 0, which marks a free row */
}

/* The row of `key`, claimed if it has none; NULL when none of its
 * STACK_PROBES rows is its or free. `*index` is the row's. */
static __always_inline struct alloc_stack_row *stack_row_of(const struct alloc_key *key, u32 *index)
{
    u64 tag = alloc_key_hash(key);
    for (u32 i = 0; i < STACK_PROBES; i++) {
        u32 at = (u32)(tag + i) & (ALLOC_STACK_ROWS - 1);
        struct alloc_stack_row *row = alloc_stacks.lookup(&at);
        if (!row)
            return NULL;
        u64 seen = row->tag;
        if (!seen) {
            seen = __sync_val_compare_and_swap(&row->tag, 0, tag);
            if (!seen) { /* claimed: the key follows (user space skips a row without one) */
                row->key = *key;
                *index = at;
                return row;
            }
        }
        if (seen == tag) {
            *index = at;
            return row;
        }
    }
    return NULL;
}

/* Release `ptr` of process `tgid`: its outstanding entry, its stack's live bytes. */
static __always_inline void release(u32 fn, u32 tgid, u32 tid, u64 call_site, u64 ptr)
{
    struct outstanding_row *o = outstanding_find(ptr, tgid);
    struct alloc_proc *proc = EXACT_STACKS && o ? NULL : alloc_proc_of(tgid);
    if (proc)
        __sync_fetch_and_add(&proc->frees, 1);
    if (!o) {
        if (proc)
            __sync_fetch_and_add(&proc->unknown_frees, 1);
#if SAMPLE_BYTES == 0
        alloc_event(EV_FREE, fn, tgid, tid, call_site, ptr, 0, 0, 0, 0, 0, -1);
#endif
        return;
    }
    struct outstanding known = o->value;
    o->tag = OUT_DELETED;
    struct alloc_stack_row *row = alloc_stacks.lookup(&known.stack_row);
    struct alloc_stats *s = row ? &row->stats : NULL;
    if (s) {
        __sync_fetch_and_add(&s->frees, 1);
        __sync_fetch_and_add(&s->bytes_freed, known.weight);
        __sync_fetch_and_add(&s->sizes_freed, known.size);
    }
    /* no stack: a free's stack is not walked (its call site is the event's ip) */
    alloc_event(EV_FREE, fn, tgid, tid, call_site, ptr, known.size, 0, known.weight, known.ts,
                known.key.call_site, -1);
}

/* How many bytes an allocation of `size` stands for: size itself without
 * sampling; with it, SAMPLE_BYTES per sample point inside it, or 0. */
static __always_inline u64 sample_weight(u64 size)
{
#if SAMPLE_BYTES > 0
    u32 zero = 0;
    s64 *left = sample_left.lookup(&zero);
    if (!left)
        return 0;
    s64 remaining = *left - (s64)size;
    u64 points = 0;
#pragma unroll
    for (int i = 0; i < MAX_CROSSINGS; i++) {
        if (remaining > 0)
            break;
        u32 q = bpf_get_prandom_u32() & (SAMPLE_QUANTILES - 1);
        u64 *interval = sample_quantiles.lookup(&q);
        remaining += interval ? (s64)*interval : SAMPLE_BYTES;
        points++;
    }
    if (remaining <= 0) { /* larger than MAX_CROSSINGS intervals: kept at its size */
        *left = SAMPLE_BYTES;
        return size;
    }
    *left = remaining;
    return points * SAMPLE_BYTES;
#else
    return size;
#endif
}

#if ALLOC_WALK
#define MAX_FRAME_BYTES (8 << 20) /* a frame larger than the default stack limit ends a walk */
/* The call site (the return address, where the return probe stands), then
 * its callers, walked by frame pointers from %rbp (the caller's frame,
 * restored by the function that returned): each saved %rbp must lie above
 * the last, within MAX_FRAME_BYTES, and be 8-aligned, else the walk ends.
 * A chain into code without frame pointers mostly ends there, without
 * reading an unmapped address (a page fault). The kernel's walker
 * (bpf_get_stackid) cost about ten times more here (docs/allocations.md).
 * Returns the id of the stored frames, or -1. */
static __always_inline s32 walk_frames(struct pt_regs *ctx)
{
    u32 zero = 0;
    struct alloc_frames_row *row = alloc_walk.lookup(&zero);
    if (!row)
        return -1;
    u64 fp = ctx->bp, below = PT_REGS_SP(ctx), ip = PT_REGS_IP(ctx);
    u64 hash = (0x84222325cbf29ce4ull ^ ip) * 0x9e3779b97f4a7c15ull;
    row->ip[0] = ip; /* the call site, then its callers */
    int n = 1;
    for (int i = 1; i < ALLOC_DEPTH; i++) {
        u64 frame[2]; /* the saved %rbp, the return address */
        if (fp <= below || fp - below > MAX_FRAME_BYTES || (fp & 7))
            break;
        if (bpf_probe_read_user(frame, sizeof(frame), (void *)fp) || !frame[1])
            break;
        row->ip[i] = frame[1];
        hash = (hash ^ (hash >> 29) ^ frame[1]) * 0x9e3779b97f4a7c15ull;
        below = fp;
        fp = frame[0];
        n = i + 1;
    }
    if (n < ALLOC_DEPTH)
        row->ip[n & (ALLOC_DEPTH - 1)] = 0;
    hash |= 1; /* never 0, which marks a free row */
    for (u32 probe = 0; probe < FRAME_PROBES; probe++) {
        u32 index = (u32)(hash + probe) & (ALLOC_FRAME_ROWS - 1);
        struct alloc_frames_row *slot = alloc_frames.lookup(&index);
        if (!slot)
            break;
        if (slot->hash == hash)
            return ALLOC_FRAMES_BASE + index;
        if (slot->hash)
            continue; /* another stack's */
        if (alloc_frame_claims.insert(&index, &hash)) { /* another CPU is storing a stack here */
            u64 *claimed = alloc_frame_claims.lookup(&index);
            if (claimed && *claimed == hash)
                return ALLOC_FRAMES_BASE + index;
            continue;
        }
        __builtin_memcpy(slot->ip, row->ip, sizeof(slot->ip));
        asm volatile("" ::: "memory"); /* the frames before the hash that says they are there */
        slot->hash = hash;
        return ALLOC_FRAMES_BASE + index;
    }
    alloc_misc.increment(AX_FRAMES_FULL);
    return -1;
}
#endif

/* Every allocating function's return probe. */
int alloc_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    u32 tgid = id >> 32;
    struct pending_call *p = pending_of(slot_of(tid), tid);
    if (!p)
        return 0;
    if (p->depth > 1) {
        p->depth--;
        return 0;
    }
    struct pending_call call = *p;
    p->depth = 0;
    if (p->proc_tgid != tgid) { /* the process's row, made once per thread */
        alloc_proc_of(tgid);
        p->proc_tgid = tgid;
    }
    if (allocs_gate_closed())
        return 0;
    u64 ptr = PT_REGS_RC(ctx);
    if (call.fn == AF_POSIX_MEMALIGN) {
        u64 got = 0;
        if ((int)ptr != 0 || bpf_probe_read_user(&got, sizeof(got), (void *)call.aux))
            got = 0;
        ptr = got;
    }
    u64 call_site = PT_REGS_IP(ctx); /* the return address, restored by the kernel */
    if (call.fn == AF_REALLOC || call.fn == AF_REALLOCARRAY) {
        /* glibc frees the old block on success, and on a request of 0 bytes. */
        if (call.aux && (ptr || call.size == 0))
            release(call.fn, tgid, tid, call_site, call.aux);
        if (!ptr && call.size == 0)
            return 0;
    }
    if (!ptr) { /* failed: counted, and nothing more */
        struct alloc_proc *proc = alloc_proc_of(tgid);
        if (proc)
            __sync_fetch_and_add(&proc->failed, 1);
        return 0;
    }
#if !EXACT_STACKS
    struct alloc_proc *proc = alloc_proc_of(tgid);
    if (proc) {
        __sync_fetch_and_add(&proc->calls, 1);
        __sync_fetch_and_add(&proc->bytes, call.size);
    }
#endif
    u64 weight = sample_weight(call.size);
#if SAMPLE_BYTES > 0
    if (!weight)
        return 0;
#endif
    struct alloc_key key = {.call_site = call_site, .tgid = tgid, .fn = call.fn};
#if ALLOC_WALK
    key.stack = walk_frames(ctx);
#else
    key.stack = -1;
#endif
    u32 stack_row = 0;
    struct alloc_stack_row *row = stack_row_of(&key, &stack_row);
    struct alloc_stats *s = row ? &row->stats : NULL;
    u64 now = alloc_now();
    if (!s) {
        alloc_misc.increment(AX_STACKS_FULL);
#if EXACT_STACKS
        struct alloc_proc *proc = alloc_proc_of(tgid); /* counted here, as no row has it */
        if (proc) {
            __sync_fetch_and_add(&proc->calls, 1);
            __sync_fetch_and_add(&proc->bytes, call.size);
        }
#endif
    } else {
        __sync_fetch_and_add(&s->calls, 1);
        __sync_fetch_and_add(&s->bytes, weight);
        __sync_fetch_and_add(&s->sizes, call.size);
        s->last_ts = now;
    }
    if (s) {
        struct outstanding o = {.key = key, .size = call.size, .weight = weight, .ts = now,
                                .tid = tid, .stack_row = stack_row};
        if (outstanding_add(ptr, tgid, &o)) {
            alloc_misc.increment(AX_OUTSTANDING_FULL);
            /* never to be matched: counted as freed at once, so live bytes stay right */
            __sync_fetch_and_add(&s->frees, 1);
            __sync_fetch_and_add(&s->bytes_freed, weight);
            __sync_fetch_and_add(&s->sizes_freed, call.size);
#if EXACT_STACKS
            struct alloc_proc *proc = alloc_proc_of(tgid); /* not a free of the process's */
            if (proc)
                __sync_fetch_and_add(&proc->untracked, 1);
#endif
        }
    }
    alloc_event(EV_ALLOC, call.fn, tgid, tid, call_site, ptr, call.size, call.aux, weight, 0, 0, key.stack);
    return 0;
}

/* Entry handlers: the sites' registers, as alloc_sites.py checked. */
int alloc_malloc(struct pt_regs *ctx)
{
    return on_alloc_entry(ctx, AF_MALLOC, PT_REGS_PARM1(ctx), 0);
}

/* n * size, or 0 where it overflows (the call then fails). */
static __always_inline u64 product(u64 n, u64 size)
{
    if (!((n | size) >> 32))
        return n * size;
    if (!size)
        return 0;
    u64 limit = (u64)-1 / size;
    asm volatile("" : "+r"(limit)); /* else clang fuses this into a 128-bit multiply BPF lacks */
    return n > limit ? 0 : n * size;
}

int alloc_calloc(struct pt_regs *ctx)
{
    u64 n = PT_REGS_PARM1(ctx), size = PT_REGS_PARM2(ctx);
    return on_alloc_entry(ctx, AF_CALLOC, product(n, size), 0);
}

int alloc_realloc(struct pt_regs *ctx)
{
    return on_alloc_entry(ctx, AF_REALLOC, PT_REGS_PARM2(ctx), PT_REGS_PARM1(ctx));
}

int alloc_reallocarray(struct pt_regs *ctx)
{
    u64 n = PT_REGS_PARM2(ctx), size = PT_REGS_PARM3(ctx);
    return on_alloc_entry(ctx, AF_REALLOCARRAY, product(n, size), PT_REGS_PARM1(ctx));
}

int alloc_memalign(struct pt_regs *ctx)
{
    return on_alloc_entry(ctx, AF_MEMALIGN, PT_REGS_PARM2(ctx), PT_REGS_PARM1(ctx));
}

int alloc_aligned_alloc(struct pt_regs *ctx)
{
    return on_alloc_entry(ctx, AF_ALIGNED_ALLOC, PT_REGS_PARM2(ctx), PT_REGS_PARM1(ctx));
}

int alloc_posix_memalign(struct pt_regs *ctx)
{
    return on_alloc_entry(ctx, AF_POSIX_MEMALIGN, PT_REGS_PARM3(ctx), PT_REGS_PARM1(ctx));
}

int alloc_valloc(struct pt_regs *ctx)
{
    return on_alloc_entry(ctx, AF_VALLOC, PT_REGS_PARM1(ctx), 0);
}

int alloc_pvalloc(struct pt_regs *ctx)
{
    return on_alloc_entry(ctx, AF_PVALLOC, PT_REGS_PARM1(ctx), 0);
}

int alloc_free(struct pt_regs *ctx)
{
    if (allocs_gate_closed())
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!alloc_followed(tgid))
        return 0;
    alloc_calls.increment(AF_FREE);
    u64 ptr = PT_REGS_PARM1(ctx);
    if (!ptr) {
        alloc_misc.increment(AX_NULL_FREES);
        return 0;
    }
    u64 sp = PT_REGS_SP(ctx);
    if (enclosing(slot_of((u32)id), (u32)id, sp)) { /* realloc's own free of its old block */
        alloc_misc.increment(AX_NESTED);
        return 0;
    }
    u64 call_site = 0; /* the site is before any push: the return address is at sp */
#if ALLOC_EVENTS
    bpf_probe_read_user(&call_site, sizeof(call_site), (void *)sp); /* only events show it */
#endif
    release(AF_FREE, tgid, (u32)id, call_site, ptr);
    return 0;
}

#if HOLD_AT_EXIT && WITH_EVENTS
/* _exit: the process's mappings are still there. It stops itself (SIGSTOP,
 * delivered as the handler returns to user space) and says so; user space
 * reads /proc/PID/maps, to name the frames of its stacks after it is gone,
 * and continues it. Only processes with allocations seen, and only while
 * the gate is open: a trace that ends stops no one. */
int alloc_exit(struct pt_regs *ctx)
{
    if (allocs_gate_closed())
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!tgid_is_followed(tgid) || !alloc_procs.lookup(&tgid))
        return 0; /* only processes whose allocations were seen */
    struct event *e = events.ringbuf_reserve(sizeof(struct event));
    if (!e)
        return 0; /* no room to say so: not held */
    __builtin_memset(e, 0, sizeof(*e));
    e->ts = bpf_ktime_get_ns();
    e->tgid = tgid;
    e->tid = (u32)id;
    e->kind = EV_HELD;
    e->ustack = e->kstack = -1;
    bpf_send_signal(19); /* SIGSTOP */
    events.ringbuf_submit(e, 0);
    return 0;
}
#endif

/* ---- memory that bypasses malloc: mmap, munmap, mremap, brk --------------
 * Counted per process when the call returns (its arguments kept per thread
 * at entry). Only the traced processes; munmap counts what it was asked to
 * unmap, whoever mapped it. */
#define MAP_ANONYMOUS_ 0x20
struct vm_call {
    u64 len;
    u64 other; /* mmap: flags; mremap: the new length; brk: the break asked for */
};
BPF_TABLE("lru_hash", u32, struct vm_call, vm_pending, 16384);
BPF_HASH(vm_procs, u32, struct vm_proc, MAX_FOLLOWED);
BPF_HASH(vm_brk, u32, u64, MAX_FOLLOWED); /* each process's break as last seen */

static __always_inline struct vm_proc *vm_proc_of(u32 tgid)
{
    struct vm_proc zero = {};
    return vm_procs.lookup_or_try_init(&tgid, &zero);
}

static __always_inline int vm_enter(u64 len, u64 other)
{
    if (allocs_gate_closed())
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    if (!tgid_is_followed(id >> 32))
        return 0;
    u32 tid = (u32)id;
    struct vm_call call = {.len = len, .other = other};
    vm_pending.update(&tid, &call);
    return 0;
}

/* The call of this thread that just returned (taken out of vm_pending into
 * `out`) and its process's counters, when it succeeded: `ret` 0 for munmap,
 * not an error number for the others. */
static __always_inline struct vm_proc *vm_returned(s64 ret, int zero_is_success,
                                                   struct vm_call *out)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct vm_call *call = vm_pending.lookup(&tid);
    if (!call)
        return NULL;
    *out = *call;
    vm_pending.delete(&tid);
    if (zero_is_success ? ret != 0 : (ret < 0 && ret > -4096))
        return NULL;
    return vm_proc_of(bpf_get_current_pid_tgid() >> 32);
}

TRACEPOINT_PROBE(syscalls, sys_enter_mmap)
{
    return vm_enter(args->len, args->flags);
}

TRACEPOINT_PROBE(syscalls, sys_exit_mmap)
{
    struct vm_call call;
    struct vm_proc *p = vm_returned(args->ret, 0, &call);
    if (!p)
        return 0;
    __sync_fetch_and_add(&p->mmap_calls, 1);
    if (call.other & MAP_ANONYMOUS_)
        __sync_fetch_and_add(&p->mmap_bytes, call.len);
    else
        __sync_fetch_and_add(&p->mmap_file_bytes, call.len);
    return 0;
}

/* sys_enter_munmap and the brk tracepoints are shared with the derived
 * probes: see the dispatch at the end. */

TRACEPOINT_PROBE(syscalls, sys_exit_munmap)
{
    struct vm_call call;
    struct vm_proc *p = vm_returned(args->ret, 1, &call);
    if (!p)
        return 0;
    __sync_fetch_and_add(&p->munmap_calls, 1);
    __sync_fetch_and_add(&p->munmap_bytes, call.len);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_mremap)
{
    return vm_enter(args->old_len, args->new_len);
}

TRACEPOINT_PROBE(syscalls, sys_exit_mremap)
{
    struct vm_call call;
    struct vm_proc *p = vm_returned(args->ret, 0, &call);
    if (!p)
        return 0;
    __sync_fetch_and_add(&p->mremap_calls, 1);
    if (call.other > call.len)
        __sync_fetch_and_add(&p->mremap_grown, call.other - call.len);
    else
        __sync_fetch_and_add(&p->mremap_shrunk, call.len - call.other);
    return 0;
}

/* brk returns the break, moved or not; the first one seen only sets it. */
static __always_inline int vm_exit_brk(u64 ret)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    if (!vm_pending.lookup(&tid))
        return 0;
    vm_pending.delete(&tid);
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u64 now = ret;
    u64 *last = vm_brk.lookup(&tgid);
    if (!last) {
        vm_brk.update(&tgid, &now);
        return 0;
    }
    u64 before = *last;
    if (now == before)
        return 0;
    *last = now;
    struct vm_proc *p = vm_proc_of(tgid);
    if (!p)
        return 0;
    __sync_fetch_and_add(&p->brk_calls, 1);
    if (now > before)
        __sync_fetch_and_add(&p->brk_grown, now - before);
    else
        __sync_fetch_and_add(&p->brk_shrunk, before - now);
    return 0;
}
#endif

/* ---- system calls both the allocation tables and the derived probes use --*/
#if WITH_ALLOCS || DERIVED_SYSCALLS
TRACEPOINT_PROBE(syscalls, sys_enter_munmap)
{
#if WITH_ALLOCS
    vm_enter(args->len, 0);
#endif
#if DERIVED_SYSCALLS
    derived_enter_munmap(args, args->addr, args->len);
#endif
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_brk)
{
#if WITH_ALLOCS
    vm_enter(0, args->brk);
#endif
#if DERIVED_SYSCALLS
    derived_enter_brk(args->brk);
#endif
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_brk)
{
#if WITH_ALLOCS
    vm_exit_brk((u64)args->ret);
#endif
#if DERIVED_SYSCALLS
    derived_exit_brk(args, (u64)args->ret);
#endif
    return 0;
}
#endif
