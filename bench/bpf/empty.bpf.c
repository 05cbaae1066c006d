/* A handler that does nothing: the benchmark's floor (bench/alloc_floor.py)
 * attaches it where mtrace-live attaches the allocation functions' handlers,
 * so that what is measured is the kernel's own cost of the probes. */
#include <uapi/linux/ptrace.h>

int empty(struct pt_regs *ctx)
{
    return 0;
}
