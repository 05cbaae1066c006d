/* An allocator mtrace-live does not know: it exports the standard names,
 * none of glibc's, jemalloc's, tcmalloc's or mimalloc's own. Blocks are cut
 * from one mapping, each after a header holding its size, and never reused
 * (tests/privileged/test_allocators.py preloads it). */
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define ROOM (1UL << 30)
#define HEADER 16

static char *base;
static uintptr_t used;

static void *cut(size_t size, size_t align)
{
    if (!base) {
        void *room = mmap(NULL, ROOM, PROT_READ | PROT_WRITE,
                          MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        char *expected = NULL;
        if (room == MAP_FAILED)
            return NULL;
        if (!__atomic_compare_exchange_n(&base, &expected, room, 0, __ATOMIC_SEQ_CST,
                                         __ATOMIC_SEQ_CST))
            munmap(room, ROOM);
    }
    if (align < HEADER)
        align = HEADER;
    for (;;) {
        uintptr_t at = __atomic_load_n(&used, __ATOMIC_SEQ_CST);
        uintptr_t block = (at + HEADER + align - 1) & ~(uintptr_t)(align - 1);
        uintptr_t end = block + size;
        if (end > ROOM)
            return NULL;
        if (__atomic_compare_exchange_n(&used, &at, end, 0, __ATOMIC_SEQ_CST,
                                        __ATOMIC_SEQ_CST)) {
            *(size_t *)(base + block - HEADER) = size;
            return base + block;
        }
    }
}

void *malloc(size_t size) { return cut(size, HEADER); }
void free(void *p) { (void)p; }
void *calloc(size_t n, size_t size) { return n && size > SIZE_MAX / n ? NULL : cut(n * size, HEADER); }
void *memalign(size_t align, size_t size) { return cut(size, align); }
void *aligned_alloc(size_t align, size_t size) { return cut(size, align); }
void *valloc(size_t size) { return cut(size, 4096); }
void *pvalloc(size_t size) { return cut((size + 4095) & ~4095UL, 4096); }

void *realloc(void *p, size_t size)
{
    void *fresh = cut(size, HEADER);
    if (fresh && p) {
        size_t old = *(size_t *)((char *)p - HEADER);
        memcpy(fresh, p, old < size ? old : size);
    }
    return fresh;
}

int posix_memalign(void **out, size_t align, size_t size)
{
    void *p = cut(size, align);
    if (!p)
        return ENOMEM;
    *out = p;
    return 0;
}

size_t malloc_usable_size(void *p) { return p ? *(size_t *)((char *)p - HEADER) : 0; }
