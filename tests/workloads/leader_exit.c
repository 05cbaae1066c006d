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
 * pairs of both threads) and exits. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
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

int main(int argc, char **argv)
{
    calls = argc > 1 ? atol(argv[1]) : 1000;
    wait_after_main = argc > 2 && argv[2][0] == 'w';
    busy = argc > 2 && argv[2][0] == 'b';
    main_thread = pthread_self();
    pthread_t thread;
    ready_then_wait();
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
