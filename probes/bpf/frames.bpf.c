/* ---- the frame store -------------------------------------------------------
 * User stacks walked by the handlers themselves (not the kernel's `stacks`
 * map): the allocation functions' kept calls (allocs.bpf.c) and the lock
 * waits (locks.bpf.c). Each stack is stored once, at the row of
 * alloc_frames that its 64-bit hash picks (the next free of FRAME_PROBES
 * rows on a collision). The first CPU to store a stack claims its row in
 * alloc_frame_claims, writes the frames, then the hash. Ids in keys and
 * events are ALLOC_FRAMES_BASE + row (records.h); user space names them
 * with the allocations' frames. */
/* This part's settings (ProgramConfig, probes/program.py), and their defaults. */
#ifndef WITH_FRAMES
#define WITH_FRAMES 0 /* the frame store and its walk */
#endif
/* Map sizes as bcc declares them: the run makes each map at its own size
 * (RUNTIME_SIZES, probes/program.py). */
#ifndef FRAME_ROWS
#define FRAME_ROWS 32768 /* rows of alloc_frames (a power of two): twice --alloc-stacks */
#endif
#ifndef FRAME_DEPTH
#define FRAME_DEPTH 32 /* frames kept from a stack's first (a power of two) */
#endif

#define FRAMES_NO_ROOM (-2) /* walk_frames: the stack was walked, the store was full */

#if WITH_FRAMES
#define FRAME_PROBES 8
struct alloc_frames_row {
    u64 hash; /* 0: free, or not written yet */
    u64 ip[FRAME_DEPTH];
};
BPF_ARRAY(alloc_frames, struct alloc_frames_row, FRAME_ROWS);
BPF_HASH(alloc_frame_claims, u32, u64, FRAME_ROWS);
BPF_PERCPU_ARRAY(alloc_walk, struct alloc_frames_row, 1);

/* The row of alloc_frames that holds `row`'s frames, stored now if new
 * (then `fresh` is set): its id, or FRAMES_NO_ROOM. */
static __always_inline s32 store_frames(struct alloc_frames_row *row, u64 hash, u8 *fresh)
{
    hash |= 1; /* never 0, which marks a free row */
    for (u32 probe = 0; probe < FRAME_PROBES; probe++) {
        u32 index = (u32)(hash + probe) & FRAME_MASK;
        struct alloc_frames_row *slot = alloc_frames.lookup(&index);
        if (!slot)
            break;
        if (slot->hash == hash)
            return ALLOC_FRAMES_BASE + index;
        if (slot->hash)
            continue; /* another stack's */
        if (alloc_frame_claims.insert(&index, &hash)) { /* another CPU is storing a stack here */
            u64 *claimed = alloc_frame_claims.lookup(&index);
            if (claimed && *claimed == hash)
                return ALLOC_FRAMES_BASE + index;
            continue;
        }
        __builtin_memcpy(slot->ip, row->ip, sizeof(slot->ip));
        asm volatile("" ::: "memory"); /* the frames before the hash that says they are there */
        slot->hash = hash;
        *fresh = 1;
        return ALLOC_FRAMES_BASE + index;
    }
    return FRAMES_NO_ROOM;
}

#define MAX_FRAME_BYTES (8 << 20) /* a frame larger than the default stack limit ends a walk */
/* The frame at `ip` (an allocation's call site, the return address where
 * the return probe stands; a lock wait's caller), then its callers, walked
 * by frame pointers from `fp` (%rbp of the caller's frame): each saved %rbp
 * must lie above `below` (the stack pointer) and the last, within
 * MAX_FRAME_BYTES, and be 8-aligned, else the walk ends. A chain into code
 * without frame pointers mostly ends there, without reading an unmapped
 * address (a page fault). The kernel's walker (bpf_get_stackid) cost about
 * ten times more here (docs/allocations.md). Returns the id of the stored
 * frames, -1, or FRAMES_NO_ROOM. */
static __always_inline s32 walk_frames(u64 ip, u64 fp, u64 below)
{
    u32 zero = 0;
    struct alloc_frames_row *row = alloc_walk.lookup(&zero);
    if (!row)
        return -1;
    u64 hash = (0x84222325cbf29ce4ull ^ ip) * 0x9e3779b97f4a7c15ull;
    row->ip[0] = ip; /* the call site, then its callers */
    int n = 1;
    for (int i = 1; i < FRAME_DEPTH; i++) {
        u64 frame[2]; /* the saved %rbp, the return address */
        if (fp <= below || fp - below > MAX_FRAME_BYTES || (fp & 7))
            break;
        if (bpf_probe_read_user(frame, sizeof(frame), (void *)fp) || !frame[1])
            break;
        row->ip[i] = frame[1];
        hash = (hash ^ (hash >> 29) ^ frame[1]) * 0x9e3779b97f4a7c15ull;
        below = fp;
        fp = frame[0];
        n = i + 1;
    }
    if (n < FRAME_DEPTH)
        row->ip[n & (FRAME_DEPTH - 1)] = 0;
    u8 fresh = 0;
    return store_frames(row, hash, &fresh);
}
#endif
