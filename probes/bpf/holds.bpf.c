/* ---- processes stopped until user space has done its part ---------------
 * A handler stops its process, if mtrace-live started it (hold_process,
 * common.bpf.h: SIGSTOP, delivered as the handler returns to user space, so
 * every thread stops before it runs on), and says why in the ring; user
 * space does what it must while the process cannot change, then continues
 * it (SIGCONT; the guardian does if the tracer cannot):
 *   - at _exit (HOLD_AT_EXIT), user space reads the process's maps, to name
 *     the frames of its stacks after it is gone (tracer/loop/live.py);
 *   - at pthread_exit of the thread one process's uprobes are attached for
 *     (ALLOC_ONE_PROCESS), user space attaches them for a thread that stays
 *     (tracer/processes/retarget.py). */
#if WITH_EVENTS

/* Say `kind` in the musts ring, stopping the calling process first if
 * mtrace-live started it. Nothing is stopped without room to say so. */
static __always_inline void stop_and_say(u32 kind)
{
    struct event *e = musts.ringbuf_reserve(sizeof(struct event));
    if (!e) {
        lost_musts.increment(0);
        return;
    }
    u64 id = bpf_get_current_pid_tgid();
    __builtin_memset(e, 0, sizeof(*e));
    e->ts = bpf_ktime_get_ns();
    e->tgid = id >> 32;
    e->tid = (u32)id;
    e->kind = kind;
    e->ustack = e->kstack = -1;
    hold_process(id >> 32);
    musts.ringbuf_submit(e, 0);
}

/* (ALLOC_ONE_PROCESS) */
BPF_ARRAY(alloc_target, u32, 1); /* the thread the uprobes are attached for (user space sets it) */

/* pthread_exit. The uprobes of one process are attached for one of its
 * threads, and the kernel takes a call to be the process's while that
 * thread's memory is the caller's: once that thread has ended (main calling
 * pthread_exit, its other threads going on), no call of the process would
 * be seen. So that thread's pthread_exit says so, and user space attaches
 * the uprobes for a thread that stays. A process mtrace-live started is
 * stopped meanwhile; any other goes on, and what it calls after that
 * thread is gone and before the move is done is not seen. */
int alloc_thread_exit(struct pt_regs *ctx)
{
    if (!uprobe_followed(ctx, ALLOC_ONE_PROCESS, 0))
        return 0; /* an old generation's, while the uprobes move */
    u32 zero = 0;
    u32 *target = alloc_target.lookup(&zero);
    if (target && *target == (u32)bpf_get_current_pid_tgid())
        stop_and_say(EV_RETARGET); /* another thread's: the uprobes stay */
    return 0;
}

/* (HOLD_AT_EXIT, HOLDS) _exit: the process's mappings are still there. Only processes mtrace-live
 * started, with allocations seen, and only while the gate is open: a trace
 * that ends stops no one. Any other process is named from the maps read
 * while it ran (tracer/loop/live.py). */
int alloc_exit(struct pt_regs *ctx)
{
    if (!HOLD_AT_EXIT || !HOLDS || gate_closed())
        return 0;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!uprobe_followed(ctx, ALLOC_ONE_PROCESS, tgid))
        return 0;
    if (holdable.lookup(&tgid) && alloc_procs.lookup(&tgid))
        stop_and_say(EV_HELD);
    return 0;
}

#endif /* WITH_EVENTS */
