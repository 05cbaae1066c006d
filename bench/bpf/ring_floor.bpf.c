/* The floors of the event stream's cost (bench/usdt_floor.py): on the same
 * probe sites as mtrace-live, a handler that does nothing, and one that only
 * reserves a ring record of RECORD_BYTES, writes into it what it holds of a
 * hit (the thread's ids; from 16 bytes the site's address; from 40 bytes the
 * first three argument registers, all jmp_loop's probes have) and submits it.
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
#if RECORD_BYTES >= 16
    r->words[1] = PT_REGS_IP(ctx);
#endif
#if RECORD_BYTES >= 40
    r->words[2] = PT_REGS_PARM1(ctx);
    r->words[3] = PT_REGS_PARM2(ctx);
    r->words[4] = PT_REGS_PARM3(ctx);
#endif
    records.ringbuf_submit(r, BPF_RB_NO_WAKEUP);
    return 0;
}
