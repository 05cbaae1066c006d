/* The allocators' own entry points, each called through dlsym from a call
 * site of its own, for checking mtrace-live's accounting of them against
 * the truth (tests/privileged/test_allocators.py).
 *
 * `allocator_entries ALLOCATOR --out FILE`, with ALLOCATOR's library
 * preloaded (the process's malloc), calls its entry points with known
 * sizes: jemalloc's mallocx, rallocx and sdallocx; tcmalloc's tc_new and
 * tc_delete_sized; mimalloc's mi_zalloc and mi_heap_* functions (the heap
 * first, every other argument one register on), mi_free and mi_free_size;
 * and each one's C++ operator new and delete (plain, array, sized and
 * aligned). Each noinline function below calls one entry point, in a
 * loop: a known number of calls of known sizes, some of whose blocks a
 * later site frees or reallocates, the others left live.
 *
 * It prints "ready" and waits for a line on standard input (a tracer
 * attaches meanwhile), calls them all, and writes its truth as JSON
 * (--out FILE), as tests/workloads/alloc_workload.c does:
 *   {"pid": P, "sites": [{"function": "<site>", "at": <its address>,
 *    "lib": "<soname>", "entry": "<entry point>", "fn": "<kind>",
 *    "calls": N, "bytes": B, "leaked_calls": L, "leaked_bytes": LB}, ...]}
 * where the kind is what the call is by its arguments (malloc, calloc,
 * realloc, reallocarray, free), bytes are what the calls asked for (0 for
 * a free), and leaked_* what is still live at the end (0 for a free). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define N 40 /* calls of each allocating site; a multiple of 4 */
#define NOINLINE __attribute__((noinline))

static const char *const JEMALLOC = "libjemalloc.so.2";
static const char *const TCMALLOC = "libtcmalloc_minimal.so.4";
static const char *const MIMALLOC = "libmimalloc.so.2";

struct site {
    const char *function, *lib, *entry, *fn;
    void *at;
    long calls, bytes, leaked_calls, leaked_bytes;
};

static struct site sites[64];
static int nsites;
static void *volatile sink; /* keeps the compiler from dropping calls */

/* The site's truth, found or added. */
static struct site *site(const char *function, void *at, const char *lib, const char *entry,
                         const char *fn)
{
    for (int i = 0; i < nsites; i++)
        if (!strcmp(sites[i].function, function))
            return &sites[i];
    struct site *s = &sites[nsites++];
    *s = (struct site){function, lib, entry, fn, at, 0, 0, 0, 0};
    return s;
}

#define SITE(function, lib, entry, fn) site(#function, (void *)function, lib, entry, fn)

/* Blocks of size `size` allocated at site `s`, all live until released. */
static void allocated(struct site *s, long calls, long size)
{
    s->calls += calls;
    s->bytes += calls * size;
    s->leaked_calls += calls;
    s->leaked_bytes += calls * size;
}

/* `calls` of site `s`'s blocks of size `size` freed, or reallocated elsewhere. */
static void released(struct site *s, long calls, long size)
{
    s->leaked_calls -= calls;
    s->leaked_bytes -= calls * size;
}

static void freed(struct site *s, long calls)
{
    s->calls += calls;
}

/* The allocator's library, already mapped: preloaded, so that its own
 * entry points' calls of the standard names (jemalloc's operator delete
 * jumps to free through its PLT) stay in it. */
static void *preloaded(const char *lib)
{
    void *h = dlopen(lib, RTLD_NOW | RTLD_NOLOAD);
    if (!h) {
        fprintf(stderr, "allocator_entries: %s is not preloaded\n", lib);
        exit(2);
    }
    return h;
}

static void *entry(void *h, const char *name)
{
    void *f = dlsym(h, name);
    if (!f) {
        fprintf(stderr, "allocator_entries: no %s: %s\n", name, dlerror());
        exit(2);
    }
    return f;
}

typedef void *(*alloc_fn)(size_t);
typedef void *(*alloc2_fn)(size_t, size_t);
typedef void (*free_fn)(void *);
typedef void (*free2_fn)(void *, size_t);
typedef void *(*heap_alloc_fn)(void *, size_t);
typedef void *(*heap_alloc2_fn)(void *, size_t, size_t);
typedef void *(*heap_realloc_fn)(void *, void *, size_t);
typedef void *(*heap_reallocn_fn)(void *, void *, size_t, size_t);

/* C++'s operator new and delete of one allocator. */
struct cxx {
    const char *lib;
    alloc_fn new_, new_array;
    alloc2_fn new_aligned;
    free_fn delete_, delete_array;
    free2_fn delete_sized, delete_aligned;
    void *plain[N], *array[N], *aligned[N];
};

static struct cxx cxx_of(void *h, const char *lib)
{
    return (struct cxx){
        .lib = lib,
        .new_ = (alloc_fn)entry(h, "_Znwm"),
        .new_array = (alloc_fn)entry(h, "_Znam"),
        .new_aligned = (alloc2_fn)entry(h, "_ZnwmSt11align_val_t"),
        .delete_ = (free_fn)entry(h, "_ZdlPv"),
        .delete_array = (free_fn)entry(h, "_ZdaPv"),
        .delete_sized = (free2_fn)entry(h, "_ZdlPvm"),
        .delete_aligned = (free2_fn)entry(h, "_ZdlPvSt11align_val_t"),
    };
}

/* Each allocator's C++ sites: functions of their own (a call site each),
 * named after the allocator. */
#define CXX_SITES(name)                                                                        \
    NOINLINE void name##_new(struct cxx *c)                                                    \
    {                                                                                          \
        for (int i = 0; i < N; i++)                                                            \
            sink = c->plain[i] = c->new_(72);                                                  \
        allocated(SITE(name##_new, c->lib, "_Znwm", "malloc"), N, 72);                         \
    }                                                                                          \
    NOINLINE void name##_delete(struct cxx *c)                                                 \
    {                                                                                          \
        for (int i = 0; i < N / 2; i++)                                                        \
            c->delete_(c->plain[i]);                                                           \
        freed(SITE(name##_delete, c->lib, "_ZdlPv", "free"), N / 2);                           \
    }                                                                                          \
    NOINLINE void name##_delete_sized(struct cxx *c)                                           \
    {                                                                                          \
        for (int i = N / 2; i < 3 * N / 4; i++)                                                \
            c->delete_sized(c->plain[i], 72);                                                  \
        freed(SITE(name##_delete_sized, c->lib, "_ZdlPvm", "free"), N / 4);                    \
    }                                                                                          \
    NOINLINE void name##_new_array(struct cxx *c)                                              \
    {                                                                                          \
        for (int i = 0; i < N; i++)                                                            \
            sink = c->array[i] = c->new_array(40);                                             \
        allocated(SITE(name##_new_array, c->lib, "_Znam", "malloc"), N, 40);                   \
    }                                                                                          \
    NOINLINE void name##_delete_array(struct cxx *c)                                           \
    {                                                                                          \
        for (int i = 0; i < N / 2; i++)                                                        \
            c->delete_array(c->array[i]);                                                      \
        freed(SITE(name##_delete_array, c->lib, "_ZdaPv", "free"), N / 2);                     \
    }                                                                                          \
    NOINLINE void name##_new_aligned(struct cxx *c)                                            \
    {                                                                                          \
        for (int i = 0; i < N; i++)                                                            \
            sink = c->aligned[i] = c->new_aligned(96, 64);                                     \
        allocated(SITE(name##_new_aligned, c->lib, "_ZnwmSt11align_val_t", "malloc"), N, 96);  \
    }                                                                                          \
    NOINLINE void name##_delete_aligned(struct cxx *c)                                         \
    {                                                                                          \
        for (int i = 0; i < N / 2; i++)                                                        \
            c->delete_aligned(c->aligned[i], 64);                                              \
        freed(SITE(name##_delete_aligned, c->lib, "_ZdlPvSt11align_val_t", "free"), N / 2);    \
    }                                                                                          \
    static void name##_cxx(struct cxx *c)                                                      \
    {                                                                                          \
        name##_new(c);                                                                         \
        name##_delete(c);                                                                      \
        name##_delete_sized(c);                                                                \
        released(SITE_OF(name##_new), 3 * N / 4, 72);                                          \
        name##_new_array(c);                                                                   \
        name##_delete_array(c);                                                                \
        released(SITE_OF(name##_new_array), N / 2, 40);                                        \
        name##_new_aligned(c);                                                                 \
        name##_delete_aligned(c);                                                              \
        released(SITE_OF(name##_new_aligned), N / 2, 96);                                      \
    }

/* The truth of a site already called. */
static struct site *site_of(const char *function)
{
    for (int i = 0; i < nsites; i++)
        if (!strcmp(sites[i].function, function))
            return &sites[i];
    fprintf(stderr, "allocator_entries: no site %s\n", function);
    exit(2);
}
#define SITE_OF(function) site_of(#function)

CXX_SITES(jemalloc)
CXX_SITES(tcmalloc)
CXX_SITES(mimalloc)

/* jemalloc's own: mallocx, rallocx of half of those blocks, sdallocx of a
 * quarter of each site's. */
static void *(*call_mallocx)(size_t, int);
static void *(*call_rallocx)(void *, size_t, int);
static void (*call_sdallocx)(void *, size_t, int);
static void *je_blocks[N];

NOINLINE void jemalloc_mallocx(void)
{
    for (int i = 0; i < N; i++)
        sink = je_blocks[i] = call_mallocx(200, 0);
    allocated(SITE(jemalloc_mallocx, JEMALLOC, "mallocx", "malloc"), N, 200);
}

NOINLINE void jemalloc_rallocx(void)
{
    for (int i = 0; i < N / 2; i++)
        sink = je_blocks[i] = call_rallocx(je_blocks[i], 3000, 0);
    allocated(SITE(jemalloc_rallocx, JEMALLOC, "rallocx", "realloc"), N / 2, 3000);
    released(SITE_OF(jemalloc_mallocx), N / 2, 200);
}

NOINLINE void jemalloc_sdallocx(void)
{
    for (int i = 0; i < N / 4; i++)
        call_sdallocx(je_blocks[i], 3000, 0);
    for (int i = N / 2; i < 3 * N / 4; i++)
        call_sdallocx(je_blocks[i], 200, 0);
    freed(SITE(jemalloc_sdallocx, JEMALLOC, "sdallocx", "free"), N / 2);
    released(SITE_OF(jemalloc_rallocx), N / 4, 3000);
    released(SITE_OF(jemalloc_mallocx), N / 4, 200);
}

/* tcmalloc's own: tc_new, and tc_delete_sized of half of those blocks. */
static void *(*call_tc_new)(size_t);
static void (*call_tc_delete_sized)(void *, size_t);
static void *tc_blocks[N];

NOINLINE void tcmalloc_tc_new(void)
{
    for (int i = 0; i < N; i++)
        sink = tc_blocks[i] = call_tc_new(56);
    allocated(SITE(tcmalloc_tc_new, TCMALLOC, "tc_new", "malloc"), N, 56);
}

NOINLINE void tcmalloc_tc_delete_sized(void)
{
    for (int i = 0; i < N / 2; i++)
        call_tc_delete_sized(tc_blocks[i], 56);
    freed(SITE(tcmalloc_tc_delete_sized, TCMALLOC, "tc_delete_sized", "free"), N / 2);
    released(SITE_OF(tcmalloc_tc_new), N / 2, 56);
}

/* mimalloc's own: mi_zalloc, and the mi_heap_* functions on the default
 * heap (the heap in the first register, the sizes one register on); half
 * of some sites' blocks reallocated, half of others freed by mi_free or
 * mi_free_size. */
static void *(*call_mi_zalloc)(size_t);
static void (*call_mi_free)(void *);
static void (*call_mi_free_size)(void *, size_t);
static heap_alloc_fn call_mi_heap_malloc, call_mi_heap_zalloc;
static heap_alloc2_fn call_mi_heap_calloc, call_mi_heap_mallocn, call_mi_heap_malloc_aligned;
static heap_realloc_fn call_mi_heap_realloc;
static heap_reallocn_fn call_mi_heap_reallocn;
static void *heap;
static void *mi_zeroed[N], *mi_plain[N], *mi_cleared[N], *mi_counted[N];

NOINLINE void mimalloc_zalloc(void)
{
    for (int i = 0; i < N; i++)
        sink = mi_zeroed[i] = call_mi_zalloc(33);
    allocated(SITE(mimalloc_zalloc, MIMALLOC, "mi_zalloc", "malloc"), N, 33);
}

NOINLINE void mimalloc_heap_malloc(void)
{
    for (int i = 0; i < N; i++)
        sink = mi_plain[i] = call_mi_heap_malloc(heap, 150);
    allocated(SITE(mimalloc_heap_malloc, MIMALLOC, "mi_heap_malloc", "malloc"), N, 150);
}

NOINLINE void mimalloc_heap_zalloc(void)
{
    for (int i = 0; i < N; i++)
        sink = mi_cleared[i] = call_mi_heap_zalloc(heap, 260);
    allocated(SITE(mimalloc_heap_zalloc, MIMALLOC, "mi_heap_zalloc", "malloc"), N, 260);
}

NOINLINE void mimalloc_heap_calloc(void)
{
    for (int i = 0; i < N; i++)
        sink = mi_counted[i] = call_mi_heap_calloc(heap, 7, 24);
    allocated(SITE(mimalloc_heap_calloc, MIMALLOC, "mi_heap_calloc", "calloc"), N, 7 * 24);
}

NOINLINE void mimalloc_heap_mallocn(void)
{
    for (int i = 0; i < N; i++)
        sink = call_mi_heap_mallocn(heap, 5, 40);
    allocated(SITE(mimalloc_heap_mallocn, MIMALLOC, "mi_heap_mallocn", "calloc"), N, 5 * 40);
}

NOINLINE void mimalloc_heap_malloc_aligned(void)
{
    for (int i = 0; i < N; i++)
        sink = call_mi_heap_malloc_aligned(heap, 80, 16);
    allocated(SITE(mimalloc_heap_malloc_aligned, MIMALLOC, "mi_heap_malloc_aligned", "malloc"), N, 80);
}

NOINLINE void mimalloc_heap_realloc(void)
{
    for (int i = 0; i < N / 2; i++)
        sink = mi_plain[i] = call_mi_heap_realloc(heap, mi_plain[i], 900);
    allocated(SITE(mimalloc_heap_realloc, MIMALLOC, "mi_heap_realloc", "realloc"), N / 2, 900);
    released(SITE_OF(mimalloc_heap_malloc), N / 2, 150);
}

NOINLINE void mimalloc_heap_reallocn(void)
{
    for (int i = 0; i < N / 2; i++)
        sink = mi_cleared[i] = call_mi_heap_reallocn(heap, mi_cleared[i], 3, 100);
    /* it multiplies and jumps to mi_heap_realloc: a realloc of count * size
     * (as glibc 2.36's reallocarray jumps to realloc) */
    allocated(SITE(mimalloc_heap_reallocn, MIMALLOC, "mi_heap_reallocn", "realloc"), N / 2, 3 * 100);
    released(SITE_OF(mimalloc_heap_zalloc), N / 2, 260);
}

NOINLINE void mimalloc_free(void)
{
    for (int i = 0; i < N / 2; i++)
        call_mi_free(mi_zeroed[i]);
    for (int i = 0; i < N / 2; i++)
        call_mi_free(mi_counted[i]);
    freed(SITE(mimalloc_free, MIMALLOC, "mi_free", "free"), N);
    released(SITE_OF(mimalloc_zalloc), N / 2, 33);
    released(SITE_OF(mimalloc_heap_calloc), N / 2, 7 * 24);
}

NOINLINE void mimalloc_free_size(void)
{
    for (int i = 0; i < N / 4; i++)
        call_mi_free_size(mi_plain[i], 900);
    freed(SITE(mimalloc_free_size, MIMALLOC, "mi_free_size", "free"), N / 4);
    released(SITE_OF(mimalloc_heap_realloc), N / 4, 900);
}

static void write_truth(const char *path)
{
    FILE *out = fopen(path, "w"); /* its allocations are glibc's, in the libc */
    if (!out) {
        perror(path);
        exit(2);
    }
    fprintf(out, "{\"pid\": %d, \"sites\": [", getpid());
    for (int i = 0; i < nsites; i++) {
        struct site *s = &sites[i];
        fprintf(out, "%s{\"function\": \"%s\", \"at\": %lu, \"lib\": \"%s\", \"entry\": \"%s\", "
                "\"fn\": \"%s\", \"calls\": %ld, \"bytes\": %ld, \"leaked_calls\": %ld, "
                "\"leaked_bytes\": %ld}", i ? ", " : "", s->function, (unsigned long)(uintptr_t)s->at,
                s->lib, s->entry, s->fn, s->calls, s->bytes, s->leaked_calls, s->leaked_bytes);
    }
    fprintf(out, "]}\n");
    fclose(out);
}

/* Each allocator's entry points found, and its sites called. */
static void jemalloc_sites(void *h)
{
    struct cxx c = cxx_of(h, JEMALLOC);
    call_mallocx = entry(h, "mallocx");
    call_rallocx = entry(h, "rallocx");
    call_sdallocx = entry(h, "sdallocx");
    jemalloc_mallocx();
    jemalloc_rallocx();
    jemalloc_sdallocx();
    jemalloc_cxx(&c);
}

static void tcmalloc_sites(void *h)
{
    struct cxx c = cxx_of(h, TCMALLOC);
    call_tc_new = entry(h, "tc_new");
    call_tc_delete_sized = entry(h, "tc_delete_sized");
    tcmalloc_tc_new();
    tcmalloc_tc_delete_sized();
    tcmalloc_cxx(&c);
}

static void mimalloc_sites(void *h)
{
    struct cxx c = cxx_of(h, MIMALLOC);
    call_mi_zalloc = entry(h, "mi_zalloc");
    call_mi_free = entry(h, "mi_free");
    call_mi_free_size = entry(h, "mi_free_size");
    call_mi_heap_malloc = entry(h, "mi_heap_malloc");
    call_mi_heap_zalloc = entry(h, "mi_heap_zalloc");
    call_mi_heap_calloc = entry(h, "mi_heap_calloc");
    call_mi_heap_mallocn = entry(h, "mi_heap_mallocn");
    call_mi_heap_malloc_aligned = entry(h, "mi_heap_malloc_aligned");
    call_mi_heap_realloc = entry(h, "mi_heap_realloc");
    call_mi_heap_reallocn = entry(h, "mi_heap_reallocn");
    heap = ((void *(*)(void))entry(h, "mi_heap_get_default"))();
    mimalloc_zalloc();
    mimalloc_heap_malloc();
    mimalloc_heap_zalloc();
    mimalloc_heap_calloc();
    mimalloc_heap_mallocn();
    mimalloc_heap_malloc_aligned();
    mimalloc_heap_realloc();
    mimalloc_heap_reallocn();
    mimalloc_free();
    mimalloc_free_size();
    mimalloc_cxx(&c);
}

static const struct {
    const char *name, *lib;
    void (*sites)(void *);
} ALLOCATORS[] = {
    {"jemalloc", JEMALLOC, jemalloc_sites},
    {"tcmalloc", TCMALLOC, tcmalloc_sites},
    {"mimalloc", MIMALLOC, mimalloc_sites},
};

int main(int argc, char **argv)
{
    int which = -1;
    for (int i = 0; argc == 4 && !strcmp(argv[2], "--out") && i < 3; i++)
        if (!strcmp(argv[1], ALLOCATORS[i].name))
            which = i;
    if (which < 0) {
        fprintf(stderr, "usage: allocator_entries jemalloc|tcmalloc|mimalloc --out FILE "
                "(the allocator's library preloaded)\n");
        return 2;
    }
    void *h = preloaded(ALLOCATORS[which].lib);
    printf("ready\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof(line), stdin))
        return 3;
    ALLOCATORS[which].sites(h);
    write_truth(argv[3]);
    return 0;
}
