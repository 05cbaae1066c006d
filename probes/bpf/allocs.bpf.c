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
/* This part's settings (ProgramConfig, probes/program.py), and their defaults. */
/* Map sizes as bcc declares them: the run makes each map at its own size
 * (RUNTIME_SIZES, probes/program.py). */
#ifndef ALLOC_OUT_ROWS
#define ALLOC_OUT_ROWS 524288 /* rows of `outstanding` (a power of two): twice --max-outstanding */
#endif
#ifndef ALLOC_STACK_ROWS
#define ALLOC_STACK_ROWS 32768 /* rows of alloc_stacks (a power of two): twice --alloc-stacks */
#endif
#ifndef ALLOC_WALK
#define ALLOC_WALK 0 /* walk the user stack of kept allocations (else: call site only) */
#endif
#if ALLOC_WALK && !WITH_FRAMES
#error "ALLOC_WALK needs the frame store (WITH_FRAMES, frames.bpf.c)"
#endif

/* The part is in every program; a run without the allocation functions
 * (WITH_ALLOCS 0, runtime.h) leaves its handlers out of the load and makes
 * its tables with one entry (probes/program.py ALLOC_HANDLERS, RUNTIME_SIZES). */

/* Without sampling every allocation has its alloc_stacks row, so a
 * process's allocations, bytes and frees of known pointers are the sums of
 * its rows, and alloc_procs counts only what no row has: frees of unknown
 * pointers, failed calls, allocations alloc_stacks had no room for. With
 * sampling alloc_procs counts every call. (tracer/loop/alloc_probes.py adds them up.) */
#define EXACT_STACKS (SAMPLE_BYTES == 0)
#define SAMPLE_QUANTILES 1024 /* a power of two */
#define MAX_CROSSINGS 32

/* In a pending call's fn: jemalloc's xallocx, a realloc in place (alloc_return). */
#define AF_IN_PLACE 0x8000
/* Map sizes as bcc declares them: the run makes each map at its own size
 * (RUNTIME_SIZES, probes/program.py). */
#ifndef PENDING_SLOTS
#define PENDING_SLOTS 65536 /* a power of two: threads whose ids differ by a multiple share one */
#endif
#ifndef ALLOC_PROCS
#define ALLOC_PROCS MAX_FOLLOWED /* rows of alloc_procs, vm_procs and vm_brk */
#endif

struct pending_call {
    u64 sp;    /* the stack pointer at the site: deeper calls are nested */
    u64 size;
    u64 aux;   /* realloc's old pointer, posix_memalign's pointer's address, the alignment */
    u16 fn;
    u16 provider; /* the site's (its cookie from bit SITE_PROVIDER_SHIFT) */
    u32 depth; /* 1: a call in flight; 0: the slot is free (nested ones are not kept) */
    u32 tid;   /* whose call it is */
    u32 proc_tgid; /* the process whose alloc_procs row this slot's thread has made */
    u32 proc_gen;  /* ... while alloc_procs_gen was this (user space takes rows out) */
    u32 proc_incarnation; /* ... and that row's incarnation */
#if WITH_UNWIND && LOCK_STACKS
    u64 ret; /* the return address, before the kernel replaced it (a lock wait's walk reads it) */
#endif
#if WITH_UNWIND
    u64 tables_gen;  /* unwind_gen() when this slot's thread last found its process's tables */
    u32 tables_tgid; /* ... that process */
#endif
    u32 uprobe_gen; /* the generation of the entry probe that saw the call (common.bpf.h) */
};

BPF_ARRAY(pending, struct pending_call, PENDING_SLOTS);
/* The outstanding allocations: an open-addressed table in an array, so that
 * an allocation and its free cost an array access and a compare-and-swap
 * each, not a hash map's insert and delete with their bucket locks (about
 * 0.1 us a call here, docs/allocations.md). A row is claimed by swapping its
 * tag from free (0) or deleted (1) to the allocation's own; a free marks
 * it deleted. Up to OUT_PROBES rows from the one the tag hashes to. */
#define OUT_PROBES 16
#define OUT_DELETED 1
/* Mapped into the tracer's memory (BPF_F_MMAPABLE): read with a copy of
 * memory, not one lookup a row (0.22 s for 524,288 rows). Linux 5.5. */
BPF_F_TABLE("array", int, struct outstanding_row, outstanding, ALLOC_OUT_ROWS, BPF_F_MMAPABLE);
/* Per (process, function, stack): an open-addressed table in an array, so
 * that the free of a block finds its stack's row by the index its
 * outstanding row keeps, not by hashing the key again. A row is claimed by
 * swapping its tag from 0 to the key's 64-bit hash; the tag alone then
 * names the key (two keys of one hash among some thousands: about one
 * chance in 2^40). Up to STACK_PROBES rows from the one the hash picks. */
#define STACK_PROBES 8
/* Mapped too: a snapshot copies its memory (10 ms a read through the kernel). */
BPF_F_TABLE("array", int, struct alloc_stack_row, alloc_stacks, ALLOC_STACK_ROWS, BPF_F_MMAPABLE);
PROC_TABLE(alloc_procs, u32, struct alloc_proc, ALLOC_PROCS);
/* Bumped by user space each time it takes the rows of processes gone out of
 * alloc_procs: a thread then looks its process's row up again (its pid may
 * be a new process's). */
BPF_ARRAY(alloc_procs_gen, u64, 1);
BPF_ARRAY(alloc_incarnations, u64, 1); /* alloc_procs rows made so far */
BPF_PERCPU_ARRAY(alloc_calls, u64, AF_COUNT); /* every hit, nested ones included */
BPF_PERCPU_ARRAY(alloc_misc, u64, AX_COUNT);
BPF_ARRAY(sample_quantiles, u64, SAMPLE_QUANTILES); /* SAMPLE_BYTES * -ln(1 - (i + 0.5) / N) */
BPF_PERCPU_ARRAY(sample_left, s64, 1);


static __always_inline u64 alloc_now(void)
{
    if (ALLOC_EVENTS)
        return bpf_ktime_get_ns(); /* events show it, and order by it */
    /* the ages of live blocks and the stacks' last allocations are read
     * in seconds (docs/allocations.md) */
    return tick_now();
}

/* The process's row, made with its name at its first call. */
static __always_inline struct alloc_proc *alloc_proc_of(u32 tgid)
{
    struct alloc_proc *proc = alloc_procs.lookup(&tgid);
    if (proc)
        return proc;
    struct alloc_proc fresh = {};
    u32 zero = 0;
    u64 *made = alloc_incarnations.lookup(&zero);
    fresh.incarnation = made ? (u32)__sync_fetch_and_add(made, 1) + 1 : 1;
    bpf_get_current_comm(fresh.comm, sizeof(fresh.comm));
    alloc_procs.insert(&tgid, &fresh); /* another thread may have made it meanwhile */
    return alloc_procs.lookup(&tgid);
}

static __always_inline struct pending_call *slot_of(u32 tid)
{
    u32 slot = tid & PENDING_MASK;
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

static __always_inline int on_alloc_entry(struct pt_regs *ctx, u32 fn, u64 size, u64 aux,
                                          u64 cookie)
{
    if (gate_closed())
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    if (!uprobe_followed(ctx, ALLOC_ONE_PROCESS, id >> 32))
        return 0;
    alloc_calls.increment(fn & ~AF_IN_PLACE);
    u32 tid = (u32)id;
    u64 sp = PT_REGS_SP(ctx);
    struct pending_call *slot = slot_of(tid);
    if (!slot)
        return 0;
#if WITH_UNWIND
    /* the process's tables, asked for once per thread and generation, not
     * looked up at every call (a hash lookup: most of the sampled cost) */
    u64 gen = unwind_gen();
    if ((slot->tables_tgid != (u32)(id >> 32) || slot->tables_gen != gen) &&
        unwind_wanted(id >> 32)) {
        slot->tables_tgid = id >> 32;
        slot->tables_gen = gen;
    }
#endif
    struct pending_call *outer = enclosing(slot, tid, sp);
    if (outer) {
        alloc_misc.increment(AX_NESTED);
        return 0;
    }
    if (slot->depth && slot->tid != tid) /* another thread's call, in flight: it loses it */
        alloc_misc.increment(AX_SLOT_TAKEN);
    slot->sp = sp;
    slot->size = size;
    slot->aux = aux;
    slot->fn = fn;
    slot->provider = cookie >> SITE_PROVIDER_SHIFT;
    slot->tid = tid;
    slot->depth = 1;
    slot->uprobe_gen = uprobe_generation_of(ctx, ALLOC_ONE_PROCESS);
#if WITH_UNWIND && LOCK_STACKS
    /* The return probe stands at the site: the kernel replaces the return
     * address after this handler. */
    if (bpf_probe_read_user(&slot->ret, sizeof(slot->ret), (void *)sp))
        slot->ret = 0;
#endif
    return 0;
}

static __always_inline void alloc_event(u8 kind, u32 fn, u32 tgid, u32 tid, u64 call_site, u64 ptr,
                                        u64 size, u64 aux, u64 weight, u64 born, u64 site, s32 stack)
{
#if WITH_EVENTS
    if (!ALLOC_EVENTS)
        return;
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
    return (u32)((tag * 0x9e3779b97f4a7c15ull) >> 32) & ALLOC_OUT_MASK;
}

static __always_inline struct outstanding_row *outstanding_find(u64 ptr, u32 tgid)
{
    u64 tag = outstanding_tag(ptr, tgid);
    u32 home = outstanding_home(tag);
    for (u32 i = 0; i < OUT_PROBES; i++) {
        u32 index = (home + i) & ALLOC_OUT_MASK;
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
        u32 index = (home + i) & ALLOC_OUT_MASK;
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
    h = (h ^ (h >> 29) ^ ((u64)key->incarnation << 32 | (u32)key->provider << 16 | key->fn)) *
        0x9e3779b97f4a7c15ull;
    return h | 1; /* never 0, which marks a free row; the tag names the whole key */
}

/* The row of `key`, claimed if it has none; NULL when none of its
 * STACK_PROBES rows is its or free. `*index` is the row's. */
static __always_inline struct alloc_stack_row *stack_row_of(const struct alloc_key *key, u32 *index)
{
    u64 tag = alloc_key_hash(key);
    for (u32 i = 0; i < STACK_PROBES; i++) {
        u32 at = (u32)(tag + i) & ALLOC_STACK_MASK;
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
        if (SAMPLE_BYTES == 0)
            alloc_event(EV_FREE, fn, tgid, tid, call_site, ptr, 0, 0, 0, 0, 0, -1);
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
    const u64 mean = SAMPLE_BYTES;
    if (mean == 0)
        return size;
    u32 zero = 0;
    s64 *left = sample_left.lookup(&zero);
    if (!left)
        return 0;
    s64 remaining = *left - (s64)size;
    u64 points = 0;
    /* A bounded loop, which the verifier walks (clang cannot unroll it:
     * asked to, it said so on every compile with sampling). */
    for (int i = 0; i < MAX_CROSSINGS; i++) {
        if (remaining > 0)
            break;
        u32 q = bpf_get_prandom_u32() & (SAMPLE_QUANTILES - 1);
        u64 *interval = sample_quantiles.lookup(&q);
        remaining += interval ? (s64)*interval : (s64)mean;
        points++;
    }
    if (remaining <= 0) { /* larger than MAX_CROSSINGS intervals: kept at its size */
        *left = mean;
        return size;
    }
    *left = remaining;
    return points * mean;
}


/* A kept allocation not tracked until freed, for want of room: its free
 * will be unknown. Counted in its process's row, so that the outputs tell
 * such frees from those of memory allocated before the trace; `booked`:
 * counted as freed in its stack's row (not a free of the process's). */
static __always_inline void count_untracked(u32 tgid, int booked)
{
    struct alloc_proc *proc = alloc_proc_of(tgid);
    if (!proc)
        return;
    __sync_fetch_and_add(&proc->untracked, 1);
    if (booked)
        __sync_fetch_and_add(&proc->booked_freed, 1);
}

/* An allocation the outstanding table had no room for: never to be
 * matched, so counted as freed at once (live bytes stay right). */
static __always_inline void untracked(struct alloc_stats *s, u32 tgid, u64 size, u64 weight)
{
    alloc_misc.increment(AX_OUTSTANDING_FULL);
    __sync_fetch_and_add(&s->frees, 1);
    __sync_fetch_and_add(&s->bytes_freed, weight);
    __sync_fetch_and_add(&s->sizes_freed, size);
    count_untracked(tgid, EXACT_STACKS);
}

/* This thread's returning call into *call: 1, or 0 (a nested return, another generation's, or gated). */
static __always_inline int returning_call(struct pt_regs *ctx, u32 tgid, u32 tid, struct pending_call *call)
{
    struct pending_call *p = pending_of(slot_of(tid), tid);
    if (!p)
        return 0;
    /* Taken by the call's entry generation alone (tracer/processes/retarget.py). Past the call's own return
     * the stack pointer is its entry's + 8; the first return there (a tail call's too) takes it. */
    if (uprobe_generation_of(ctx, ALLOC_ONE_PROCESS) != p->uprobe_gen)
        return 0;
    if (PT_REGS_SP(ctx) <= p->sp) /* a nested call's */
        return 0;
    u32 zero = 0;
    u64 *gen = alloc_procs_gen.lookup(&zero);
    u32 now_gen = gen ? (u32)*gen : 0;
    if (p->proc_tgid != tgid || p->proc_gen != now_gen) { /* the row, once per thread */
        struct alloc_proc *proc = alloc_proc_of(tgid);
        p->proc_tgid = tgid;
        p->proc_gen = now_gen;
        p->proc_incarnation = proc ? proc->incarnation : 0;
    }
    *call = *p;
    p->depth = 0;
    return !gate_closed();
}

/* The block the call returned: its return value, or for posix_memalign
 * the pointer it stored (0 when it failed). */
static __always_inline u64 returned_block(struct pt_regs *ctx, const struct pending_call *call)
{
    u64 ptr = PT_REGS_RC(ctx);
    if (call->fn == AF_POSIX_MEMALIGN) {
        u64 got = 0;
        if ((int)ptr != 0 || bpf_probe_read_user(&got, sizeof(got), (void *)call->aux))
            got = 0;
        ptr = got;
    }
    return ptr;
}

/* A call counted in its process's row (every call with sampling; without,
 * only one that no stack row has). */
static __always_inline void count_in_process(u32 tgid, u64 size)
{
    struct alloc_proc *proc = alloc_proc_of(tgid);
    if (proc) {
        __sync_fetch_and_add(&proc->calls, 1);
        __sync_fetch_and_add(&proc->bytes, size);
    }
}

/* A kept allocation: counted in its stack's row and tracked until freed.
 * `stack`: the id of its frames, or FRAMES_NO_ROOM, or -1. */
static __always_inline void keep_allocation(const struct pending_call *call, u32 tgid, u32 tid,
                                            u64 call_site, u64 ptr, u64 weight, s32 stack)
{
    struct alloc_key key = {.call_site = call_site, .tgid = tgid, .fn = call->fn,
                            .provider = call->provider, .stack = stack,
                            .incarnation = call->proc_incarnation};
    if (key.stack == FRAMES_NO_ROOM) {
        alloc_misc.increment(AX_FRAMES_FULL);
        key.stack = -1;
    }
    u32 stack_row = 0;
    struct alloc_stack_row *row = stack_row_of(&key, &stack_row);
    struct alloc_stats *s = row ? &row->stats : NULL;
    u64 now = alloc_now();
    if (!s) {
        alloc_misc.increment(AX_STACKS_FULL);
        if (EXACT_STACKS)
            count_in_process(tgid, call->size); /* counted here, as no row has it */
        count_untracked(tgid, 0);
    } else {
        __sync_fetch_and_add(&s->calls, 1);
        __sync_fetch_and_add(&s->bytes, weight);
        __sync_fetch_and_add(&s->sizes, call->size);
        s->last_ts = now;
        struct outstanding o = {.key = key, .size = call->size, .weight = weight, .ts = now,
                                .tid = tid, .stack_row = stack_row};
        if (outstanding_add(ptr, tgid, &o))
            untracked(s, tgid, call->size, weight);
    }
    alloc_event(EV_ALLOC, call->fn, tgid, tid, call_site, ptr, call->size, call->aux, weight, 0, 0,
                key.stack);
}

#if WITH_UNWIND
/* What a kept allocation's accounting needs after its stack's walk. */
struct alloc_resumption {
    struct pending_call call;
    u64 call_site, ptr, weight;
    u32 tgid, tid;
};
_Static_assert(sizeof(struct alloc_resumption) <= sizeof(((struct unwind_state *)0)->payload),
               "the walk's payload holds an allocation's");

/* UNWIND_RESUME_ALLOC: the kept allocation whose stack was just walked. */
int alloc_resume(struct pt_regs *ctx)
{
    struct unwind_state *st = unwind_state();
    if (!st)
        return 0;
    struct alloc_resumption *a = (struct alloc_resumption *)st->payload;
    keep_allocation(&a->call, a->tgid, a->tid, a->call_site, a->ptr, a->weight, st->stack);
    return 0;
}
#endif

/* The kept allocation's stack walked by CFI (the walk resumes at
 * alloc_resume, and this returns only where it could not start), else by
 * frame pointers, then the allocation kept. */
static __always_inline void walk_and_keep(struct pt_regs *ctx, const struct pending_call *call,
                                          u32 tgid, u32 tid, u64 call_site, u64 ptr, u64 weight)
{
#if WITH_UNWIND
    struct unwind_state *st = unwind_begin(tgid, PT_REGS_IP(ctx), PT_REGS_SP(ctx), ctx->bp,
                                           UNWIND_RESUME_ALLOC);
    if (st) {
        struct alloc_resumption *a = (struct alloc_resumption *)st->payload;
        a->call = *call;
        a->call_site = call_site;
        a->ptr = ptr;
        a->weight = weight;
        a->tgid = tgid;
        a->tid = tid;
        unwind_progs.call(ctx, UNWIND_STEP);
    }
#endif
#if ALLOC_WALK
    s32 stack = walk_frames(PT_REGS_IP(ctx), ctx->bp, PT_REGS_SP(ctx));
#else
    s32 stack = -1;
#endif
    keep_allocation(call, tgid, tid, call_site, ptr, weight, stack);
}

/* Every allocating function's return probe. */
int alloc_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    u32 tgid = id >> 32;
    struct pending_call call;
    if (!returning_call(ctx, tgid, tid, &call))
        return 0;
    u64 ptr = returned_block(ctx, &call);
    u64 call_site = PT_REGS_IP(ctx); /* the return address, restored by the kernel */
    if (call.fn & AF_IN_PLACE) { /* xallocx returns the block's size: at least the size */
        if (ptr < call.size)     /* asked, it was resized where it is; else left alone */
            return 0;
        ptr = call.aux;
        call.fn &= ~AF_IN_PLACE;
    }
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
    if (!EXACT_STACKS)
        count_in_process(tgid, call.size);
    u64 weight = sample_weight(call.size);
    if (SAMPLE_BYTES > 0 && !weight)
        return 0;
    walk_and_keep(ctx, &call, tgid, tid, call_site, ptr, weight);
    return 0;
}

/* Entry handlers: the sites' registers, as alloc_sites.py checked (or where
 * their cookie says). */
int alloc_malloc(struct pt_regs *ctx)
{
    u64 cookie = site_cookie(ctx);
    return on_alloc_entry(ctx, AF_MALLOC, ARG1(ctx, cookie), 0, cookie);
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
    u64 cookie = site_cookie(ctx);
    u64 n = ARG1(ctx, cookie), size = ARG2(ctx, cookie);
    return on_alloc_entry(ctx, AF_CALLOC, product(n, size), 0, cookie);
}

int alloc_realloc(struct pt_regs *ctx)
{
    u64 cookie = site_cookie(ctx);
    return on_alloc_entry(ctx, AF_REALLOC, ARG2(ctx, cookie), ARG1(ctx, cookie), cookie);
}

int alloc_reallocarray(struct pt_regs *ctx)
{
    u64 cookie = site_cookie(ctx);
    u64 n = ARG2(ctx, cookie), size = ARG3(ctx, cookie);
    return on_alloc_entry(ctx, AF_REALLOCARRAY, product(n, size), ARG1(ctx, cookie), cookie);
}

/* jemalloc's xallocx(ptr, size, extra, flags): a realloc that never moves the block. */
int alloc_xallocx(struct pt_regs *ctx)
{
    u64 cookie = site_cookie(ctx);
    return on_alloc_entry(ctx, AF_REALLOC | AF_IN_PLACE, ARG2(ctx, cookie), ARG1(ctx, cookie), cookie);
}

int alloc_memalign(struct pt_regs *ctx)
{
    u64 cookie = site_cookie(ctx);
    return on_alloc_entry(ctx, AF_MEMALIGN, ARG2(ctx, cookie), ARG1(ctx, cookie), cookie);
}

int alloc_aligned_alloc(struct pt_regs *ctx)
{
    u64 cookie = site_cookie(ctx);
    return on_alloc_entry(ctx, AF_ALIGNED_ALLOC, ARG2(ctx, cookie), ARG1(ctx, cookie), cookie);
}

int alloc_posix_memalign(struct pt_regs *ctx)
{
    u64 cookie = site_cookie(ctx);
    return on_alloc_entry(ctx, AF_POSIX_MEMALIGN, ARG3(ctx, cookie), ARG1(ctx, cookie), cookie);
}

int alloc_valloc(struct pt_regs *ctx)
{
    u64 cookie = site_cookie(ctx);
    return on_alloc_entry(ctx, AF_VALLOC, ARG1(ctx, cookie), 0, cookie);
}

int alloc_pvalloc(struct pt_regs *ctx)
{
    u64 cookie = site_cookie(ctx);
    return on_alloc_entry(ctx, AF_PVALLOC, ARG1(ctx, cookie), 0, cookie);
}

int alloc_free(struct pt_regs *ctx)
{
    if (gate_closed())
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!uprobe_followed(ctx, ALLOC_ONE_PROCESS, tgid))
        return 0;
    alloc_calls.increment(AF_FREE);
    u64 ptr = ARG1(ctx, site_cookie(ctx));
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
    if (ALLOC_EVENTS)
        bpf_probe_read_user(&call_site, sizeof(call_site), (void *)sp); /* only events show it */
    release(AF_FREE, tgid, (u32)id, call_site, ptr);
    return 0;
}


