/* ---- memory_* probes derived from system calls (probes/derived.py) -------
 * D_<PROBE> is the probe's slot, or -1 when it is not traced; D_<PROBE>_SITE
 * the index of the site entry that names its arguments for user space.
 * HEAP_MAX is glibc's HEAP_MAX_SIZE; HEAP_SIZE_OFF and HEAP_MPROTECT_OFF are
 * the offsets of heap_info's size and mprotect_size.
 *
 * Hooks of the shared handlers: derived_fork (task_newtask, common.bpf.h),
 * derived_enter_mmap, derived_enter_munmap, derived_enter_brk and
 * derived_exit_brk (vm.bpf.c); empty without DERIVED_SYSCALLS. */
#if DERIVED_SYSCALLS
/* The break each process last had, as its brk calls returned it, and the
 * break each thread's brk call in flight asked for. */
BPF_HASH(brk_last, u32, u64, 16384);
BPF_HASH(brk_asked, u32, u64, 16384);
/* The threads whose last heap-sized reservation (alloc_new_heap's mmap:
 * PROT_NONE, MAP_NORESERVE, HEAP_MAX or twice that) awaits its first
 * mprotect. A thread's stack is opened by a read-write mprotect too, from
 * its guard page's end, which can fall on a HEAP_MAX boundary; its mapping
 * is not reserved so. */
BPF_TABLE("lru_hash", u32, u8, heap_reserved, 16384);

#define MTRACE_PROT_WRITE 0x2   /* include/uapi/asm-generic/mman-common.h */
#define MTRACE_MADV_DONTNEED 4
#define MTRACE_MAP_NORESERVE 0x4000 /* include/uapi/asm-generic/mman.h */

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
        u32 tid = (u32)bpf_get_current_pid_tgid();
        if (heap_reserved.lookup(&tid)) {
            heap_reserved.delete(&tid);
            derived_event(args, D_HEAP_NEW, D_HEAP_NEW_SITE, start, args->len);
        }
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

static __always_inline void derived_enter_mmap(u64 len, u64 prot, u64 flags)
{
    if (D_HEAP_NEW < 0 || prot || !(flags & MTRACE_MAP_NORESERVE) ||
        (len != HEAP_MAX && len != 2 * (u64)HEAP_MAX) || !derived_traced())
        return;
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u8 reserved = 1;
    heap_reserved.update(&tid, &reserved);
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

/* A forked child has its parent's break, and its libc knows it: it will not
 * ask the kernel again before growing. */
static __always_inline void derived_fork(u32 parent, u32 child)
{
    u64 *brk = brk_last.lookup(&parent);
    if (brk) {
        u64 inherited = *brk;
        brk_last.update(&child, &inherited);
    }
}
#else
static __always_inline void derived_fork(u32 parent, u32 child)
{
}

static __always_inline void derived_enter_mmap(u64 len, u64 prot, u64 flags)
{
}

static __always_inline void derived_enter_munmap(void *args, u64 heap, u64 len)
{
}

static __always_inline void derived_enter_brk(u64 asked)
{
}

static __always_inline void derived_exit_brk(void *args, u64 now)
{
}
#endif /* DERIVED_SYSCALLS */
