/* Main ends first: pthread_exit in main, while a thread goes on allocating.
 *
 *   leader_exit CALLS [wait|busy]
 *
 * Starts a worker thread, prints "ready" and waits for a byte on stdin (a
 * tracer attaches meanwhile, by pid), then makes CALLS malloc/free pairs in
 * main and calls pthread_exit. The worker joins main (its thread ends; the
 * process goes on); with "wait" it then prints "main gone" and waits for
 * another byte on stdin (a tracer moves its probes meanwhile); it makes
 * CALLS pairs of its own, prints "done 2*CALLS" (the pairs made after the
 * tracer attached) and returns, ending the process. With "busy" the worker
 * does not wait for main: it makes pairs from the start (one each 20 us or
 * so), while main exits
 * and after, until another byte comes on stdin, then prints "done N" (the
 * pairs of both threads) and exits.
 *
 *   leader_exit CALLS inside
 *
 * A call in flight while the probes move (CALLS unused): a worker calls
 * posix_memalign with the place of its result in a page that userfaultfd
 * keeps missing, so the call stays inside, storing the pointer, until the
 * page is filled. Once a thread reading the fault has printed "inside",
 * main calls pthread_exit; at a byte on stdin the page is filled (zeros),
 * the call returns and the worker prints "returned"; at another byte it
 * frees its block, prints "done 1" and exits.
 *
 *   leader_exit CALLS tail
 *
 * The same with realloc(NULL, 100) in flight, which jumps to malloc (a
 * tail call) once its stack, on the missing page, is filled. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ready.h"

#ifndef UFFD_USER_MODE_ONLY
#define UFFD_USER_MODE_ONLY 1 /* Linux 5.11 */
#endif

static long calls;
static int wait_after_main, busy;
static volatile int stop_busy;
static long busy_pairs;
static pthread_t main_thread;

static void pairs(void)
{
    for (long i = 0; i < calls; i++) {
        void *p = malloc(64 + i % 512);
        if (!p)
            abort();
        free(p);
    }
}

static void *stopper(void *arg)
{
    (void)arg;
    char byte;
    if (read(0, &byte, 1) != 1)
        exit(1);
    stop_busy = 1;
    return NULL;
}

/* Main's thread-specific value's destructor, in its pthread_exit: waits
 * for a byte, then has another thread wait for the byte that stops the worker. */
static void linger(void *value)
{
    (void)value;
    char byte;
    if (read(0, &byte, 1) != 1)
        exit(1);
    pthread_t reader;
    if (pthread_create(&reader, NULL, stopper, NULL))
        exit(1);
}

static void *worker(void *arg)
{
    (void)arg;
    if (busy) {
        while (!stop_busy) {
            void *p = malloc(64 + busy_pairs % 512);
            if (!p)
                abort();
            free(p);
            busy_pairs++;
            usleep(20); /* some 30,000 pairs a second: the event stream keeps up */
        }
        printf("done %ld\n", 2 * (calls + busy_pairs));
        fflush(stdout);
        exit(0);
    }
    if (pthread_join(main_thread, NULL)) /* main's thread has ended */
        abort();
    if (wait_after_main) {
        printf("main gone\n");
        fflush(stdout);
        char byte;
        if (read(0, &byte, 1) != 1)
            exit(1);
    }
    pairs();
    printf("done %ld\n", 2 * calls);
    fflush(stdout);
    exit(0);
}

static int uffd;
static int tail; /* "tail": realloc(NULL), which jumps to malloc, is the call in flight */
#define STACK_PAGES 8 /* realloc_over_missing's stack: the 7th is kept missing */
static char *missing; /* the page userfaultfd keeps missing */
static sem_t worker_inside;

/* realloc(NULL, size) called with the stack pointer 16 bytes into the
 * page above `missing`: its return address and first push land there, its
 * second push on `missing`, where it waits until that is filled; then it
 * jumps to malloc (a tail call), with six pages of stack below. */
static void *realloc_over_missing(size_t size)
{
    void *got;
    char *top = missing + sysconf(_SC_PAGESIZE) + 16;
    /* realloc's own address (dlsym), never a PLT entry: a first call
     * through the PLT would fault in the loader's lazy binding */
    void *(*fn)(void *, size_t) = (void *(*)(void *, size_t))dlsym(RTLD_DEFAULT, "realloc");
    if (!fn)
        abort();
    __asm__ volatile("mov %%rsp, %%r12\n\t"
                     "mov %[top], %%rsp\n\t"
                     "xor %%edi, %%edi\n\t"
                     "mov %[size], %%rsi\n\t"
                     "call *%[fn]\n\t"
                     "mov %%r12, %%rsp"
                     : "=a"(got)
                     : [top] "r"(top), [size] "r"(size), [fn] "r"(fn)
                     : "r12", "rcx", "rdx", "rsi", "rdi", "r8", "r9", "r10", "r11", "xmm0",
                       "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
                       "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory", "cc");
    return got;
}

static void *inside_worker(void *arg)
{
    (void)arg;
    void *block = NULL;
    if (tail)
        block = realloc_over_missing(100);
    else if (posix_memalign((void **)missing, 64, 100))
        abort();
    else
        block = *(void **)missing;
    if (!block)
        abort();
    printf("returned\n");
    fflush(stdout);
    char byte;
    if (read(0, &byte, 1) != 1)
        exit(1);
    free(block);
    printf("done 1\n");
    fflush(stdout);
    exit(0);
}

/* Reads the worker's fault, says so, and fills the page at a byte on stdin. */
static void *filler(void *arg)
{
    (void)arg;
    struct uffd_msg msg;
    if (read(uffd, &msg, sizeof(msg)) != sizeof(msg) || msg.event != UFFD_EVENT_PAGEFAULT)
        exit(1);
    printf("inside\n");
    fflush(stdout);
    sem_post(&worker_inside);
    char byte;
    if (read(0, &byte, 1) != 1)
        exit(1);
    long page = sysconf(_SC_PAGESIZE);
    struct uffdio_zeropage zero = {.range = {.start = (unsigned long)missing, .len = page}};
    if (ioctl(uffd, UFFDIO_ZEROPAGE, &zero))
        exit(1);
    return NULL;
}

static void call_inside(void)
{
    long page = sysconf(_SC_PAGESIZE);
    /* (faults in user mode only: no privilege needed) */
    uffd = syscall(SYS_userfaultfd, O_CLOEXEC | UFFD_USER_MODE_ONLY);
    struct uffdio_api api = {.api = UFFD_API};
    char *stack = mmap(NULL, STACK_PAGES * page, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (stack == MAP_FAILED)
        exit(1);
    missing = stack + (STACK_PAGES - 2) * page;
    for (char *p = stack; p < stack + STACK_PAGES * page; p += page)
        if (p != missing)
            *p = 1; /* every other page is there */
    struct uffdio_register reg = {.range = {.start = (unsigned long)missing, .len = page},
                                  .mode = UFFDIO_REGISTER_MODE_MISSING};
    if (uffd < 0 || ioctl(uffd, UFFDIO_API, &api) || ioctl(uffd, UFFDIO_REGISTER, &reg) ||
        sem_init(&worker_inside, 0, 0)) {
        perror("leader_exit: userfaultfd");
        exit(1);
    }
    pthread_t fill, worker;
    if (pthread_create(&fill, NULL, filler, NULL) ||
        pthread_create(&worker, NULL, inside_worker, NULL))
        exit(1);
    while (sem_wait(&worker_inside))
        ;
    pthread_exit(NULL);
}

int main(int argc, char **argv)
{
    calls = argc > 1 ? atol(argv[1]) : 1000;
    wait_after_main = argc > 2 && argv[2][0] == 'w';
    busy = argc > 2 && argv[2][0] == 'b';
    main_thread = pthread_self();
    pthread_t thread;
    ready_then_wait();
    tail = argc > 2 && argv[2][0] == 't';
    if (argc > 2 && (argv[2][0] == 'i' || tail))
        call_inside();
    if (pthread_create(&thread, NULL, worker, NULL))
        return 1;
    if (busy) {
        pthread_key_t key;
        if (pthread_key_create(&key, linger) || pthread_setspecific(key, &key))
            return 1;
    }
    pairs();
    pthread_exit(NULL);
}
