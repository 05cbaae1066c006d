/* ---- memory that bypasses malloc: mmap, munmap, mremap, brk --------------
 * Counted per process when the call returns (its arguments kept per thread
 * at entry), with the allocation functions (WITH_ALLOCS: a run without them
 * leaves this part's own handlers out, and the shared ones call no hook of it). Only the traced
 * processes; munmap counts what it was asked to unmap, whoever mapped it.
 *
 * mmap's and munmap's entries and brk's entry and exit are shared with the
 * derived probes (derived.bpf.c): their handlers, at the end, call one hook
 * of each part, and a part switched off has empty hooks. */
#define MAP_ANONYMOUS_ 0x20
struct vm_call {
    u64 len;
    u64 other; /* mmap: flags; mremap: the new length; brk: the break asked for */
};
#ifndef VM_PENDING
#define VM_PENDING 16384 /* calls in flight (a map size bcc declares: RUNTIME_SIZES) */
#endif
BPF_TABLE("lru_hash", u32, struct vm_call, vm_pending, VM_PENDING);
PROC_TABLE(vm_procs, u32, struct vm_proc, ALLOC_PROCS);
PROC_TABLE(vm_brk, u32, u64, ALLOC_PROCS); /* each process's break as last seen */

static __always_inline struct vm_proc *vm_proc_of(u32 tgid)
{
    struct vm_proc zero = {};
    return vm_procs.lookup_or_try_init(&tgid, &zero);
}

static __always_inline int vm_enter(u64 len, u64 other)
{
    if (!WITH_ALLOCS || gate_closed())
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

/* sys_enter_mmap, sys_enter_munmap and the brk tracepoints are shared with
 * the derived probes: see the dispatch at the end. */

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
    if (!WITH_ALLOCS)
        return 0;
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

/* ---- system calls both the allocation tables and the derived probes use --*/
TRACEPOINT_PROBE(syscalls, sys_enter_mmap)
{
    vm_enter(args->len, args->flags);
    derived_enter_mmap(args->len, args->prot, args->flags);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_munmap)
{
    vm_enter(args->len, 0);
    derived_enter_munmap(args, args->addr, args->len);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_brk)
{
    vm_enter(0, args->brk);
    derived_enter_brk(args->brk);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_brk)
{
    vm_exit_brk((u64)args->ret);
    derived_exit_brk(args, (u64)args->ret);
    return 0;
}
