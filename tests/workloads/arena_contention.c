/* A multithreaded allocation load with few arenas, for watching contention.
 *
 *   arena_contention [SECONDS] [THREADS] [ARENAS]
 *
 * Limits malloc to ARENAS arenas (mallopt M_ARENA_MAX, default 2) and runs
 * THREADS threads (default 8) for SECONDS (default 10), each allocating and
 * freeing blocks of varied sizes in bursts, with a new thread started every
 * 100 ms so arenas keep being chosen and reused. Threads outnumber arenas,
 * so they wait on arena locks: memory_arena_reuse_wait and
 * lll_lock_wait_private on the arenas' mutexes. */
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double seconds = 10;

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
    while (now() < stop) {
        for (int i = 0; i < 64; i++) {
            free(blocks[i]);
            blocks[i] = malloc(16 + rand_r(&seed) % 4096);
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
    if (seconds <= 0 || threads < 1 || threads > 256 || arenas < 1) {
        fprintf(stderr, "usage: %s [SECONDS] [THREADS] [ARENAS]\n", argv[0]);
        return 2;
    }
    mallopt(M_ARENA_MAX, arenas);
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
