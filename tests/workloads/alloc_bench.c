/* The allocation benchmark's workload (bench/alloc_bench.py).
 *
 *   alloc_bench ITERATIONS THREADS MIX
 *
 * Each of THREADS threads runs ITERATIONS steps. MIX 0: malloc(32) then
 * free, a pair per step. MIX 1: a mix like a server's: sizes from 16 bytes
 * to 4 KiB (small ones most often), one step in 16 a calloc, one in 8 a
 * realloc of a live block, each block freed 256 steps after it was made.
 *
 * With DEPTH=N in the environment each thread runs its loop N calls deeper
 * (descend), so that an allocation's stack is N + 4 frames: the loop's
 * function, N of descend, the thread's start function, start_thread and
 * clone3 (the cost of a stack walk by its depth, bench/alloc_bench.py).
 *
 * With GATE set it waits for a byte on stdin before the loop (so that a
 * tracer can attach to its pid) and another before exiting. It prints
 * "wall SECONDS" (the loop, all threads) and "calls N" (allocation
 * functions called, frees included). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define WINDOW 256

static long iterations;
static int mix;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void *volatile sink;

static void *pairs(void *arg)
{
    (void)arg;
    for (long i = 0; i < iterations; i++) {
        void *p = malloc(32);
        sink = p;
        free(p);
    }
    return (void *)(2 * iterations);
}

static void *server_mix(void *arg)
{
    unsigned seed = (unsigned)(unsigned long)arg;
    void *live[WINDOW] = {0};
    long calls = 0;
    for (long i = 0; i < iterations; i++) {
        int slot = i % WINDOW;
        if (live[slot]) {
            free(live[slot]);
            calls++;
        }
        unsigned r = rand_r(&seed);
        size_t size = 16u << (r % 9); /* 16 .. 4096 */
        size += r % size;
        if (size > 4096)
            size = 4096;
        if (r % 16 == 0)
            live[slot] = calloc(1, size);
        else
            live[slot] = malloc(size);
        calls++;
        if (r % 8 == 1) {
            int other = (slot + WINDOW / 2) % WINDOW;
            if (live[other]) {
                live[other] = realloc(live[other], size * 2);
                calls++;
            }
        }
    }
    for (int slot = 0; slot < WINDOW; slot++)
        if (live[slot]) {
            free(live[slot]);
            calls++;
        }
    return (void *)calls;
}

static long depth;

/* level calls of itself, then the loop: a call, not a jump (work after it). */
__attribute__((noinline, noclone)) static void *descend(long level, void *arg)
{
    void *done = level > 1 ? descend(level - 1, arg) : (mix ? server_mix : pairs)(arg);
    __asm__ volatile("" : : "r"(done) : "memory");
    return done;
}

static void *thread_start(void *arg)
{
    return depth > 0 ? descend(depth, arg) : (mix ? server_mix : pairs)(arg);
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: %s ITERATIONS THREADS MIX\n", argv[0]);
        return 2;
    }
    iterations = atol(argv[1]);
    int threads = atoi(argv[2]);
    mix = atoi(argv[3]);
    if (iterations < 1 || threads < 1 || threads > 64) {
        fprintf(stderr, "usage: %s ITERATIONS THREADS MIX\n", argv[0]);
        return 2;
    }
    depth = getenv("DEPTH") ? atol(getenv("DEPTH")) : 0;
    char byte;
    if (getenv("GATE") && read(0, &byte, 1) != 1)
        return 1;
    pthread_t tid[64];
    double start = now();
    for (int t = 0; t < threads; t++)
        pthread_create(&tid[t], NULL, thread_start, (void *)(unsigned long)(t + 1));
    long calls = 0;
    for (int t = 0; t < threads; t++) {
        void *done;
        pthread_join(tid[t], &done);
        calls += (long)done;
    }
    double wall = now() - start;
    printf("wall %.6f\ncalls %ld\n", wall, calls);
    fflush(stdout);
    if (getenv("GATE") && read(0, &byte, 1) < 0)
        return 1;
    return 0;
}
