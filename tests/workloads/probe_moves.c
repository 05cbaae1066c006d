/* The thread a process's uprobes are attached for ends, again and again,
 * while another thread allocates without a pause.
 *
 *   probe_moves MOVES
 *
 * Starts MOVES - 1 threads that wait their turn, then a hammer thread that
 * makes malloc/free pairs without a pause, then a reader thread; prints
 * "ready" and waits for a byte on stdin (a tracer attaches meanwhile, by
 * pid, its probes for main's thread). At that byte the hammer starts and
 * main calls pthread_exit, then the waiting threads in the order they were
 * made, each at its byte: the oldest thread left each time (a tracer moves
 * its probes to the next oldest; the hammer is that thread after the
 * last). Each lingers in pthread_exit (a thread-specific value's
 * destructor) until one more byte, so that the thread the probes are
 * attached for lives until they have moved: two bytes per move. At the
 * byte after the last move the reader stops the hammer, which prints
 * "done N" (its pairs) and ends the process. */
#define _GNU_SOURCE
#include <pthread.h>
#include <semaphore.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "ready.h"

#define MAX_MOVES 256

static sem_t turn[MAX_MOVES]; /* turn[i]: the i-th waiting thread's (turn[MOVES - 1]: the reader's) */
static sem_t go; /* the hammer's start, at main's byte */
static volatile int stop;

static pthread_key_t lingers;

static void wait_byte(void)
{
    char byte;
    if (read(0, &byte, 1) != 1)
        exit(1);
}

/* In pthread_exit: until a byte, then the next thread's turn. */
static void linger(void *next)
{
    wait_byte();
    sem_post(next);
}

static void end_thread(long i)
{
    if (pthread_setspecific(lingers, &turn[i]))
        exit(1);
    pthread_exit(NULL);
}

static void *waiting(void *arg)
{
    long i = (long)arg;
    while (sem_wait(&turn[i]))
        ;
    wait_byte();
    end_thread(i + 1);
    return NULL;
}

static void *hammer(void *arg)
{
    (void)arg;
    long pairs = 0;
    while (sem_wait(&go))
        ;
    while (!stop) {
        void *p = malloc(64 + pairs % 512);
        if (!p)
            abort();
        free(p);
        pairs++;
    }
    printf("done %ld\n", pairs);
    fflush(stdout);
    exit(0);
}

static void *reader(void *arg)
{
    long moves = (long)arg;
    while (sem_wait(&turn[moves]))
        ;
    wait_byte();
    stop = 1;
    return NULL;
}

int main(int argc, char **argv)
{
    long moves = argc > 1 ? atol(argv[1]) : 10;
    if (moves < 1 || moves > MAX_MOVES)
        return 2;
    pthread_t thread;
    for (long i = 0; i < moves; i++)
        if (sem_init(&turn[i], 0, 0))
            return 1;
    if (sem_init(&go, 0, 0) || pthread_key_create(&lingers, linger))
        return 1;
    for (long i = 0; i < moves - 1; i++) /* main is the first to end */
        if (pthread_create(&thread, NULL, waiting, (void *)i))
            return 1;
    if (pthread_create(&thread, NULL, hammer, NULL) ||
        pthread_create(&thread, NULL, reader, (void *)(moves - 1)))
        return 1;
    ready_then_wait(); /* main's own byte */
    sem_post(&go);
    end_thread(0);
}
