/* The soak's churn (tests/soak/soak.py): processes started and ended by the
 * thousand, threads, dlopen/dlclose, fork/exec and allocation bursts, for a
 * given time, counting what it did.
 *
 *   churn PLUGIN SECONDS [WRAPS]
 *
 * Prints "ready" and waits for a byte on stdin (tracers attach meanwhile),
 * then runs rounds until SECONDS have passed and the pids it was given have
 * wrapped past pid_max WRAPS times (0 unless given), so that pid reuse comes
 * by construction, not by the machine's speed; a round begun past
 * LIMIT x SECONDS is the last, however few wraps were seen. Each round:
 *   - forks FORKS children; each makes CHILD_CALLS malloc/free pairs and exits;
 *   - starts THREADS threads; each makes THREAD_CALLS pairs;
 *   - dlopens PLUGIN (libcfi_plugin.so), calls its plugin_alloc (a calloc)
 *     PLUGIN_CALLS times, frees each block, dlcloses it;
 *   - forks and execs itself as "churn --leaf" EXECS times; each makes
 *     CHILD_CALLS pairs;
 *   - allocates BURST blocks at once, then frees them.
 * and pauses PAUSE_MS. Then it prints one JSON line of what it did (the
 * calls it made itself; libc's own allocations come on top) and exits.
 * Every process of it is named "churn" (comm). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "ready.h"

#define FORKS 16
#define EXECS 2
#define THREADS 4
#define CHILD_CALLS 100
#define THREAD_CALLS 200
#define PLUGIN_CALLS 50
#define BURST 20000
#define PAUSE_MS 20
#define LIMIT 20

struct totals {
    long rounds, processes, execs, threads, dlopens, mallocs, callocs, frees, failures, wraps;
};

static struct totals *shared; /* MAP_SHARED: the forked children add theirs */
static pid_t last_pid;         /* the last child's: a smaller one means the pids wrapped */

static void seen_pid(pid_t pid)
{
    if (pid > 0 && pid < last_pid)
        shared->wraps++;
    if (pid > 0)
        last_pid = pid;
}

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void add(long *counter, long n)
{
    __atomic_add_fetch(counter, n, __ATOMIC_RELAXED);
}

/* `calls` malloc/free pairs of sizes that vary. */
static void pairs(int calls, unsigned seed)
{
    for (int i = 0; i < calls; i++) {
        void *p = malloc(16 + rand_r(&seed) % 2048);
        if (!p)
            abort();
        free(p);
    }
    add(&shared->mallocs, calls);
    add(&shared->frees, calls);
}

static void *thread_main(void *arg)
{
    pairs(THREAD_CALLS, (unsigned)(unsigned long)arg);
    return NULL;
}

static void forks(void)
{
    pid_t children[FORKS];
    for (int c = 0; c < FORKS; c++) {
        children[c] = fork();
        if (children[c] == 0) {
            pairs(CHILD_CALLS, (unsigned)c);
            _exit(0);
        }
        seen_pid(children[c]);
    }
    for (int c = 0; c < FORKS; c++) {
        int status;
        if (children[c] < 0 || waitpid(children[c], &status, 0) < 0 || status != 0)
            add(&shared->failures, 1);
        else
            add(&shared->processes, 1);
    }
}

static void threads(void)
{
    pthread_t ids[THREADS];
    for (long t = 0; t < THREADS; t++)
        if (pthread_create(&ids[t], NULL, thread_main, (void *)t))
            abort();
    for (int t = 0; t < THREADS; t++)
        pthread_join(ids[t], NULL);
    add(&shared->threads, THREADS);
}

static void plugin(const char *path)
{
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
        fprintf(stderr, "%s\n", dlerror());
        exit(1);
    }
    void *(*alloc)(size_t) = (void *(*)(size_t))dlsym(handle, "plugin_alloc");
    for (int i = 0; i < PLUGIN_CALLS; i++)
        free(alloc(64 + i));
    dlclose(handle);
    add(&shared->dlopens, 1);
    add(&shared->callocs, PLUGIN_CALLS);
    add(&shared->frees, PLUGIN_CALLS);
}

static void execs(const char *self)
{
    for (int e = 0; e < EXECS; e++) {
        pid_t child = fork();
        if (child == 0) {
            execl(self, self, "--leaf", (char *)NULL);
            _exit(127);
        }
        seen_pid(child);
        int status;
        if (child < 0 || waitpid(child, &status, 0) < 0 || status != 0) {
            add(&shared->failures, 1);
            continue;
        }
        add(&shared->execs, 1);
        add(&shared->mallocs, CHILD_CALLS);
        add(&shared->frees, CHILD_CALLS);
    }
}

static void burst(void)
{
    static void *blocks[BURST];
    for (int i = 0; i < BURST; i++)
        if (!(blocks[i] = malloc(32 + i % 512)))
            abort();
    for (int i = 0; i < BURST; i++)
        free(blocks[i]);
    add(&shared->mallocs, BURST);
    add(&shared->frees, BURST);
}

int main(int argc, char **argv)
{
    if (argc == 2 && !strcmp(argv[1], "--leaf")) {
        static struct totals mine; /* counted by the parent, which knows CHILD_CALLS */
        shared = &mine;
        pairs(CHILD_CALLS, 7);
        return 0;
    }
    if (argc < 3 || argc > 4 || atof(argv[2]) <= 0) {
        fprintf(stderr, "usage: %s PLUGIN SECONDS [WRAPS]\n", argv[0]);
        return 2;
    }
    long wraps = argc == 4 ? atol(argv[3]) : 0;
    char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n <= 0)
        return 1;
    self[n] = 0; /* the real path: exec'd through it, the child keeps the name "churn" */
    shared = mmap(NULL, sizeof *shared, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shared == MAP_FAILED)
        return 1;
    ready_then_wait();
    double start = now(), end = start + atof(argv[2]), limit = start + LIMIT * atof(argv[2]);
    struct timespec pause = {0, PAUSE_MS * 1000000L};
    while (now() < end || (shared->wraps < wraps && now() < limit)) {
        forks();
        threads();
        plugin(argv[1]);
        execs(self);
        burst();
        shared->rounds++;
        nanosleep(&pause, NULL);
    }
    printf("{\"rounds\": %ld, \"processes\": %ld, \"execs\": %ld, \"threads\": %ld, "
           "\"dlopens\": %ld, \"mallocs\": %ld, \"callocs\": %ld, \"frees\": %ld, "
           "\"failures\": %ld, \"wraps\": %ld, \"seconds\": %.1f}\n",
           shared->rounds, shared->processes, shared->execs, shared->threads, shared->dlopens,
           shared->mallocs, shared->callocs, shared->frees, shared->failures, shared->wraps,
           now() - start);
    fflush(stdout);
    return shared->failures ? 1 : 0;
}
