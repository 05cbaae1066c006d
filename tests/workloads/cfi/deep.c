/* libcfi_deep.so: a shared library built as distributions build them
 * (-O2, no frame pointers, PIC), whose functions allocate at the end of a
 * chain of calls (tests/workloads/cfi/cfi_stacks.c). Each function does
 * work after its call, so that the compiler makes a call, not a jump. */
#include <stdlib.h>

volatile unsigned long cfi_deep_sink;

__attribute__((noinline, noclone)) void *deep_leaf(size_t size)
{
    void *p = malloc(size);
    cfi_deep_sink += (unsigned long)p;
    return p;
}

/* depth calls of deep_chain, then deep_leaf */
__attribute__((noinline, noclone)) void *deep_chain(int depth, size_t size)
{
    void *p = depth > 1 ? deep_chain(depth - 1, size) : deep_leaf(size);
    cfi_deep_sink += depth;
    return p;
}
