/* Holds N blocks at once, then frees them all: more than a small
 * --max-outstanding can track (tests/privileged/test_untracked_frees.py).
 *
 *   hold_blocks N TRUTH FIFO
 *
 * After the frees it writes TRUTH, {"pid": P, "mallocs": M, "frees": F}:
 * the calls it made itself (its array of pointers among them), then waits
 * until a byte comes through FIFO, so that the trace can be read while it
 * lives. Nothing in between allocates: no stdio. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define BLOCK 24

int main(int argc, char **argv)
{
    if (argc != 4)
        return 2;
    long n = strtol(argv[1], NULL, 10);
    if (n <= 0)
        return 2;
    void **blocks = malloc((size_t)n * sizeof(void *));
    if (!blocks)
        return 1;
    for (long i = 0; i < n; i++) {
        blocks[i] = malloc(BLOCK);
        if (!blocks[i])
            return 1;
    }
    for (long i = 0; i < n; i++)
        free(blocks[i]);
    free(blocks);

    char truth[128];
    int len = snprintf(truth, sizeof(truth), "{\"pid\": %d, \"mallocs\": %ld, \"frees\": %ld}\n",
                       (int)getpid(), n + 1, n + 1);
    char partial[4096];
    snprintf(partial, sizeof(partial), "%s.partial", argv[2]);
    int out = open(partial, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (out < 0 || write(out, truth, (size_t)len) != len || close(out) || rename(partial, argv[2]))
        return 1;
    int gate = open(argv[3], O_RDONLY);
    char byte;
    if (gate < 0 || read(gate, &byte, 1) != 1)
        return 1;
    return 0;
}
