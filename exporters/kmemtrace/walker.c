/*
 * The one walker of kmemtrace records (the format: abi.py,
 * docs/kmemtrace-format.md), for every reader of them:
 *
 * - decode(): one record into a decoded record, rec_t, whose layout is
 *   abi.py's DECODED (a unit test compares the two). Every walk below
 *   goes through it: the same skip reasons, the same damage statuses.
 * - scan(): one cpuN file decoded into memory, for the reader
 *   (read_record_set: convert, the JSON lines, the fallback below).
 * - report_pass(): report's one pass over a record set, in bounded memory.
 *   The cpuN files are read in fixed-size chunks and merged by sequence
 *   number (each file's 32-bit numbers unwrapped, then put on the first
 *   file's scale, as the reader does). Each record is handled once, in
 *   sequence order: counted at its call site, and a free matched to the
 *   allocation of the same pointer (kernel records) or of the same process
 *   and pointer (the allocation functions' records) through an
 *   open-addressing table of the allocations still live. Memory is the
 *   chunks, the call sites and the live allocations, whatever the size of
 *   the files. A file whose sequence numbers go backwards cannot be merged:
 *   the pass says so ("unsorted").
 * - report_records(): the same analysis over records already decoded and
 *   sorted in memory, for such a file (analysis.py's analyse).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stddef.h>
#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef unsigned __int128 u128;

enum { ST_OK = 0, ST_TRUNCATED = 1, ST_BAD_SIZE = 2 };
enum { EV_ALLOC = 0, EV_FREE = 1, EV_PROBE = 2 };
enum { T_KMALLOC = 0, T_CACHE = 1, T_PAGES = 2, T_SBRK = 3, T_ARENA = 5, T_PROBE = 6, T_USER = 7 };
#define ORDERS 66
#define NO_FUNCTION 0xFF

/* One decoded record: the layout of exporters/kmemtrace/abi.py's
 * DECODED (tests/unit/test_kmemtrace_format.py compares the two). */
typedef struct {
    int64_t seq;
    uint64_t call_site, ptr, bytes_req, bytes_alloc, timestamp;
    uint32_t pid, tid, gfp_flags;
    int32_t target;
    uint16_t probe, cpu;
    uint8_t event_id, type_id, has_task, fn;
    uint64_t aux, weight;
} rec_t;
_Static_assert(sizeof(rec_t) == 88, "rec_t is DECODED's 88 bytes, without padding");
#define MAX_ARGS 6

typedef struct {
    int fd;
    unsigned char *buf;
    size_t cap, len, pos;
    uint64_t base; /* file offset of buf[0] */
    int eof, done, status;
    uint64_t status_offset;
    int64_t count, skipped[4];
    int32_t cpu, node;
    uint32_t prev_raw;
    int64_t prev_seq, scale;
    int has_head;
    rec_t head;
} file_t;

/* ---- byte order ---------------------------------------------------------- */

static int g_big;

static inline uint64_t rd(const unsigned char *p, int width) {
    uint64_t v = 0;
    if (g_big) {
        for (int k = 0; k < width; k++) v = (v << 8) | p[k];
    } else {
        memcpy(&v, p, (size_t)width); /* little-endian host: the layouts are native */
    }
    return v;
}

/* ---- open-addressing tables ---------------------------------------------- */

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/* Live allocations: key (pid, ptr), ptr never 0 (0 marks an empty slot). */
typedef struct {
    uint64_t ptr;
    uint64_t bytes;
    uint32_t pid, site;
    uint16_t cpu;
    uint8_t type;
} live_t;

typedef struct {
    live_t *slots;
    size_t mask, used;
} live_table;

static inline size_t live_home(const live_table *t, uint64_t ptr, uint32_t pid) {
    return (size_t)mix(ptr ^ ((uint64_t)pid << 40)) & t->mask;
}

static int live_init(live_table *t, size_t cap) {
    t->slots = calloc(cap, sizeof(live_t));
    t->mask = cap - 1;
    t->used = 0;
    return t->slots != NULL;
}

static live_t *live_find(live_table *t, uint64_t ptr, uint32_t pid) {
    size_t i = live_home(t, ptr, pid);
    while (t->slots[i].ptr) {
        if (t->slots[i].ptr == ptr && t->slots[i].pid == pid) return &t->slots[i];
        i = (i + 1) & t->mask;
    }
    return NULL;
}

static int live_grow(live_table *t) {
    live_table bigger;
    if (!live_init(&bigger, (t->mask + 1) * 2)) return 0;
    for (size_t i = 0; i <= t->mask; i++) {
        live_t *e = &t->slots[i];
        if (!e->ptr) continue;
        size_t j = live_home(&bigger, e->ptr, e->pid);
        while (bigger.slots[j].ptr) j = (j + 1) & bigger.mask;
        bigger.slots[j] = *e;
    }
    bigger.used = t->used;
    free(t->slots);
    *t = bigger;
    return 1;
}

/* The slot for (pid, ptr): found, or a new empty one claimed (*fresh set). */
static live_t *live_claim(live_table *t, uint64_t ptr, uint32_t pid, int *fresh) {
    if ((t->used + 1) * 2 > t->mask + 1 && !live_grow(t)) return NULL;
    size_t i = live_home(t, ptr, pid);
    while (t->slots[i].ptr) {
        if (t->slots[i].ptr == ptr && t->slots[i].pid == pid) {
            *fresh = 0;
            return &t->slots[i];
        }
        i = (i + 1) & t->mask;
    }
    t->used++;
    *fresh = 1;
    t->slots[i].ptr = ptr;
    t->slots[i].pid = pid;
    return &t->slots[i];
}

/* Backward-shift deletion: no tombstones, so lookups stay short. */
static void live_remove(live_table *t, live_t *e) {
    size_t i = (size_t)(e - t->slots), j = i;
    for (;;) {
        j = (j + 1) & t->mask;
        if (!t->slots[j].ptr) break;
        size_t k = live_home(t, t->slots[j].ptr, t->slots[j].pid);
        int stays = i <= j ? (i < k && k <= j) : (i < k || k <= j);
        if (stays) continue;
        t->slots[i] = t->slots[j];
        i = j;
    }
    t->slots[i].ptr = 0;
    t->used--;
}

/* Call sites: kernel (call site, type), user (pid, function, call site). */
typedef struct {
    uint64_t call_site;
    uint64_t allocs, failed, cross_node, frees, cross_cpu, mismatched, unknown;
    u128 bytes_req, bytes_alloc, bytes_freed;
    uint8_t type;
} ksite_t;

typedef struct {
    uint64_t call_site, allocs, frees, min_ptr;
    int64_t min_rank;
    u128 bytes, bytes_freed;
    uint32_t pid;
    uint8_t fn;
} usite_t;

typedef struct {
    uint32_t *slots; /* index + 1; 0 empty */
    size_t mask;
    void *items;
    size_t item_size, count, room;
} site_table;

static int sites_init(site_table *t, size_t item_size) {
    t->mask = 1023;
    t->slots = calloc(t->mask + 1, sizeof(uint32_t));
    t->item_size = item_size;
    t->count = 0;
    t->room = 256;
    t->items = calloc(t->room, item_size);
    return t->slots && t->items;
}

static inline uint64_t site_hash(uint64_t call_site, uint64_t extra) {
    return mix(call_site ^ (extra * 0x9e3779b97f4a7c15ULL));
}

static int sites_rehash(site_table *t, uint64_t (*hash_of)(const void *)) {
    size_t cap = (t->mask + 1) * 2;
    uint32_t *slots = calloc(cap, sizeof(uint32_t));
    if (!slots) return 0;
    for (size_t n = 0; n < t->count; n++) {
        size_t i = (size_t)hash_of((char *)t->items + n * t->item_size) & (cap - 1);
        while (slots[i]) i = (i + 1) & (cap - 1);
        slots[i] = (uint32_t)(n + 1);
    }
    free(t->slots);
    t->slots = slots;
    t->mask = cap - 1;
    return 1;
}

static void *sites_append(site_table *t) {
    if (t->count == t->room) {
        void *more = realloc(t->items, t->room * 2 * t->item_size);
        if (!more) return NULL;
        t->items = more;
        t->room *= 2;
    }
    void *item = (char *)t->items + t->count * t->item_size;
    memset(item, 0, t->item_size);
    t->count++;
    return item;
}

static uint64_t ksite_hash(const void *item) {
    const ksite_t *s = item;
    return site_hash(s->call_site, s->type);
}

static uint64_t usite_hash(const void *item) {
    const usite_t *s = item;
    return site_hash(s->call_site, ((uint64_t)s->pid << 8) | s->fn);
}

/* The index of kernel site (call_site, type), made if new; -1 out of memory. */
static int64_t ksite(site_table *t, uint64_t call_site, uint8_t type) {
    size_t i = (size_t)site_hash(call_site, type) & t->mask;
    for (; t->slots[i]; i = (i + 1) & t->mask) {
        ksite_t *s = (ksite_t *)t->items + (t->slots[i] - 1);
        if (s->call_site == call_site && s->type == type) return t->slots[i] - 1;
    }
    ksite_t *s = sites_append(t);
    if (!s) return -1;
    s->call_site = call_site;
    s->type = type;
    t->slots[i] = (uint32_t)t->count;
    if (t->count * 2 > t->mask + 1 && !sites_rehash(t, ksite_hash)) return -1;
    return (int64_t)t->count - 1;
}

static int64_t usite(site_table *t, uint32_t pid, uint8_t fn, uint64_t call_site) {
    size_t i = (size_t)site_hash(call_site, ((uint64_t)pid << 8) | fn) & t->mask;
    for (; t->slots[i]; i = (i + 1) & t->mask) {
        usite_t *s = (usite_t *)t->items + (t->slots[i] - 1);
        if (s->call_site == call_site && s->pid == pid && s->fn == fn) return t->slots[i] - 1;
    }
    usite_t *s = sites_append(t);
    if (!s) return -1;
    s->call_site = call_site;
    s->pid = pid;
    s->fn = fn;
    s->min_ptr = UINT64_MAX;
    s->min_rank = INT64_MAX;
    t->slots[i] = (uint32_t)t->count;
    if (t->count * 2 > t->mask + 1 && !sites_rehash(t, usite_hash)) return -1;
    return (int64_t)t->count - 1;
}

/* ---- one record -------------------------------------------------------------- */

/* The feature blocks after a record's body: the task (pid; with ``full``,
 * tid and time too) and the allocation function (the function; with
 * ``full``, aux and weight too). */
static inline __attribute__((always_inline)) void
decode_features(const unsigned char *p, size_t size, size_t at, rec_t *r, int64_t *skipped,
                const int full) {
    while (at + 3 <= size) {
        size_t fsize = (size_t)rd(p + at, 2);
        if (fsize < 3 || at + fsize > size) {
            skipped[3]++;
            return;
        }
        if (p[at + 2] == 1 && fsize >= 24) {
            r->pid = (uint32_t)rd(p + at + 4, 4);
            if (full) {
                r->has_task = 1;
                r->tid = (uint32_t)rd(p + at + 8, 4);
                r->timestamp = rd(p + at + 16, 8);
            }
        } else if (p[at + 2] == 2 && fsize >= 24) {
            r->fn = p[at + 3];
            if (full) {
                r->aux = rd(p + at + 8, 8);
                r->weight = rd(p + at + 16, 8);
            }
        }
        at += fsize;
    }
}

/* The record at p, `size` bytes (24 or more, all of them there), into *r,
 * and a probe record's arguments into args[0..5] when args is not NULL: 1.
 * 0 for a record skipped, its reason counted in skipped[] (SKIP_REASONS:
 * unknown event id, unknown type id, too short; a bad feature block ends
 * the record's features). r->seq is the 32-bit number, sign-extended.
 * ``full``: every field of rec_t (scan); else the ones the report's
 * analysis reads (the pass, which decodes every record of a set). */
static inline __attribute__((always_inline)) int
decode(const unsigned char *p, size_t size, rec_t *r, uint64_t *args, int64_t *skipped,
       const int full) {
    uint8_t eid = p[0], tid = p[1];
    if (eid > 2) {
        skipped[0]++;
        return 0;
    }
    if ((eid < 2 && tid > 5 && tid != 7) || (eid == 2 && tid != 6)) {
        skipped[1]++;
        return 0;
    }
    if ((eid == 0 && size < 48) || (eid == 2 && size < 80)) {
        skipped[2]++;
        return 0;
    }
    if (full) memset(r, 0, sizeof *r);
    r->event_id = eid;
    r->type_id = tid;
    r->seq = (int32_t)(uint32_t)rd(p + 4, 4);
    r->call_site = rd(p + 8, 8);
    r->ptr = rd(p + 16, 8);
    r->bytes_req = r->bytes_alloc = 0;
    r->target = -1;
    r->probe = 0;
    r->pid = 0;
    r->fn = NO_FUNCTION;
    size_t body = 24;
    if (eid == 0) {
        r->bytes_req = rd(p + 24, 8);
        r->bytes_alloc = rd(p + 32, 8);
        if (full) r->gfp_flags = (uint32_t)rd(p + 40, 4);
        r->target = (int32_t)(uint32_t)rd(p + 44, 4);
        body = 48;
    } else if (eid == 2) {
        r->probe = (uint16_t)rd(p + 24, 2);
        if (args)
            for (int a = 0; a < MAX_ARGS; a++) args[a] = rd(p + 32 + 8 * a, 8);
        body = 80;
    }
    decode_features(p, size, body, r, skipped, full);
    return 1;
}

/* ---- reading one file ------------------------------------------------------ */

static int g_unsorted;

/* Read on, keeping the unread bytes, with room for at least ``need``:
 * 0 fine, -1 read error (errno set), -2 out of memory. */
static int refill(file_t *f, size_t need) {
    size_t left = f->len - f->pos;
    if (need > f->cap) { /* a record larger than the chunk */
        unsigned char *bigger = malloc(need);
        if (!bigger) return -2;
        memcpy(bigger, f->buf + f->pos, left);
        free(f->buf);
        f->buf = bigger;
        f->cap = need;
        f->base += f->pos;
        f->pos = 0;
        f->len = left;
    }
    memmove(f->buf, f->buf + f->pos, left);
    f->base += f->pos;
    f->pos = 0;
    f->len = left;
    while (f->len < f->cap) {
        ssize_t got = read(f->fd, f->buf + f->len, f->cap - f->len);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (got == 0) {
            f->eof = 1;
            break;
        }
        f->len += (size_t)got;
    }
    return 0;
}

static void stop(file_t *f, int status) {
    f->done = 1;
    f->status = status;
    f->status_offset = f->base + f->pos;
}

/* Decode the file's next record into f->head: 1 found, 0 none left, -1 read
 * error, -2 out of memory. */
/* The one unwrapping of the records' 32-bit sequence numbers: the number
 * `raw` read after `prev` (whose 32-bit number was `prev_raw`), the two
 * taken to be less than 2^31 apart. The merge below and the reader
 * (reader.py, through unwrap()) both use it. */
static inline int64_t unwrapped(int64_t prev, uint32_t prev_raw, uint32_t raw) {
    return prev + (int32_t)(raw - prev_raw);
}

static int next_record(file_t *f) {
    while (!f->done) {
        size_t avail = f->len - f->pos;
        if (avail < 4 || avail < 24) {
            if (!f->eof) {
                int err = refill(f, 24);
                if (err) return err;
                continue;
            }
            if (avail == 0) {
                f->done = 1;
                return 0;
            }
            if (avail < 4) {
                stop(f, ST_TRUNCATED);
                return 0;
            }
        }
        const unsigned char *p = f->buf + f->pos;
        size_t size = (size_t)rd(p + 2, 2);
        if (size < 24) {
            stop(f, ST_BAD_SIZE);
            return 0;
        }
        if (avail < size) {
            if (!f->eof) {
                int err = refill(f, size);
                if (err) return err;
                continue;
            }
            stop(f, ST_TRUNCATED);
            return 0;
        }
        f->pos += size;
        rec_t *r = &f->head;
        if (!decode(p, size, r, NULL, f->skipped, 0))
            continue;
        uint32_t raw = (uint32_t)r->seq;
        int64_t seq;
        if (f->count == 0) {
            seq = (int32_t)raw;
        } else {
            seq = unwrapped(f->prev_seq, f->prev_raw, raw);
            if (seq < f->prev_seq) g_unsorted = 1;
        }
        f->prev_raw = raw;
        f->prev_seq = seq;
        r->seq = seq + f->scale;
        f->count++;
        return 1;
    }
    return 0;
}

/* ---- the merge: a min-heap of files by (sequence number, file index) ------- */

static file_t *g_files;

static inline int before(int a, int b) {
    int64_t sa = g_files[a].head.seq, sb = g_files[b].head.seq;
    return sa < sb || (sa == sb && a < b);
}

static void sift_down(int *heap, int n, int i) {
    for (;;) {
        int l = 2 * i + 1, m = i;
        if (l < n && before(heap[l], heap[m])) m = l;
        if (l + 1 < n && before(heap[l + 1], heap[m])) m = l + 1;
        if (m == i) return;
        int tmp = heap[i];
        heap[i] = heap[m];
        heap[m] = tmp;
        i = m;
    }
}

/* ---- the analysis ---------------------------------------------------------- */

typedef struct {
    site_table ks, us;
    live_table klive, ulive;
    uint64_t null_frees, unknown_frees, reallocated_live, mismatched, above, cross_cpu,
        cross_node, user_unknown, records;
    uint64_t orders_alloc[ORDERS], orders_free[ORDERS];
    uint64_t libc_allocs[3], libc_frees[3];
    u128 libc_bytes[3];
    uint64_t *probes; /* 65536 */
    uint64_t page_size;
} state_t;

static inline int page_order(uint64_t bytes, uint64_t page_size) {
    uint64_t pages = bytes / page_size;
    if (pages < 1) pages = 1;
    int64_t order = (int64_t)log2((double)pages);
    return order < 0 ? 0 : order >= ORDERS ? ORDERS - 1 : (int)order;
}

/* 0 fine, -1 out of memory. */
/* A kernel allocation on ``cpu`` of ``node``: 0, or -1 out of memory. */
static int kernel_alloc(state_t *s, const rec_t *r, int32_t cpu, int32_t node) {
    int64_t at = ksite(&s->ks, r->call_site, r->type_id);
    if (at < 0) return -1;
    ksite_t *site = (ksite_t *)s->ks.items + at;
    site->allocs++;
    site->bytes_req += r->bytes_req;
    site->bytes_alloc += r->bytes_alloc;
    site->failed += r->ptr == 0;
    int cross = r->target >= 0 && r->target != node;
    site->cross_node += cross;
    s->cross_node += cross;
    s->above += r->bytes_req > r->bytes_alloc;
    if (r->type_id == T_PAGES) s->orders_alloc[page_order(r->bytes_alloc, s->page_size)]++;
    if (!r->ptr) return 0;
    int fresh;
    live_t *e = live_claim(&s->klive, r->ptr, 0, &fresh);
    if (!e) return -1;
    if (!fresh) s->reallocated_live++;
    e->site = (uint32_t)at;
    e->type = r->type_id;
    e->cpu = (uint16_t)cpu;
    e->bytes = r->bytes_alloc;
    return 0;
}

/* A kernel free on ``cpu``: matched by pointer to its allocation, or
 * counted unknown at its own call site. 0, or -1 out of memory. */
static int kernel_free(state_t *s, const rec_t *r, int32_t cpu) {
    if (!r->ptr) {
        s->null_frees++;
        return 0;
    }
    live_t *e = live_find(&s->klive, r->ptr, 0);
    if (e) {
        ksite_t *site = (ksite_t *)s->ks.items + e->site;
        site->frees++;
        site->bytes_freed += e->bytes;
        int cross = e->cpu != cpu, mismatched = e->type != r->type_id;
        site->cross_cpu += cross;
        site->mismatched += mismatched;
        s->cross_cpu += cross;
        s->mismatched += mismatched;
        if (e->type == T_PAGES) s->orders_free[page_order(e->bytes, s->page_size)]++;
        live_remove(&s->klive, e);
        return 0;
    }
    int64_t at = ksite(&s->ks, r->call_site, r->type_id);
    if (at < 0) return -1;
    ((ksite_t *)s->ks.items + at)->unknown++;
    s->unknown_frees++;
    return 0;
}

/* An allocation function's call (T_USER): frees matched by (process,
 * pointer). ``rank``: the record's place in sequence order. */
static int user_call(state_t *s, const rec_t *r, int64_t rank) {
    if (r->event_id == EV_ALLOC) {
        int64_t at = usite(&s->us, r->pid, r->fn, r->call_site);
        if (at < 0) return -1;
        usite_t *site = (usite_t *)s->us.items + at;
        site->allocs++;
        site->bytes += r->bytes_req;
        if (r->ptr < site->min_ptr || (r->ptr == site->min_ptr && rank < site->min_rank)) {
            site->min_ptr = r->ptr;
            site->min_rank = rank;
        }
        if (r->ptr) {
            int fresh;
            live_t *e = live_claim(&s->ulive, r->ptr, r->pid, &fresh);
            if (!e) return -1;
            e->site = (uint32_t)at;
            e->bytes = r->bytes_req;
        }
        return 0;
    }
    if (!r->ptr) return 0;
    live_t *e = live_find(&s->ulive, r->ptr, r->pid);
    if (!e) {
        s->user_unknown++;
        return 0;
    }
    usite_t *site = (usite_t *)s->us.items + e->site;
    site->frees++;
    site->bytes_freed += e->bytes;
    live_remove(&s->ulive, e);
    return 0;
}

/* One record, in sequence order, allocated or freed on ``cpu`` of ``node``;
 * ``rank``: its place in that order. 0, or -1 out of memory. */
static int handle(state_t *s, const rec_t *r, int32_t cpu, int32_t node, int64_t rank) {
    s->records++;
    if (r->event_id == EV_PROBE) {
        s->probes[r->probe]++;
        return 0;
    }
    if (r->type_id <= T_PAGES)
        return r->event_id == EV_ALLOC ? kernel_alloc(s, r, cpu, node) : kernel_free(s, r, cpu);
    if (r->type_id <= T_ARENA) {
        int k = r->type_id - T_SBRK;
        if (r->event_id == EV_ALLOC) {
            s->libc_allocs[k]++;
            s->libc_bytes[k] += r->bytes_alloc;
        } else {
            s->libc_frees[k]++;
        }
        return 0;
    }
    return user_call(s, r, rank);
}

/* ---- Python ------------------------------------------------------------------ */

static PyObject *u128_long(u128 v) {
    PyObject *hi = PyLong_FromUnsignedLongLong((unsigned long long)(v >> 64));
    PyObject *lo = PyLong_FromUnsignedLongLong((unsigned long long)v);
    PyObject *shift = PyLong_FromLong(64);
    PyObject *out = NULL;
    if (hi && lo && shift) {
        PyObject *up = PyNumber_Lshift(hi, shift);
        if (up) {
            out = PyNumber_Or(up, lo);
            Py_DECREF(up);
        }
    }
    Py_XDECREF(hi);
    Py_XDECREF(lo);
    Py_XDECREF(shift);
    return out;
}

/* Each file's walk: (records, status, offset, (skipped by reason)). */
static PyObject *files_list(const file_t *files, Py_ssize_t n) {
    PyObject *list = PyList_New(n);
    for (Py_ssize_t i = 0; list && i < n; i++) {
        const file_t *f = &files[i];
        PyObject *t = Py_BuildValue("(LiK(LLLL))", (long long)f->count, f->status,
                                    (unsigned long long)f->status_offset,
                                    (long long)f->skipped[0], (long long)f->skipped[1],
                                    (long long)f->skipped[2], (long long)f->skipped[3]);
        if (!t) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, t);
    }
    return list;
}

static PyObject *ksite_tuple(const ksite_t *k) {
    PyObject *br = u128_long(k->bytes_req), *ba = u128_long(k->bytes_alloc),
             *bf = u128_long(k->bytes_freed), *t = NULL;
    if (br && ba && bf)
        t = Py_BuildValue("(KiKOOKKKOKKK)", (unsigned long long)k->call_site, (int)k->type,
                          (unsigned long long)k->allocs, br, ba, (unsigned long long)k->failed,
                          (unsigned long long)k->cross_node, (unsigned long long)k->frees, bf,
                          (unsigned long long)k->cross_cpu, (unsigned long long)k->mismatched,
                          (unsigned long long)k->unknown);
    Py_XDECREF(br);
    Py_XDECREF(ba);
    Py_XDECREF(bf);
    return t;
}

static PyObject *usite_tuple(const usite_t *u) {
    PyObject *b = u128_long(u->bytes), *bf = u128_long(u->bytes_freed), *t = NULL;
    if (b && bf)
        t = Py_BuildValue("(IiKKOKOKL)", (unsigned)u->pid, (int)u->fn,
                          (unsigned long long)u->call_site, (unsigned long long)u->allocs, b,
                          (unsigned long long)u->frees, bf, (unsigned long long)u->min_ptr,
                          (long long)u->min_rank);
    Py_XDECREF(b);
    Py_XDECREF(bf);
    return t;
}

static PyObject *libc_tuple(const state_t *s, int k) {
    PyObject *bytes = u128_long(s->libc_bytes[k]), *t = NULL;
    if (bytes)
        t = Py_BuildValue("(KOK)", (unsigned long long)s->libc_allocs[k], bytes,
                          (unsigned long long)s->libc_frees[k]);
    Py_XDECREF(bytes);
    return t;
}

/* A list of ``count`` tuples, the i-th made by ``make(items, i)``. */
static PyObject *tuples(size_t count, PyObject *(*make)(const state_t *, size_t),
                        const state_t *s) {
    PyObject *list = PyList_New((Py_ssize_t)count);
    for (size_t i = 0; list && i < count; i++) {
        PyObject *t = make(s, i);
        if (!t) Py_CLEAR(list);
        else PyList_SET_ITEM(list, (Py_ssize_t)i, t);
    }
    return list;
}

static PyObject *kernel_site(const state_t *s, size_t i) {
    return ksite_tuple((const ksite_t *)s->ks.items + i);
}

static PyObject *user_site(const state_t *s, size_t i) {
    return usite_tuple((const usite_t *)s->us.items + i);
}

static PyObject *libc_kind(const state_t *s, size_t i) { return libc_tuple(s, (int)i); }

/* {key: value} of the nonzero entries: value(s, key), or NULL for none. */
static PyObject *sparse(const state_t *s, long keys, PyObject *(*value)(const state_t *, long)) {
    PyObject *dict = PyDict_New();
    for (long k = 0; dict && k < keys; k++) {
        PyObject *v = value(s, k);
        if (v == Py_None) {
            Py_DECREF(v);
            continue;
        }
        PyObject *key = PyLong_FromLong(k);
        int bad = !key || !v || PyDict_SetItem(dict, key, v) < 0;
        Py_XDECREF(key);
        Py_XDECREF(v);
        if (bad) Py_CLEAR(dict);
    }
    return dict;
}

static PyObject *order_pair(const state_t *s, long o) {
    if (!s->orders_alloc[o] && !s->orders_free[o]) Py_RETURN_NONE;
    return Py_BuildValue("(KK)", (unsigned long long)s->orders_alloc[o],
                         (unsigned long long)s->orders_free[o]);
}

static PyObject *probe_count(const state_t *s, long p) {
    if (!s->probes[p]) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(s->probes[p]);
}

static PyObject *results(state_t *s, file_t *files, Py_ssize_t n) {
    PyObject *out = PyDict_New(), *item = NULL;
    if (!out) return NULL;
#define PUT(key, value)                                                     \
    do {                                                                    \
        item = (value);                                                     \
        if (!item || PyDict_SetItemString(out, key, item) < 0) goto fail;   \
        Py_DECREF(item);                                                    \
        item = NULL;                                                        \
    } while (0)
    PUT("files", files_list(files, n));
    PUT("unsorted", PyBool_FromLong(g_unsorted));
    PUT("records", PyLong_FromUnsignedLongLong(s->records));
    PUT("findings", Py_BuildValue("(KKKKK)", (unsigned long long)s->mismatched,
                                  (unsigned long long)s->unknown_frees,
                                  (unsigned long long)s->above,
                                  (unsigned long long)s->null_frees,
                                  (unsigned long long)s->reallocated_live));
    PUT("cross_cpu_frees", PyLong_FromUnsignedLongLong(s->cross_cpu));
    PUT("cross_node_allocs", PyLong_FromUnsignedLongLong(s->cross_node));
    PUT("user_unknown_frees", PyLong_FromUnsignedLongLong(s->user_unknown));
    PUT("kernel_sites", tuples(s->ks.count, kernel_site, s));
    PUT("user_sites", tuples(s->us.count, user_site, s));
    PUT("page_orders", sparse(s, ORDERS, order_pair));
    PUT("libc", tuples(3, libc_kind, s));
    PUT("probe_hits", sparse(s, 65536, probe_count));
#undef PUT
    return out;
fail:
    Py_XDECREF(item);
    Py_DECREF(out);
    return NULL;
}

static int state_init(state_t *s, uint64_t page_size) {
    memset(s, 0, sizeof *s);
    s->page_size = page_size;
    return sites_init(&s->ks, sizeof(ksite_t)) && sites_init(&s->us, sizeof(usite_t)) &&
           live_init(&s->klive, 1 << 12) && live_init(&s->ulive, 1 << 12) &&
           (s->probes = calloc(65536, sizeof(uint64_t))) != NULL;
}

static void state_free(state_t *s) {
    free(s->ks.slots);
    free(s->ks.items);
    free(s->us.slots);
    free(s->us.items);
    free(s->klive.slots);
    free(s->ulive.slots);
    free(s->probes);
}

static void release(state_t *s, file_t *files, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (files[i].fd >= 0) close(files[i].fd);
        free(files[i].buf);
    }
    free(files);
    state_free(s);
}

/* The pass proper, without the interpreter's lock: 0, -1 read error, -2 memory. */
static int run(state_t *s, file_t *files, int n) {
    int *heap = malloc(sizeof(int) * (size_t)(n ? n : 1));
    if (!heap) return -2;
    int live = 0;
    int64_t base = 0;
    int have_base = 0;
    for (int i = 0; i < n; i++) {
        int got = next_record(&files[i]);
        if (got < 0) {
            free(heap);
            return got;
        }
        if (!got) continue;
        /* The first record sets the file's scale against the first file's. */
        int64_t first = files[i].head.seq;
        if (!have_base) {
            base = first;
            have_base = 1;
        }
        files[i].scale = unwrapped(base, (uint32_t)base, (uint32_t)first) - first;
        files[i].head.seq += files[i].scale;
        heap[live++] = i;
    }
    for (int i = live / 2 - 1; i >= 0; i--) sift_down(heap, live, i);
    int64_t rank = 0;
    while (live && !g_unsorted) {
        file_t *f = &files[heap[0]];
        if (handle(s, &f->head, f->cpu, f->node, rank++) < 0) {
            free(heap);
            return -2;
        }
        int got = next_record(f);
        if (got < 0) {
            free(heap);
            return got;
        }
        if (!got) heap[0] = heap[--live];
        sift_down(heap, live, 0);
    }
    free(heap);
    return 0;
}

/* File i of the pass, opened for reading in chunks of ``chunk`` bytes: 1,
 * or 0 with the Python error set. */
static int open_file(file_t *f, PyObject *paths, PyObject *cpus, PyObject *nodes, Py_ssize_t i,
                     size_t chunk) {
    PyObject *path = PySequence_GetItem(paths, i), *cpu = PySequence_GetItem(cpus, i),
             *node = PySequence_GetItem(nodes, i), *encoded = NULL;
    int ok = path && cpu && node && PyUnicode_FSConverter(path, &encoded);
    if (ok) {
        f->cpu = (int32_t)PyLong_AsLong(cpu);
        f->node = (int32_t)PyLong_AsLong(node);
        f->cap = chunk;
        f->buf = malloc(f->cap);
        f->fd = open(PyBytes_AS_STRING(encoded), O_RDONLY | O_CLOEXEC);
        if (f->fd < 0) {
            PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
            ok = 0;
        } else if (!f->buf) {
            PyErr_NoMemory();
            ok = 0;
        } else {
            posix_fadvise(f->fd, 0, 0, POSIX_FADV_SEQUENTIAL);
        }
    }
    Py_XDECREF(path);
    Py_XDECREF(cpu);
    Py_XDECREF(node);
    Py_XDECREF(encoded);
    return ok && !PyErr_Occurred();
}

static PyObject *report_pass(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *paths, *cpus, *nodes;
    int big;
    unsigned long long page_size, chunk;
    if (!PyArg_ParseTuple(args, "OOOpKK", &paths, &cpus, &nodes, &big, &page_size, &chunk))
        return NULL;
    Py_ssize_t n = PySequence_Size(paths);
    if (n < 0 || PySequence_Size(cpus) != n || PySequence_Size(nodes) != n || n > INT32_MAX ||
        chunk < 24 || page_size == 0) {
        PyErr_SetString(PyExc_ValueError, "report_pass: bad arguments");
        return NULL;
    }
    state_t s;
    file_t *files = calloc((size_t)(n ? n : 1), sizeof(file_t));
    if (!files) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) files[i].fd = -1;
    g_files = files;
    g_big = big;
    g_unsorted = 0;
    if (!state_init(&s, page_size)) {
        release(&s, files, n);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!open_file(&files[i], paths, cpus, nodes, i, (size_t)chunk)) {
            release(&s, files, n);
            return NULL;
        }
    }
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = run(&s, files, (int)n);
    Py_END_ALLOW_THREADS
    PyObject *out = NULL;
    if (status == -1)
        PyErr_SetFromErrno(PyExc_OSError);
    else if (status == -2)
        PyErr_NoMemory();
    else
        out = results(&s, files, n);
    release(&s, files, n);
    return out;
}

/* The report's figures from decoded records (DECODED) already in sequence
 * order: what report_pass gives, for a record set no merge can order. */
static PyObject *report_records(PyObject *self, PyObject *pyargs) {
    (void)self;
    Py_buffer recs;
    PyObject *nodes;
    unsigned long long page_size;
    if (!PyArg_ParseTuple(pyargs, "y*OK", &recs, &nodes, &page_size)) return NULL;
    Py_ssize_t known = PySequence_Size(nodes);
    if (known < 0 || recs.len % (Py_ssize_t)sizeof(rec_t) || page_size == 0) {
        PyBuffer_Release(&recs);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "report_records: bad arguments");
        return NULL;
    }
    int32_t *node_of = malloc(65536 * sizeof(int32_t));
    state_t s;
    memset(&s, 0, sizeof s);
    int ok = node_of != NULL;
    for (long cpu = 0; ok && cpu < 65536; cpu++) {
        node_of[cpu] = -1;
        if (cpu < known) {
            PyObject *node = PySequence_GetItem(nodes, cpu);
            node_of[cpu] = node ? (int32_t)PyLong_AsLong(node) : -1;
            Py_XDECREF(node);
        }
    }
    ok = ok && !PyErr_Occurred() && state_init(&s, page_size);
    const rec_t *r = recs.buf;
    size_t n = (size_t)recs.len / sizeof(rec_t);
    for (size_t i = 0; ok && i < n; i++)
        ok = handle(&s, &r[i], r[i].cpu, node_of[r[i].cpu], (int64_t)i) == 0;
    free(node_of);
    PyBuffer_Release(&recs);
    g_unsorted = 0;
    PyObject *out = ok ? results(&s, NULL, 0) : NULL;
    if (!ok && !PyErr_Occurred()) PyErr_NoMemory();
    state_free(&s);
    return out;
}

/* ---- one file, decoded into memory ------------------------------------------ */

/* The walk of scan(): (records, probe records, offset, status). */
static void walk(const unsigned char *buf, size_t n, uint16_t cpu, rec_t *out, uint64_t *args,
                 int64_t *skipped, size_t result[4]) {
    size_t o = 0, k = 0, probes = 0;
    int status = ST_OK;
    while (o < n) {
        if (n - o < 4) {
            status = ST_TRUNCATED;
            break;
        }
        size_t size = (size_t)rd(buf + o + 2, 2);
        if (size < 24) {
            status = ST_BAD_SIZE;
            break;
        }
        if (o + size > n) {
            status = ST_TRUNCATED;
            break;
        }
        if (decode(buf + o, size, &out[k], args + MAX_ARGS * probes, skipped, 1)) {
            out[k].cpu = cpu;
            probes += out[k].event_id == EV_PROBE;
            k++;
        }
        o += size;
    }
    result[0] = k;
    result[1] = probes;
    result[2] = o;
    result[3] = (size_t)status;
}

static PyObject *scan(PyObject *self, PyObject *pyargs) {
    (void)self;
    Py_buffer data, out, args, skipped;
    int big;
    unsigned int cpu;
    if (!PyArg_ParseTuple(pyargs, "y*pIw*w*w*", &data, &big, &cpu, &out, &args, &skipped))
        return NULL;
    size_t n = (size_t)data.len, result[4] = {0, 0, 0, 0};
    int fits = (size_t)out.len >= n / 24 * sizeof(rec_t) &&
               (size_t)args.len >= (n / 80 + 1) * MAX_ARGS * sizeof(uint64_t) &&
               (size_t)skipped.len >= 4 * sizeof(int64_t) && cpu <= UINT16_MAX;
    if (fits) {
        g_big = big;
        walk(data.buf, n, (uint16_t)cpu, out.buf, args.buf, skipped.buf, result);
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    PyBuffer_Release(&args);
    PyBuffer_Release(&skipped);
    if (!fits) {
        PyErr_SetString(PyExc_ValueError, "scan: an output has no room for the file's records");
        return NULL;
    }
    return Py_BuildValue("(nnnn)", (Py_ssize_t)result[0], (Py_ssize_t)result[1],
                         (Py_ssize_t)result[2], (Py_ssize_t)result[3]);
}

/* unwrap(seq, prev=None): 32-bit sequence numbers in file order, each
 * sign-extended in an int64 (as decode() leaves them), unwrapped in place;
 * the first against `prev` (an unwrapped number) where given. */
static PyObject *unwrap(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b;
    PyObject *prev_obj = Py_None;
    if (!PyArg_ParseTuple(args, "w*|O", &b, &prev_obj)) return NULL;
    if (b.itemsize != 8 || b.len % 8 || !PyBuffer_IsContiguous(&b, 'C')) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "unwrap: a contiguous int64 array is needed");
        return NULL;
    }
    int64_t *seq = b.buf;
    Py_ssize_t n = b.len / 8;
    if (n > 0) {
        uint32_t prev_raw = (uint32_t)seq[0];
        if (prev_obj == Py_None) {
            seq[0] = (int32_t)prev_raw;
        } else {
            long long prev = PyLong_AsLongLong(prev_obj);
            if (prev == -1 && PyErr_Occurred()) {
                PyBuffer_Release(&b);
                return NULL;
            }
            seq[0] = unwrapped(prev, (uint32_t)prev, prev_raw);
        }
        for (Py_ssize_t i = 1; i < n; i++) {
            uint32_t raw = (uint32_t)seq[i];
            seq[i] = unwrapped(seq[i - 1], prev_raw, raw);
            prev_raw = raw;
        }
    }
    PyBuffer_Release(&b);
    Py_RETURN_NONE;
}

/* Each field of rec_t: name -> (offset, size), for the layout test. */
static PyObject *record_layout(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
#define FIELD(name) #name, (Py_ssize_t)offsetof(rec_t, name), (Py_ssize_t)sizeof(((rec_t *)0)->name)
    return Py_BuildValue(
        "{s(nn)s(nn)s(nn)s(nn)s(nn)s(nn)s(nn)s(nn)s(nn)s(nn)s(nn)s(nn)s(nn)s(nn)s(nn)s(nn)s(nn)"
        "s(nn)}",
        FIELD(seq), FIELD(call_site), FIELD(ptr), FIELD(bytes_req), FIELD(bytes_alloc),
        FIELD(timestamp), FIELD(pid), FIELD(tid), FIELD(gfp_flags), FIELD(target), FIELD(probe),
        FIELD(cpu), FIELD(event_id), FIELD(type_id), FIELD(has_task), FIELD(fn), FIELD(aux),
        FIELD(weight));
#undef FIELD
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(data, big_endian, cpu, out, args, skipped) -> (records, probe records, offset, "
     "status): one cpuN file's records decoded into out (DECODED), the probe records' "
     "arguments into args, the records skipped counted in skipped."},
    {"report_records", report_records, METH_VARARGS,
     "report_records(records, nodes, page_size) -> dict: report_pass's figures from decoded "
     "records in sequence order; nodes[cpu] is the CPU's node, or -1."},
    {"unwrap", unwrap, METH_VARARGS,
     "unwrap(seq, prev=None): 32-bit sequence numbers (sign-extended int64, in file order) "
     "unwrapped in place, the first against prev where given."},
    {"record_layout", record_layout, METH_NOARGS,
     "record_layout() -> {field: (offset, size)} of a decoded record."},
    {"report_pass", report_pass, METH_VARARGS,
     "report_pass(paths, cpus, nodes, big_endian, page_size, chunk) -> dict: the report's "
     "figures from the cpuN files, merged by sequence number in one pass."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_walker", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__walker(void) { return PyModule_Create(&module); }
