/* setjmp/longjmp as fast as possible, or at a set rate: the benchmark
 * workload for the cost of one USDT hit.
 *
 *   jmp_loop ITERATIONS [RATE]
 *
 * Each iteration calls setjmp once and longjmp once, which fires three libc
 * probes: setjmp, longjmp and longjmp_target. With RATE (iterations per
 * second) it paces itself against CLOCK_MONOTONIC. Prints the elapsed
 * seconds on stdout. */
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: %s ITERATIONS [RATE]\n", argv[0]);
        return 2;
    }
    long iterations = strtol(argv[1], NULL, 10);
    double rate = argc == 3 ? strtod(argv[2], NULL) : 0;
    static jmp_buf env;
    double start = now();
    for (volatile long i = 0; i < iterations; i++) {
        if (rate > 0)
            while (now() - start < i / rate)
                ;
        if (setjmp(env) == 0)
            longjmp(env, 1);
    }
    printf("%.6f\n", now() - start);
    return 0;
}
