/* kmem_exerciser: makes a known number of allocating syscalls in its own
 * process and writes what it did as JSON.
 *
 * Each socket() allocates exactly one inode from the kernel's
 * sock_inode_cache (net/socket.c: sock_alloc_inode), a cache with a
 * constructor and therefore never merged with another; each pipe() allocates
 * its pipe_inode_info and buffers with kmalloc.
 *
 * Usage: kmem_exerciser --sockets N --pipes M --out FILE.json
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int fail(const char *what)
{
    perror(what);
    return 2;
}

int main(int argc, char **argv)
{
    long sockets = 0, pipes = 0;
    const char *out = NULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--sockets"))
            sockets = strtol(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--pipes"))
            pipes = strtol(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--out"))
            out = argv[i + 1];
    }
    if (!out || sockets < 0 || pipes < 0) {
        fprintf(stderr, "usage: kmem_exerciser --sockets N --pipes M --out FILE.json\n");
        return 2;
    }
    for (long i = 0; i < sockets; i++) {
        int fd = socket(AF_UNIX, SOCK_DGRAM, 0);
        if (fd < 0)
            return fail("socket");
        close(fd);
    }
    for (long i = 0; i < pipes; i++) {
        int fds[2];
        if (pipe(fds))
            return fail("pipe");
        close(fds[0]);
        close(fds[1]);
    }
    FILE *f = fopen(out, "w");
    if (!f)
        return fail(out);
    fprintf(f, "{\"pid\": %d, \"sockets\": %ld, \"pipes\": %ld,\n"
               " \"expected\": {\"kmem_cache_alloc\": {\"sock_inode_cache\": %ld}}}\n",
            (int)getpid(), sockets, pipes, sockets);
    return fclose(f) ? fail(out) : 0;
}
