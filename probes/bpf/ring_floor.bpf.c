/* The floors of the event stream's cost (bench/usdt_floor.py): on the same
 * probe sites as mtrace-live, a handler that does nothing, and one that only
 * reserves a ring record of RECORD_BYTES, writes the thread's ids into it and
 * submits it.
 * User space reads the records every millisecond and does nothing else with
 * them, and a commit wakes no one: what is measured is the record alone. */
#include <uapi/linux/ptrace.h>

#ifndef RECORD_BYTES
#define RECORD_BYTES 88 /* sizeof(struct event), probes/bpf/records.h */
#endif
#ifndef RING_PAGES
#define RING_PAGES 256
#endif

struct floor_record {
    u64 words[RECORD_BYTES / 8];
};

BPF_RINGBUF_OUTPUT(records, RING_PAGES);
BPF_PERCPU_ARRAY(refused, u64, 1); /* records the ring had no room for */

int empty(struct pt_regs *ctx)
{
    return 0;
}

int record(struct pt_regs *ctx)
{
    struct floor_record *r = records.ringbuf_reserve(sizeof(struct floor_record));
    if (!r) {
        refused.increment(0);
        return 0;
    }
    r->words[0] = bpf_get_current_pid_tgid();
    records.ringbuf_submit(r, BPF_RB_NO_WAKEUP);
    return 0;
}
