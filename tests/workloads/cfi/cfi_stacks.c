/* Allocations at the end of call chains it knows, in code built as
 * distributions build it: -O2, no frame pointers, PIE, a shared library
 * (libcfi_deep.so), a library loaded with dlopen while traced
 * (libcfi_plugin.so), and a thread.
 *
 *   cfi_stacks PLUGIN_PATH CALLS DEEP
 *
 * Waits for a byte on stdin (a tracer attaches meanwhile; "ready" first),
 * then, CALLS times each:
 *   main -> run_direct -> direct_leaf -> malloc(24)
 *   main -> run_library -> deep_chain x4 -> deep_leaf -> malloc(40)     (the library)
 *   main -> run_deep -> deep_chain x DEEP -> deep_leaf -> malloc(56)   (deeper than a walk keeps)
 *   main -> run_plugin -> plugin_alloc -> plugin_leaf -> calloc(1, 72) (after dlopen)
 *   thread_main -> thread_leaf -> malloc(88)                          (in a thread)
 * freeing each block, and prints each chain it made, outermost caller
 * first, as folded stacks do:
 *   stack CALLS SIZE main;run_direct;direct_leaf
 * then "done", and waits for another byte (or the end of stdin). */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

void *deep_chain(int depth, size_t size);
volatile unsigned long sink;
static long calls;

__attribute__((noinline, noclone)) static void *direct_leaf(size_t size)
{
    void *p = malloc(size);
    sink += (unsigned long)p;
    return p;
}

__attribute__((noinline, noclone)) static void run_direct(void)
{
    for (long i = 0; i < calls; i++)
        free(direct_leaf(24));
    sink++;
}

__attribute__((noinline, noclone)) static void run_library(void)
{
    for (long i = 0; i < calls; i++)
        free(deep_chain(4, 40));
    sink++;
}

__attribute__((noinline, noclone)) static void run_deep(int depth)
{
    for (long i = 0; i < calls; i++)
        free(deep_chain(depth, 56));
    sink++;
}

__attribute__((noinline, noclone)) static void run_plugin(void *(*plugin_alloc)(size_t))
{
    for (long i = 0; i < calls; i++)
        free(plugin_alloc(64));
    sink++;
}

/* Not the same code as direct_leaf: the compiler would fold the two into one. */
__attribute__((noinline, noclone)) static void *thread_leaf(size_t size)
{
    void *p = malloc(size);
    sink ^= (unsigned long)p;
    return p;
}

static void *thread_main(void *unused)
{
    (void)unused;
    for (long i = 0; i < calls; i++)
        free(thread_leaf(88));
    sink++;
    return NULL;
}

static void chain(long count, int size, const char *frames, int repeat, const char *tail)
{
    printf("stack %ld %d %s", count, size, frames);
    for (int i = 0; i < repeat; i++)
        printf(";deep_chain");
    printf("%s\n", tail);
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: cfi_stacks PLUGIN_PATH CALLS DEEP\n");
        return 2;
    }
    calls = atol(argv[2]);
    int deep = atoi(argv[3]);
    char byte;
    printf("ready\n");
    fflush(stdout);
    if (read(0, &byte, 1) != 1)
        return 1;
    run_direct();
    run_library();
    run_deep(deep);
    void *plugin = dlopen(argv[1], RTLD_NOW);
    if (!plugin) {
        fprintf(stderr, "%s\n", dlerror());
        return 1;
    }
    run_plugin((void *(*)(size_t))dlsym(plugin, "plugin_alloc"));
    pthread_t thread;
    if (pthread_create(&thread, NULL, thread_main, NULL) || pthread_join(thread, NULL))
        return 1;
    chain(calls, 24, "main;run_direct;direct_leaf", 0, "");
    chain(calls, 40, "main;run_library", 4, ";deep_leaf");
    chain(calls, 56, "main;run_deep", deep, ";deep_leaf");
    chain(calls, 72, "main;run_plugin;plugin_alloc;plugin_leaf", 0, "");
    chain(calls, 88, "thread_main;thread_leaf", 0, "");
    printf("done\n");
    fflush(stdout);
    if (read(0, &byte, 1) < 0)
        return 1;
    return 0;
}
