/* nocfi_main CALLS: CALLS allocations through libnocfi.so's chain
 * (tests/workloads/cfi/nocfi.c), each freed; built as distributions build. */
#include <stdio.h>
#include <stdlib.h>
void *nocfi_chain(int depth, size_t n);
int main(int argc, char **argv)
{
    int calls = atoi(argv[1]);
    for (int i = 0; i < calls; i++)
        free(nocfi_chain(3, 40));
    printf("done\n");
    return 0;
}
