/* A short program as distributions build theirs (-O2, no frame pointers,
 * PIE): ALLOCS allocations, each through main > outer > middle > inner >
 * malloc, all freed, then it exits. Run by the thousand under a trace
 * (tests/privileged/test_short_processes.py): each process starts after
 * the trace did, and is gone before its maps could be read. */
#include <stdlib.h>

#define ALLOCS 50

static void *volatile kept[ALLOCS];

__attribute__((noinline)) static void *inner(size_t size)
{
    void *p = malloc(size);
    __asm__ volatile("" ::: "memory"); /* not a tail call */
    return p;
}

__attribute__((noinline)) static void *middle(size_t size)
{
    void *p = inner(size + 1);
    __asm__ volatile("" ::: "memory");
    return p;
}

__attribute__((noinline)) static void *outer(size_t size)
{
    void *p = middle(size + 1);
    __asm__ volatile("" ::: "memory");
    return p;
}

int main(void)
{
    for (int i = 0; i < ALLOCS; i++)
        kept[i] = outer(40 + (size_t)i);
    for (int i = 0; i < ALLOCS; i++)
        free(kept[i]);
    return 0;
}
