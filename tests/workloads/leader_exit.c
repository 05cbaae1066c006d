/* Main ends first: pthread_exit in main, while a thread goes on allocating.
 *
 *   leader_exit CALLS
 *
 * Starts a worker thread, prints "ready" and waits for a byte on stdin (a
 * tracer attaches meanwhile, by pid), then makes CALLS malloc/free pairs in
 * main and calls pthread_exit. The worker joins main (its thread ends; the
 * process goes on), makes CALLS pairs of its own, prints "done 2*CALLS"
 * (the pairs made after the tracer attached) and returns, ending the process. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "ready.h"

static long calls;
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
    pairs();
    printf("done %ld\n", 2 * calls);
    fflush(stdout);
    exit(0);
}

int main(int argc, char **argv)
{
    calls = argc > 1 ? atol(argv[1]) : 1000;
    main_thread = pthread_self();
    pthread_t thread;
    if (pthread_create(&thread, NULL, worker, NULL))
        return 1;
    ready_then_wait();
    pairs();
    pthread_exit(NULL);
}
