/* The libc's lock-wait slow path, entered on a free lock, again and again:
 * what a probe on it costs per wait, without a wait's own time.
 *
 *   lock_wait_calls N
 *
 * Calls __lll_lock_wait_private (found with dlsym: glibc exports it as
 * GLIBC_PRIVATE) N times on a lock that is free, so that each call takes
 * it at once and returns; the lock is freed again before the next call.
 * With GATE set in the environment it waits for a byte on stdin before the
 * calls (a tracer attaches meanwhile) and for another after printing
 *
 *   calls N
 *   ns_per_call NS
 *   SECONDS                (the calls' wall time, last) */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

typedef void (*wait_fn)(int *);

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
    long n = argc > 1 ? atol(argv[1]) : 0;
    wait_fn wait_private = (wait_fn)dlsym(RTLD_DEFAULT, "__lll_lock_wait_private");
    if (argc != 2 || n <= 0 || !wait_private) {
        fprintf(stderr, "usage: %s N (and a glibc exporting __lll_lock_wait_private)\n", argv[0]);
        return 2;
    }
    char byte;
    if (getenv("GATE") && read(0, &byte, 1) != 1)
        return 1;
    volatile int lock = 0;
    double start = now();
    for (long i = 0; i < n; i++) {
        lock = 0;
        wait_private((int *)&lock);
    }
    double took = now() - start;
    printf("calls %ld\nns_per_call %.1f\n%.6f\n", n, took * 1e9 / n, took);
    fflush(stdout);
    if (getenv("GATE") && read(0, &byte, 1) < 0)
        return 1;
    return 0;
}
