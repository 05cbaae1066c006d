/* mtrace-live's BPF program, first part: the settings, the maps every part
 * uses, the process filter and the process lifecycle. The loader
 * (probes/program.py) joins this header and the parts after it into one
 * text, in the order of program.PARTS: sdt.bpf.c (the libc's SDT sites),
 * derived.bpf.c (memory_* probes derived from system calls), kmem.bpf.c (the
 * kmem tracepoints), frames.bpf.c (the stacks the handlers walk),
 * allocs.bpf.c (the allocation functions), locks.bpf.c (lock waits, timed)
 * and vm.bpf.c (mmap, munmap, mremap, brk). bcc rewrites map calls only in the main
 * source file, so the parts are one text, not #includes; the layouts user
 * space reads are in records.h.
 *
 * Every probe hit is counted in the kernel and (WITH_EVENTS) streamed
 * through the `events` ring buffer.
 *
 * Process filter (FILTER_PIDS): `followed` holds the tgids to trace. With
 * FOLLOW_FORKS every process a followed one forks is added before it can run
 * an instruction (task_newtask fires in copy_process, ahead of
 * wake_up_new_task). Exec and exit of a followed process are sent as events.
 *
 * Two more filters, for `serve`: FILTER_COMM (with FILTER_PIDS) follows a
 * process from the exec that gives it the name COMM_LO/COMM_HI (the 16 bytes
 * of the kernel's comm, as two little-endian u64) and forgets it when it
 * exec's another program; FILTER_CGROUP keeps the tasks whose cgroup v2
 * ancestor at CGROUP_LEVEL has id CGROUP_ID (the cgroup and its children).
 *
 * A handler that two parts share (task_newtask here, munmap and brk in
 * vm.bpf.c) calls one hook per part; a part that is switched off defines
 * its hooks empty. */
#include <uapi/linux/ptrace.h>

#include "records.h"
#include "runtime.h"
#include "set_table.h"
#include "site_cookie.h"

#ifndef DERIVED_SYSCALLS
#define DERIVED_SYSCALLS 0 /* derive memory_sbrk_* and memory_heap_* from syscalls (probes/derived.py) */
#endif
#ifndef WITH_EVENTS
#define WITH_EVENTS 1
#endif
/* Map sizes as bcc declares them: the run makes each map at its own size
 * (RUNTIME_SIZES, probes/program.py). */
#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 2048 /* 8 MiB with 4 KiB pages; a power of two */
#endif
#ifndef WITH_STACKS
#define WITH_STACKS 0 /* a user (and, for kmem, kernel) stack id on each event */
#endif
#ifndef STACK_DEPTH
#define STACK_DEPTH 32 /* frames kept per stack */
#endif
#ifndef STACK_ENTRIES
#define STACK_ENTRIES 16384 /* distinct stacks the map holds */
#endif

#ifndef PAGE_SHIFT_
#define PAGE_SHIFT_ 12 /* the kernel's pages: 1 << PAGE_SHIFT_ bytes */
#endif
#ifndef EXIT_GROUP_DEAD
#define EXIT_GROUP_DEAD 0 /* sched_process_exit says when a process's last thread exits */
#endif


#ifndef PROC_TABLES_ON_DEMAND
#define PROC_TABLES_ON_DEMAND 0
#endif
/* A table keyed by process or thread (MAX_FOLLOWED or MAX_PROC_COUNTERS
 * entries). Preallocated, its creation zeroes and links every entry (1-3 ms
 * each, at every start, for tables that hold a few dozen keys); allocated as
 * its keys come, an insert may fail for want of memory before the table is
 * full, as a full table's does. Where tracing programs may use a hash map
 * allocated as its keys come (Linux 6.1: the BPF memory allocator), it is
 * made so (PROC_TABLES_ON_DEMAND, probes/program.py). */
#if PROC_TABLES_ON_DEMAND
#define PROC_TABLE(name, key, leaf, size) BPF_F_TABLE("hash", key, leaf, name, size, BPF_F_NO_PREALLOC)
#else
#define PROC_TABLE(name, key, leaf, size) BPF_HASH(name, key, leaf, size)
#endif

#define MAX_FOLLOWED 65536
#define MAX_PROC_COUNTERS 65536
#define MAX_SITES 128
#define MAX_PROBES MAX_SITES
#define MTRACE_CLONE_THREAD 0x00010000 /* include/uapi/linux/sched.h */

PROC_TABLE(followed, u32, u8, MAX_FOLLOWED);

/* mtrace-live's own processes (the tracer, its guardian, its metrics
 * endpoint), never traced, whatever the filter: written by user space
 * before anything attaches (tracer/bpf/trace_tables.py), 0 in unused slots.
 * One array lookup and SELF_SLOTS compares: --all pays no hash lookup. */
#define SELF_SLOTS 8
struct self_set {
    u32 tgid[SELF_SLOTS];
};
BPF_ARRAY(self_set, struct self_set, 1);

static __always_inline int is_self(u32 tgid)
{
    u32 zero = 0;
    struct self_set *set = self_set.lookup(&zero);
    if (!set || !tgid)
        return 0;
#pragma unroll
    for (int i = 0; i < SELF_SLOTS; i++) {
        if (set->tgid[i] == tgid)
            return 1;
    }
    return 0;
}
/* The process asked for, written by user space once the program is loaded
 * (a value, not a compile-time constant, so that the compiled program does
 * not depend on the pid and can be kept between runs: tracer/bpf/bpf_cache.py).
 * live is 0 until then and once it has exited: its pid may be reused. */
struct first_target {
    u32 tgid;
    u32 live;
};
BPF_ARRAY(first_target, struct first_target, 1);
#if WITH_STACKS
struct stack_frames {
    u64 ip[STACK_DEPTH];
};
BPF_TABLE("stacktrace", int, struct stack_frames, stacks, STACK_ENTRIES);
BPF_PERCPU_ARRAY(stack_errors, u64, 2);           /* [0] user, [1] kernel: stacks not stored */
#endif
BPF_PERCPU_ARRAY(hits, u64, MAX_PROBES);          /* every hit that passed the filter */
PROC_TABLE(proc_hits, struct proc_key, struct proc_hit, MAX_PROC_COUNTERS);
BPF_PERCPU_ARRAY(proc_hits_dropped, u64, 1);      /* hits proc_hits had no room for */
#if WITH_EVENTS
/* control[0] != 0 while tracing. Unregistering a uprobe takes the kernel
 * about 0.1 s per site, so at the end user space closes the gate, reads
 * everything, and only then detaches. */
BPF_ARRAY(control, u32, 1);
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
/* The records a trace cannot do without, in a ring of their own, which the
 * records that come by the thousand (allocations, probe hits, kmem events,
 * lock waits) cannot fill: a move of a process's uprobes (EV_RETARGET), a
 * hold (EV_HELD), an ask for unwind tables (EV_UNWIND). User space reads
 * it after the events ring and handles it first. In the events ring, a thread allocating without a pause left
 * no room for a move: it was lost, and with it every later call. */
#define MUSTS_PAGES 16
BPF_RINGBUF_OUTPUT(musts, MUSTS_PAGES);
BPF_PERCPU_ARRAY(lost_musts, u64, 1);             /* musts records without room (said at the end) */
BPF_PERCPU_ARRAY(lost, u64, MAX_PROBES);          /* hits the ring buffer had no room for */
BPF_PERCPU_ARRAY(lost_lifecycle, u64, 1);         /* exec/exit events without room */
#endif

/* ---- holds: processes stopped until user space has done its part ---------
 * Only a process mtrace-live started is ever stopped: `holdable` holds the
 * command user space launched (it adds it before the exec) and the
 * children the command forks. Every stop is in `holds` (how many, the last
 * one's time); user space writes in `hold_continued` how many of them it
 * has continued, so a process is held while its stops outnumber those.
 * The guardian (tracer/processes/holds.py), a process of its own, reads both: it
 * continues a process held longer than its bound, and every held one when
 * the tracer dies, however it dies. */
struct hold {
    u64 stops;
    u64 since; /* the last stop's time (bpf_ktime_get_ns) */
};
PROC_TABLE(holdable, u32, u8, MAX_FOLLOWED);
PROC_TABLE(holds, u32, struct hold, MAX_FOLLOWED);
PROC_TABLE(hold_continued, u32, u64, MAX_FOLLOWED);
BPF_ARRAY(hold_counts, u64, 4); /* written by the guardian: enum hold_count (records.h) */

/* Stop the calling process (SIGSTOP, delivered as the handler returns to
 * user space, so every thread stops before it runs on), if it may be: 1 if
 * it was. The stop is written down before the signal is sent. */
static __always_inline int hold_process(u32 tgid)
{
    if (!HOLDS || !holdable.lookup(&tgid))
        return 0;
    u64 now = bpf_ktime_get_ns();
    struct hold *h = holds.lookup(&tgid);
    if (h) {
        h->since = now;
        __sync_fetch_and_add(&h->stops, 1);
    } else {
        struct hold first = {1, now};
        if (holds.update(&tgid, &first))
            return 0; /* no room to write it down: not stopped */
    }
    bpf_send_signal(19); /* SIGSTOP */
    return 1;
}

static __always_inline void holds_fork(u32 parent, u32 child)
{
    if (HOLDS && holdable.lookup(&parent)) {
        u8 one = 1;
        holdable.update(&child, &one);
    }
}

static __always_inline void holds_end(u32 tgid)
{
    if (!HOLDS)
        return;
    holdable.delete(&tgid);
    holds.delete(&tgid);
    hold_continued.delete(&tgid);
}

static __always_inline int tgid_is_followed(u32 tgid)
{
    if (FILTER_CGROUP)
        return bpf_get_current_ancestor_cgroup_id(CGROUP_LEVEL) == CGROUP_ID && !is_self(tgid);
    if (!FILTER_PIDS)
        return !is_self(tgid);
    if (FIRST_TGID) {
        /* Most events of a traced process are its own: a compare instead of a
         * hash lookup (an array lookup is inlined by the verifier). */
        u32 first = 0;
        struct first_target *target = first_target.lookup(&first);
        if (target && tgid == target->tgid && target->live)
            return 1;
    }
    return followed.lookup(&tgid) != NULL;
}

/* UPROBE_MOVES: uprobes attached for one thread, which may move to another.
 * The generation of the uprobes attached for one thread. When that thread
 * ends first (main's pthread_exit), user space attaches them for another
 * with the next generation as their BPF cookie, then turns this to it, then
 * closes the old entry probes: while both fire, an entry handler whose
 * cookie is not the current generation returns at once, so each call
 * counts once. The old return probes stay until the calls they saw enter
 * have returned; a return is taken by its call's entry generation alone
 * (tracer/processes/retarget.py). */
BPF_ARRAY(uprobe_generation, u64, 1);
/* While both generations fire, the kernel runs a call's newer probe first
 * (the consumer attached last), and each handler reads the generation: had
 * it turned between the two reads, neither would count the call (a call
 * lost in 3 runs of 5 of test_changing_targets' ten moves). So the first
 * handler of a trap says what it read, and an older generation's handler at
 * the same thread, address and stack pointer (the same trap) takes that
 * instead of reading again. Per CPU: a trap's handlers run on one CPU, but
 * for a preemptible kernel's migration between them, after which the
 * second reads the generation itself, as before. */
struct turn_read {
    u64 id; /* bpf_get_current_pid_tgid, 0: taken */
    u64 ip;
    u64 sp;
    u32 cookie_gen; /* the generation of the probe that read */
    u32 read;
};
BPF_PERCPU_ARRAY(uprobe_turn_read, struct turn_read, 1);

/* The generation of the uprobe that fired: its cookie's low half where the
 * uprobes may move (0 where they do not; the high half may say where a
 * site's arguments are, allocs.bpf.c's site_arg). */
static __always_inline u32 uprobe_generation_of(void *ctx, const int alone)
{
    if (UPROBE_MOVES && alone)
        return (u32)bpf_get_attach_cookie(ctx);
    return 0;
}

/* A uprobe attached for one process alone (`alone`: a part's *_ONE_PROCESS)
 * fires in no other: the kernel filters, and the followed table need not be
 * asked; only its generation, while it moves to another thread. */
static __always_inline int uprobe_followed(void *ctx, const int alone, u32 tgid)
{
    if (UPROBE_MOVES && alone) {
        u32 zero = 0, mine = uprobe_generation_of(ctx, alone);
        u64 *generation = uprobe_generation.lookup(&zero);
        struct turn_read *last = uprobe_turn_read.lookup(&zero);
        if (!generation || !last)
            return 1;
        u64 id = bpf_get_current_pid_tgid();
        u64 ip = PT_REGS_IP((struct pt_regs *)ctx), sp = PT_REGS_SP((struct pt_regs *)ctx);
        if (last->id == id && last->ip == ip && last->sp == sp && last->cookie_gen > mine) {
            last->id = 0;
            return last->read == mine; /* the trap's newer probe read it */
        }
        u32 read = *generation;
        last->id = id;
        last->ip = ip;
        last->sp = sp;
        last->cookie_gen = mine;
        last->read = read;
        return mine == read;
    }
    return alone || tgid_is_followed(tgid);
}

/* A stack on each probe and kmem event (WITH_STACKS). */
static __always_inline s32 stack_id(void *ctx, u64 flags, u32 slot)
{
#if WITH_STACKS
    int id = stacks.get_stackid(ctx, flags);
    if (id < 0)
        stack_errors.increment(slot);
    return id;
#else
    return -1;
#endif
}

/* ---- process lifecycle ---------------------------------------------------*/

/* The hook of derived.bpf.c: a forked child inherits its parent's break. */
static __always_inline void derived_fork(u32 parent, u32 child);

static __always_inline void follow_child(u32 child)
{
    if (FILTER_PIDS && FOLLOW_FORKS) {
        u8 one = 1;
        followed.update(&child, &one);
    }
}

/* The hook of locks.bpf.c: a thread of a followed process is made. */
static __always_inline void locks_new_thread(u32 tgid, u32 tid);
/* The hook of unwind.bpf.c: a followed process forked one that is followed
 * too (it has its parent's mappings, so its parent's tables). */
static __always_inline void unwind_fork(u32 parent, u32 child);

/* (Attached in every trace: which of its parts act is the run's choice.) */
TRACEPOINT_PROBE(task, task_newtask)
{
    u32 parent = bpf_get_current_pid_tgid() >> 32;
    /* Threads share their parent's tgid and need no entry of their own. */
    if (args->clone_flags & MTRACE_CLONE_THREAD) {
        if (tgid_is_followed(parent))
            locks_new_thread(parent, args->pid);
        return 0;
    }
    if (!tgid_is_followed(parent))
        return 0;
    if ((FILTER_PIDS && FOLLOW_FORKS) || DERIVED_SYSCALLS) {
        follow_child(args->pid);
        derived_fork(parent, args->pid);
    }
    if (FILTER_PIDS && FOLLOW_FORKS)
        holds_fork(parent, args->pid);
    if (!FILTER_PIDS || FOLLOW_FORKS) {
        locks_new_thread(args->pid, args->pid); /* a process traced from its fork */
        unwind_fork(parent, args->pid);
    }
    return 0;
}

/* The hooks of unwind.bpf.c: a process's mappings are gone (exec, exit);
 * a followed process exec'd the program at `path` (in kernel memory). */
static __always_inline void unwind_forget(u32 tgid);
static __always_inline void unwind_exec(u32 tgid, const void *path);

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
    e->ustack = e->kstack = -1;
    events.ringbuf_submit(e, 0);
}
#endif

#if WITH_EVENTS || WITH_UNWIND
TRACEPOINT_PROBE(sched, sched_process_exec)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    unwind_forget(tgid);
#if WITH_EVENTS
    if (FILTER_PIDS && tgid_is_followed(tgid))
        lifecycle_event(tgid, EV_EXEC, args->old_pid);
    if (FILTER_PIDS && FILTER_COMM) {
        /* The comm is the new program's by now (begin_new_exec set it). */
        u64 comm[2] = {};
        bpf_get_current_comm(comm, sizeof(comm));
        if (comm[0] == COMM_LO && comm[1] == COMM_HI) {
            u8 one = 1;
            followed.update(&tgid, &one);
        } else {
            followed.delete(&tgid);
        }
    }
#endif
    if (tgid_is_followed(tgid)) /* (--comm: once followed by its new name) */
        unwind_exec(tgid, (const void *)args + (args->data_loc_filename & 0xFFFF));
    return 0;
}
#endif

/* The hook of locks.bpf.c: any thread's exit (a wait it was in is gone). */
static __always_inline void locks_thread_exit(u32 tid);

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    locks_thread_exit((u32)id);
#if EXIT_GROUP_DEAD
    int ends = args->group_dead; /* its last thread: main may have called pthread_exit */
#else
    int ends = (u32)id == tgid; /* a kernel before group_dead: the leader's exit */
#endif
    if (ends) {
        unwind_forget(tgid);
        holds_end(tgid);
    }
    if (!FILTER_PIDS || !ends || !tgid_is_followed(tgid))
        return 0; /* only the last thread's exit ends a process */
#if WITH_EVENTS
    /* No exit code: task_struct's layout in the build headers need not be
     * the running kernel's. */
    lifecycle_event(tgid, EV_EXIT, 0);
#endif
    followed.delete(&tgid); /* the pid may be reused by an unrelated process */
    if (FIRST_TGID) {
        u32 first = 0;
        struct first_target *target = first_target.lookup(&first);
        if (target && tgid == target->tgid)
            target->live = 0;
    }
    return 0;
}

/* ---- clocks ----------------------------------------------------------------*/
/* A time that no output shows to the nanosecond: the clock read once a tick
 * per CPU, less than a tick (jiffy) behind. Reading the clock at every hit
 * cost 20-40 ns of a 400-600 ns uprobe hit here (a paravirtual clock read
 * under KVM); bpf_jiffies64 and a per-CPU array cost a few. */
struct tick_clock {
    u64 jiffies;
    u64 ns;
};
BPF_PERCPU_ARRAY(tick_clocks, struct tick_clock, 1);

static __always_inline u64 tick_now(void)
{
    u32 zero = 0;
    struct tick_clock *clock = tick_clocks.lookup(&zero);
    if (!clock)
        return bpf_ktime_get_ns();
    u64 tick = bpf_jiffies64();
    if (clock->jiffies != tick) {
        clock->jiffies = tick;
        clock->ns = bpf_ktime_get_ns();
    }
    return clock->ns;
}

/* ---- the hits every part counts ------------------------------------------*/
/* 1 once user space has closed the gate at the end of a trace (or before
 * it opens it): the handlers count nothing more. */
static __always_inline int gate_closed(void)
{
#if WITH_EVENTS
    u32 first = 0;
    u32 *open = control.lookup(&first);
    return !open || !*open;
#else
    return 0;
#endif
}

/* proc_hits' row of (tgid, probe), made with the current task's name if new. */
static __always_inline struct proc_hit *process_row(u32 tgid, const u32 probe)
{
    struct proc_key key = {.tgid = tgid, .probe = probe};
    struct proc_hit fresh = {};
    struct proc_hit *n = proc_hits.lookup_or_try_init(&key, &fresh);
    if (!n)
        proc_hits_dropped.increment(0);
    else if (!n->comm[0]) /* two first hits at once both write a name: harmless */
        bpf_get_current_comm(n->comm, sizeof(n->comm));
    return n;
}

#if WITH_EVENTS
/* With the event stream, user space counts each process's hits from the
 * records it reads (tracer/loop/counters.py): proc_hits counts only the hits
 * whose record the ring had no room for (probe_record), and names each
 * process once, in a row of its first probe. A CPU remembers the process it
 * named last, so a hit costs an array lookup here, not a hash lookup and an
 * atomic add. */
BPF_PERCPU_ARRAY(named_tgid, u32, 1);

static __always_inline void name_process(u32 tgid, const u32 probe)
{
    u32 first = 0;
    u32 *named = named_tgid.lookup(&first);
    if (!named || *named == tgid)
        return;
    if (process_row(tgid, probe))
        *named = tgid;
}
#endif

/* Counts a hit of `probe` by the current task if it is traced: 1 if so. */
static __always_inline int admit(u32 tgid, const u32 probe)
{
    if (gate_closed() || !tgid_is_followed(tgid))
        return 0;
    hits.increment(probe);
#if WITH_EVENTS
    name_process(tgid, probe);
#else
    struct proc_hit *n = process_row(tgid, probe);
    if (n)
        __sync_fetch_and_add(&n->count, 1);
#endif
    return 1;
}

#if WITH_EVENTS
/* A probe record with its header filled, or NULL (counted as lost). */
static __always_inline struct event *probe_record(u64 ip, u64 id, const u32 site,
                                                  const u32 probe, const u32 nargs)
{
    struct event *e = events.ringbuf_reserve(sizeof(struct event));
    if (!e) {
        lost.increment(probe);
        struct proc_hit *n = process_row(id >> 32, probe);
        if (n)
            __sync_fetch_and_add(&n->count, 1);
        return NULL;
    }
    e->ts = PROBE_EXACT_TIME ? bpf_ktime_get_ns() : tick_now();
    e->ip = ip;
    e->tgid = id >> 32;
    e->tid = (u32)id;
    e->cpu = bpf_get_smp_processor_id();
    e->probe = probe;
    e->site = site;
    e->kind = EV_PROBE;
    e->nargs = nargs;
    e->kstack = -1;
    return e;
}
#endif
