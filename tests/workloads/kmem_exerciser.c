/* kmem_exerciser: makes a known number of allocating syscalls in its own
 * process and writes what it did as JSON.
 *
 * Each socket() allocates exactly one inode from the kernel's
 * sock_inode_cache (net/socket.c: sock_alloc_inode), a cache with a
 * constructor and therefore never merged with another; each pipe() allocates
 * its pipe_inode_info and buffers with kmalloc.
 *
 * Usage: kmem_exerciser --sockets N --pipes M --out FILE.json [--gated] [--leak K]
 *
 * --leak K: the first K sockets and the first K pipes are left open until
 * the process exits, so while it waits at "done" they are allocated and not
 * freed: leaks of known count. Each pipe holds two kmalloc objects made in
 * alloc_pipe_info (the pipe and its buffer array), freed at once on close;
 * a socket inode is freed only after an RCU grace period.
 *
 * --gated: print "ready" and wait for a line on stdin before the work, then
 * print "done" and wait for another before exiting, so that tracers can be
 * attached and stopped while the process is asleep (and makes no events).
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static int fail(const char *what)
{
    perror(what);
    return 2;
}

static void gate(const char *say)
{
    char line[64];
    printf("%s\n", say);
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin))
        exit(3);
}

int main(int argc, char **argv)
{
    long sockets = 0, pipes = 0, leak = 0;
    const char *out = NULL;
    int gated = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--gated")) {
            gated = 1;
            continue;
        }
        if (i + 1 >= argc)
            break;
        if (!strcmp(argv[i], "--sockets"))
            sockets = strtol(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--pipes"))
            pipes = strtol(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--out"))
            out = argv[i + 1];
        else if (!strcmp(argv[i], "--leak"))
            leak = strtol(argv[i + 1], NULL, 10);
        i++;
    }
    if (!out || sockets < 0 || pipes < 0 || leak < 0 || leak > sockets || leak > pipes) {
        fprintf(stderr, "usage: kmem_exerciser --sockets N --pipes M --out FILE.json [--gated] [--leak K]\n");
        return 2;
    }
    if (gated)
        gate("ready");
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < sockets; i++) {
        int fd = socket(AF_UNIX, SOCK_DGRAM, 0);
        if (fd < 0)
            return fail("socket");
        if (i >= leak)
            close(fd);
    }
    for (long i = 0; i < pipes; i++) {
        int fds[2];
        if (pipe(fds))
            return fail("pipe");
        if (i >= leak) {
            close(fds[0]);
            close(fds[1]);
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    long long work_ns = (t1.tv_sec - t0.tv_sec) * 1000000000LL + (t1.tv_nsec - t0.tv_nsec);
    FILE *f = fopen(out, "w");
    if (!f)
        return fail(out);
    fprintf(f, "{\"pid\": %d, \"sockets\": %ld, \"pipes\": %ld, \"leaked\": %ld, "
               "\"work_ns\": %lld,\n"
               " \"expected\": {\"kmem_cache_alloc\": {\"sock_inode_cache\": %ld}}}\n",
            (int)getpid(), sockets, pipes, leak, work_ns, sockets);
    if (fclose(f))
        return fail(out);
    if (gated)
        gate("done");
    return 0;
}
