/* ---- the CFI unwinder -------------------------------------------------------
 * Whole user stacks on code built without frame pointers, from the mapped
 * files' own call-frame information (.eh_frame, .debug_frame), in the kernel.
 * User space turns each file's CFI into rows (probes/elf/cfi.py) and writes
 * them, with each traced process's executable mappings, into the tables of
 * records.h (tracer/unwind/unwind_tables.py).
 *
 * A handler that wants a stack (an allocation's return, a lock wait's
 * entry) starts a walk (unwind_begin) with the registers as they are just
 * after a return to the first frame, puts what it will need afterwards in
 * the walk's state, and tail-calls unwind_step. unwind_step unwinds
 * UNWIND_STEP_FRAMES frames, and tail-calls itself until the walk ends; then
 * it stores the frames (the frame store, frames.bpf.c) and tail-calls the
 * handler's resumption, which finishes the handler's work with the stack's
 * id. The walk is split so because the verifier follows every branch of
 * every frame's two searches: one program of 64 frames passes, one of 127
 * does not ("the sequence of jumps is too complex").
 *
 * Each frame: the process's mapping holding pc - 1 (a binary search of its
 * mappings), the row in force there (a binary search of its file's rows),
 * then the CFA from %rsp or %rbp, the return address at CFA - 8, and the
 * caller's %rbp where the row says it was saved. Where no row covers the PC
 * (code without CFI: JIT code, a file with none) and %rbp is known, one
 * step by frame pointers. Every read is of the stack: at or above the
 * stack pointer and below it plus MAX_STACK_BYTES, else the walk ends
 * (counted as out of the stack). How each walk ended is counted
 * (unwind_misc), and how many frames each way was used.
 *
 * The state and the frames are per CPU: a uprobe's programs run with
 * migration disabled, and the kernel runs no other kprobe or uprobe program
 * on the CPU meanwhile (bpf_prog_active), so one walk at a time per CPU. */
/* This part's settings (ProgramConfig, probes/program.py), and their defaults. */
#ifndef WITH_UNWIND
#define WITH_UNWIND 0 /* unwind by CFI (needs the frame store) */
#endif
#ifndef UNWIND_ROWS
#define UNWIND_ROWS 2097152 /* rows of unwind_rows, all files together (--unwind-rows) */
#endif
#ifndef UNWIND_MAPS
#define UNWIND_MAPS 65536 /* rows of unwind_maps, all processes together */
#endif
#ifndef UNWIND_PAGES
#define UNWIND_PAGES 2097152 /* entries of unwind_pages, all files together (as many) */
#endif
#ifndef UNWIND_VMA
#define UNWIND_VMA 0 /* a PC in no mapping of the process's tables: its VMA found in the kernel */
#endif
#ifndef UNWIND_LOOP
#define UNWIND_LOOP 0 /* the kernel has bpf_loop (Linux 5.17): a step's frames through it */
#endif
#ifndef UNWIND_FILES
#define UNWIND_FILES 16384 /* entries of unwind_files: files found by the kernel's VMA */
#endif
#define UNWIND_PAGE_SHIFT 12
#if WITH_UNWIND && !WITH_FRAMES
#error "WITH_UNWIND needs the frame store (WITH_FRAMES, frames.bpf.c)"
#endif

#if WITH_UNWIND
/* Frames a step unwinds. Unrolled (no UNWIND_LOOP), the verifier's time on
 * unwind_step grows with it, as it follows each frame's searches, and every
 * start pays it (95 ms at 8 here). 8 keeps a whole walk (FRAME_DEPTH - 1
 * frames: 16 steps, with the handler's call and the resumption 18 tail
 * calls) within the kernel's 33. */
#define UNWIND_STEP_FRAMES 8
#define MAP_STEPS 12  /* a process's mappings: at most 4096 searched */
#define ROW_STEPS 22  /* a file's rows: at most 4 M searched */
#define MAX_STACK_BYTES (8 << 20)
/* Bytes of the stack copied at once: most frames' reads then come from
 * the copy (one bpf_probe_read_user for many frames, not two a frame). */
#define STACK_WINDOW 1024

/* unwind_progs' slots */
#define UNWIND_STEP 0
#define UNWIND_RESUME_ALLOC 1
#define UNWIND_RESUME_LOCK 2
#define UNWIND_VMA_LOOKUP 3
#define UNWIND_PYTHON 4 /* python.bpf.c: the Python frames an eval loop's frame runs */
#define UNWIND_PROGS 5
/* Tail calls a walk makes at most, its resumption's included: the kernel's
 * limit (MAX_TAIL_CALL_CNT), less the handler's first call. */
#define UNWIND_CALLS 32

/* unwind_state.py_state */
#define PY_NONE 0   /* no Python frames in this walk (no interpreter, or none found) */
#define PY_UNREAD 1 /* the process has an interpreter: the thread's state not read yet */
#define PY_READ 2   /* read: py_frame is the next Python frame to store */

struct unwind_state {
    u64 pc, sp, bp; /* the frame being left: its PC and registers */
    u64 top;        /* reads stay below this (the first stack pointer + MAX_STACK_BYTES) */
    u64 hash;       /* of the frames so far */
    u32 n;          /* frames so far, in alloc_walk's row */
    u32 maps_first, maps_count; /* the process's mappings */
    u32 last_map;   /* the mapping of the last frame: the next one is most often in it too */
    s32 stack;      /* the stored frames' id, once the walk ends */
    u32 cfi_frames, fp_frames; /* frames found each way (added to unwind_misc at the end) */
    u64 window_at;  /* the stack's bytes [window_at, window_at + STACK_WINDOW) are in window */
    u8 bp_known;    /* %rbp holds the frame's value (no rule lost it) */
    u8 resume;      /* the slot of unwind_progs to resume */
    u8 ended;       /* enum unwind_misc: how the walk ended, 0 while it goes on */
    u8 pad;
    u32 calls;      /* tail calls made so far (UNWIND_CALLS at most) */
    u32 vma_frames, unwritten_frames; /* frames by mappings from the kernel, and of them in
                                       * files whose rows were not written yet */
    u32 files_gen;  /* unwind_files_gen when the step began */
    u32 mixed;      /* frames in the hash so far: each once its kind is known */
    u64 vma_fp;     /* a PC whose VMA could not be looked up: its frame by frame pointers */
    /* Return addresses the kernel replaced with its uretprobe trampoline:
     * where each was on the stack, and what it was. */
    u64 hijack_at[2], hijack_ra[2];
    /* The process's CPython eval loop, [py_lo, py_hi) and its cold part
     * (WITH_PYTHON, python.bpf.c): a frame there is replaced by the Python
     * frames it runs. py_frame: the next of them to store, once read;
     * py_at: the stack pointer of the eval loop's frame whose Python frames
     * were stored (then it is stepped natively). */
    u64 py_lo[2], py_hi[2];
    u64 py_frame, py_at;
    u64 py_win; /* the address python_frame_bytes holds a copy from (0: none) */
    u8 py_state;  /* PY_NONE, PY_UNREAD (the thread state not read yet), PY_READ */
    u8 py_stored; /* Python frames stored for the eval loop's frame at py_at (0: none yet) */
    u8 py_any;    /* Python frames stored in this walk */
    u8 py_rest;   /* the walk's calls run out: the rest of its Python frames, the native ones between left out */
    u8 py_pad[2];
    u16 py_win_len; /* its length */
    u64 payload[13]; /* what the resumption needs (allocs.bpf.c, locks.bpf.c) */
    u64 window[STACK_WINDOW / 8]; /* a copy of the stack, read once for many frames */
};

/* A thread inside dlopen or dlmopen, whose return address the kernel
 * replaced (unwind_dlopen_return is a return probe): where it was, and
 * what it was, read at the entry before the kernel replaced it. */
#define HIJACK_SLOTS 65536 /* a power of two: threads whose ids differ by a multiple share one */
struct unwind_hijack {
    u64 at, ra;
    u32 tid, pad;
};
BPF_ARRAY(unwind_hijacks, struct unwind_hijack, HIJACK_SLOTS);
/* Where the dynamic loader's _r_debug.r_state is from its _dl_debug_state,
 * in bytes (user space writes it from the loader's symbols; 0: not read). */
BPF_ARRAY(unwind_rtld, s64, 1);
/* Rows and page index: user space writes them through a mapping of their pages (Linux 5.5) */
BPF_F_TABLE("array", int, struct unwind_row, unwind_rows, UNWIND_ROWS, BPF_F_MMAPABLE);
BPF_ARRAY(unwind_maps, struct unwind_map, UNWIND_MAPS);
BPF_F_TABLE("array", int, u32, unwind_pages, UNWIND_PAGES, BPF_F_MMAPABLE);
PROC_TABLE(unwind_procs, u32, struct unwind_proc, MAX_FOLLOWED);
BPF_PERCPU_ARRAY(unwind_states, struct unwind_state, 1);
BPF_PERCPU_ARRAY(unwind_misc, u64, UX_COUNT);
BPF_PROG_ARRAY(unwind_progs, UNWIND_PROGS);
#if UNWIND_VMA
/* Files' rows for the mappings found in the kernel (user space writes an
 * entry for each file whose rows it wrote, and for each one asked for),
 * bumped by user space whenever it wrote one; each process's last
 * mappings found there. */
BPF_HASH(unwind_files, struct unwind_file_key, struct unwind_file, UNWIND_FILES);
BPF_ARRAY(unwind_files_gen, u32, 2); /* by the trace's process, and by the file server */
BPF_TABLE("lru_hash", u32, struct unwind_vmas, unwind_vmas, MAX_FOLLOWED);
BPF_PERCPU_ARRAY(unwind_no_vmas, struct unwind_vmas, 1); /* stays empty: a process with none */
#endif

/* python.bpf.c's, for the walk's start and the processes' forks and ends. */
static __always_inline void python_begin(struct unwind_state *st, u32 tgid);
static __always_inline void python_fork(u32 parent, u32 child);
static __always_inline void python_forget(u32 tgid);
static __always_inline void python_new_stack(struct unwind_state *st);
static __always_inline int python_rest_due(struct unwind_state *st);

static __always_inline void unwind_misc_add(u32 slot, u64 n)
{
    u64 *count = unwind_misc.lookup(&slot);
    if (count)
        *count += n; /* per CPU: no other writer */
}

static __always_inline struct unwind_state *unwind_state(void)
{
    u32 zero = 0;
    return unwind_states.lookup(&zero);
}

/* A walk of the current process's stack from `pc` (a return address: the
 * frame's registers as they are after the return), to be resumed at
 * `resume`: its state, for the caller to add the payload to, or NULL when
 * the process has no tables (the caller walks by frame pointers, counted). */
static __always_inline struct unwind_state *unwind_begin(u32 tgid, u64 pc, u64 sp, u64 bp,
                                                         u8 resume)
{
    struct unwind_proc *proc = unwind_procs.lookup(&tgid);
    u32 first = 0, count = 0;
    if (proc && proc->count) {
        first = proc->first;
        count = proc->count;
    } else {
        /* by the mappings the kernel has (UNWIND_VMA), else by frame pointers */
        unwind_misc.increment(UX_NO_TABLES);
        if (!UNWIND_VMA)
            return NULL;
    }
    struct unwind_state *st = unwind_state();
    u32 zero = 0;
    struct alloc_frames_row *row = alloc_walk.lookup(&zero);
    if (!st || !row)
        return NULL;
    if (proc && count && proc->inherited)
        unwind_misc.increment(UX_INHERITED);
    st->pc = pc;
    st->sp = sp;
    st->bp = bp;
    st->top = sp + MAX_STACK_BYTES;
    st->hash = 0x84222325cbf29ce4ull;
    st->n = 1;
    st->mixed = 0;
    st->maps_first = first;
    st->last_map = first;
    st->maps_count = count;
    st->calls = 1; /* the handler's, to UNWIND_STEP */
    st->vma_fp = 0;
    st->stack = -1;
    st->cfi_frames = st->fp_frames = st->vma_frames = st->unwritten_frames = 0;
    st->window_at = 0;
    st->bp_known = 1;
    st->resume = resume;
    st->ended = 0;
    st->hijack_at[0] = st->hijack_at[1] = 0;
    python_begin(st, tgid);
    u32 tid = (u32)bpf_get_current_pid_tgid(), slot = tid & (HIJACK_SLOTS - 1);
    struct unwind_hijack *h = unwind_hijacks.lookup(&slot);
    if (h && h->tid == tid && h->at) {
        st->hijack_at[1] = h->at;
        st->hijack_ra[1] = h->ra;
    }
    row->ip[0] = pc;
    return st;
}

/* Bumped whenever a process's tables go: each thread's allocation slot
 * (allocs.bpf.c) remembers the generation at which it last found its
 * process's tables, and asks again only when it changed. */
BPF_ARRAY(unwind_generation, u64, 1);

static __always_inline u64 unwind_gen(void)
{
    u32 zero = 0;
    u64 *gen = unwind_generation.lookup(&zero);
    return gen ? *gen : 0;
}

/* A process's mappings are gone (exec, exit): its tables with them. */
static __always_inline void unwind_forget(u32 tgid)
{
    python_forget(tgid);
#if UNWIND_VMA
    unwind_vmas.delete(&tgid);
#endif
    if (unwind_procs.delete(&tgid))
        return; /* it had none */
    u32 zero = 0;
    u64 *gen = unwind_generation.lookup(&zero);
    if (gen)
        __sync_fetch_and_add(gen, 1);
}

/* A process's first call that wants a stack says so, once; user space
 * writes its tables. A process mtrace-live started (HOLDS: run's command,
 * its children) also stops (SIGSTOP, delivered as the handler returns to
 * user space, before the call runs) until they are written, and is
 * continued then; no other process is ever stopped. Until its tables are
 * written its stacks are walked by frame pointers, counted as
 * UX_NO_TABLES. */
static __always_inline int unwind_ask(u32 tgid, int hold, u32 parent);

/* 1 once nothing is left to ask (the caller asks no more until the
 * generation changes); 0 when the ring had no room to say so, to be asked
 * again at the next call. */
static __always_inline int unwind_wanted(u32 tgid)
{
#if WITH_EVENTS
    struct unwind_proc *proc = unwind_procs.lookup(&tgid);
    if (proc) {
        /* Its parent's tables, from its fork: whole stacks now; its own
         * asked for once, and no hold, as it needs none to be unwound
         * (two threads may both ask: user space writes them once). */
        if (proc->inherited == 1) {
            proc->inherited = 2; /* before the ask is out: user space may replace the entry */
            if (!unwind_ask(tgid, 0, proc->parent)) {
                proc->inherited = 1;
                return 0;
            }
        }
        return 1;
    }
    struct unwind_proc asked = {};
    if (unwind_procs.insert(&tgid, &asked))
        return 1; /* another thread asked first */
    if (unwind_ask(tgid, 1, 0))
        return 1;
    unwind_procs.delete(&tgid); /* not said: asked again at the next call */
    return 0;
#else
    return 1;
#endif
}

/* A followed process forked `child`: its mappings are its parent's, so it
 * is unwound by its parent's tables from its first call, the same block of
 * unwind_maps (user space frees a block only once no entry names it,
 * tracer/unwind/unwind_tables.py), until its own are written. A child of a process
 * with no tables has none (a pid reused since an entry was written). */
static __always_inline void unwind_fork(u32 parent, u32 child)
{
    python_fork(parent, child);
#if UNWIND_VMA
    struct unwind_vmas *found = unwind_vmas.lookup(&parent);
    if (found)
        unwind_vmas.update(&child, found);
    else
        unwind_vmas.delete(&child);
#endif
    struct unwind_proc *theirs = unwind_procs.lookup(&parent);
    if (!theirs || !theirs->count) {
        unwind_procs.delete(&child);
        return;
    }
    struct unwind_proc given = {theirs->first, theirs->count, 1, parent};
    unwind_procs.update(&child, &given);
}

/* Say that process `tgid` wants its tables (written anew), holding it
 * meanwhile (`hold`) if mtrace-live started it; `parent`, the process it
 * inherited its tables from at its fork (0: none), is the event's one
 * argument: its frames are named by its parent's maps if it is gone before
 * its own are read. */
static __always_inline int unwind_ask(u32 tgid, int hold, u32 parent)
{
#if WITH_EVENTS
    struct event *e = musts.ringbuf_reserve(sizeof(struct event));
    if (!e) {
        lost_musts.increment(0);
        return 0; /* no room to say so: not stopped */
    }
    __builtin_memset(e, 0, sizeof(*e));
    e->ts = bpf_ktime_get_ns();
    e->tgid = tgid;
    e->tid = (u32)bpf_get_current_pid_tgid();
    e->kind = EV_UNWIND;
    e->nargs = parent ? 1 : 0;
    e->args[0] = parent;
    e->ustack = e->kstack = -1;
    if (hold)
        hold_process(tgid); /* a process mtrace-live started (HOLDS) */
    musts.ringbuf_submit(e, 0);
#endif
    return 1;
}

/* The mapping of the state's process that holds `pc`, or NULL. */
static __always_inline struct unwind_map *unwind_map_of(struct unwind_state *st, u64 pc)
{
    u32 last = st->last_map;
    struct unwind_map *m = unwind_maps.lookup(&last);
    if (m && m->start <= pc && pc < m->end)
        return m;
    u32 lo = st->maps_first, hi = st->maps_first + st->maps_count;
    for (int i = 0; i < MAP_STEPS; i++) {
        if (lo >= hi)
            break;
        u32 mid = lo + (hi - lo) / 2;
        struct unwind_map *m = unwind_maps.lookup(&mid);
        if (!m)
            return NULL;
        if (m->start <= pc)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo == st->maps_first)
        return NULL; /* below the first mapping */
    lo--;
    m = unwind_maps.lookup(&lo);
    if (!m || pc >= m->end)
        return NULL;
    st->last_map = lo;
    return m;
}

/* The row in force at `pc`, or NULL where the mapping has no rows or pc is
 * below its first. */
static __always_inline struct unwind_row *unwind_row_of(struct unwind_map *m, u64 pc)
{
    if (!m->count)
        return NULL;
    u32 at = (u32)(pc - m->bias);
    u32 lo = m->first, hi = m->first + m->count; /* the row is in [lo, hi) */
    if (at >= m->page_base && m->page_count) {
        u32 page = (at - m->page_base) >> UNWIND_PAGE_SHIFT, k = m->pages + page;
        u32 *from = page < m->page_count ? unwind_pages.lookup(&k) : NULL;
        if (from) {
            lo = m->first + *from;
            k++;
            u32 *to = page + 1 < m->page_count ? unwind_pages.lookup(&k) : NULL;
            if (to && m->first + *to + 1 < hi)
                hi = m->first + *to + 1;
        }
    }
    for (int i = 0; i < ROW_STEPS; i++) {
        if (lo + 1 >= hi)
            break;
        u32 mid = lo + (hi - lo) / 2;
        struct unwind_row *r = unwind_rows.lookup(&mid);
        if (!r)
            return NULL;
        if (r->pc <= at)
            lo = mid;
        else
            hi = mid;
    }
    struct unwind_row *r = unwind_rows.lookup(&lo);
    return r && r->pc <= at ? r : NULL;
}

/* A read of 8 bytes of the stack at `at`: 0, or the cause that ends the walk. */
static __always_inline u8 stack_read(struct unwind_state *st, u64 at, u64 *out)
{
    if (at < st->sp || at + 8 > st->top)
        return UX_OUT_OF_STACK;
    if (at & 7) /* rare: no copy's words line up with it */
        return bpf_probe_read_user(out, sizeof(*out), (void *)at) ? UX_UNREADABLE : 0;
    if (!st->window_at || at < st->window_at || at + 8 > st->window_at + STACK_WINDOW) {
        /* a new copy from here on; near the stack's end (where the copy
         * would run past the mapping) the 8 bytes alone */
        if (at + STACK_WINDOW > st->top ||
            bpf_probe_read_user(st->window, sizeof(st->window), (void *)at)) {
            st->window_at = 0;
            return bpf_probe_read_user(out, sizeof(*out), (void *)at) ? UX_UNREADABLE : 0;
        }
        st->window_at = at;
    }
    u64 word = ((at - st->window_at) / 8) & (STACK_WINDOW / 8 - 1);
    *out = st->window[word];
    return 0;
}

/* The CFA and the caller's %rbp by the row `r`: 0, or why the walk ends. */
static __always_inline u8 cfi_step(struct unwind_state *st, struct unwind_row *r, u64 *cfa)
{
    if (r->cfa == UC_RBP && !st->bp_known)
        return UX_NO_CFI;
    *cfa = (r->cfa == UC_RSP ? st->sp : st->bp) + (s64)r->cfa_off;
    if (*cfa <= st->sp)
        return UX_OUT_OF_STACK;
    if (r->rbp == UR_AT) {
        u8 failed = stack_read(st, *cfa + (s64)r->rbp_off, &st->bp);
        if (failed)
            return failed;
    } else if (r->rbp == UR_LOST) {
        st->bp_known = 0;
    }
    st->cfi_frames++;
    return 0;
}

/* The CFA and the caller's %rbp by frame pointers: 0, or why the walk ends. */
static __always_inline u8 fp_step(struct unwind_state *st, u64 *cfa)
{
    if (!st->bp_known || st->bp < st->sp || (st->bp & 7))
        return UX_NO_CFI;
    u64 saved = st->bp;
    u8 failed = stack_read(st, saved, &st->bp);
    if (failed)
        return failed;
    *cfa = saved + 16;
    st->fp_frames++;
    return 0;
}

#if UNWIND_VMA
/* The mapping holding `pc` among those the kernel gave the process (its
 * last UNWIND_VMA_SLOTS), or NULL. One of a file whose rows were not
 * written yet holds until user space writes a file. */
static __always_inline struct unwind_map *unwind_vma_of(struct unwind_state *st,
                                                        struct unwind_vmas *vmas, u64 pc)
{
    for (int i = 0; i < UNWIND_VMA_SLOTS; i++) {
        struct unwind_map *m = &vmas->maps[i];
        if (m->start <= pc && pc < m->end && (!m->pad || m->pad == st->files_gen + 1))
            return m;
    }
    return NULL;
}
#endif

/* The last frame as stored, now that its mapping `m` (or none) is known: in
 * a file (FRAME_KIND_FILE) where the mapping names a numbered file with
 * rows, else its address; and into the stack's hash as stored, so that a
 * stack of numbered files is one stored stack in every process. */
static __always_inline void unwind_frame_kind(struct unwind_state *st,
                                              struct alloc_frames_row *row, struct unwind_map *m)
{
    u32 at = (st->n - 1) & (FRAME_DEPTH - 1);
    u64 frame = row->ip[at];
    if (m && m->count && m->file && m->file < FRAME_FILE_NUMBERS) {
        u64 address = st->pc - m->bias;
        if (address < (1ull << FRAME_FILE_SHIFT)) {
            frame = ((u64)FRAME_KIND_FILE << FRAME_KIND_SHIFT) |
                    ((u64)m->file << FRAME_FILE_SHIFT) | address;
            row->ip[at] = frame;
        }
    }
    st->hash = (st->hash ^ (st->hash >> 29) ^ frame) * 0x9e3779b97f4a7c15ull;
    st->mixed = st->n;
}

/* Whether the frame being left is the eval loop's, its Python frames not
 * stored yet (python.bpf.c stores them in its place). */
static __always_inline int python_due(struct unwind_state *st)
{
    if (st->py_state == PY_NONE || st->sp == st->py_at)
        return 0;
    u64 pc = st->pc - 1;
    return (st->py_lo[0] <= pc && pc < st->py_hi[0]) ||
           (st->py_lo[1] <= pc && pc < st->py_hi[1]);
}

/* One frame: 1 while the walk goes on, 0 when it ended (st->ended says
 * why), 2 when its PC's mapping is to be looked up in the kernel first,
 * 3 when it is the eval loop's, whose Python frames are to be stored first. */
static __always_inline int unwind_frame(struct unwind_state *st, struct alloc_frames_row *row,
                                        struct unwind_vmas *vmas)
{
    struct unwind_map *m = unwind_map_of(st, st->pc - 1);
#if UNWIND_VMA
    if (!m) {
        m = unwind_vma_of(st, vmas, st->pc - 1);
        if (m) {
            st->vma_frames++;
            if (!m->count && m->pad)
                st->unwritten_frames++;
        } else if (st->pc - 1 != st->vma_fp) {
            return 2;
        }
    }
#endif
    if (st->mixed < st->n && python_due(st))
        return 3;
    if (st->mixed < st->n)
        unwind_frame_kind(st, row, m);
    struct unwind_row *r = m ? unwind_row_of(m, st->pc - 1) : NULL;
    u64 cfa = 0, ra = 0;
    u8 ended;
    if (r && r->cfa == UC_END)
        ended = UX_COMPLETE;
    else if (r && (r->cfa == UC_RSP || r->cfa == UC_RBP))
        ended = cfi_step(st, r, &cfa);
    else
        ended = fp_step(st, &cfa);
    if (!ended) {
        if (cfa - 8 == st->hijack_at[0] && st->hijack_at[0])
            ra = st->hijack_ra[0];
        else if (cfa - 8 == st->hijack_at[1] && st->hijack_at[1])
            ra = st->hijack_ra[1];
        else
            ended = stack_read(st, cfa - 8, &ra);
    }
    if (!ended && !ra)
        ended = UX_COMPLETE;
    if (!ended && st->n >= FRAME_DEPTH)
        ended = UX_DEPTH;
    if (ended) {
        st->ended = ended;
        return 0;
    }
    st->sp = cfa;
    st->pc = ra;
    row->ip[st->n & (FRAME_DEPTH - 1)] = ra;
    st->n++;
    return 1;
}

/* The walk's end: its counts, its frames stored, and its resumption. */
static __always_inline void unwind_finish(struct pt_regs *ctx, struct unwind_state *st,
                                          struct alloc_frames_row *row)
{
    unwind_misc.increment(UX_STACKS);
    unwind_misc_add(UX_CFI_FRAMES, st->cfi_frames);
    unwind_misc_add(UX_FP_FRAMES, st->fp_frames);
#if UNWIND_VMA
    unwind_misc_add(UX_VMA_FRAMES, st->vma_frames);
    unwind_misc_add(UX_UNWRITTEN, st->unwritten_frames);
#endif
    unwind_misc.increment(st->ended);
    if (st->mixed < st->n) /* the last frame's mapping was not looked at: its address */
        unwind_frame_kind(st, row, NULL);
    if (st->n < FRAME_DEPTH)
        row->ip[st->n & (FRAME_DEPTH - 1)] = 0;
    u8 fresh = 0;
    st->stack = store_frames(row, st->hash, &fresh);
    if (fresh && st->py_any)
        python_new_stack(st);
    unwind_progs.call(ctx, st->resume);
    unwind_misc.increment(UX_LOST);
}

/* A tail call to `slot` if the walk has one left besides its resumption's
 * (returns only where it made none). */
static __always_inline void unwind_next(struct pt_regs *ctx, struct unwind_state *st, u32 slot)
{
    if (st->calls + 1 >= UNWIND_CALLS)
        return;
    st->calls++;
    unwind_progs.call(ctx, slot);
    st->calls--;
}

#if UNWIND_LOOP
/* A step's frames through bpf_loop (Linux 5.17, UNWIND_LOOP): the verifier
 * follows one frame's searches once, not once per frame of the step (a
 * third of the time every start paid). What the frames work on. */
struct unwind_loop {
    struct unwind_state *st;
    struct alloc_frames_row *row;
    struct unwind_vmas *vmas;
    long going; /* unwind_frame's last answer */
};

/* bpf_loop's callback (its arguments: the frame's index, the loop; its
 * code is linked in by user space, tracer/bpf/bpf_callbacks.py, as bcc 0.26
 * leaves its address 0): one frame; 1 (no more) unless the walk goes on. */
long unwind_step__callback(void *index)
{
    struct unwind_loop *loop;
    asm volatile("%0 = r2" : "=r"(loop));
    loop->going = unwind_frame(loop->st, loop->row, loop->vmas);
    return loop->going != 1;
}
#endif

/* UNWIND_STEP: a part of a walk, then the next part, a lookup of a
 * mapping in the kernel (UNWIND_VMA_LOOKUP), or the resumption. */
int unwind_step(struct pt_regs *ctx)
{
    u32 zero = 0;
    struct unwind_state *st = unwind_state();
    struct alloc_frames_row *row = alloc_walk.lookup(&zero);
    if (!st || !row)
        return 0;
    struct unwind_vmas *vmas = NULL;
#if UNWIND_VMA
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    vmas = unwind_vmas.lookup(&tgid);
    if (!vmas)
        vmas = unwind_no_vmas.lookup(&zero);
    if (!vmas)
        return 0;
    u32 one = 1;
    u32 *gen = unwind_files_gen.lookup(&zero), *served = unwind_files_gen.lookup(&one);
    st->files_gen = (gen ? *gen : 0) + (served ? *served : 0);
#endif
#if UNWIND_LOOP
    struct unwind_loop loop = {st, row, vmas, 1};
    bpf_loop(UNWIND_STEP_FRAMES, unwind_step__callback, &loop, 0);
    int going = loop.going;
#else
    int going = 1;
    for (int i = 0; i < UNWIND_STEP_FRAMES; i++) {
        going = unwind_frame(st, row, vmas);
        if (going != 1)
            break;
    }
#endif
    if (going == 2) {
        unwind_next(ctx, st, UNWIND_VMA_LOOKUP);
        st->vma_fp = st->pc - 1; /* no lookup: this frame by frame pointers */
        going = 1;
    }
    if (going == 3) {
        unwind_next(ctx, st, UNWIND_PYTHON);
        st->py_at = st->sp; /* no call left: this frame as it is */
        going = 1;
    }
    if (going == 1 && !st->ended) {
        /* the last call left: the thread's Python frames not stored yet
         * rather than a few more native ones (python.bpf.c) */
        if (python_rest_due(st)) {
            if (st->mixed < st->n)
                unwind_frame_kind(st, row, NULL); /* (its mapping not looked up: its address) */
            unwind_next(ctx, st, UNWIND_PYTHON);
        }
        unwind_next(ctx, st, UNWIND_STEP);
        st->ended = UX_BOUNDS; /* no more tail calls */
    }
    unwind_finish(ctx, st, row);
    return 0;
}

#else
static __always_inline void unwind_forget(u32 tgid) {}
static __always_inline int unwind_wanted(u32 tgid) { return 1; }
static __always_inline void unwind_fork(u32 parent, u32 child) {}
static __always_inline u64 unwind_gen(void) { return 0; }
#endif
