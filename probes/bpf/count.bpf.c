/* In-kernel hit counters for a followed process tree: libc USDT probes (one
 * slot per probe name) and, with WITH_KMEM, the kmem tracepoints.
 *
 * User space seeds `followed` with the target pid; with FOLLOW_FORKS every
 * process a followed one forks is added before it can run an instruction
 * (task_newtask fires in copy_process, ahead of wake_up_new_task). bcc only
 * rewrites map calls in the main source file, so everything is in this one. */
#include <uapi/linux/ptrace.h>

#ifndef FOLLOW_FORKS
#define FOLLOW_FORKS 1
#endif
#ifndef WITH_KMEM
#define WITH_KMEM 0
#endif
#ifndef HAVE_CACHE_NAME
#define HAVE_CACHE_NAME 0
#endif
#define MAX_FOLLOWED 65536
#define MAX_PROBES 100
#define MTRACE_CLONE_THREAD 0x00010000 /* include/uapi/linux/sched.h */

BPF_HASH(followed, u32, u8, MAX_FOLLOWED);
BPF_PERCPU_ARRAY(hits, u64, MAX_PROBES);

static __always_inline int current_is_followed(void)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    return followed.lookup(&tgid) != NULL;
}

#if FOLLOW_FORKS
TRACEPOINT_PROBE(task, task_newtask)
{
    /* Threads share their parent's tgid and need no entry of their own. */
    if (args->clone_flags & MTRACE_CLONE_THREAD)
        return 0;
    if (!current_is_followed())
        return 0;
    u32 child = args->pid;
    u8 one = 1;
    followed.update(&child, &one);
    return 0;
}
#endif

/* ---- libc USDT probes ---------------------------------------------------
 * User space attaches every site of probe i to count_<i>; the mallopt_*
 * probes have two sites and both land in the same slot. */
static __always_inline int count_hit(u32 probe)
{
    if (!current_is_followed())
        return 0;
    hits.increment(probe);
    return 0;
}

/* count_0 ... count_99: ten explicit handlers, then nine blocks of ten built
 * by pasting a tens digit onto 0..9 (count_10 ... count_99). */
#define COUNTER(n) int count_##n(struct pt_regs *ctx) { return count_hit(n); }
#define COUNTERS_OF_TENS(t) \
    COUNTER(t##0) COUNTER(t##1) COUNTER(t##2) COUNTER(t##3) COUNTER(t##4) \
    COUNTER(t##5) COUNTER(t##6) COUNTER(t##7) COUNTER(t##8) COUNTER(t##9)

COUNTER(0) COUNTER(1) COUNTER(2) COUNTER(3) COUNTER(4)
COUNTER(5) COUNTER(6) COUNTER(7) COUNTER(8) COUNTER(9)
COUNTERS_OF_TENS(1) COUNTERS_OF_TENS(2) COUNTERS_OF_TENS(3)
COUNTERS_OF_TENS(4) COUNTERS_OF_TENS(5) COUNTERS_OF_TENS(6)
COUNTERS_OF_TENS(7) COUNTERS_OF_TENS(8) COUNTERS_OF_TENS(9)

/* ---- kmem tracepoints ----------------------------------------------------
 * The tracepoint structs come from the running kernel's tracefs formats.
 * Frees are counted in the context of the freeing task only; attributing RCU
 * and softirq frees to the allocating process needs pointer tracking. */
#if WITH_KMEM
#define CACHE_NAME_LEN 32

enum kmem_event {
    EV_KMALLOC,
    EV_KFREE,
    EV_KMEM_CACHE_ALLOC,
    EV_KMEM_CACHE_FREE,
    EV_MM_PAGE_ALLOC,
    EV_MM_PAGE_FREE,
    EV_COUNT,
};

struct cache_key {
    char name[CACHE_NAME_LEN];
};

BPF_PERCPU_ARRAY(kmem_hits, u64, EV_COUNT);
BPF_HASH(cache_allocs, struct cache_key, u64, 1024);

static __always_inline int count_kmem(u32 event)
{
    if (!current_is_followed())
        return 0;
    kmem_hits.increment(event);
    return 0;
}

TRACEPOINT_PROBE(kmem, kmalloc) { return count_kmem(EV_KMALLOC); }
TRACEPOINT_PROBE(kmem, kfree) { return count_kmem(EV_KFREE); }
TRACEPOINT_PROBE(kmem, kmem_cache_free) { return count_kmem(EV_KMEM_CACHE_FREE); }
TRACEPOINT_PROBE(kmem, mm_page_alloc) { return count_kmem(EV_MM_PAGE_ALLOC); }
TRACEPOINT_PROBE(kmem, mm_page_free) { return count_kmem(EV_MM_PAGE_FREE); }

TRACEPOINT_PROBE(kmem, kmem_cache_alloc)
{
    if (!current_is_followed())
        return 0;
    kmem_hits.increment(EV_KMEM_CACHE_ALLOC);
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
