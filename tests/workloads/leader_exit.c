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
 *   leader_exit 0 inside
 *
 * A call in flight while the probes move: a worker calls posix_memalign
 * with the place of its result in a page that userfaultfd keeps missing,
 * so the call stays inside, storing the pointer, until the page is filled.
 * Once a thread reading the fault has printed "inside", main calls
 * pthread_exit; at a byte on stdin the page is filled (zeros), the call
 * returns, and the worker frees its block, prints "done 1" and exits. */
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
static void **missing; /* the page the worker's posix_memalign stores its pointer in */
static sem_t worker_inside;

static void *inside_worker(void *arg)
{
    (void)arg;
    if (posix_memalign(missing, 64, 100) || !*missing)
        abort();
    free(*missing);
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
    uffd = syscall(SYS_userfaultfd, O_CLOEXEC);
    struct uffdio_api api = {.api = UFFD_API};
    missing = mmap(NULL, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    struct uffdio_register reg = {.range = {.start = (unsigned long)missing, .len = page},
                                  .mode = UFFDIO_REGISTER_MODE_MISSING};
    if (uffd < 0 || ioctl(uffd, UFFDIO_API, &api) || missing == MAP_FAILED ||
        ioctl(uffd, UFFDIO_REGISTER, &reg) || sem_init(&worker_inside, 0, 0))
        exit(1);
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
    if (argc > 2 && argv[2][0] == 'i')
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
