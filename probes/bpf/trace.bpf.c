/* mtrace-live's one BPF program: libc USDT sites, read per their ELF notes,
 * counted in the kernel and (WITH_EVENTS) streamed through a ring buffer;
 * optionally the kmem tracepoints, counted.
 *
 * User space attaches SDT site i to handler site_<i> and writes, at index i
 * of the `sites` array, which probe slot the site belongs to and where each
 * argument lives (register, register + displacement, or an address at a
 * constant distance from the site's instruction pointer: the rip-relative
 * operands). One handler body serves every site; it is a BPF-to-BPF call so
 * that the 128 entry points stay a few instructions each.
 *
 * Process filter (FILTER_PIDS): `followed` holds the tgids to trace. With
 * FOLLOW_FORKS every process a followed one forks is added before it can run
 * an instruction (task_newtask fires in copy_process, ahead of
 * wake_up_new_task). Exec and exit of a followed process are sent as events.
 *
 * bcc only rewrites map calls in the main source file, so everything is in
 * this one. */
#include <uapi/linux/ptrace.h>

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

#define MAX_FOLLOWED 65536
#define MAX_PROC_COUNTERS 65536
#define MAX_SITES 128
#define MAX_PROBES MAX_SITES
#define MAX_ARGS 6
#define MTRACE_CLONE_THREAD 0x00010000 /* include/uapi/linux/sched.h */

/* Must match tracer/events.py. */
enum arg_kind {
    ARG_NONE = 0,     /* not recorded: the note's operand is not understood */
    ARG_CONST = 1,    /* $value */
    ARG_REG = 2,      /* %reg */
    ARG_DEREF_REG = 3, /* value(%reg) */
    ARG_DEREF_IP = 4, /* memory at (site's ip + value), from sym+off(%rip) */
};

enum event_kind {
    EV_PROBE = 0,
    EV_EXEC = 1, /* a followed process exec'd; args[0] = its pid before exec */
    EV_EXIT = 2, /* a followed process's group leader exited */
};

struct arg_desc {
    u8 kind;
    u8 size;      /* 1, 2, 4 or 8 bytes */
    u8 is_signed;
    u8 reg;       /* index of the u64 slot in struct pt_regs */
    u32 pad;
    s64 value;
};

struct site_desc {
    u16 probe;
    u16 nargs;
    u32 pad;
    struct arg_desc args[MAX_ARGS];
};

struct event {
    u64 ts;       /* bpf_ktime_get_ns(): CLOCK_MONOTONIC */
    u64 ip;       /* the site's address in the process */
    u32 tgid;
    u32 tid;
    u16 cpu;
    u16 probe;    /* probe slot, in user space's order */
    u16 site;
    u8 kind;      /* enum event_kind */
    u8 nargs;
    u64 args[MAX_ARGS]; /* sign- or zero-extended to 64 bits */
};

struct proc_key {
    u32 tgid;
    u32 probe;
};

BPF_HASH(followed, u32, u8, MAX_FOLLOWED);
BPF_ARRAY(sites, struct site_desc, MAX_SITES);
BPF_PERCPU_ARRAY(hits, u64, MAX_PROBES);          /* every hit that passed the filter */
BPF_HASH(proc_hits, struct proc_key, u64, MAX_PROC_COUNTERS);
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
#if FILTER_PIDS
    return followed.lookup(&tgid) != NULL;
#else
    return 1;
#endif
}

/* ---- process lifecycle ---------------------------------------------------*/
#if FILTER_PIDS
#if FOLLOW_FORKS
TRACEPOINT_PROBE(task, task_newtask)
{
    /* Threads share their parent's tgid and need no entry of their own. */
    if (args->clone_flags & MTRACE_CLONE_THREAD)
        return 0;
    if (!tgid_is_followed(bpf_get_current_pid_tgid() >> 32))
        return 0;
    u32 child = args->pid;
    u8 one = 1;
    followed.update(&child, &one);
    return 0;
}
#endif

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
    events.ringbuf_submit(e, 0);
}

TRACEPOINT_PROBE(sched, sched_process_exec)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (tgid_is_followed(tgid))
        lifecycle_event(tgid, EV_EXEC, args->old_pid);
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
    return 0;
}
#endif

/* ---- reading arguments ---------------------------------------------------*/
#define PT_REGS_SLOTS (sizeof(struct pt_regs) / sizeof(u64))
#define PT_REGS_IP_SLOT(regs) ((regs)->slot[offsetof(struct pt_regs, ip) / sizeof(u64)])

/* A copy of the registers on the stack, indexed by pt_regs slot. The
 * verifier refuses a load through a ctx pointer at a computed offset, which
 * is what clang makes of a switch over the registers. */
struct regs_copy {
    u64 slot[PT_REGS_SLOTS];
};

static __always_inline u64 reg_value(struct regs_copy *regs, u32 reg)
{
    return reg < PT_REGS_SLOTS ? regs->slot[reg] : 0;
}

static __always_inline u64 extend(u64 v, u8 size, u8 is_signed)
{
    switch (size) {
    case 1: return is_signed ? (u64)(s64)(s8)v : (u8)v;
    case 2: return is_signed ? (u64)(s64)(s16)v : (u16)v;
    case 4: return is_signed ? (u64)(s64)(s32)v : (u32)v;
    }
    return v;
}

static __always_inline u64 read_arg(struct regs_copy *regs, struct arg_desc *a)
{
    u64 v = 0;
    u64 addr;
    switch (a->kind) {
    case ARG_CONST:
        v = a->value;
        break;
    case ARG_REG:
        v = reg_value(regs, a->reg);
        break;
    case ARG_DEREF_REG:
    case ARG_DEREF_IP:
        addr = (a->kind == ARG_DEREF_IP ? PT_REGS_IP_SLOT(regs) : reg_value(regs, a->reg)) + a->value;
        if (bpf_probe_read_user(&v, a->size & 0x8 ? 8 : a->size & 0x7, (void *)addr))
            v = 0;
        break;
    default:
        return 0;
    }
    return extend(v, a->size, a->is_signed);
}

/* ---- one body for every site ---------------------------------------------*/
static __always_inline int on_site(struct pt_regs *ctx, u32 site)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
#if WITH_EVENTS
    u32 first = 0;
    u32 *open = control.lookup(&first);
    if (!open || !*open)
        return 0;
#endif
    if (!tgid_is_followed(tgid))
        return 0;
    struct site_desc *d = sites.lookup(&site);
    if (!d)
        return 0;
    u32 probe = d->probe;
    hits.increment(probe);
    struct proc_key key = {.tgid = tgid, .probe = probe};
    u64 zero = 0;
    u64 *n = proc_hits.lookup_or_try_init(&key, &zero);
    if (n)
        __sync_fetch_and_add(n, 1);
    else
        proc_hits_dropped.increment(0);
#if WITH_EVENTS
    struct event *e = events.ringbuf_reserve(sizeof(struct event));
    if (!e) {
        lost.increment(probe);
        return 0;
    }
    e->ts = bpf_ktime_get_ns();
    e->ip = PT_REGS_IP(ctx);
    e->tgid = tgid;
    e->tid = (u32)id;
    e->cpu = bpf_get_smp_processor_id();
    e->probe = probe;
    e->site = site;
    e->kind = EV_PROBE;
    e->nargs = d->nargs;
    struct regs_copy regs;
    bpf_probe_read_kernel(&regs, sizeof(regs), ctx);
#pragma unroll
    for (int i = 0; i < MAX_ARGS; i++)
        e->args[i] = read_arg(&regs, &d->args[i]);
    events.ringbuf_submit(e, 0);
#endif
    return 0;
}

/* site_0 ... site_<SITE_COUNT - 1>, in blocks of ten: site_0 ... site_9,
 * then a tens digit pasted onto 0..9 (site_10 ... site_119), then 120..127.
 * Only the blocks user space needs are compiled: each handler inlines the
 * whole body, and compile time is most of the start-up time. */
#define SITE(n) int site_##n(struct pt_regs *ctx) { return on_site(ctx, n); }
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

/* ---- kmem tracepoints ----------------------------------------------------
 * The tracepoint structs come from the running kernel's tracefs formats.
 * Frees are counted in the context of the freeing task only; attributing RCU
 * and softirq frees to the allocating process needs pointer tracking. */
#if WITH_KMEM
#define CACHE_NAME_LEN 32

enum kmem_event {
    KM_KMALLOC,
    KM_KFREE,
    KM_KMEM_CACHE_ALLOC,
    KM_KMEM_CACHE_FREE,
    KM_MM_PAGE_ALLOC,
    KM_MM_PAGE_FREE,
    KM_COUNT,
};

struct cache_key {
    char name[CACHE_NAME_LEN];
};

BPF_PERCPU_ARRAY(kmem_hits, u64, KM_COUNT);
BPF_HASH(cache_allocs, struct cache_key, u64, 1024);

static __always_inline int count_kmem(u32 event)
{
    if (!tgid_is_followed(bpf_get_current_pid_tgid() >> 32))
        return 0;
    kmem_hits.increment(event);
    return 0;
}

TRACEPOINT_PROBE(kmem, kmalloc) { return count_kmem(KM_KMALLOC); }
TRACEPOINT_PROBE(kmem, kfree) { return count_kmem(KM_KFREE); }
TRACEPOINT_PROBE(kmem, kmem_cache_free) { return count_kmem(KM_KMEM_CACHE_FREE); }
TRACEPOINT_PROBE(kmem, mm_page_alloc) { return count_kmem(KM_MM_PAGE_ALLOC); }
TRACEPOINT_PROBE(kmem, mm_page_free) { return count_kmem(KM_MM_PAGE_FREE); }

TRACEPOINT_PROBE(kmem, kmem_cache_alloc)
{
    if (!tgid_is_followed(bpf_get_current_pid_tgid() >> 32))
        return 0;
    kmem_hits.increment(KM_KMEM_CACHE_ALLOC);
#if HAVE_CACHE_NAME
    /* Not every kernel's format has the "name" field (6.18 has it); user
     * space sets HAVE_CACHE_NAME from tracefs. */
    struct cache_key key = {};
    TP_DATA_LOC_READ_STR(key.name, name, sizeof(key.name));
    cache_allocs.increment(key);
#endif
    return 0;
}
#endif
