/* Threads that contend for a few arenas made before a tracer attaches.
 *
 *   arena_waits THREADS ARENAS OPS [keep]
 *
 * Limits malloc to ARENAS arenas (mallopt M_ARENA_MAX), starts THREADS
 * threads, and has each one allocate once, so that every arena it will use
 * exists. Then it prints, one line each:
 *
 *   pid PID
 *   arena TID ADDRESS      (each thread's arena: "main", or its address)
 *   ready
 *
 * and waits for a byte on stdin (a tracer attaches meanwhile). Each thread
 * then makes OPS rounds of 64 free()/malloc() pairs of 1-4 KiB, threads
 * outnumbering arenas, so that they wait on the arenas' mutexes. Last it
 * prints
 *
 *   wall SECONDS           (from the release of the threads to the last one's end)
 *   thread_seconds SECONDS (the sum of the threads' own times, release to end)
 *   lifetimes SECONDS      (the sum of every thread's life so far: main's from
 *                          its start, each worker's from its start to its end)
 *   main SECONDS           (main's part of it)
 *
 * and waits for another byte (or the end of stdin) before it exits, so that
 * what a tracer counted can be read while it is still attached.
 *
 * With "keep", the threads stay after their rounds, each still attached to
 * its arena (glibc takes a thread off its arena's attached_threads only at
 * its exit), until that byte: main prints
 *
 *   worked
 *
 * once they are all done, and the lines above only after it has the byte and
 * has joined them.
 *
 * A thread's arena is found as glibc lays its chunks out: a chunk of a
 * non-main arena has the NON_MAIN_ARENA bit (4) in its size word, and its
 * heap (the chunk's address rounded down to HEAP_MAX_SIZE, 64 MiB on 64-bit)
 * starts with heap_info, whose first word is the arena. */
#define _GNU_SOURCE
#include <malloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define HEAP_MAX_SIZE (64UL << 20)
#define NON_MAIN_ARENA 4UL

static long ops;
static pthread_barrier_t settled, released, worked, leave;
static int keep;
static pthread_mutex_t print_lock = PTHREAD_MUTEX_INITIALIZER;
static double thread_seconds, lifetimes;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void print_arena(void *block)
{
    uintptr_t size_word = ((uintptr_t *)block)[-1];
    pthread_mutex_lock(&print_lock);
    if (size_word & NON_MAIN_ARENA)
        printf("arena %ld %#lx\n", (long)syscall(SYS_gettid),
               (unsigned long)*(uintptr_t *)((uintptr_t)block & ~(HEAP_MAX_SIZE - 1)));
    else
        printf("arena %ld main\n", (long)syscall(SYS_gettid));
    pthread_mutex_unlock(&print_lock);
}

static void *worker(void *arg)
{
    double born = now();
    unsigned seed = (unsigned)(unsigned long)arg;
    void *blocks[64] = {0};
    blocks[0] = malloc(64);
    print_arena(blocks[0]);
    pthread_barrier_wait(&settled);
    pthread_barrier_wait(&released);
    double start = now();
    for (long n = 0; n < ops; n++) {
        for (int i = 0; i < 64; i++) {
            free(blocks[i]);
            blocks[i] = malloc(1024 + rand_r(&seed) % 3072);
        }
    }
    for (int i = 0; i < 64; i++)
        free(blocks[i]);
    double took = now() - start;
    if (keep) {
        pthread_barrier_wait(&worked);
        pthread_barrier_wait(&leave);
    }
    pthread_mutex_lock(&print_lock);
    thread_seconds += took;
    lifetimes += now() - born;
    pthread_mutex_unlock(&print_lock);
    return NULL;
}

int main(int argc, char **argv)
{
    double born = now();
    int threads = argc > 1 ? atoi(argv[1]) : 4;
    int arenas = argc > 2 ? atoi(argv[2]) : 2;
    ops = argc > 3 ? atol(argv[3]) : 10000;
    keep = argc == 5 && strcmp(argv[4], "keep") == 0;
    if (argc != 4 + keep || threads < 1 || threads > 256 || arenas < 1 || ops < 0) {
        fprintf(stderr, "usage: %s THREADS ARENAS OPS [keep]\n", argv[0]);
        return 2;
    }
    mallopt(M_ARENA_MAX, arenas);
    pthread_barrier_init(&settled, NULL, threads + 1);
    pthread_barrier_init(&released, NULL, threads + 1);
    pthread_barrier_init(&worked, NULL, threads + 1);
    pthread_barrier_init(&leave, NULL, threads + 1);
    pthread_t tid[256];
    for (int t = 0; t < threads; t++)
        pthread_create(&tid[t], NULL, worker, (void *)(unsigned long)(t + 1));
    pthread_barrier_wait(&settled);
    printf("pid %ld\nready\n", (long)getpid());
    fflush(stdout);
    char byte;
    if (read(0, &byte, 1) != 1)
        return 1;
    double start = now();
    pthread_barrier_wait(&released);
    if (keep) {
        pthread_barrier_wait(&worked);
        printf("worked\n");
        fflush(stdout);
        if (read(0, &byte, 1) != 1)
            return 1;
        pthread_barrier_wait(&leave);
    }
    for (int t = 0; t < threads; t++)
        pthread_join(tid[t], NULL);
    double end = now();
    printf("wall %.6f\nthread_seconds %.6f\nlifetimes %.6f\nmain %.6f\n", end - start,
           thread_seconds, lifetimes + end - born, end - born);
    fflush(stdout);
    if (read(0, &byte, 1) < 0)
        return 1;
    return 0;
}
