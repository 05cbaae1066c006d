/* A workload that knows exactly what it makes the allocator probes report.
 *
 *   mallopt_loop COUNT [--exec PROGRAM]
 *
 * Prints "ready", waits for a line on stdin (so a tracer can attach to the
 * running process first), then calls mallopt(M_PERTURB, i % 256) for i in
 * 0 .. COUNT-1: each call fires memory_mallopt(-6, i % 256) and
 * memory_mallopt_perturb(i % 256, previous value). Then it exits 0, or
 * execs PROGRAM. */
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    if (argc != 2 && !(argc == 4 && strcmp(argv[2], "--exec") == 0)) {
        fprintf(stderr, "usage: %s COUNT [--exec PROGRAM]\n", argv[0]);
        return 2;
    }
    long count = strtol(argv[1], NULL, 10);
    printf("ready\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin))
        return 3;
    for (long i = 0; i < count; i++)
        mallopt(M_PERTURB, (int)(i % 256));
    mallopt(M_PERTURB, 0);
    if (argc == 4) {
        execl(argv[3], argv[3], (char *)NULL);
        perror("execl");
        return 4;
    }
    return 0;
}
