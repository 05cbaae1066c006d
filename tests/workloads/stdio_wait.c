/* One wait on a libc lock that is not an arena's: stdout's, held by main.
 *
 *   stdio_wait release|exit|exec
 *
 * Writes "pid PID" and "ready" (with write(2): stdout's lock is the one
 * waited on), then waits for a byte on stdin (a tracer attaches meanwhile).
 * Main then takes stdout's lock (flockfile) and starts a thread that writes
 * to stdout, which waits in the libc's lock-wait slow path until the lock is
 * free. Once the thread sleeps on the futex (/proc/self/task/TID/syscall
 * shows futex, 202), main
 *   release: holds the lock 50 ms more, frees it, joins the thread, and
 *            writes "held NS" (the time from the thread's sleep seen to the
 *            release: the wait lasted at least that) and "done";
 *   exit:    ends the process with _exit while the thread waits;
 *   exec:    execs /bin/true while the thread waits.
 * In release mode it waits for another byte before it exits. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static volatile long waiter_tid;

static long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void say(const char *text)
{
    if (write(1, text, strlen(text)) < 0)
        _exit(1);
}

static void *waiter(void *arg)
{
    (void)arg;
    waiter_tid = syscall(SYS_gettid);
    fputs("waiter\n", stdout); /* blocks: main holds stdout's lock */
    fflush(stdout);
    return NULL;
}

static int sleeping_on_futex(long tid)
{
    char path[64], buf[64] = {0};
    snprintf(path, sizeof(path), "/proc/self/task/%ld/syscall", tid);
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    return n > 0 && strncmp(buf, "202 ", 4) == 0;
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s release|exit|exec\n", argv[0]);
        return 2;
    }
    char line[64], byte;
    snprintf(line, sizeof(line), "pid %ld\nready\n", (long)getpid());
    say(line);
    if (read(0, &byte, 1) != 1)
        return 1;
    flockfile(stdout);
    pthread_t thread;
    pthread_create(&thread, NULL, waiter, NULL);
    while (!waiter_tid || !sleeping_on_futex(waiter_tid))
        usleep(1000);
    long seen = now_ns();
    if (strcmp(argv[1], "exit") == 0)
        _exit(0);
    if (strcmp(argv[1], "exec") == 0) {
        execl("/bin/true", "true", (char *)NULL);
        return 1;
    }
    usleep(50000);
    long held = now_ns() - seen;
    funlockfile(stdout);
    pthread_join(thread, NULL);
    snprintf(line, sizeof(line), "held %ld\ndone\n", held);
    say(line);
    if (read(0, &byte, 1) < 0)
        return 1;
    return 0;
}
