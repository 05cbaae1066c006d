/* The workloads' start: say "ready" and wait for a byte on stdin (a tracer
 * attaches meanwhile); exit 1 if stdin ends first. */
#ifndef WORKLOAD_READY_H
#define WORKLOAD_READY_H
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static void ready_then_wait(void)
{
    printf("ready\n");
    fflush(stdout);
    char byte;
    if (read(0, &byte, 1) != 1)
        exit(1);
}

#endif
