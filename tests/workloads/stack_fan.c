/* Allocations under many distinct call stacks, for building heap profiles
 * of a known size (bench section 10).
 *
 * stack_fan N [--churn]: allocation i (0 <= i < N) is made through a chain
 * of BITS noinline calls, each to left() or right() by one bit of i, so that
 * the N allocations have N distinct stacks of 35 frames. Every block stays
 * allocated. The program prints "ready" and waits for a line on standard
 * input before the work, then prints "done" and waits for another before it
 * exits (its blocks still held). --churn: while it waits, it frees and makes
 * every block again, round after round, so that every stack's counts keep
 * changing. */
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BITS 15 /* up to 32,768 distinct stacks */
#define NOINLINE __attribute__((noinline))

static volatile unsigned long calls; /* work after each call: no tail call folds a frame */

NOINLINE void *step(int level, unsigned long i);

NOINLINE void *left(int level, unsigned long i)
{
    void *p = step(level + 1, i);
    calls++;
    return p;
}

NOINLINE void *right(int level, unsigned long i)
{
    void *p = step(level + 1, i);
    calls++;
    return p;
}

NOINLINE void *step(int level, unsigned long i)
{
    if (level == BITS)
        return malloc(32 + (i & 7) * 8);
    void *p = (i >> level & 1) ? right(level, i) : left(level, i);
    calls++;
    return p;
}

static int wait_line(void)
{
    char line[16];
    return fgets(line, sizeof(line), stdin) != NULL;
}

int main(int argc, char **argv)
{
    unsigned long n = argc > 1 ? strtoul(argv[1], NULL, 10) : 1000;
    if (n > 1UL << BITS)
        n = 1UL << BITS;
    void **blocks = calloc(n, sizeof(void *));
    printf("ready\n");
    fflush(stdout);
    if (!wait_line())
        return 3;
    /* one loop for the first round and the churn's, so that a block is
     * made under the same stack each round (main's one call site) */
    int churn = argc > 2 && !strcmp(argv[2], "--churn");
    struct pollfd input = {.fd = 0, .events = POLLIN};
    for (unsigned long round = 0;; round++) {
        for (unsigned long i = 0; i < n; i++) {
            if (round > 0)
                free(blocks[i]);
            blocks[i] = step(0, i);
        }
        if (round == 0) {
            printf("done\n");
            fflush(stdout);
        }
        if (!churn || poll(&input, 1, 0) != 0)
            break;
    }
    if (!wait_line())
        return 3;
    return blocks[0] == NULL;
}
