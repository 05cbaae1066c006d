/* A library with no call-frame information at all (built without unwind
 * tables and without -g by tests/privileged/test_cfi_stacks.py), with frame
 * pointers or without: a chain of four calls down to malloc. */
#include <stdlib.h>
volatile int keep;
__attribute__((noinline)) void *nocfi_leaf(size_t n) { void *p = malloc(n); keep++; return p; }
__attribute__((noinline)) void *nocfi_chain(int depth, size_t n)
{
    void *p = depth ? nocfi_chain(depth - 1, n) : nocfi_leaf(n);
    keep++;
    return p;
}
