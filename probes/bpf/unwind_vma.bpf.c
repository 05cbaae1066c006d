/* ---- mappings found in the kernel ---------------------------------------------
 * A PC in no mapping of its process's tables (a process that started or
 * exec'd after the trace did and whose tables user space has not written
 * yet, a library it just dlopen'ed) is looked up in the kernel's VMA of
 * the process (bpf_find_vma, Linux 5.17; UNWIND_VMA): the file (device,
 * inode), the start and the page offset give the file's rows in
 * unwind_files, which user space writes once per file (tracer/
 * unwind_tables.py), and the mapping is kept among the process's last
 * ones (unwind_vmas), where unwind_step finds it at its next frames.
 * Where the file's rows are not written yet, its frames are stepped by
 * frame pointers (counted), and the first walk to meet it asks for them
 * through the unwind_found ring: the next call is whole. Each mapping
 * found is said there too, so that a process gone before its maps were
 * read is still named. */
#if WITH_UNWIND && UNWIND_VMA
/* The mappings found (EV_UNWIND_VMA), in a ring of their own: user space
 * reads it first, and between the files it writes for others, so that a
 * file asked for is written within milliseconds, not after the events. */
#define UNWIND_FOUND_PAGES 64
BPF_RINGBUF_OUTPUT(unwind_found, UNWIND_FOUND_PAGES);
/* The asks alone, for the file server (tracer/unwind/file_server.py): a process
 * of its own, which writes a small file's rows within a millisecond or
 * two, never kept waiting by the trace's own work. */
#define UNWIND_ASKS_PAGES 16
BPF_RINGBUF_OUTPUT(unwind_asks, UNWIND_ASKS_PAGES);
/* The program each followed process exec'd last, as execve was given it:
 * user space opens it by that path to write its rows, if the process is
 * gone before its maps could be read (a short one). */
struct unwind_exec_path {
    u32 parent; /* its parent's pid at the exec: a relative path is from the parent's cwd */
    u32 pad;
    char path[248];
};
BPF_TABLE("lru_hash", u32, struct unwind_exec_path, unwind_exec_paths, 4096);
BPF_PERCPU_ARRAY(unwind_path_scratch, struct unwind_exec_path, 1);

static __always_inline void unwind_exec(u32 tgid, const void *path)
{
    u32 zero = 0;
    struct unwind_exec_path *scratch = unwind_path_scratch.lookup(&zero);
    if (!scratch)
        return;
    bpf_probe_read_kernel_str(scratch->path, sizeof(scratch->path), path);
    void *task = (void *)bpf_get_current_task(), *parent = NULL;
    scratch->parent = 0;
    bpf_probe_read_kernel(&parent, sizeof(parent), task + TASK_REAL_PARENT_OFF);
    if (parent)
        bpf_probe_read_kernel(&scratch->parent, sizeof(scratch->parent), parent + TASK_TGID_OFF);
    unwind_exec_paths.update(&tgid, scratch);
}

/* What the kernel's VMA holding a PC says (unwind_vma__callback fills it). */
struct unwind_vma_found {
    u64 start, end, pgoff, file, dev, ino;
};

/* bpf_find_vma's callback (its arguments: the task, the VMA, the context;
 * its code is linked in by user space, tracer/bpf/bpf_callbacks.py, as bcc
 * 0.26 leaves its address 0). The VMA's fields at the running kernel's
 * offsets (its BTF: VMA_*_OFF and the like, tracer/unwind/unwind_tables.py). */
long unwind_vma__callback(void *task)
{
    void *vma;
    struct unwind_vma_found *found;
    asm volatile("%0 = r2" : "=r"(vma));
    asm volatile("%0 = r3" : "=r"(found));
    bpf_probe_read_kernel(&found->start, 8, vma + VMA_START_OFF);
    bpf_probe_read_kernel(&found->end, 8, vma + VMA_END_OFF);
    bpf_probe_read_kernel(&found->pgoff, 8, vma + VMA_PGOFF_OFF);
    bpf_probe_read_kernel(&found->file, 8, vma + VMA_FILE_OFF);
    if (!found->file)
        return 0;
    void *inode = NULL, *sb = NULL;
    u32 dev = 0;
    bpf_probe_read_kernel(&inode, 8, (void *)found->file + FILE_INODE_OFF);
    if (!inode)
        return 0;
    bpf_probe_read_kernel(&found->ino, 8, inode + INODE_INO_OFF);
    bpf_probe_read_kernel(&sb, 8, inode + INODE_SB_OFF);
    if (sb)
        bpf_probe_read_kernel(&dev, 4, sb + SB_DEV_OFF);
    found->dev = dev;
    return 0;
}

/* Say that the process found a mapping in the kernel: its frames are named
 * by it if it is gone before its maps are read, and where `ask`, the
 * file's rows are wanted; to unwind_found, or (`to_asks`) unwind_asks. 0
 * when the ring had no room. */
static __always_inline int unwind_vma_event(int to_asks, u32 tgid, struct unwind_vma_found *f,
                                            int ask, u32 number)
{
    struct event *e = to_asks ? unwind_asks.ringbuf_reserve(sizeof(struct event))
                              : unwind_found.ringbuf_reserve(sizeof(struct event));
    if (!e)
        return 0;
    __builtin_memset(e, 0, sizeof(*e));
    e->ts = bpf_ktime_get_ns();
    e->tgid = tgid;
    e->tid = (u32)bpf_get_current_pid_tgid();
    e->kind = EV_UNWIND_VMA;
    e->nargs = 6;
    e->args[0] = f->start;
    e->args[1] = f->end;
    e->args[2] = f->pgoff;
    e->args[3] = f->dev;
    e->args[4] = f->ino;
    e->args[5] = ask ? 1 | (u64)number << 1 : 0; /* an ask, and the number it gave the file */
    e->ustack = e->kstack = -1;
    unwind_found.ringbuf_submit(e, 0); /* (either ring's: the record says which) */
    return 1;
}

/* The numbers the walks' asks give files (their frames', FRAME_KIND_FILE):
 * the last given. The file server writes a file's rows with its number;
 * the trace numbers the files it writes itself from FRAME_KERNEL_NUMBERS on. */
BPF_ARRAY(unwind_file_numbers, u64, 1);

/* A new file number (0 once they ran out). A compare-and-swap: bcc's
 * LLVM 14 has no fetching add. */
static __always_inline u32 unwind_file_number(void)
{
    u32 zero = 0;
    u64 *next = unwind_file_numbers.lookup(&zero);
    if (!next)
        return 0;
    u64 seen = *next;
    for (int i = 0; i < 4; i++) {
        u64 was = __sync_val_compare_and_swap(next, seen, seen + 1);
        if (was == seen)
            return seen + 1 < FRAME_KERNEL_NUMBERS ? seen + 1 : 0;
        seen = was;
    }
    return 0;
}

/* The mapping of `f`, as the walk uses it: its file's rows where they are
 * written (asked for, the first time, where they are not). */
static __always_inline void unwind_vma_map(u32 tgid, struct unwind_vma_found *f,
                                           struct unwind_map *m, u32 files_gen)
{
    m->start = f->start;
    m->end = f->end;
    if (!f->file)
        return; /* anonymous memory (JIT code), or none: frame pointers there */
    struct unwind_file_key key = {f->dev, f->ino};
    struct unwind_file *file = unwind_files.lookup(&key);
    if (!file) {
        struct unwind_file asked = {};
        /* The first to find it asks (-EEXIST: another walk did; -E2BIG, a
         * full table: the file's frames stay by frame pointers, counted as
         * unwritten). The trace reads every ask from unwind_found, and
         * serves it if the file server, told through its own ring, does
         * not; an ask neither can read is taken back, asked again. */
        int ask = !unwind_files.insert(&key, &asked);
        struct unwind_file *mine = ask ? unwind_files.lookup(&key) : NULL;
        if (mine && !mine->written) /* the ask's own entry: numbered before anyone hears of it */
            mine->number = asked.number = unwind_file_number();
        int said = unwind_vma_event(0, tgid, f, ask, asked.number);
        if (ask && said)
            unwind_vma_event(1, tgid, f, ask, asked.number);
        else if (ask)
            unwind_files.delete(&key);
        m->pad = files_gen + 1;
        return;
    }
    unwind_vma_event(0, tgid, f, 0, 0);
    if (!file->written) {
        m->pad = files_gen + 1;
        return;
    }
    u64 offset = f->pgoff << PAGE_SHIFT_; /* the file offset at start (vm_pgoff counts pages) */
    if (!file->count || offset < file->seg_start || offset >= file->seg_end)
        return; /* no rows, or not its code: frame pointers there */
    m->bias = f->start - offset - file->seg_delta;
    m->first = file->first;
    m->count = file->count;
    m->pages = file->pages;
    m->page_count = file->page_count;
    m->page_base = file->page_base;
    m->file = file->number;
}

/* UNWIND_VMA_LOOKUP: the mapping of the walk's PC, found in the kernel's
 * VMA of the process, kept among its last ones (unwind_vmas); then the walk
 * goes on (UNWIND_STEP). */
int unwind_vma(struct pt_regs *ctx)
{
    u32 zero = 0;
    struct unwind_state *st = unwind_state();
    struct alloc_frames_row *row = alloc_walk.lookup(&zero);
    if (!st || !row)
        return 0;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u64 pc = st->pc - 1;
    struct unwind_vma_found f = {};
    unwind_misc.increment(UX_VMA_LOOKUPS);
    long failed = bpf_find_vma(bpf_get_current_task_btf(), pc, unwind_vma__callback, &f, 0);
    struct unwind_map m = {};
    if (failed == -16 /* -EBUSY */) {
        unwind_misc.increment(UX_VMA_BUSY);
        st->vma_fp = pc; /* by frame pointers, this once */
    } else {
        if (failed || f.start > pc || pc >= f.end) {
            f.start = pc; /* in no mapping: frame pointers there */
            f.end = pc + 1;
            f.file = 0;
        }
        unwind_vma_map(tgid, &f, &m, st->files_gen);
        struct unwind_vmas *vmas = unwind_vmas.lookup(&tgid);
        if (!vmas) {
            struct unwind_vmas none = {};
            unwind_vmas.update(&tgid, &none);
            vmas = unwind_vmas.lookup(&tgid);
        }
        if (vmas) {
            u32 slot = vmas->next++ & (UNWIND_VMA_SLOTS - 1);
            vmas->maps[slot] = m;
        } else {
            st->vma_fp = pc;
        }
    }
    unwind_next(ctx, st, UNWIND_STEP);
    st->ended = UX_BOUNDS;
    unwind_finish(ctx, st, row);
    return 0;
}
#else
static __always_inline void unwind_exec(u32 tgid, const void *path) {}
#endif
