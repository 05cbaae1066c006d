/* A multithreaded allocation load with few arenas, for watching contention.
 *
 *   arena_contention [SECONDS] [THREADS] [ARENAS] [OPS]
 *
 * Limits malloc to ARENAS arenas (mallopt M_ARENA_MAX, default 2) and runs
 * THREADS threads (default 8) for SECONDS (default 10), each allocating and
 * freeing blocks of varied sizes in bursts, with a new thread started every
 * 100 ms so arenas keep being chosen and reused. Threads outnumber arenas,
 * so they wait on arena locks: memory_arena_reuse_wait and
 * lll_lock_wait_private on the arenas' mutexes.
 *
 * With OPS > 0 the work is fixed instead, for benchmarks: one round of
 * THREADS threads, each making OPS bursts of 64 free()/malloc() pairs and
 * one 256 KiB block allocated and freed. With the trim threshold at 64 KiB
 * and the mmap threshold fixed at 1 MiB, each big block grows its arena
 * (memory_sbrk_more in the main arena, memory_heap_more in the others) and
 * its free shrinks it again (memory_sbrk_less, memory_heap_less): hits the
 * workload knows, besides the lock waits it cannot predict. Prints the
 * wall-clock seconds, then, last, the CPU seconds of all its threads. With
 * GATE set in the environment, the program waits for a byte on stdin before
 * it starts, so that a tracer that needs its pid can attach first; and in
 * the OPS mode, once it has printed its times, for another byte (or the end
 * of stdin) before it exits, so that what the tracers counted can be read
 * while they are still attached. */
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

static double seconds = 10;
static long ops;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void *worker(void *arg)
{
    unsigned seed = (unsigned)(unsigned long)arg;
    void *blocks[64] = {0};
    double stop = now() + 0.5;
    for (long n = 0; ops ? n < ops : now() < stop; n++) {
        for (int i = 0; i < 64; i++) {
            free(blocks[i]);
            blocks[i] = malloc(16 + rand_r(&seed) % 4096);
        }
        if (ops) {
            volatile char *big = malloc(256 << 10);
            big[0] = 1;
            free((void *)big);
        }
    }
    for (int i = 0; i < 64; i++)
        free(blocks[i]);
    return NULL;
}

int main(int argc, char **argv)
{
    seconds = argc > 1 ? atof(argv[1]) : 10;
    int threads = argc > 2 ? atoi(argv[2]) : 8;
    int arenas = argc > 3 ? atoi(argv[3]) : 2;
    ops = argc > 4 ? atol(argv[4]) : 0;
    if (seconds <= 0 || threads < 1 || threads > 256 || arenas < 1 || ops < 0) {
        fprintf(stderr, "usage: %s [SECONDS] [THREADS] [ARENAS] [OPS]\n", argv[0]);
        return 2;
    }
    mallopt(M_ARENA_MAX, arenas);
    char byte;
    if (getenv("GATE") && read(0, &byte, 1) != 1)
        return 1;
    if (ops) {
        mallopt(M_MMAP_THRESHOLD, 1 << 20);
        mallopt(M_TRIM_THRESHOLD, 64 << 10);
        double start = now();
        pthread_t tid[256];
        for (int t = 0; t < threads; t++)
            pthread_create(&tid[t], NULL, worker, (void *)(unsigned long)(t + 1));
        for (int t = 0; t < threads; t++)
            pthread_join(tid[t], NULL);
        double wall = now() - start;
        struct rusage usage;
        getrusage(RUSAGE_SELF, &usage);
        printf("wall %.6f\n%.6f\n", wall,
               usage.ru_utime.tv_sec + usage.ru_utime.tv_usec / 1e6 + usage.ru_stime.tv_sec +
                   usage.ru_stime.tv_usec / 1e6);
        fflush(stdout);
        if (getenv("GATE") && read(0, &byte, 1) < 0)
            return 1;
        return 0;
    }
    double end = now() + seconds;
    unsigned long round = 0;
    while (now() < end) {
        pthread_t tid[256];
        for (int t = 0; t < threads; t++)
            pthread_create(&tid[t], NULL, worker, (void *)(round * 256 + t + 1));
        for (int t = 0; t < threads; t++)
            pthread_join(tid[t], NULL);
        round++;
    }
    printf("%lu rounds of %d threads over %d arenas\n", round, threads, arenas);
    return 0;
}
