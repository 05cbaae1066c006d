/* Lock waits on a malloc arena's own lock, from known call chains, built as
 * distributions build their programs (no frame pointers: Makefile's
 * CFLAGS_DISTRO), each wait timed by the workload itself.
 *
 *   lock_chains WAITS
 *
 * A thread, "owner", makes an arena of its own (its first malloc) before
 * anything else happens; its lock is the first word of the arena, found from
 * the block's heap (glibc's heap_info begins with its arena's address). The
 * program prints "ready" and waits for a byte on stdin (a tracer attaches
 * meanwhile), then makes WAITS waits on that lock from each of three chains:
 *
 *   main;chain_a;wait_a                    the main thread
 *   main;chain_b;chain_b_inner;wait_b      the main thread
 *   owner_main;wait_c                      the owner thread
 *
 * Each wait: the lock is marked held (1), a helper releases it about 1 ms
 * later (0, and a futex wake), and meanwhile the chain's leaf calls glibc's
 * slow path, __lll_lock_wait_private (found with dlsym), which sleeps until
 * the release and returns holding the lock; the leaf frees it. Nothing else
 * uses that arena meanwhile. The leaf times each call with CLOCK_MONOTONIC.
 * At the end it prints, per chain,
 *
 *   stack WAITS TOTAL_NS FRAMES        (frames outermost first, ';' between)
 *
 * and waits for another byte before it exits. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define NOINLINE __attribute__((noinline))
#define HEAP_MAX (64L << 20) /* glibc's HEAP_MAX_SIZE on 64-bit: heaps are aligned to it */

typedef void (*wait_fn)(int *);
static wait_fn wait_private;
static int *lock;          /* the owner's arena's lock */
static long waits;
static volatile int keep;  /* keeps the leaves' tails from being merged */

struct chain {
    const char *frames;
    long calls, total_ns;
};
static struct chain chains[3] = {
    {"main;chain_a;wait_a", 0, 0},
    {"main;chain_b;chain_b_inner;wait_b", 0, 0},
    {"owner_main;wait_c", 0, 0},
};

static long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* The helper: each request (a byte on the pipe) releases the lock ~1 ms later. */
static int requests[2];

static void *helper_main(void *unused)
{
    (void)unused;
    char byte;
    while (read(requests[0], &byte, 1) == 1) {
        struct timespec pause = {0, 1000000};
        nanosleep(&pause, NULL);
        __atomic_store_n(lock, 0, __ATOMIC_RELEASE);
        syscall(SYS_futex, lock, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    }
    return NULL;
}

/* One wait from chain ``n``'s leaf: the lock held, its release asked for,
 * glibc's slow path called and timed, the lock freed. */
static inline __attribute__((always_inline)) void one_wait(int n)
{
    __atomic_store_n(lock, 1, __ATOMIC_RELEASE);
    if (write(requests[1], "w", 1) != 1)
        abort();
    long begun = now_ns();
    wait_private(lock);
    chains[n].total_ns += now_ns() - begun;
    chains[n].calls++;
    __atomic_store_n(lock, 0, __ATOMIC_RELEASE);
}

NOINLINE void wait_a(void) { for (long i = 0; i < waits; i++) one_wait(0); keep++; }
NOINLINE void chain_a(void) { wait_a(); keep++; }
NOINLINE void wait_b(void) { for (long i = 0; i < waits; i++) one_wait(1); keep++; }
NOINLINE void chain_b_inner(void) { wait_b(); keep++; }
NOINLINE void chain_b(void) { chain_b_inner(); keep++; }
NOINLINE void wait_c(void) { for (long i = 0; i < waits; i++) one_wait(2); keep++; }

static pthread_mutex_t step = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t stepped = PTHREAD_COND_INITIALIZER;
static int stage; /* 1: the arena is made; 2: the owner may wait; 3: it has */

static void set_stage(int to)
{
    pthread_mutex_lock(&step);
    stage = to;
    pthread_cond_broadcast(&stepped);
    pthread_mutex_unlock(&step);
}

static void await_stage(int at)
{
    pthread_mutex_lock(&step);
    while (stage < at)
        pthread_cond_wait(&stepped, &step);
    pthread_mutex_unlock(&step);
}

NOINLINE void *owner_main(void *unused)
{
    (void)unused;
    void *block = malloc(64); /* this thread's first: an arena of its own */
    uintptr_t heap = (uintptr_t)block & ~(uintptr_t)(HEAP_MAX - 1);
    uintptr_t arena = *(uintptr_t *)heap;
    if (!block || arena <= heap || arena - heap > 256) {
        fprintf(stderr, "lock_chains: the thread's block is not in a heap of its own arena\n");
        exit(1);
    }
    lock = (int *)arena; /* the arena's mutex is its first member */
    set_stage(1);
    await_stage(2);
    wait_c();
    set_stage(3);
    free(block);
    keep++;
    return NULL;
}

int main(int argc, char **argv)
{
    waits = argc == 2 ? atol(argv[1]) : 0;
    wait_private = (wait_fn)dlsym(RTLD_DEFAULT, "__lll_lock_wait_private");
    if (waits <= 0 || !wait_private) {
        fprintf(stderr, "usage: %s WAITS (and a glibc exporting __lll_lock_wait_private)\n",
                argv[0]);
        return 2;
    }
    pthread_t owner, helper;
    if (pipe(requests) || pthread_create(&owner, NULL, owner_main, NULL))
        return 1;
    await_stage(1);
    if (pthread_create(&helper, NULL, helper_main, NULL))
        return 1;
    printf("ready\n");
    fflush(stdout);
    char byte;
    if (read(0, &byte, 1) != 1)
        return 1;
    chain_a();
    chain_b();
    set_stage(2);
    await_stage(3);
    pthread_join(owner, NULL);
    close(requests[1]);
    pthread_join(helper, NULL);
    for (int n = 0; n < 3; n++)
        printf("stack %ld %ld %s\n", chains[n].calls, chains[n].total_ns, chains[n].frames);
    fflush(stdout);
    if (read(0, &byte, 1) < 0)
        return 1;
    return keep < 0;
}
