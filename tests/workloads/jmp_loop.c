/* setjmp/longjmp as fast as possible, or at a set rate: the benchmark
 * workload for the cost of one USDT hit and for the event path.
 *
 *   jmp_loop ITERATIONS [RATE [THREADS]]
 *
 * Each of THREADS threads (default 1) makes ITERATIONS iterations; each
 * iteration calls setjmp once and longjmp once, which fires three libc
 * probes: setjmp, longjmp and longjmp_target. With RATE > 0 (iterations per
 * second, all threads together) each thread paces itself against
 * CLOCK_MONOTONIC, sleeping whenever it is ahead, so a paced loop leaves the
 * CPU to others. Prints the elapsed seconds on stdout. With GATE set in the
 * environment, waits for a byte on stdin first (see arena_contention.c). */
#include <pthread.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static long iterations;
static double rate; /* per thread */
static double start;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void pause_until(double when)
{
    double wait = when - now();
    if (wait <= 200e-6)
        return;
    struct timespec ts = {(time_t)wait, (long)((wait - (time_t)wait) * 1e9)};
    nanosleep(&ts, NULL);
}

static void *loop(void *arg)
{
    (void)arg;
    jmp_buf env;
    for (volatile long i = 0; i < iterations; i++) {
        if (rate > 0 && i % 64 == 0)
            pause_until(start + i / rate);
        if (setjmp(env) == 0)
            longjmp(env, 1);
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc < 2 || argc > 4) {
        fprintf(stderr, "usage: %s ITERATIONS [RATE [THREADS]]\n", argv[0]);
        return 2;
    }
    iterations = strtol(argv[1], NULL, 10);
    int threads = argc == 4 ? atoi(argv[3]) : 1;
    if (iterations < 0 || threads < 1 || threads > 64) {
        fprintf(stderr, "usage: %s ITERATIONS [RATE [THREADS]]\n", argv[0]);
        return 2;
    }
    rate = argc >= 3 ? strtod(argv[2], NULL) / threads : 0;
    char byte;
    if (getenv("GATE") && read(0, &byte, 1) != 1)
        return 1;
    start = now();
    if (threads == 1) {
        loop(NULL);
    } else {
        pthread_t tid[64];
        for (int t = 0; t < threads; t++)
            pthread_create(&tid[t], NULL, loop, NULL);
        for (int t = 0; t < threads; t++)
            pthread_join(tid[t], NULL);
    }
    printf("%.6f\n", now() - start);
    return 0;
}
