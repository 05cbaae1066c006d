/* Main ends first: pthread_exit in main, while a thread goes on allocating.
 *
 *   leader_exit CALLS [wait]
 *
 * Starts a worker thread, prints "ready" and waits for a byte on stdin (a
 * tracer attaches meanwhile, by pid), then makes CALLS malloc/free pairs in
 * main and calls pthread_exit. The worker joins main (its thread ends; the
 * process goes on); with "wait" it then prints "main gone" and waits for
 * another byte on stdin (a tracer moves its probes meanwhile); it makes
 * CALLS pairs of its own, prints "done 2*CALLS" (the pairs made after the
 * tracer attached) and returns, ending the process. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "ready.h"

static long calls;
static int wait_after_main;
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

static void *worker(void *arg)
{
    (void)arg;
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
    main_thread = pthread_self();
    pthread_t thread;
    if (pthread_create(&thread, NULL, worker, NULL))
        return 1;
    ready_then_wait();
    pairs();
    pthread_exit(NULL);
}
