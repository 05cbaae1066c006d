/* A program whose malloc is jemalloc's (linked before the libc) and that
 * also calls glibc's own malloc, found in the libc by dlsym, as a plugin
 * that bypasses the process's allocator does: two providers in one process.
 *
 * usage: two_providers N M: waits for a line on standard input, then makes
 * N calls of malloc(48) from via_jemalloc, freeing every other block, M
 * calls of the libc's malloc(80) from via_libc, freeing none, and from
 * in_place M blocks of 64 bytes each shrunk in place to 60 by jemalloc's
 * xallocx (a block of 64 holds 60 where it is), then freed; and prints
 * {"jemalloc_calls": N, "jemalloc_bytes": ..., "libc_calls": M, ...}. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

#define NOINLINE __attribute__((noinline))

static void *(*libc_malloc)(size_t);
size_t xallocx(void *ptr, size_t size, size_t extra, int flags); /* jemalloc's */

NOINLINE long via_jemalloc(long n)
{
    long kept = 0;
    for (long i = 0; i < n; i++) {
        void *p = malloc(48);
        __asm__ volatile("" : : "r"(p) : "memory");
        if (i % 2)
            free(p);
        else
            kept++;
    }
    return kept;
}

NOINLINE void via_libc(long m)
{
    for (long i = 0; i < m; i++) {
        void *p = libc_malloc(80);
        __asm__ volatile("" : : "r"(p) : "memory");
    }
}

NOINLINE long in_place(long m)
{
    long resized = 0;
    for (long i = 0; i < m; i++) {
        void *p = malloc(64);
        resized += xallocx(p, 60, 0, 0) >= 60;
        free(p);
    }
    return resized;
}

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 1000, m = argc > 2 ? atol(argv[2]) : 100;
    void *libc = dlopen("libc.so.6", RTLD_LAZY | RTLD_NOLOAD);
    libc_malloc = libc ? (void *(*)(size_t))dlsym(libc, "malloc") : NULL;
    if (!libc_malloc || libc_malloc == malloc)
        return 2; /* the libc's malloc is not another provider's */
    char line[16];
    printf("ready\n");
    fflush(stdout);
    if (!fgets(line, sizeof(line), stdin))
        return 3;
    long kept = via_jemalloc(n);
    via_libc(m);
    long resized = in_place(m);
    printf("{\"jemalloc_calls\": %ld, \"jemalloc_bytes\": %ld, \"jemalloc_leaked\": %ld, "
           "\"libc_calls\": %ld, \"libc_bytes\": %ld, \"in_place_mallocs\": %ld, "
           "\"in_place_resized\": %ld}\n", n, n * 48, kept, m, m * 80, m, resized);
    return 0;
}
