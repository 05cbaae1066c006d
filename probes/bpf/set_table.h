/* The set-associative tables in BPF arrays that the trace program keeps its live
 * objects, call sites and caches in, and the kmem floor (kmem_empty.bpf.c)
 * its live pointers: a key's home is one bucket of TABLE_WAYS ways, whose
 * keys fill one cache line; a way is claimed with a compare-and-swap of
 * its key (0: free). No maps here: bcc rewrites map calls only in the
 * main source file. */
#ifndef MTRACE_SET_TABLE_H
#define MTRACE_SET_TABLE_H

#define TABLE_WAYS 8 /* the slots of a bucket: their keys fill one cache line */

/* The home bucket of `key` among `buckets` (a power of two). */
static __always_inline u32 table_bucket(u64 key, u32 buckets)
{
    return (u32)((key * 0x9E3779B97F4A7C15ULL) >> 32) & (buckets - 1);
}

/* The way of bucket `words` holding `value`, or -1. */
static __always_inline int way_of(u64 *words, u64 value)
{
#pragma unroll
    for (int i = 0; i < TABLE_WAYS; i++)
        if (words[i] == value)
            return i;
    return -1;
}

/* Claims a free way of `words` for `value`: its index, or -1 if all are taken. */
static __always_inline int claim_way(u64 *words, u64 value)
{
#pragma unroll
    for (int i = 0; i < TABLE_WAYS; i++)
        if (words[i] == 0 && __sync_val_compare_and_swap(&words[i], 0, value) == 0)
            return i;
    return -1;
}

#endif
