/* ---- lock waits, in time ---------------------------------------------------
 * An entry and a return probe on the libc's lock-wait slow path
 * (__lll_lock_wait_private: every libc-internal lock a thread could not
 * take at once, the arenas' mutexes among them). The entry keeps the futex,
 * the time and (LOCK_STACKS) the waiting thread's stack per thread in
 * lock_pending; the return adds the wait to the (process, futex) row of
 * lock_times (count, total, maximum and a log2 histogram of nanoseconds)
 * and to its stack's row of lock_stack_times. User space tells the arenas'
 * futexes from the other libc locks (tracer/loop/lock_waits.py).
 *
 * Each handler reads the clock as late (entry) or as early (return) as it
 * can, so that what is measured is the wait, not the probes. A wait that
 * never returns (its thread exited or exec'd in it) leaves no entry:
 * sched_process_exit takes it out and counts it.
 *
 * The waits' share of the time: each traced thread's start is kept in
 * thread_starts (from task_newtask; user space adds the threads there at
 * attach), and its exit adds its time to its process's row of thread_times
 * (records.h). */
/* This part's settings (ProgramConfig, probes/program.py), and their defaults. */
#ifndef WITH_LOCK_TIMES
#define WITH_LOCK_TIMES 0 /* time the waits in the libc's lock-wait slow path */
#endif
#ifndef LOCK_STACKS
#define LOCK_STACKS 0 /* each wait's stack (the frame store, frames.bpf.c) */
#endif
/* Map sizes as bcc declares them: the run makes each map at its own size
 * (RUNTIME_SIZES, probes/program.py). */
#ifndef LOCK_ROWS
#define LOCK_ROWS 4096 /* (process, futex) rows of lock_times */
#endif
#ifndef LOCK_STACK_ROWS
#define LOCK_STACK_ROWS 8192 /* (process, futex, stack) rows of lock_stack_times */
#endif
#define LOCK_PENDING 16384 /* threads waiting at once */

#if WITH_LOCK_TIMES
#if LOCK_STACKS && !WITH_FRAMES
#error "LOCK_STACKS needs the frame store (WITH_FRAMES, frames.bpf.c)"
#endif

struct lock_pending {
    u64 start;
    u64 futex;
    u64 caller; /* the return address into the code that waits */
    s32 stack;
    u32 uprobe_gen; /* the generation of the entry probe that saw the wait (common.bpf.h) */
};

BPF_HASH(lock_pending, u32, struct lock_pending, LOCK_PENDING);
BPF_HASH(lock_times, struct lock_key, struct lock_time, LOCK_ROWS);
BPF_HASH(lock_stack_times, struct lock_key, struct lock_stack_time, LOCK_STACK_ROWS);
BPF_PERCPU_ARRAY(lock_misc, u64, LX_COUNT);
BPF_ARRAY(lock_zero, struct lock_time, 1); /* a fresh row of lock_times */
PROC_TABLE(thread_starts, u32, struct thread_start, MAX_FOLLOWED);
PROC_TABLE(thread_times, u32, struct thread_time, MAX_FOLLOWED);

/* lock_times' bucket of a wait of `ns` (records.h). */
static __always_inline u32 lock_bucket(u64 ns)
{
    if (ns <= 1)
        return 0;
    u64 v = ns - 1;
    u32 b = 1;
    if (v >> 32) { v >>= 32; b += 32; }
    if (v >> 16) { v >>= 16; b += 16; }
    if (v >> 8) { v >>= 8; b += 8; }
    if (v >> 4) { v >>= 4; b += 4; }
    if (v >> 2) { v >>= 2; b += 2; }
    if (v >> 1) { b += 1; }
    return b < LOCK_BUCKETS ? b : LOCK_BUCKETS - 1;
}

static __always_inline void raise_max(u64 *max, u64 ns)
{
    for (int i = 0; i < 4; i++) { /* a few tries against the other CPUs' */
        u64 seen = *max;
        if (ns <= seen || __sync_val_compare_and_swap(max, seen, ns) == seen)
            return;
    }
}

/* A wait begins: timed from now (after its stack's walk). */
static __always_inline void lock_wait_begins(struct lock_pending *p, u32 tid)
{
    if (p->stack == FRAMES_NO_ROOM) {
        lock_misc.increment(LX_FRAMES_FULL);
        p->stack = -1;
    }
    p->start = bpf_ktime_get_ns();
    if (lock_pending.update(&tid, p))
        lock_misc.increment(LX_PENDING_FULL);
}

#if LOCK_STACKS && WITH_UNWIND
/* UNWIND_RESUME_LOCK: the wait whose stack was just walked. */
int lock_resume(struct pt_regs *ctx)
{
    struct unwind_state *st = unwind_state();
    if (!st)
        return 0;
    struct lock_pending *p = (struct lock_pending *)st->payload;
    p->stack = st->stack;
    lock_wait_begins(p, (u32)bpf_get_current_pid_tgid());
    return 0;
}
#endif

/* The entry of the slow path: the futex is its first argument. */
int lock_wait_enter(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    if (gate_closed() || !uprobe_followed(ctx, LOCK_ONE_PROCESS, id >> 32))
        return 0;
    struct lock_pending p = {.futex = PT_REGS_PARM1(ctx), .stack = -1,
                             .uprobe_gen = uprobe_generation_of(ctx, LOCK_ONE_PROCESS)};
    u64 sp = PT_REGS_SP(ctx);
    bpf_probe_read_user(&p.caller, sizeof(p.caller), (void *)sp);
#if LOCK_STACKS
    /* At the entry nothing is pushed yet: the caller's frame is as after a
     * return to it, with the stack pointer above the return address. */
#if WITH_UNWIND
    unwind_wanted(id >> 32);
    struct unwind_state *st = unwind_begin(id >> 32, p.caller, sp + 8, ctx->bp, UNWIND_RESUME_LOCK);
    if (st) {
        /* A wait inside an allocation function: its return address is the
         * kernel's trampoline by now, the one it replaced is in its slot. */
        struct pending_call *call = WITH_ALLOCS ? pending_of(slot_of(tid), tid) : NULL;
        if (call) {
            st->hijack_at[0] = call->sp;
            st->hijack_ra[0] = call->ret;
        }
        __builtin_memcpy(st->payload, &p, sizeof(p));
        unwind_progs.call(ctx, UNWIND_STEP);
    }
#endif
    p.stack = walk_frames(p.caller, ctx->bp, sp + 8);
#endif
    lock_wait_begins(&p, tid);
    return 0;
}

static __always_inline void lock_add_stack(struct lock_key *key, u64 ns)
{
    struct lock_stack_time fresh = {};
    struct lock_stack_time *row = lock_stack_times.lookup_or_try_init(key, &fresh);
    if (!row) {
        lock_misc.increment(LX_NO_STACK_ROW);
        return;
    }
    __sync_fetch_and_add(&row->count, 1);
    __sync_fetch_and_add(&row->total_ns, ns);
    raise_max(&row->max_ns, ns);
}

static __always_inline void lock_event(const struct lock_pending *p, u64 id, u64 now, u64 ns)
{
#if WITH_EVENTS
    if (!LOCK_EVENTS)
        return;
    struct event *e = events.ringbuf_reserve(sizeof(struct event));
    if (!e) {
        lock_misc.increment(LX_LOST_EVENTS);
        return;
    }
    __builtin_memset(e, 0, sizeof(*e));
    e->ts = now;
    e->ip = p->caller;
    e->tgid = id >> 32;
    e->tid = (u32)id;
    e->cpu = bpf_get_smp_processor_id();
    e->kind = EV_LOCK_WAIT;
    e->nargs = 2;
    e->args[0] = p->futex;
    e->args[1] = ns;
    e->ustack = p->stack;
    e->kstack = -1;
    events.ringbuf_submit(e, 0);
#endif
}

/* The slow path's return: the lock is taken. */
int lock_wait_return(struct pt_regs *ctx)
{
    u64 now = bpf_ktime_get_ns();
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct lock_pending *pending = lock_pending.lookup(&tid);
    if (!pending)
        return 0;
    struct lock_pending p = *pending;
    lock_pending.delete(&tid);
    u64 ns = now > p.start ? now - p.start : 0;
    struct lock_key key = {.futex = p.futex, .tgid = id >> 32, .stack = -1};
    u32 zero = 0;
    struct lock_time *fresh = lock_zero.lookup(&zero);
    struct lock_time *row = fresh ? lock_times.lookup_or_try_init(&key, fresh) : NULL;
    if (!row) {
        lock_misc.increment(LX_NO_ROW);
    } else {
        __sync_fetch_and_add(&row->count, 1);
        __sync_fetch_and_add(&row->total_ns, ns);
        raise_max(&row->max_ns, ns);
        u32 bucket = lock_bucket(ns);
        if (bucket < LOCK_BUCKETS)
            __sync_fetch_and_add(&row->hist[bucket], 1);
    }
#if LOCK_STACKS
    key.stack = p.stack;
    lock_add_stack(&key, ns);
#endif
    lock_event(&p, id, now, ns);
    return 0;
}

/* task_newtask's hook (common.bpf.h): thread `tid` of followed process
 * `tgid` is made (its first thread, when `tid` is `tgid`). */
static __always_inline void locks_new_thread(u32 tgid, u32 tid)
{
    struct thread_start s = {.start = bpf_ktime_get_ns(), .tgid = tgid};
    if (thread_starts.update(&tid, &s)) {
        lock_misc.increment(LX_NO_THREAD_ROW);
        return;
    }
    if (tid == tgid) {
        struct thread_time fresh = {.first_ns = s.start};
        thread_times.update(&tgid, &fresh);
    }
}

/* sched_process_exit's hook (common.bpf.h): a thread ends; a wait it was in
 * is gone. */
static __always_inline void locks_thread_exit(u32 tid)
{
    if (lock_pending.lookup(&tid)) {
        lock_pending.delete(&tid);
        lock_misc.increment(LX_ABANDONED);
    }
    struct thread_start *s = thread_starts.lookup(&tid);
    if (!s)
        return;
    u64 now = bpf_ktime_get_ns();
    u32 tgid = s->tgid;
    u64 lived = now > s->start ? now - s->start : 0;
    thread_starts.delete(&tid);
    struct thread_time fresh = {};
    struct thread_time *row = thread_times.lookup_or_try_init(&tgid, &fresh);
    if (!row) {
        lock_misc.increment(LX_NO_THREAD_ROW);
        return;
    }
    __sync_fetch_and_add(&row->done_ns, lived);
    __sync_fetch_and_add(&row->exited, 1);
    row->last_exit_ns = now;
}
#else
static __always_inline void locks_new_thread(u32 tgid, u32 tid) {}
static __always_inline void locks_thread_exit(u32 tid) {}
#endif
