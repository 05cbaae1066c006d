/* Handlers that do nothing, on the kmem tracepoints mtrace-live attaches:
 * the floor of the kmem benchmark (bench/kmem_bench.py), what the kernel
 * alone costs to run a BPF program at each event.
 *
 * RAW_SLAB 1: the four slab events as raw tracepoints, as
 * tracer/bpf/kmem_attach.py attaches them where the kernel's BTF allows; 0: all
 * classic. PAGE_FREE_BATCHED 1: this kernel has mm_page_free_batched.
 * PID_FILTER 1: each handler does the least a pid-filtered aggregation does
 * (bench/kmem_floor.py): it compares the event's process with the one in
 * `target` and counts the events that match.
 * MATCH_FREES 1 (with PID_FILTER and RAW_SLAB): besides, the least a
 * tracer that knows which objects are live does: an allocation the filter
 * lets through puts its pointer in a table, and every free, whoever frees,
 * looks its pointer up there and takes it out. The table is the cheapest
 * kind this project knows, the trace program's own (set_table.h): one bucket of
 * eight pointers in one cache line, claimed and released with a
 * compare-and-swap, here with no spill to a second bucket and nothing
 * stored beside the pointer. KMALLOC_ARG_PTR, KFREE_ARG_PTR, CACHE_ALLOC_ARG_PTR and
 * CACHE_FREE_ARG_PTR are each event's pointer argument, from the kernel's BTF
 * (tracer/bpf/kmem_attach.py). */
#ifndef RAW_SLAB
#define RAW_SLAB 1
#endif
#ifndef PAGE_FREE_BATCHED
#define PAGE_FREE_BATCHED 0
#endif
#ifndef PID_FILTER
#define PID_FILTER 0
#endif
#ifndef MATCH_FREES
#define MATCH_FREES 0
#endif

#if PID_FILTER
BPF_ARRAY(target, u32, 1);
BPF_PERCPU_ARRAY(matched, u64, 1);

static __always_inline int traced(void)
{
    u32 zero = 0;
    u32 *tgid = target.lookup(&zero);
    return tgid && *tgid == bpf_get_current_pid_tgid() >> 32;
}

static __always_inline int handled(void)
{
    if (traced())
        matched.increment(0);
    return 0;
}
#else
static __always_inline int handled(void)
{
    return 0;
}
#endif

#if MATCH_FREES
#include "set_table.h"
#define BUCKETS 32768 /* 262,144 pointers, as kmem.bpf.c's KMEM_OBJECTS */
struct bucket {
    u64 ptr[TABLE_WAYS];
};
BPF_ARRAY(live, struct bucket, BUCKETS);
BPF_PERCPU_ARRAY(freed, u64, 1); /* frees whose allocation was found */
BPF_PERCPU_ARRAY(full, u64, 1);  /* allocations whose bucket was full */

static __always_inline struct bucket *home(u64 ptr)
{
    u32 index = table_bucket(ptr, BUCKETS);
    return live.lookup(&index);
}

static __always_inline int allocated(u64 ptr)
{
    if (!traced())
        return 0;
    matched.increment(0);
    struct bucket *b = home(ptr);
    if (b && ptr && claim_way(b->ptr, ptr) < 0)
        full.increment(0);
    return 0;
}

static __always_inline int released(u64 ptr)
{
    struct bucket *b = home(ptr);
    if (!b || !ptr)
        return 0;
    int way = way_of(b->ptr, ptr);
    if (way < 0)
        return 0;
    way &= TABLE_WAYS - 1;
    if (__sync_val_compare_and_swap(&b->ptr[way], ptr, 0) == ptr)
        freed.increment(0);
    return 0;
}

RAW_TRACEPOINT_PROBE(kmalloc) { return allocated(ctx->args[KMALLOC_ARG_PTR]); }
RAW_TRACEPOINT_PROBE(kfree) { return released(ctx->args[KFREE_ARG_PTR]); }
RAW_TRACEPOINT_PROBE(kmem_cache_alloc) { return allocated(ctx->args[CACHE_ALLOC_ARG_PTR]); }
RAW_TRACEPOINT_PROBE(kmem_cache_free) { return released(ctx->args[CACHE_FREE_ARG_PTR]); }
TRACEPOINT_PROBE(kmem, mm_page_alloc) { return allocated(args->pfn); }
TRACEPOINT_PROBE(kmem, mm_page_free) { return released(args->pfn); }
#if PAGE_FREE_BATCHED
TRACEPOINT_PROBE(kmem, mm_page_free_batched) { return released(args->pfn); }
#endif
#else /* !MATCH_FREES */

#if RAW_SLAB
RAW_TRACEPOINT_PROBE(kmalloc) { return handled(); }
RAW_TRACEPOINT_PROBE(kfree) { return handled(); }
RAW_TRACEPOINT_PROBE(kmem_cache_alloc) { return handled(); }
RAW_TRACEPOINT_PROBE(kmem_cache_free) { return handled(); }
#else
TRACEPOINT_PROBE(kmem, kmalloc) { return handled(); }
TRACEPOINT_PROBE(kmem, kfree) { return handled(); }
TRACEPOINT_PROBE(kmem, kmem_cache_alloc) { return handled(); }
TRACEPOINT_PROBE(kmem, kmem_cache_free) { return handled(); }
#endif
TRACEPOINT_PROBE(kmem, mm_page_alloc) { return handled(); }
TRACEPOINT_PROBE(kmem, mm_page_free) { return handled(); }
#if PAGE_FREE_BATCHED
TRACEPOINT_PROBE(kmem, mm_page_free_batched) { return handled(); }
#endif
#endif
