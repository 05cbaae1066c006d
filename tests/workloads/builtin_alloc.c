/* A program with an allocator built in under jemalloc's prefixed names, as
 * a server that bundles jemalloc with --with-jemalloc-prefix=je_ has it:
 * je_malloc, je_mallocx and je_free in its own symbol table, its malloc
 * still glibc's. Blocks are cut from a static pool and never reused.
 *
 * usage: builtin_alloc N: waits for a line on standard input, then makes N
 * calls of je_malloc(24) from main and frees every other block with
 * je_free, N / 4 calls of je_mallocx(40, 0) freeing none, and prints
 * {"malloc_calls": N, "malloc_bytes": ..., "mallocx_calls": ..., ...}. */
#include <stdio.h>
#include <stdlib.h>

#define NOINLINE __attribute__((noinline, used))

static char pool[64 << 20];
static size_t used;

NOINLINE void *je_malloc(size_t size)
{
    size_t at = (used + 15) & ~(size_t)15;
    if (at + size > sizeof(pool))
        return NULL;
    used = at + size;
    return pool + at;
}

NOINLINE void *je_mallocx(size_t size, int flags)
{
    (void)flags;
    return je_malloc(size);
}

NOINLINE void je_free(void *ptr)
{
    __asm__ volatile("" : : "r"(ptr) : "memory");
}

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 1000, kept = 0;
    char line[16];
    printf("ready\n");
    fflush(stdout);
    if (!fgets(line, sizeof(line), stdin))
        return 3;
    for (long i = 0; i < n; i++) {
        void *p = je_malloc(24);
        if (i % 2)
            je_free(p);
        else
            kept++;
    }
    for (long i = 0; i < n / 4; i++)
        je_mallocx(40, 0);
    printf("{\"malloc_calls\": %ld, \"malloc_bytes\": %ld, \"leaked\": %ld, "
           "\"mallocx_calls\": %ld, \"mallocx_bytes\": %ld}\n", n, n * 24, kept, n / 4,
           n / 4 * 40);
    return 0;
}
