/* libcfi_plugin.so: loaded by cfi_stacks with dlopen while it is traced. */
#include <stdlib.h>

volatile unsigned long cfi_plugin_sink;

__attribute__((noinline, noclone)) void *plugin_leaf(size_t size)
{
    void *p = calloc(1, size);
    cfi_plugin_sink += (unsigned long)p;
    return p;
}

__attribute__((noinline, noclone)) void *plugin_alloc(size_t size)
{
    void *p = plugin_leaf(size + 8);
    cfi_plugin_sink += size;
    return p;
}
