/* Handlers that do nothing, on the kmem tracepoints mtrace-live attaches:
 * the floor of the kmem benchmark (bench/kmem_bench.py), what the kernel
 * alone costs to run a BPF program at each event.
 *
 * RAW_SLAB 1: the four slab events as raw tracepoints, as
 * tracer/kmem_attach.py attaches them where the kernel's BTF allows; 0: all
 * classic. PAGE_FREE_BATCHED 1: this kernel has mm_page_free_batched.
 * PID_FILTER 1: each handler does the least a pid-filtered aggregation does
 * (bench/kmem_floor.py): it compares the event's process with the one in
 * `target` and counts the events that match. */
#ifndef RAW_SLAB
#define RAW_SLAB 1
#endif
#ifndef PAGE_FREE_BATCHED
#define PAGE_FREE_BATCHED 0
#endif
#ifndef PID_FILTER
#define PID_FILTER 0
#endif

#if PID_FILTER
BPF_ARRAY(target, u32, 1);
BPF_PERCPU_ARRAY(matched, u64, 1);

static __always_inline int handled(void)
{
    u32 zero = 0;
    u32 *tgid = target.lookup(&zero);
    if (tgid && *tgid == bpf_get_current_pid_tgid() >> 32)
        matched.increment(0);
    return 0;
}
#else
static __always_inline int handled(void)
{
    return 0;
}
#endif

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
