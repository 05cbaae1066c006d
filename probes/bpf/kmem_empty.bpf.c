/* Handlers that do nothing, on the kmem tracepoints mtrace-live attaches:
 * the floor of the kmem benchmark (bench/kmem_bench.py), what the kernel
 * alone costs to run a BPF program at each event.
 *
 * RAW_SLAB 1: the four slab events as raw tracepoints, as
 * tracer/kmem_attach.py attaches them where the kernel's BTF allows; 0: all
 * classic. PAGE_FREE_BATCHED 1: this kernel has mm_page_free_batched. */
#ifndef RAW_SLAB
#define RAW_SLAB 1
#endif
#ifndef PAGE_FREE_BATCHED
#define PAGE_FREE_BATCHED 0
#endif

#if RAW_SLAB
RAW_TRACEPOINT_PROBE(kmalloc) { return 0; }
RAW_TRACEPOINT_PROBE(kfree) { return 0; }
RAW_TRACEPOINT_PROBE(kmem_cache_alloc) { return 0; }
RAW_TRACEPOINT_PROBE(kmem_cache_free) { return 0; }
#else
TRACEPOINT_PROBE(kmem, kmalloc) { return 0; }
TRACEPOINT_PROBE(kmem, kfree) { return 0; }
TRACEPOINT_PROBE(kmem, kmem_cache_alloc) { return 0; }
TRACEPOINT_PROBE(kmem, kmem_cache_free) { return 0; }
#endif
TRACEPOINT_PROBE(kmem, mm_page_alloc) { return 0; }
TRACEPOINT_PROBE(kmem, mm_page_free) { return 0; }
#if PAGE_FREE_BATCHED
TRACEPOINT_PROBE(kmem, mm_page_free_batched) { return 0; }
#endif
