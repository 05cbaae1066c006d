/* probe_exerciser: fires each of the 32 probes documented in the glibc
 * manual's "Internal probes" chapter at least once, and writes a JSON ground
 * truth of how many times it caused each one, with the argument values it
 * knows.
 *
 * Written against glibc 2.36 on x86_64 (malloc/malloc.c, malloc/arena.c).
 * Counts are exact for the whole process tree: the forked children report
 * their own counts back through a pipe. Where glibc's behaviour depends on
 * state the program cannot predict (heap growth, sbrk), the exerciser does
 * not guess: it observes the brk and its thread heaps after every allocator
 * call and counts the changes.
 *
 * Usage: probe_exerciser --out FILE.json
 * Run it under an SDT-enabled glibc (scripts/with-sdt-glibc). It re-executes
 * itself once, in the same process, to set GLIBC_TUNABLES: the tunable probes
 * fire only while malloc reads tunables at initialisation.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define TUNABLES_ENV "GLIBC_TUNABLES"
#define TUNABLES                                                              \
    "glibc.malloc.tcache_max=512:glibc.malloc.tcache_count=5:"                \
    "glibc.malloc.tcache_unsorted_limit=4:glibc.malloc.mxfast=96"
#define REEXEC_MARK "MTRACE_EXERCISER_REEXEC"

/* malloc/arena.c: HEAP_MAX_SIZE is 2 * DEFAULT_MMAP_THRESHOLD_MAX, 64 MiB on
 * 64-bit; thread heaps are aligned to it and start with struct heap_info. */
#define HEAP_MAX ((uintptr_t)64 << 20)
struct heap_info_head {
    void *ar_ptr;
    struct heap_info_head *prev;
    size_t size;
};

/* ------------------------------------------------------------------ */
/* Probe list and counts                                               */

enum probe {
    P_SBRK_MORE, P_SBRK_LESS, P_HEAP_NEW, P_HEAP_FREE, P_HEAP_MORE, P_HEAP_LESS,
    P_MALLOC_RETRY, P_REALLOC_RETRY, P_MEMALIGN_RETRY, P_CALLOC_RETRY,
    P_ARENA_RETRY, P_ARENA_NEW, P_ARENA_REUSE, P_ARENA_REUSE_WAIT,
    P_ARENA_REUSE_FREE_LIST, P_MALLOPT, P_MALLOPT_MXFAST,
    P_MALLOPT_TRIM_THRESHOLD, P_MALLOPT_TOP_PAD, P_MALLOPT_MMAP_THRESHOLD,
    P_MALLOPT_MMAP_MAX, P_MALLOPT_PERTURB, P_MALLOPT_ARENA_TEST,
    P_MALLOPT_ARENA_MAX, P_MALLOPT_FREE_DYN_THRESHOLDS,
    P_TUNABLE_TCACHE_MAX_BYTES, P_TUNABLE_TCACHE_COUNT,
    P_TUNABLE_TCACHE_UNSORTED_LIMIT, P_TCACHE_DOUBLE_FREE, P_SETJMP,
    P_LONGJMP, P_LONGJMP_TARGET, P_COUNT
};

static const char *const probe_names[P_COUNT] = {
    "memory_sbrk_more", "memory_sbrk_less", "memory_heap_new",
    "memory_heap_free", "memory_heap_more", "memory_heap_less",
    "memory_malloc_retry", "memory_realloc_retry", "memory_memalign_retry",
    "memory_calloc_retry", "memory_arena_retry", "memory_arena_new",
    "memory_arena_reuse", "memory_arena_reuse_wait",
    "memory_arena_reuse_free_list", "memory_mallopt", "memory_mallopt_mxfast",
    "memory_mallopt_trim_threshold", "memory_mallopt_top_pad",
    "memory_mallopt_mmap_threshold", "memory_mallopt_mmap_max",
    "memory_mallopt_perturb", "memory_mallopt_arena_test",
    "memory_mallopt_arena_max", "memory_mallopt_free_dyn_thresholds",
    "memory_tunable_tcache_max_bytes", "memory_tunable_tcache_count",
    "memory_tunable_tcache_unsorted_limit", "memory_tcache_double_free",
    "setjmp", "longjmp", "longjmp_target",
};

/* Counts caused by this process; children send theirs through a pipe. */
static long counts[P_COUNT];

/* Known argument values, as JSON object members, appended in the order the
 * probes fire; each member is named as the catalog (probes/specs) names the
 * argument. */
static char args_json[P_COUNT][2048];

static void note_args(enum probe p, const char *fmt, ...)
{
    char entry[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(entry, sizeof entry, fmt, ap);
    va_end(ap);
    size_t used = strlen(args_json[p]);
    snprintf(args_json[p] + used, sizeof args_json[p] - used, "%s{%s}",
             used ? ", " : "", entry);
}

static void die(const char *what)
{
    dprintf(2, "probe_exerciser: %s: %s\n", what, strerror(errno));
    _exit(2);
}

/* ------------------------------------------------------------------ */
/* Observing the main arena's brk                                      */

/* Every allocator call made from a single-threaded point of the program is
 * followed by brk_note(): sbrk growth and shrinkage both move the break, and
 * glibc fires sbrk_more/sbrk_less at most once per malloc/free call. */
static uintptr_t last_brk;

static void brk_note(void)
{
    uintptr_t now = (uintptr_t)sbrk(0);
    if (now > last_brk)
        counts[P_SBRK_MORE]++;
    else if (now < last_brk)
        counts[P_SBRK_LESS]++;
    last_brk = now;
}

#define MAIN(call) do { call; brk_note(); } while (0)

/* Every block passes through here, so the compiler cannot drop a
 * malloc/free pair whose pointer is otherwise unused (GCC does). */
static void *volatile sink;
#define KEEP(ptr) (sink = (ptr))

/* Reads a file with plain syscalls: no stdio, so no malloc. */
static ssize_t read_small_file(const char *path, char *buf, size_t len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, len - 1);
    close(fd);
    if (n >= 0)
        buf[n] = '\0';
    return n;
}

/* Field 47 of /proc/self/stat is start_brk, where the heap began. */
static uintptr_t start_brk(void)
{
    static char stat[4096];
    if (read_small_file("/proc/self/stat", stat, sizeof stat) <= 0)
        die("read /proc/self/stat");
    char *p = strrchr(stat, ')');
    int field = 2;
    for (; p && *p; p++)
        if (*p == ' ' && ++field == 47)
            return strtoull(p + 1, NULL, 10);
    die("parse /proc/self/stat");
    return 0;
}

/* ------------------------------------------------------------------ */
/* Observing a thread arena's heaps                                    */

#define MAX_HEAPS 16
struct heap_view {
    struct heap_info_head *heap;
    size_t size;
    int live;
};
static struct heap_view heaps[MAX_HEAPS];
static int nheaps;

static struct heap_info_head *heap_of(void *chunk)
{
    return (struct heap_info_head *)((uintptr_t)chunk & ~(HEAP_MAX - 1));
}

static int mapped(const void *addr)
{
    unsigned char vec;
    return mincore((void *)addr, (size_t)sysconf(_SC_PAGESIZE), &vec) == 0;
}

/* Compares every known heap of the arena with its last view. A heap that
 * appeared was mmapped (heap_new), one that vanished was unmapped
 * (heap_free); a size change is grow_heap (heap_more) or shrink_heap
 * (heap_less). `fresh` is a chunk just allocated, which may sit in a new heap. */
static void heaps_note(void *fresh)
{
    if (fresh) {
        struct heap_info_head *h = heap_of(fresh);
        int known = 0;
        for (int i = 0; i < nheaps; i++)
            known |= heaps[i].live && heaps[i].heap == h;
        if (!known) {
            if (nheaps == MAX_HEAPS)
                die("too many heaps");
            heaps[nheaps++] = (struct heap_view){h, h->size, 1};
            counts[P_HEAP_NEW]++;
            note_args(P_HEAP_NEW, "\"h\": %lu, \"size\": %lu",
                      (unsigned long)(uintptr_t)h, (unsigned long)h->size);
        }
    }
    for (int i = 0; i < nheaps; i++) {
        struct heap_view *v = &heaps[i];
        if (!v->live)
            continue;
        if (!mapped(v->heap)) {
            v->live = 0;
            counts[P_HEAP_FREE]++;
            note_args(P_HEAP_FREE, "\"heap\": %lu", (unsigned long)(uintptr_t)v->heap);
            continue;
        }
        if (v->heap->size > v->size) {
            counts[P_HEAP_MORE]++;
            note_args(P_HEAP_MORE, "\"h\": %lu, \"size\": %lu",
                      (unsigned long)(uintptr_t)v->heap, (unsigned long)v->heap->size);
        } else if (v->heap->size < v->size) {
            counts[P_HEAP_LESS]++;
            note_args(P_HEAP_LESS, "\"h\": %lu, \"size\": %lu",
                      (unsigned long)(uintptr_t)v->heap, (unsigned long)v->heap->size);
        }
        v->size = v->heap->size;
    }
}

/* ------------------------------------------------------------------ */
/* Child processes report their counts to the parent                   */

/* A forked child starts from zero: what it inherited is the parent's. */
static void start_child_accounting(void)
{
    memset(counts, 0, sizeof counts);
    memset(args_json, 0, sizeof args_json);
}

static void write_all(int fd, const void *buf, size_t len)
{
    for (const char *p = buf; len;) {
        ssize_t n = write(fd, p, len);
        if (n <= 0)
            die("write to parent");
        p += n;
        len -= (size_t)n;
    }
}

static int read_all(int fd, void *buf, size_t len)
{
    for (char *p = buf; len;) {
        ssize_t n = read(fd, p, len);
        if (n <= 0)
            return 0;
        p += n;
        len -= (size_t)n;
    }
    return 1;
}

static void send_counts(int fd)
{
    write_all(fd, counts, sizeof counts);
    write_all(fd, args_json, sizeof args_json);
    start_child_accounting();
}

static void add_counts_from(int fd)
{
    static long theirs[P_COUNT];
    static char their_args[P_COUNT][sizeof args_json[0]];
    if (!read_all(fd, theirs, sizeof theirs) || !read_all(fd, their_args, sizeof their_args))
        die("read child counts");
    for (int i = 0; i < P_COUNT; i++) {
        counts[i] += theirs[i];
        if (their_args[i][0])
            note_args((enum probe)i, "%.*s", (int)strlen(their_args[i]) - 2,
                      their_args[i] + 1);
    }
}

/* ------------------------------------------------------------------ */
/* Phase 1, in a child: arena contention (reuse_wait, reuse)           */

/* With M_ARENA_MAX=1 the main arena is the only arena, so a new thread's
 * first malloc goes through reused_arena(). malloc_stats() holds the main
 * arena's mutex while it prints, and we make it print to a stream whose
 * writer waits until that thread is asleep on the mutex: the trylock in
 * reused_arena() must have failed, so memory_arena_reuse_wait fired, exactly
 * once. */
static volatile pid_t waiter_tid;
static volatile int waiter_ready, waiter_go;
static int held_once;

static int blocked_in_futex(pid_t tid)
{
    char path[64], buf[128];
    snprintf(path, sizeof path, "/proc/self/task/%d/syscall", (int)tid);
    if (read_small_file(path, buf, sizeof buf) <= 0)
        return 0;
    return strtol(buf, NULL, 10) == SYS_futex;
}

/* Waits in 1 ms steps; ten seconds without progress means glibc did not
 * behave as this program expects, which must fail loudly, not hang. */
static void wait_until(volatile int *flag, pid_t futex_tid, const char *what)
{
    for (int ms = 0; ms < 10000; ms++) {
        if (flag ? *flag : blocked_in_futex(futex_tid))
            return;
        usleep(1000);
    }
    errno = ETIMEDOUT;
    die(what);
}

static ssize_t stalling_write(void *cookie, const char *buf, size_t len)
{
    (void)cookie;
    (void)buf;
    if (!held_once) {
        held_once = 1;
        wait_until((volatile int *)&waiter_ready, 0, "contending thread never started");
        waiter_go = 1; /* the main arena's mutex is held from here on */
        wait_until(NULL, waiter_tid, "contending thread never waited for the arena");
    }
    return (ssize_t)len;
}

static void *contending_thread(void *arg)
{
    void **out = arg;
    waiter_tid = (pid_t)syscall(SYS_gettid);
    waiter_ready = 1;
    wait_until((volatile int *)&waiter_go, 0, "main thread never took the arena");
    *out = malloc(64); /* blocks in reused_arena until malloc_stats is done */
    return NULL;
}

static void contention_child(int report_fd, uintptr_t main_arena)
{
    MAIN(mallopt(M_ARENA_MAX, 1));
    counts[P_MALLOPT]++;
    counts[P_MALLOPT_ARENA_MAX]++;
    note_args(P_MALLOPT_ARENA_MAX, "\"value\": 1, \"old\": 0");

    FILE *stall;
    MAIN(stall = fopencookie(NULL, "w", (cookie_io_functions_t){.write = stalling_write}));
    if (!stall)
        die("fopencookie");
    setvbuf(stall, NULL, _IONBF, 0);
    FILE *saved_stderr = stderr;
    stderr = stall;

    pthread_t t;
    void *block = NULL;
    MAIN(errno = pthread_create(&t, NULL, contending_thread, &block));
    if (errno)
        die("pthread_create");
    counts[P_SETJMP]++; /* start_thread() calls setjmp (nptl/pthread_create.c) */
    MAIN(malloc_stats());
    MAIN(pthread_join(t, NULL));
    stderr = saved_stderr;

    counts[P_ARENA_REUSE_WAIT]++;
    note_args(P_ARENA_REUSE_WAIT, "\"mutex\": %lu, \"result\": %lu, \"avoid_arena\": 0",
              (unsigned long)main_arena, (unsigned long)main_arena);
    counts[P_ARENA_REUSE]++;
    note_args(P_ARENA_REUSE, "\"result\": %lu, \"avoid_arena\": 0", (unsigned long)main_arena);
    send_counts(report_fd);
    _exit(block ? 0 : 3);
}

/* ------------------------------------------------------------------ */
/* Phase 2: dynamic thresholds, then every mallopt parameter           */

static void thresholds_and_mallopt(void)
{
    /* A 200 KiB block is above the initial 128 KiB mmap threshold, so it is
     * mmapped; freeing it raises the threshold (malloc.c, __libc_free). This
     * must come before any mallopt that sets no_dyn_threshold. */
    void *big;
    MAIN(KEEP(big = malloc(200 * 1024)));
    /* An mmapped chunk's usable size is its chunk size less two size
     * fields; free sets mmap_threshold to the chunk size, trim_threshold to
     * twice that. */
    size_t chunk = malloc_usable_size(big) + 2 * sizeof(size_t);
    MAIN(free(big));
    counts[P_MALLOPT_FREE_DYN_THRESHOLDS]++;
    note_args(P_MALLOPT_FREE_DYN_THRESHOLDS, "\"mmap_threshold\": %zu, \"trim_threshold\": %zu",
              chunk, 2 * chunk);
    char mmap_old[32], trim_old[32];
    snprintf(mmap_old, sizeof mmap_old, "%zu", chunk);
    snprintf(trim_old, sizeof trim_old, "%zu", 2 * chunk);

    /* top_pad starts at DEFAULT_TOP_PAD, which sysdeps/generic/
     * malloc-machine.h sets to 128 KiB before malloc.c's fallback of 0. */
    const struct { int param, value; enum probe probe; const char *old; } calls[] = {
        {M_MXFAST, 64, P_MALLOPT_MXFAST, "96"},
        {M_MXFAST, 1000, P_COUNT, NULL}, /* out of range: only memory_mallopt */
        {M_TRIM_THRESHOLD, 256 * 1024, P_MALLOPT_TRIM_THRESHOLD, trim_old},
        {M_TOP_PAD, 64 * 1024, P_MALLOPT_TOP_PAD, "131072"},
        {M_MMAP_THRESHOLD, 32 * 1024 * 1024, P_MALLOPT_MMAP_THRESHOLD, mmap_old},
        {M_MMAP_MAX, 65536, P_MALLOPT_MMAP_MAX, "65536"},
        {M_PERTURB, 0, P_MALLOPT_PERTURB, "0"},
        {M_ARENA_TEST, 16, P_MALLOPT_ARENA_TEST, "8"},
        {M_ARENA_MAX, 8, P_MALLOPT_ARENA_MAX, "0"},
    };
    for (size_t i = 0; i < sizeof calls / sizeof calls[0]; i++) {
        MAIN(mallopt(calls[i].param, calls[i].value));
        counts[P_MALLOPT]++;
        note_args(P_MALLOPT, "\"param_number\": %d, \"value\": %d", calls[i].param, calls[i].value);
        if (calls[i].probe == P_COUNT)
            continue;
        counts[calls[i].probe]++;
        if (calls[i].old)
            note_args(calls[i].probe, "\"value\": %d, \"old\": %s", calls[i].value, calls[i].old);
        else
            note_args(calls[i].probe, "\"value\": %d", calls[i].value);
    }
}

/* Phase 2b: with the trim threshold at 256 KiB, freeing a 1 MiB block at
 * the top of the main arena returns memory with a negative sbrk (systrim). */
static void main_arena_trim(void)
{
    void *block;
    MAIN(KEEP(block = malloc(1 << 20)));
    MAIN(free(block));
}

/* ------------------------------------------------------------------ */
/* Phase 3, thread 1: a new arena, heap growth, a second heap, trimming */

static uintptr_t thread_arena;

static void *heap_thread(void *arg)
{
    (void)arg;
    void *first = KEEP(malloc(32)); /* tcache_init() + _int_new_arena() */
    heaps_note(first);
    struct heap_info_head *h = heap_of(first);
    thread_arena = (uintptr_t)h->ar_ptr;
    counts[P_ARENA_NEW]++;
    note_args(P_ARENA_NEW, "\"a\": %lu", (unsigned long)thread_arena);

    /* Three 30 MiB blocks (below the 32 MiB mmap threshold set above): the
     * first two grow the 64 MiB heap, the third needs a second heap. */
    void *block[3];
    for (int i = 0; i < 3; i++) {
        block[i] = KEEP(malloc(30u << 20));
        if (!block[i])
            die("malloc 30 MiB");
        heaps_note(block[i]);
    }
    /* Freeing the block in the second heap lets heap_trim() unmap it; freeing
     * the next one makes the first heap's top large enough to shrink. */
    free(block[2]);
    heaps_note(NULL);
    free(block[1]);
    heaps_note(NULL);
    /* A small block right below the top chunk keeps the frees of thread exit
     * (tcache shutdown) from reaching the top, so they trim nothing. */
    void *pin = KEEP(malloc(64));
    heaps_note(pin);
    free(first);
    heaps_note(NULL);
    (void)block[0];
    return NULL;
}

/* ------------------------------------------------------------------ */
/* Phase 4, thread 2: the arena from the free list, then failing        */
/* allocations that retry in the main arena                             */

#define HUGE_REQUEST ((size_t)1 << 30)

static void *retry_thread(void *arg)
{
    (void)arg;
    void *small = KEEP(malloc(48)); /* arena_get2() -> get_free_list() */
    heaps_note(small);
    if ((uintptr_t)heap_of(small)->ar_ptr != thread_arena)
        die("thread 2 did not get thread 1's arena from the free list");
    counts[P_ARENA_REUSE_FREE_LIST]++;
    note_args(P_ARENA_REUSE_FREE_LIST, "\"result\": %lu", (unsigned long)thread_arena);

    /* Cap the address space just above what is mapped now, so a 1 GiB
     * request fails both in this thread's arena and in the main arena. */
    struct rlimit saved, capped;
    if (getrlimit(RLIMIT_AS, &saved))
        die("getrlimit");
    char statm[256];
    if (read_small_file("/proc/self/statm", statm, sizeof statm) <= 0)
        die("read statm");
    capped = saved;
    capped.rlim_cur = strtoull(statm, NULL, 10) * (rlim_t)sysconf(_SC_PAGESIZE) + (256u << 20);
    if (setrlimit(RLIMIT_AS, &capped))
        die("setrlimit");

    /* Each failure in this arena fires the function's retry probe and
     * arena_retry, then retries in the main arena, where sysmalloc() calls
     * sbrk and fires memory_sbrk_more even though sbrk failed (malloc.c:
     * the probe follows MORECORE whatever it returned). realloc retries
     * through malloc, which fires malloc_retry and arena_retry again. */
    void *p;
    p = malloc(HUGE_REQUEST);
    counts[P_MALLOC_RETRY]++;
    counts[P_ARENA_RETRY]++;
    counts[P_SBRK_MORE]++;
    note_args(P_MALLOC_RETRY, "\"bytes\": %zu", HUGE_REQUEST);

    void *q = realloc(small, HUGE_REQUEST);
    counts[P_REALLOC_RETRY]++;
    counts[P_MALLOC_RETRY]++;
    counts[P_ARENA_RETRY]++;
    counts[P_SBRK_MORE]++;
    note_args(P_REALLOC_RETRY, "\"bytes\": %zu, \"oldmem\": %lu", HUGE_REQUEST,
              (unsigned long)(uintptr_t)small);
    note_args(P_MALLOC_RETRY, "\"bytes\": %zu", HUGE_REQUEST);

    void *r = NULL;
    int rc = posix_memalign(&r, 4096, HUGE_REQUEST);
    counts[P_MEMALIGN_RETRY]++;
    counts[P_ARENA_RETRY]++;
    counts[P_SBRK_MORE]++;
    note_args(P_MEMALIGN_RETRY, "\"bytes\": %zu, \"alignment\": 4096", HUGE_REQUEST);

    void *s = calloc(HUGE_REQUEST / 16, 16);
    counts[P_CALLOC_RETRY]++;
    counts[P_ARENA_RETRY]++;
    counts[P_SBRK_MORE]++;
    note_args(P_CALLOC_RETRY, "\"sz\": %zu", HUGE_REQUEST);

    if (setrlimit(RLIMIT_AS, &saved))
        die("restore RLIMIT_AS");
    if (p || q || rc == 0 || s)
        die("a 1 GiB request succeeded under the address-space cap");
    void *pin = malloc(64); /* as in heap_thread: no trimming at exit */
    heaps_note(pin);
    return small;
}

/* ------------------------------------------------------------------ */
/* Phase 5, in a child: a real tcache double free                      */

static void double_free_child(int report_fd)
{
    /* glibc aborts right after the check, so report first. 200 bytes is tcache
     * bin 11, one this program never fills; a full bin would send the first
     * free to a fastbin and skip the tcache check. */
    char *p;
    MAIN(KEEP(p = malloc(200)));
    /* volatile: the compiler must not reason about (or warn on) the second free */
    char *volatile again = p;
    uintptr_t address = (uintptr_t)p;
    MAIN(free(p));
    counts[P_TCACHE_DOUBLE_FREE]++;
    note_args(P_TCACHE_DOUBLE_FREE, "\"e\": %lu, \"tc_idx\": 11",
              (unsigned long)address);
    send_counts(report_fd);
    int devnull = open("/dev/null", O_WRONLY);
    if (devnull >= 0)
        dup2(devnull, 2); /* silence "free(): double free detected" */
    struct rlimit no_core = {0, 0};
    setrlimit(RLIMIT_CORE, &no_core);
    free(again); /* memory_tcache_double_free, then abort() */
    _exit(0);
}

static void run_child(void (*body)(int, uintptr_t), uintptr_t arg, int expect_signal)
{
    int fds[2];
    if (pipe(fds))
        die("pipe");
    pid_t pid = fork();
    if (pid < 0)
        die("fork");
    if (pid == 0) {
        close(fds[0]);
        start_child_accounting();
        body(fds[1], arg);
        _exit(0);
    }
    close(fds[1]);
    add_counts_from(fds[0]);
    close(fds[0]);
    int status;
    if (waitpid(pid, &status, 0) != pid)
        die("waitpid");
    int ok = expect_signal ? WIFSIGNALED(status) && WTERMSIG(status) == expect_signal
                           : WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok) {
        dprintf(2, "probe_exerciser: child ended with status %#x\n", status);
        _exit(2);
    }
}

static void double_free_body(int fd, uintptr_t unused)
{
    (void)unused;
    double_free_child(fd);
}

static void contention_body(int fd, uintptr_t main_arena)
{
    contention_child(fd, main_arena);
}

/* ------------------------------------------------------------------ */
/* Phase 6: setjmp / sigsetjmp / longjmp / siglongjmp                   */

/* A read-write mprotect at a HEAP_MAX boundary of a mapping that is no heap,
 * as a thread's stack gets when the end of its guard page falls there: no
 * memory_heap_new, whatever a trace deriving heaps from system calls sees. */
static void stack_like_mprotect(void)
{
    size_t len = 2 * HEAP_MAX;
    char *p = mmap(NULL, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (p == MAP_FAILED)
        die("mmap");
    char *boundary = (char *)(((uintptr_t)p + HEAP_MAX) & ~(uintptr_t)(HEAP_MAX - 1));
    if (mprotect(boundary, 1 << 20, PROT_READ | PROT_WRITE))
        die("mprotect");
    boundary[0] = 1;
    if (munmap(p, len))
        die("munmap");
}

static jmp_buf env;
static sigjmp_buf sigenv;

static void __attribute__((noinline)) jump_back(int value)
{
    longjmp(env, value);
}

static void __attribute__((noinline)) sigjump_back(int value)
{
    siglongjmp(sigenv, value);
}

static void nonlocal_gotos(void)
{
    volatile int jumped = 0;
    if (setjmp(env) == 0) {
        note_args(P_SETJMP, "\"env\": %lu, \"savemask\": 0", (unsigned long)(uintptr_t)env);
        jump_back(7);
    }
    jumped++;
    if (sigsetjmp(sigenv, 1) == 0) {
        note_args(P_SETJMP, "\"env\": %lu, \"savemask\": 1", (unsigned long)(uintptr_t)sigenv);
        sigjump_back(9);
    }
    jumped++;
    if (jumped != 2)
        die("non-local gotos");
    counts[P_SETJMP] += 2;
    counts[P_LONGJMP] += 2;
    counts[P_LONGJMP_TARGET] += 2;
    note_args(P_LONGJMP, "\"env\": %lu, \"val\": 7", (unsigned long)(uintptr_t)env);
    note_args(P_LONGJMP, "\"env\": %lu, \"val\": 9", (unsigned long)(uintptr_t)sigenv);
    note_args(P_LONGJMP_TARGET, "\"env\": %lu, \"val\": 7", (unsigned long)(uintptr_t)env);
    note_args(P_LONGJMP_TARGET, "\"env\": %lu, \"val\": 9", (unsigned long)(uintptr_t)sigenv);
}

/* ------------------------------------------------------------------ */
/* The main arena's address                                            */

/* A freed chunk too large for tcache and fastbins goes to the unsorted bin,
 * whose list head lives inside the arena: in glibc 2.36 on x86_64 the chunk's
 * fd then points 96 bytes into struct malloc_state (bins[] starts at 112, and
 * the head is addressed as a chunk, 16 bytes before its fd). */
static uintptr_t find_main_arena(void)
{
    void *a, *b;
    MAIN(KEEP(a = malloc(4000)));
    MAIN(KEEP(b = malloc(32))); /* keeps `a` from merging into the top chunk */
    uintptr_t *volatile freed = a; /* read after free on purpose */
    MAIN(free(a));
    uintptr_t fd = *freed;
    MAIN(free(b));
    return fd - 96;
}

/* ------------------------------------------------------------------ */
/* Start-up and output                                                  */

static void reexec_with_tunables(void)
{
    /* /proc/self/cmdline holds the command as the kernel started it, which
     * under testrun.sh is "ld.so --library-path ... probe_exerciser ...". */
    static char cmdline[8192];
    static char *argv[64];
    ssize_t n = read_small_file("/proc/self/cmdline", cmdline, sizeof cmdline);
    if (n <= 0)
        die("read /proc/self/cmdline");
    int argc = 0;
    for (char *p = cmdline; p < cmdline + n && argc < 63; p += strlen(p) + 1)
        argv[argc++] = p;
    argv[argc] = NULL;
    /* setenv() would call malloc, and this image must not touch the heap. */
    static char *envp[1024];
    int envc = 0;
    for (char **e = environ; *e && envc < 1021; e++)
        if (strncmp(*e, TUNABLES_ENV "=", sizeof TUNABLES_ENV) != 0)
            envp[envc++] = *e;
    envp[envc++] = TUNABLES_ENV "=" TUNABLES;
    envp[envc++] = REEXEC_MARK "=1";
    envp[envc] = NULL;
    execve("/proc/self/exe", argv, envp);
    die("re-exec");
}

static void write_ground_truth(const char *path, int images, uintptr_t main_arena)
{
    static char out[1 << 16];
    size_t len = 0;
#define EMIT(...) len += (size_t)snprintf(out + len, sizeof out - len, __VA_ARGS__)
    EMIT("{\n  \"pid\": %d,\n  \"glibc_tunables\": \"%s\",\n", (int)getpid(), TUNABLES);
    EMIT("  \"program_images\": %d,\n  \"main_arena\": %lu,\n", images,
         (unsigned long)main_arena);
    EMIT("  \"tunables\": {\"memory_tunable_tcache_max_bytes\": {\"value\": 512, \"old\": 1032},"
         " \"memory_tunable_tcache_count\": {\"value\": 5, \"old\": 7},"
         " \"memory_tunable_tcache_unsorted_limit\": {\"value\": 4, \"old\": 0},"
         " \"memory_mallopt_mxfast\": {\"value\": 96, \"old\": 128}},\n");
    EMIT("  \"probes\": {\n");
    for (int i = 0; i < P_COUNT; i++)
        EMIT("    \"%s\": {\"count\": %ld, \"known_args\": [%s]}%s\n", probe_names[i],
             counts[i], args_json[i], i + 1 < P_COUNT ? "," : "");
    EMIT("  }\n}\n");
#undef EMIT
    if (len >= sizeof out)
        die("ground truth too large");
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0 || write(fd, out, len) != (ssize_t)len || close(fd))
        die(path);
}

int main(int argc, char **argv)
{
    const char *out_path = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--out") == 0 && i + 1 < argc)
            out_path = argv[++i];
        else {
            dprintf(2, "usage: probe_exerciser --out FILE.json\n");
            return 2;
        }
    }
    if (!out_path) {
        dprintf(2, "usage: probe_exerciser --out FILE.json\n");
        return 2;
    }
    if (!getenv(REEXEC_MARK))
        reexec_with_tunables();

    /* __libc_start_call_main() calls setjmp once per program image: the one
     * that re-executed and this one. */
    int images = 2;
    counts[P_SETJMP] += images;

    /* Nothing has called malloc yet if the break is where the kernel put it. */
    uintptr_t initial = start_brk();
    last_brk = initial;
    brk_note();
    if (counts[P_SBRK_MORE])
        dprintf(2, "probe_exerciser: the heap grew before main()\n");

    /* The first allocation initialises malloc, which applies GLIBC_TUNABLES:
     * each tunable set fires its probe once. */
    uintptr_t main_arena = find_main_arena();
    counts[P_TUNABLE_TCACHE_MAX_BYTES]++;
    counts[P_TUNABLE_TCACHE_COUNT]++;
    counts[P_TUNABLE_TCACHE_UNSORTED_LIMIT]++;
    counts[P_MALLOPT_MXFAST]++;

    /* Phase 1 runs while the main arena is still the only arena. */
    run_child(contention_body, main_arena, 0);
    thresholds_and_mallopt();
    main_arena_trim();

    pthread_t t;
    MAIN(errno = pthread_create(&t, NULL, heap_thread, NULL));
    if (errno)
        die("pthread_create");
    counts[P_SETJMP]++;
    MAIN(pthread_join(t, NULL));
    heaps_note(NULL); /* thread exit (tcache shutdown) happened before join returned */

    void *ret;
    MAIN(errno = pthread_create(&t, NULL, retry_thread, NULL));
    if (errno)
        die("pthread_create");
    counts[P_SETJMP]++;
    MAIN(pthread_join(t, &ret));
    heaps_note(NULL);

    run_child(double_free_body, 0, SIGABRT);
    stack_like_mprotect();
    nonlocal_gotos();

    write_ground_truth(out_path, images, main_arena);
    return 0;
}
