/* ---- Python frames ---------------------------------------------------------
 * A CPython process's stacks with its Python functions in them. Where the
 * CFI walk (unwind.bpf.c) meets a frame of the interpreter's eval loop
 * (_PyEval_EvalFrameDefault, or its cold part), the walk tail-calls
 * unwind_python, which stores in that frame's place the Python frames that
 * call of the eval loop runs, innermost first, down to the one it was
 * entered with; then the walk goes on natively from the eval loop's frame.
 *
 * The thread's state is found through its pthread key's slot (CPython's
 * thread-state key, read from the interpreter's runtime at each walk that
 * meets the eval loop, so a process whose interpreter starts after its
 * entry was written has its Python frames from its first): the thread
 * pointer (the task's fsbase, which glibc points at the thread's struct
 * pthread) plus the slot's offset in the libc's layout. A thread reads
 * its own frames: no lock is needed. Then the thread's current frame (3.11
 * and 3.12 through its cframe), and each frame's code object, instruction
 * and previous frame. A frame stored is FRAME_KIND_PYTHON: the code
 * object's address and the instruction's offset in it (records.h); user
 * space names it from the process's memory. An eval loop's entry: 3.11
 * marks its first frame (is_entry); 3.12 on push a frame of their own
 * (owner FRAME_OWNED_BY_CSTACK), which is not stored.
 *
 * A walk reads the thread's state at its first eval loop frame only: a
 * thread that never ran Python costs nothing more than the lookup of its
 * process at the walk's start. */
#ifndef WITH_PYTHON
#define WITH_PYTHON 0 /* Python frames in the CFI walk's stacks (needs WITH_UNWIND) */
#endif
#if WITH_PYTHON && !WITH_UNWIND
#error "WITH_PYTHON needs the CFI walk (WITH_UNWIND, unwind.bpf.c)"
#endif

#if WITH_UNWIND
#if WITH_PYTHON
#ifndef TASK_FSBASE_OFF
#error "WITH_PYTHON needs TASK_FSBASE_OFF: task_struct's thread.fsbase, from the kernel's BTF"
#endif
/* Python frames one call of unwind_python stores at most; a longer run
 * of them tail-calls it again. */
#define PYTHON_STEP_FRAMES 32

PROC_TABLE(python_procs, u32, struct python_proc, MAX_FOLLOWED);
/* New stacks with Python frames, said to user space (a ring of their own:
 * the events ring may be full of allocations when a burst of them comes). */
#define PYTHON_STACKS_PAGES 32
BPF_RINGBUF_OUTPUT(python_stacks, PYTHON_STACKS_PAGES);
/* A copy of the thread's memory up to a frame's first PY_FRAME_BYTES (per
 * CPU, as the walk's state): its callers' frames lie below it on the
 * thread's frame stack, so that one read serves several frames. */
#define PY_WINDOW 4096
#define PY_C_FRAME 4096 /* the eval loop's own C frame, at most */
struct python_bytes {
    u64 words[PY_WINDOW / 8];
};
BPF_PERCPU_ARRAY(python_frame_bytes, struct python_bytes, 1);

static __always_inline void python_begin(struct unwind_state *st, u32 tgid)
{
    struct python_proc *py = python_procs.lookup(&tgid);
    st->py_state = py ? PY_UNREAD : PY_NONE;
    st->py_frame = st->py_at = st->py_win = 0;
    st->py_stored = st->py_any = st->py_rest = 0;
    if (!py)
        return;
    st->py_lo[0] = py->eval_lo[0];
    st->py_hi[0] = py->eval_hi[0];
    st->py_lo[1] = py->eval_lo[1];
    st->py_hi[1] = py->eval_hi[1];
}

/* A forked child runs its parent's interpreter, at the same addresses. */
static __always_inline void python_fork(u32 parent, u32 child)
{
    struct python_proc *py = python_procs.lookup(&parent);
    if (py)
        python_procs.update(&child, py);
    else
        python_procs.delete(&child);
}

static __always_inline void python_forget(u32 tgid)
{
    python_procs.delete(&tgid);
}

/* A stack with Python frames stored for the first time: said, so that
 * user space reads its code objects while they live. (Where the ring has
 * no room, counted; they are read when the stack is named, if they still
 * are.) */
static __always_inline void python_new_stack(struct unwind_state *st)
{
    struct python_stack *e = python_stacks.ringbuf_reserve(sizeof(struct python_stack));
    if (!e) {
        unwind_misc.increment(UX_PY_STACKS_LOST);
        return;
    }
    e->tgid = bpf_get_current_pid_tgid() >> 32;
    e->stack = st->stack;
    python_stacks.ringbuf_submit(e, 0);
}

/* An 8-byte member of the frame at `off` in the copy `b`, or 0 where none is. */
static __always_inline u64 python_word(u64 *b, u32 off, u16 at)
{
    if (at > PY_FRAME_BYTES - 8 || (at & 7))
        return 0;
    return b[((off + at) >> 3) & (PY_WINDOW / 8 - 1)];
}

static __always_inline u8 python_byte(u64 *b, u32 off, u16 at)
{
    if (at >= PY_FRAME_BYTES)
        return 0;
    return ((u8 *)b)[(off + at) & (PY_WINDOW - 1)];
}

/* Where `frame`'s first PY_FRAME_BYTES are in the copy `b`. Where it does
 * not hold them, it is read again: from as far below them as it holds,
 * but not below the frame's page (mapped, as the frame is). A frame in
 * the eval loop's own C frame (3.12's entry frame), above the walk's
 * stack pointer, has no Python frames below it: its bytes alone are read.
 * -1: unreadable. */
static __always_inline long python_window(struct unwind_state *st, u64 *b, u64 frame)
{
    u64 end = frame + PY_FRAME_BYTES, lo = frame & ~4095ull;
    if (st->py_win && frame >= st->py_win && end <= st->py_win + st->py_win_len)
        return frame - st->py_win;
    if (frame >= st->sp && frame - st->sp < PY_C_FRAME)
        lo = frame;
    else if (end - lo >= PY_WINDOW)
        lo = end - (PY_WINDOW - 8);
    u32 len = (end - lo) & (PY_WINDOW - 1); /* (as it is: the verifier's bound) */
    st->py_win = 0;
    if (bpf_probe_read_user(b, len, (void *)lo))
        return -1;
    st->py_win = lo;
    st->py_win_len = len;
    return frame - lo;
}

/* The thread's current Python frame, or 0 where its state cannot be read
 * (the interpreter not started yet, a thread that never ran Python). */
static __always_inline u64 python_current(struct python_proc *py)
{
    u64 task = bpf_get_current_task(), tp = 0, tstate = 0, at = 0, frame = 0;
    if (bpf_probe_read_kernel(&tp, sizeof(tp), (void *)(task + TASK_FSBASE_OFF)) || !tp)
        return 0;
    u32 tss[2] = {}; /* made, and the pthread key */
    if (bpf_probe_read_user(tss, sizeof(tss), (void *)py->tss_at) || !tss[0] || tss[1] >= PY_KEYS)
        return 0;
    u64 slot = tp + py->slot_base + (u64)tss[1] * py->slot_stride;
    if (bpf_probe_read_user(&tstate, sizeof(tstate), (void *)slot) || !tstate)
        return 0;
    at = tstate;
    if (py->tstate_cframe != PY_NO_FIELD &&
        (bpf_probe_read_user(&at, sizeof(at), (void *)(tstate + py->tstate_cframe)) || !at))
        return 0;
    if (bpf_probe_read_user(&frame, sizeof(frame), (void *)(at + py->current_frame)))
        return 0;
    return frame;
}

/* Store `frame` as the walk's next: in the eval loop's frame's place first. */
static __always_inline void python_store(struct unwind_state *st, struct alloc_frames_row *row,
                                         u64 frame)
{
    if (st->py_stored) {
        row->ip[st->n & (FRAME_DEPTH - 1)] = frame;
        st->n++;
    } else {
        row->ip[(st->n - 1) & (FRAME_DEPTH - 1)] = frame;
    }
    st->py_stored = st->py_any = 1;
    st->hash = (st->hash ^ (st->hash >> 29) ^ frame) * 0x9e3779b97f4a7c15ull;
    st->mixed = st->n;
}

/* The walk has one tail call left and the thread Python frames it has not
 * stored: they go in it (the native frames between them left out), not a
 * few more native frames. */
static __always_inline int python_rest_due(struct unwind_state *st)
{
    if (st->py_state != PY_READ || !st->py_frame || st->calls + 2 < UNWIND_CALLS)
        return 0;
    st->py_rest = 1;
    st->py_stored = 1; /* after the frames stored: none replaced */
    return 1;
}

/* python_frames' outcomes */
#define PY_ENTRY 0 /* the eval loop's frames are all stored (or none could be read) */
#define PY_MORE 1  /* more of them than one call stores */
#define PY_FULL 2  /* the walk is full (FRAME_DEPTH) */

/* The thread's next Python frame, stored if it is one of the eval loop's
 * frame the walk is at: PY_MORE while more may follow, else the outcome. */
static __always_inline int python_frame(struct unwind_state *st, struct alloc_frames_row *row,
                                        struct python_proc *py, u64 *b, u32 *stored)
{
    u64 frame = st->py_frame;
    if (!frame)
        return PY_ENTRY;
    long off = python_window(st, b, frame);
    if (off < 0) {
        unwind_misc.increment(UX_PY_UNREADABLE);
        st->py_frame = 0;
        return PY_ENTRY;
    }
    st->py_frame = python_word(b, off, py->frame_previous);
    if (py->owner_cstack != PY_NO_OWNER &&
        python_byte(b, off, py->frame_owner) == py->owner_cstack) {
        if (st->py_rest)
            return PY_MORE; /* (an outer eval loop's frames follow) */
        return PY_ENTRY; /* the eval loop's entry frame: its Python frames end here */
    }
    if (st->py_stored && st->n >= FRAME_DEPTH)
        return PY_FULL;
    u64 code = python_word(b, off, py->frame_code);
    u64 instr = python_word(b, off, py->frame_instr);
    u64 first = code + py->code_adaptive, units = (instr - first) >> 1;
    u64 offset = instr >= first && units < PY_NO_OFFSET ? units : PY_NO_OFFSET;
    /* (a user-space address: 47 bits, its low 3 zero; a torn read's
     * higher bits are not let into the kind's) */
    u64 object = (code >> 3) & ((1ull << (FRAME_KIND_SHIFT - FRAME_PYTHON_SHIFT)) - 1);
    python_store(st, row, ((u64)FRAME_KIND_PYTHON << FRAME_KIND_SHIFT) |
                              (object << FRAME_PYTHON_SHIFT) | offset);
    (*stored)++;
    if (!st->py_rest && py->frame_is_entry != PY_NO_FIELD &&
        python_byte(b, off, py->frame_is_entry))
        return PY_ENTRY; /* 3.11: the frame the eval loop was entered with */
    return PY_MORE;
}

#if UNWIND_LOOP
/* python_frames' frames through bpf_loop (as unwind_step's, unwind.bpf.c):
 * what they work on, in the program's stack. */
struct python_loop {
    struct unwind_state *st;
    struct alloc_frames_row *row;
    struct python_proc *py;
    u64 *b;
    u32 stored;
    long outcome; /* python_frame's last answer */
};

/* bpf_loop's callback (linked in by user space, tracer/bpf/bpf_callbacks.py):
 * one frame; 1 (no more) unless more may follow. */
long unwind_python__callback(void *index)
{
    struct python_loop *loop;
    asm volatile("%0 = r2" : "=r"(loop));
    loop->outcome = python_frame(loop->st, loop->row, loop->py, loop->b, &loop->stored);
    return loop->outcome != PY_MORE;
}
#endif

/* The Python frames of the eval loop's frame the walk is at, from the
 * thread's next one, stored (`stored`: how many) as far as one call goes. */
static __always_inline int python_frames(struct unwind_state *st, struct alloc_frames_row *row,
                                         struct python_proc *py, u64 *b, u32 *stored)
{
#if UNWIND_LOOP
    struct python_loop loop = {st, row, py, b, 0, PY_MORE};
    bpf_loop(PYTHON_STEP_FRAMES, unwind_python__callback, &loop, 0);
    *stored = loop.stored;
    return loop.outcome;
#else
    for (int i = 0; i < PYTHON_STEP_FRAMES; i++) {
        int outcome = python_frame(st, row, py, b, stored);
        if (outcome != PY_MORE)
            return outcome;
    }
    return PY_MORE;
#endif
}

/* UNWIND_PYTHON: the Python frames of the eval loop's frame the walk is
 * at, stored in its place; then the walk's next step (or its end). */
int unwind_python(struct pt_regs *ctx)
{
    u32 zero = 0, tgid = bpf_get_current_pid_tgid() >> 32, stored = 0;
    struct unwind_state *st = unwind_state();
    struct alloc_frames_row *row = alloc_walk.lookup(&zero);
    struct python_bytes *bytes = python_frame_bytes.lookup(&zero);
    if (!st || !row || !bytes)
        return 0;
    struct python_proc *py = python_procs.lookup(&tgid);
    int outcome = PY_ENTRY;
    if (!py) {
        st->py_state = PY_NONE;
    } else {
        if (st->py_state == PY_UNREAD) {
            st->py_frame = python_current(py);
            st->py_state = PY_READ;
            if (!st->py_frame)
                unwind_misc.increment(UX_PY_NO_THREAD);
        }
        if (!st->py_rest && st->py_at != st->sp) { /* a new eval loop frame, not a next part */
            st->py_at = st->sp;
            st->py_stored = 0;
        }
        outcome = python_frames(st, row, py, bytes->words, &stored);
        if (!st->py_frame && outcome != PY_FULL)
            st->py_state = PY_NONE; /* none left: the eval loop's further frames stay native */
    }
    unwind_misc_add(UX_PY_FRAMES, stored);
    if (outcome == PY_FULL) {
        st->ended = UX_DEPTH;
    } else if (st->py_rest) {
        if (outcome == PY_MORE)
            unwind_next(ctx, st, UNWIND_PYTHON);
        st->ended = UX_BOUNDS; /* the native frames between left out: cut */
    } else {
        if (python_rest_due(st)) /* (no native call would come back) */
            unwind_next(ctx, st, UNWIND_PYTHON);
        /* the next part of these Python frames, or the native walk's */
        unwind_next(ctx, st, outcome == PY_MORE ? UNWIND_PYTHON : UNWIND_STEP);
        st->ended = UX_BOUNDS; /* no more tail calls */
    }
    unwind_finish(ctx, st, row);
    return 0;
}
#else
static __always_inline void python_begin(struct unwind_state *st, u32 tgid)
{
    st->py_state = PY_NONE;
}
static __always_inline void python_fork(u32 parent, u32 child) {}
static __always_inline void python_forget(u32 tgid) {}
static __always_inline void python_new_stack(struct unwind_state *st) {}
static __always_inline int python_rest_due(struct unwind_state *st) { return 0; }
#endif
#endif
