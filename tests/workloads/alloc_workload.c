/* Allocations with a known shape, for checking mtrace-live's allocation
 * tracing against the truth.
 *
 * Each noinline function below is one call site of one allocation function,
 * with a known number of calls, of known sizes, of which a known number is
 * left unfreed. The program writes that truth as JSON (--out FILE):
 *   {"pid": P, "unknown_frees": U, "sites": [{"function": "<function>",
 *    "fn": "malloc", "calls": N, "bytes": B, "leaked_calls": L,
 *    "leaked_bytes": LB}, ...]}
 * one entry per (function, allocation function).
 *
 * --wait: allocate the "early" blocks, print "ready" and wait for a line on
 * standard input before the rest (so a tracer attached by --pid meanwhile
 * sees their frees as frees of memory allocated before it attached).
 * --hold: once done (the truth written), print "done" and wait for a line
 * on standard input before exiting, the leaks still outstanding.
 * --threads N: the threaded site runs in N threads (default 4).
 * --scale K: every count times K (default 1). */
#define _GNU_SOURCE
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define EARLY 50
#define NOINLINE __attribute__((noinline))

struct site {
    const char *name;
    const char *fn;
    long calls, bytes, leaked_calls, leaked_bytes;
};

static struct site sites[16];
static int nsites;
static long scale = 1;
static pthread_mutex_t truth_lock = PTHREAD_MUTEX_INITIALIZER;

static struct site *site(const char *name, const char *fn)
{
    for (int i = 0; i < nsites; i++)
        if (!strcmp(sites[i].name, name) && !strcmp(sites[i].fn, fn))
            return &sites[i];
    sites[nsites].name = name;
    sites[nsites].fn = fn;
    return &sites[nsites++];
}

static void count(const char *name, const char *fn, long calls, long bytes, long leaked_calls,
                  long leaked_bytes)
{
    pthread_mutex_lock(&truth_lock);
    struct site *s = site(name, fn);
    s->calls += calls;
    s->bytes += bytes;
    s->leaked_calls += leaked_calls;
    s->leaked_bytes += leaked_bytes;
    pthread_mutex_unlock(&truth_lock);
}

static void *volatile sink; /* keeps the compiler from dropping allocations */

NOINLINE void **early_blocks(void)
{
    void **blocks = calloc(EARLY, sizeof(void *)); /* freed before the trace ends: not counted */
    for (int i = 0; i < EARLY; i++)
        blocks[i] = malloc(100);
    return blocks;
}

NOINLINE void leak_small(void)
{
    long n = 1000 * scale;
    for (long i = 0; i < n; i++)
        sink = malloc(24);
    count("leak_small", "malloc", n, n * 24, n, n * 24);
}

NOINLINE void churn(void)
{
    long n = 5000 * scale;
    for (long i = 0; i < n; i++) {
        void *p = malloc(64);
        sink = p;
        free(p);
    }
    count("churn", "malloc", n, n * 64, 0, 0);
}

NOINLINE void calloc_half(void)
{
    long n = 200 * scale;
    void **keep = malloc(n * sizeof(void *));
    for (long i = 0; i < n; i++)
        keep[i] = calloc(10, 48);
    for (long i = 0; i < n; i += 2)
        free(keep[i]);
    count("calloc_half", "calloc", n, n * 480, n / 2, (n / 2) * 480);
    /* the array itself: one malloc here, freed */
    free(keep);
    count("calloc_half", "malloc", 1, n * (long)sizeof(void *), 0, 0);
}

/* realloc(NULL, 16), then 9 doublings: 10 realloc calls; the last block leaks. */
NOINLINE void realloc_chain(void)
{
    long n = 100 * scale;
    for (long c = 0; c < n; c++) {
        void *p = NULL;
        size_t size = 16;
        for (int i = 0; i < 10; i++, size *= 2)
            p = realloc(p, size);
        sink = p;
    }
    long bytes = 0;
    for (long size = 16, i = 0; i < 10; i++, size *= 2)
        bytes += size;
    count("realloc_chain", "realloc", n * 10, n * bytes, n, n * 16 * 512);
}

NOINLINE void aligned_posix(void)
{
    long n = 50 * scale;
    for (long i = 0; i < n; i++) {
        void *p;
        if (posix_memalign(&p, 64, 256) == 0)
            sink = p;
    }
    count("aligned_posix", "posix_memalign", n, n * 256, n, n * 256);
}

NOINLINE void aligned_pages(void)
{
    long n = 20 * scale;
    for (long i = 0; i < n; i++) {
        void *p = aligned_alloc(4096, 4096);
        sink = p;
        free(p);
    }
    /* glibc's aligned_alloc is memalign (one address): seen as memalign;
     * another allocator's (preloaded) may be a function of its own */
    int same = (void (*)(void))aligned_alloc == (void (*)(void))memalign;
    count("aligned_pages", same ? "memalign" : "aligned_alloc", n, n * 4096, 0, 0);
}

NOINLINE void memalign_leak(void)
{
    long n = 30 * scale;
    for (long i = 0; i < n; i++)
        sink = memalign(128, 1000);
    count("memalign_leak", "memalign", n, n * 1000, n, n * 1000);
}

NOINLINE void valloc_leak(void)
{
    long n = 5 * scale;
    for (long i = 0; i < n; i++)
        sink = valloc(5000);
    count("valloc_leak", "valloc", n, n * 5000, n, n * 5000);
}

NOINLINE void *threaded(void *arg)
{
    (void)arg;
    long n = 1000 * scale;
    long leaked = n / 10;
    void **keep = malloc(n * sizeof(void *)); /* freed below: counted */
    for (long i = 0; i < n; i++)
        keep[i] = malloc(128);
    for (long i = leaked; i < n; i++)
        free(keep[i]);
    free(keep);
    count("threaded", "malloc", n + 1, n * 128 + n * (long)sizeof(void *), leaked, leaked * 128);
    return NULL;
}

static void write_truth(const char *path, long unknown_frees)
{
    FILE *out = fopen(path, "w"); /* its allocations are libc's call sites, not the workload's */
    if (!out) {
        perror(path);
        exit(2);
    }
    fprintf(out, "{\"pid\": %d, \"unknown_frees\": %ld, \"sites\": [", getpid(), unknown_frees);
    for (int i = 0; i < nsites; i++)
        fprintf(out, "%s{\"function\": \"%s\", \"fn\": \"%s\", \"calls\": %ld, \"bytes\": %ld, "
                "\"leaked_calls\": %ld, \"leaked_bytes\": %ld}", i ? ", " : "", sites[i].name,
                sites[i].fn, sites[i].calls, sites[i].bytes, sites[i].leaked_calls,
                sites[i].leaked_bytes);
    fprintf(out, "]}\n");
    fclose(out);
}

int main(int argc, char **argv)
{
    const char *out = NULL;
    int wait = 0, hold = 0, threads = 4;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--out") && i + 1 < argc)
            out = argv[++i];
        else if (!strcmp(argv[i], "--wait"))
            wait = 1;
        else if (!strcmp(argv[i], "--hold"))
            hold = 1;
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--scale") && i + 1 < argc)
            scale = atol(argv[++i]);
    }
    void **early = early_blocks();
    if (wait) {
        printf("ready\n");
        fflush(stdout);
        char line[16];
        if (!fgets(line, sizeof(line), stdin))
            return 3;
    }
    leak_small();
    churn();
    calloc_half();
    realloc_chain();
    aligned_posix();
    aligned_pages();
    memalign_leak();
    valloc_leak();
    pthread_t tids[64];
    if (threads > 64)
        threads = 64;
    for (int i = 0; i < threads; i++)
        pthread_create(&tids[i], NULL, threaded, NULL);
    for (int i = 0; i < threads; i++)
        pthread_join(tids[i], NULL);
    /* The early blocks: under --wait, allocated before a --pid tracer attached. */
    for (int i = 0; i < EARLY; i++)
        free(early[i]);
    free(early);
    if (out)
        write_truth(out, wait ? EARLY + 1 : 0);
    if (hold) { /* the leaks stay outstanding in a live process until a line comes */
        printf("done\n");
        fflush(stdout);
        char line[16];
        if (!fgets(line, sizeof(line), stdin))
            return 3;
    }
    return 0;
}
