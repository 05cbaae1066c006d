/*
 * mtrace-live's reader of call-frame information: the entries of an ELF
 * file's .eh_frame and .debug_frame, their instructions interpreted into
 * the rows the BPF unwinder searches (probes/bpf/unwind.bpf.c's struct
 * unwind_row; probes/elf/cfi.py says what each row means).
 *
 * Why C: interpreting the entries in Python (pyelftools) took 0.7 s for
 * libc and 6.4 s for a database server's binary, and a process followed by
 * the trace is walked by frame pointers until its tables exist. Here a
 * table of 100,000 rows takes milliseconds.
 *
 * It never fails on what a file holds. An entry whose length runs past its
 * section ends the section's reading (counted as skipped); an entry whose
 * CIE cannot be read, or whose range cannot be, is skipped and counted; an
 * FDE whose instructions cannot be interpreted (an unknown opcode, a read
 * past its end, a state stack too deep) covers its range with one row the
 * unwinder does not follow (CFA_OTHER), counted as malformed. Rules the
 * unwinder does not follow (a CFA by expression or in a register other
 * than %rsp and %rbp, a return address anywhere but at CFA - 8) are rows
 * marked CFA_OTHER, as every rule it cannot use.
 *
 * rows(eh_frame, eh_frame_address, debug_frame) -> (rows, functions,
 * skipped, malformed): rows packed as ROW (little-endian, 12 bytes), sorted
 * by pc, one per pc, a row equal in its rules to the one before left out.
 * Where two functions' rows share an address, a function's rule wins over
 * another's closing CFA_NONE row, and otherwise the function with the lower
 * start (then the one read first: .eh_frame before .debug_frame) stands.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { CFA_NONE = 0, CFA_RSP = 1, CFA_RBP = 2, CFA_END = 3, CFA_OTHER = 4 };
enum { RBP_SAME = 0, RBP_AT = 1, RBP_LOST = 2 };
enum { REG_RBP = 6, REG_RSP = 7, REG_RA = 16 };
#define PC_LIMIT (1ull << 32)
#define STATE_DEPTH 32

/* A register's rule, as far as the unwinder cares. */
enum { R_SAME = 0, R_OFFSET, R_UNDEFINED, R_OTHER };

struct rule {
    int kind;
    int64_t off; /* R_OFFSET: CFA + off, already factored */
};

/* The CFA as GCC's unwinder (libgcc) and readelf keep it: an expression
 * leaves the register and offset in place, and a def_cfa_register after it
 * goes back to them (libgcrypt's assembly relies on that). */
struct state {
    int cfa_reg; /* -1: none defined yet */
    int cfa_expr; /* by an expression */
    int64_t cfa_off;
    struct rule ra, rbp;
};

struct row {
    uint64_t pc;
    uint32_t order; /* its function's place among those read */
    int32_t cfa_off;
    int16_t rbp_off;
    uint8_t cfa, rbp;
};

struct rows {
    struct row *at;
    size_t len, cap;
    int failed; /* out of memory */
};

struct cursor {
    const uint8_t *p, *end;
    int bad; /* a read went past the end */
};

static uint64_t u8(struct cursor *c)
{
    if (c->p >= c->end) {
        c->bad = 1;
        return 0;
    }
    return *c->p++;
}

static uint64_t fixed(struct cursor *c, int size)
{
    if (c->end - c->p < size) {
        c->bad = 1;
        c->p = c->end;
        return 0;
    }
    uint64_t v = 0;
    for (int i = size - 1; i >= 0; i--)
        v = (v << 8) | c->p[i];
    c->p += size;
    return v;
}

static uint64_t uleb(struct cursor *c)
{
    uint64_t v = 0;
    unsigned shift = 0;
    for (;;) {
        uint64_t b = u8(c);
        if (c->bad)
            return 0;
        if (shift < 64)
            v |= (b & 0x7f) << shift;
        shift += 7;
        if (!(b & 0x80))
            return v;
    }
}

static int64_t sleb(struct cursor *c)
{
    uint64_t v = 0, b = 0;
    unsigned shift = 0;
    do {
        b = u8(c);
        if (c->bad)
            return 0;
        if (shift < 64)
            v |= (b & 0x7f) << shift;
        shift += 7;
    } while (b & 0x80);
    if (shift < 64 && (b & 0x40))
        v |= ~0ull << shift;
    return (int64_t)v;
}

/* A pointer in encoding `enc` (DW_EH_PE_*); `base` is the address of the
 * section's first byte, for pc-relative values. `*ok` is cleared on an
 * encoding this reader does not know. */
static uint64_t pointer(struct cursor *c, int enc, const uint8_t *section, uint64_t base,
                        int *ok)
{
    if (enc == 0xff)
        return 0; /* omitted */
    const uint8_t *at = c->p;
    uint64_t v;
    switch (enc & 0x0f) {
    case 0x00: v = fixed(c, 8); break;
    case 0x01: v = uleb(c); break;
    case 0x02: v = fixed(c, 2); break;
    case 0x03: v = fixed(c, 4); break;
    case 0x04: v = fixed(c, 8); break;
    case 0x09: v = (uint64_t)sleb(c); break;
    case 0x0a: v = (uint64_t)(int64_t)(int16_t)fixed(c, 2); break;
    case 0x0b: v = (uint64_t)(int64_t)(int32_t)fixed(c, 4); break;
    case 0x0c: v = fixed(c, 8); break;
    default: *ok = 0; return 0;
    }
    switch (enc & 0x70) {
    case 0x00: break;
    case 0x10: v += base + (uint64_t)(at - section); break; /* pcrel */
    default: *ok = 0; /* textrel, datarel, funcrel, aligned: not on x86-64's files */
    }
    return v;
}

struct cie {
    int ok;
    int enc; /* the FDEs' pointer encoding */
    int augmented; /* 'z': FDEs carry augmentation data */
    uint64_t caf;
    int64_t daf;
    uint64_t ra_reg;
    const uint8_t *insns, *insns_end;
};

static struct cie read_cie(const uint8_t *section, uint64_t base, const uint8_t *p,
                           const uint8_t *end)
{
    struct cie cie = {0};
    struct cursor c = {p, end, 0};
    int version = (int)u8(&c);
    const uint8_t *aug = c.p;
    while (c.p < c.end && *c.p)
        c.p++;
    if (c.p >= c.end)
        return cie;
    size_t aug_len = (size_t)(c.p - aug);
    c.p++;
    if (version == 4) {
        int address_size = (int)u8(&c);
        u8(&c); /* segment selector size */
        if (address_size != 8)
            return cie;
    } else if (version != 1 && version != 3) {
        return cie;
    }
    cie.caf = uleb(&c);
    cie.daf = sleb(&c);
    cie.ra_reg = version == 1 ? u8(&c) : uleb(&c);
    int ok = 1;
    if (aug_len && aug[0] == 'z') {
        cie.augmented = 1;
        uint64_t length = uleb(&c);
        if (c.bad || length > (uint64_t)(c.end - c.p))
            return cie;
        struct cursor a = {c.p, c.p + length, 0};
        for (size_t i = 1; i < aug_len && ok; i++) {
            switch (aug[i]) {
            case 'R': cie.enc = (int)u8(&a); break;
            case 'L': u8(&a); break;
            case 'P': {
                int penc = (int)u8(&a);
                pointer(&a, penc & 0x7f, section, base, &ok);
                break;
            }
            case 'S': case 'B': break;
            default: ok = 0; /* an augmentation whose data cannot be skipped */
            }
        }
        c.p += length;
        if (a.bad)
            ok = 0;
    } else if (aug_len) {
        ok = 0; /* "eh" and other pre-'z' augmentations */
    }
    if (!ok || c.bad)
        return cie;
    cie.insns = c.p;
    cie.insns_end = end;
    cie.ok = 1;
    return cie;
}

static int push(struct rows *rows, uint64_t pc, uint32_t order, const struct state *s)
{
    if (rows->len == rows->cap) {
        size_t cap = rows->cap ? rows->cap * 2 : 4096;
        struct row *at = realloc(rows->at, cap * sizeof(*at));
        if (!at) {
            rows->failed = 1;
            return -1;
        }
        rows->at = at;
        rows->cap = cap;
    }
    struct row *r = &rows->at[rows->len++];
    memset(r, 0, sizeof(*r));
    r->pc = pc;
    r->order = order;
    if (!s) {
        r->cfa = CFA_NONE;
        return 0;
    }
    if (s->ra.kind == R_UNDEFINED) {
        r->cfa = CFA_END;
        return 0;
    }
    int kind = s->cfa_expr ? -1 : s->cfa_reg == REG_RSP ? CFA_RSP
             : s->cfa_reg == REG_RBP ? CFA_RBP : -1;
    if (kind < 0 || s->ra.kind != R_OFFSET || s->ra.off != -8 || s->cfa_off < INT32_MIN ||
        s->cfa_off > INT32_MAX) {
        r->cfa = CFA_OTHER;
        r->rbp = RBP_LOST;
        return 0;
    }
    r->cfa = (uint8_t)kind;
    r->cfa_off = (int32_t)s->cfa_off;
    if (s->rbp.kind == R_SAME) {
        r->rbp = RBP_SAME;
    } else if (s->rbp.kind == R_OFFSET && s->rbp.off >= INT16_MIN && s->rbp.off <= INT16_MAX) {
        r->rbp = RBP_AT;
        r->rbp_off = (int16_t)s->rbp.off;
    } else {
        r->rbp = RBP_LOST;
    }
    return 0;
}

static struct rule *tracked(struct state *s, uint64_t reg)
{
    return reg == REG_RA ? &s->ra : reg == REG_RBP ? &s->rbp : NULL;
}

static void set_rule(struct state *s, uint64_t reg, int kind, int64_t off)
{
    struct rule *r = tracked(s, reg);
    if (r) {
        r->kind = kind;
        r->off = off;
    }
}

struct interp {
    const struct cie *cie;
    const struct state *initial; /* NULL while the CIE's own instructions run */
    struct state s;
    struct state stack[STATE_DEPTH];
    int depth;
    uint64_t loc, end;
    uint32_t order;
    struct rows *out; /* NULL: the CIE's instructions (no rows) */
    const uint8_t *section;
    uint64_t base;
};

/* The row in force from it.loc to `to`, then it.loc = to. */
static int advance(struct interp *it, uint64_t to)
{
    if (to < it->loc)
        return -1;
    if (it->out && to > it->loc && it->loc < it->end)
        if (push(it->out, it->loc, it->order, &it->s))
            return -1;
    it->loc = to;
    return 0;
}

/* Run instructions [p, end): 0, or -1 when they cannot be interpreted. */
static int run(struct interp *it, const uint8_t *p, const uint8_t *end)
{
    struct cursor c = {p, end, 0};
    const struct cie *cie = it->cie;
    while (c.p < c.end && !c.bad) {
        uint8_t op = (uint8_t)u8(&c);
        uint64_t reg, len;
        int ok = 1;
        switch (op >> 6) {
        case 1:
            if (advance(it, it->loc + (op & 0x3f) * cie->caf))
                return -1;
            continue;
        case 2:
            set_rule(&it->s, op & 0x3f, R_OFFSET, (int64_t)uleb(&c) * cie->daf);
            continue;
        case 3:
            reg = op & 0x3f;
            goto restore;
        }
        switch (op) {
        case 0x00: break; /* nop */
        case 0x01: /* set_loc */
            if (advance(it, pointer(&c, cie->enc, it->section, it->base, &ok)) || !ok)
                return -1;
            break;
        case 0x02: if (advance(it, it->loc + fixed(&c, 1) * cie->caf)) return -1; break;
        case 0x03: if (advance(it, it->loc + fixed(&c, 2) * cie->caf)) return -1; break;
        case 0x04: if (advance(it, it->loc + fixed(&c, 4) * cie->caf)) return -1; break;
        case 0x05: reg = uleb(&c); set_rule(&it->s, reg, R_OFFSET, (int64_t)uleb(&c) * cie->daf); break;
        case 0x06: reg = uleb(&c); goto restore;
        case 0x07: set_rule(&it->s, uleb(&c), R_UNDEFINED, 0); break;
        case 0x08: set_rule(&it->s, uleb(&c), R_SAME, 0); break;
        case 0x09: reg = uleb(&c); uleb(&c); set_rule(&it->s, reg, R_OTHER, 0); break;
        case 0x0a: /* remember_state */
            if (it->depth == STATE_DEPTH)
                return -1;
            it->stack[it->depth++] = it->s;
            break;
        case 0x0b: /* restore_state: every rule, the CFA's included (as readelf) */
            if (it->depth == 0)
                return -1;
            it->s = it->stack[--it->depth];
            break;
        case 0x0c: /* def_cfa */
            it->s.cfa_reg = (int)uleb(&c);
            it->s.cfa_off = (int64_t)uleb(&c);
            it->s.cfa_expr = 0;
            break;
        case 0x0d: /* def_cfa_register: keeps the offset */
            it->s.cfa_reg = (int)uleb(&c);
            it->s.cfa_expr = 0;
            break;
        case 0x0e: it->s.cfa_off = (int64_t)uleb(&c); break;
        case 0x0f: /* def_cfa_expression */
            len = uleb(&c);
            if (len > (uint64_t)(c.end - c.p))
                return -1;
            c.p += len;
            it->s.cfa_expr = 1;
            break;
        case 0x10: case 0x16: /* expression, val_expression */
            reg = uleb(&c);
            len = uleb(&c);
            if (len > (uint64_t)(c.end - c.p))
                return -1;
            c.p += len;
            set_rule(&it->s, reg, R_OTHER, 0);
            break;
        case 0x11: reg = uleb(&c); set_rule(&it->s, reg, R_OFFSET, sleb(&c) * cie->daf); break;
        case 0x12:
            it->s.cfa_reg = (int)uleb(&c);
            it->s.cfa_off = sleb(&c) * cie->daf;
            it->s.cfa_expr = 0;
            break;
        case 0x13: it->s.cfa_off = sleb(&c) * cie->daf; break;
        case 0x14: case 0x15: /* val_offset(_sf): the value, not a place */
            reg = uleb(&c);
            if (op == 0x14) uleb(&c); else sleb(&c);
            set_rule(&it->s, reg, R_OTHER, 0);
            break;
        case 0x2e: uleb(&c); break; /* GNU_args_size: nothing of the CFA or a register */
        case 0x2f: /* GNU_negative_offset_extended */
            reg = uleb(&c);
            set_rule(&it->s, reg, R_OFFSET, -(int64_t)uleb(&c) * cie->daf);
            break;
        default:
            return -1;
        }
        continue;
    restore:
        if (it->initial) {
            struct rule *to = tracked(&it->s, reg);
            const struct rule *from = tracked((struct state *)it->initial, reg);
            if (to && from)
                *to = *from;
        }
    }
    return c.bad ? -1 : 0;
}

/* A CIE's offset -> its reading, for the FDEs that name it. */
struct cie_cache {
    size_t offset[64];
    struct cie cie[64];
    struct state initial[64];
    int known[64];
};

static const struct cie *cie_at(struct cie_cache *cache, const uint8_t *section, size_t size,
                                uint64_t base, size_t offset, int eh, const struct state **initial)
{
    size_t slot = (offset >> 3) & 63;
    if (cache->known[slot] && cache->offset[slot] == offset) {
        *initial = &cache->initial[slot];
        return &cache->cie[slot];
    }
    struct cie bad = {0};
    cache->known[slot] = 1;
    cache->offset[slot] = offset;
    cache->cie[slot] = bad;
    *initial = &cache->initial[slot];
    struct cursor c = {section + offset, section + size, 0};
    uint64_t length = fixed(&c, 4);
    int wide = length == 0xffffffffu;
    if (wide)
        length = fixed(&c, 8);
    if (c.bad || length > (uint64_t)(c.end - c.p))
        return &cache->cie[slot];
    const uint8_t *end = c.p + length;
    uint64_t id = fixed(&c, wide ? 8 : 4);
    if (eh ? id != 0 : id != (wide ? ~0ull : 0xffffffffull))
        return &cache->cie[slot];
    struct cie cie = read_cie(section, base, c.p, end);
    if (!cie.ok)
        return &cache->cie[slot];
    struct interp it = {.cie = &cie, .initial = NULL, .section = section, .base = base};
    it.s.cfa_reg = -1;
    if (run(&it, cie.insns, cie.insns_end) || it.depth)
        return &cache->cie[slot];
    cache->cie[slot] = cie;
    cache->initial[slot] = it.s;
    return &cache->cie[slot];
}

struct counts {
    uint32_t functions, skipped, malformed, order;
};

/* Every FDE of one section, its rows appended to `out`. */
static void read_section(const uint8_t *section, size_t size, uint64_t base, int eh,
                         struct rows *out, struct counts *n)
{
    struct cie_cache *cache = calloc(1, sizeof(*cache));
    if (!cache) {
        out->failed = 1;
        return;
    }
    size_t offset = 0;
    while (offset + 4 <= size && !out->failed) {
        struct cursor c = {section + offset, section + size, 0};
        uint64_t length = fixed(&c, 4);
        if (length == 0 && eh)
            break; /* the terminator */
        int wide = length == 0xffffffffu;
        if (wide)
            length = fixed(&c, 8);
        if (c.bad || length > (uint64_t)(c.end - c.p) || length < 4) {
            n->skipped++; /* the rest of the section cannot be found */
            break;
        }
        const uint8_t *end = c.p + length;
        size_t next = (size_t)(end - section);
        const uint8_t *id_at = c.p;
        uint64_t id = fixed(&c, wide ? 8 : 4);
        int is_cie = eh ? id == 0 : id == (wide ? ~0ull : 0xffffffffull);
        offset = next;
        if (is_cie)
            continue;
        n->functions++;
        size_t cie_offset;
        if (eh) {
            if (id > (uint64_t)(id_at - section)) {
                n->skipped++;
                continue;
            }
            cie_offset = (size_t)(id_at - section) - (size_t)id;
        } else {
            if (id >= size) {
                n->skipped++;
                continue;
            }
            cie_offset = (size_t)id;
        }
        const struct state *initial = NULL;
        const struct cie *cie = cie_at(cache, section, size, base, cie_offset, eh, &initial);
        if (!cie->ok) {
            n->skipped++;
            continue;
        }
        c.end = end;
        int ok = 1;
        uint64_t start = pointer(&c, cie->enc, section, base, &ok);
        uint64_t range = pointer(&c, cie->enc & 0x0f, section, base, &ok);
        if (cie->augmented) {
            uint64_t skip = uleb(&c);
            if (skip > (uint64_t)(c.end - c.p))
                c.bad = 1;
            else
                c.p += skip;
        }
        if (!ok || c.bad || range == 0 || start + range < start || start + range >= PC_LIMIT) {
            n->skipped++; /* no range, or beyond the rows' 32-bit addresses */
            continue;
        }
        uint32_t order = n->order++;
        size_t first = out->len;
        struct interp it = {.cie = cie, .initial = initial, .s = *initial, .loc = start,
                            .end = start + range, .order = order, .out = out,
                            .section = section, .base = base};
        if (run(&it, c.p, end) == 0 && (it.loc >= it.end || advance(&it, it.end) == 0) &&
            !out->failed) {
            push(out, start + range, order, NULL);
            continue;
        }
        if (out->failed)
            break;
        /* Not interpretable: its range is one row the unwinder does not follow. */
        out->len = first;
        n->malformed++;
        struct state other = {.cfa_reg = -1, .cfa_expr = 1};
        push(out, start, order, &other);
        push(out, start + range, order, NULL);
    }
    free(cache);
}

/* The functions' first rows, for ordering: each function's start, by order. */
static uint64_t *starts;

static int by_pc(const void *a, const void *b)
{
    const struct row *x = a, *y = b;
    if (x->pc != y->pc)
        return x->pc < y->pc ? -1 : 1;
    int xn = x->cfa == CFA_NONE, yn = y->cfa == CFA_NONE;
    if (xn != yn)
        return xn - yn; /* a function's rule before another's closing row */
    uint64_t xs = starts[x->order], ys = starts[y->order];
    if (xs != ys)
        return xs < ys ? -1 : 1;
    return x->order < y->order ? -1 : x->order > y->order;
}

static int same_rules(const struct row *a, const struct row *b)
{
    return a->cfa == b->cfa && a->cfa_off == b->cfa_off && a->rbp == b->rbp &&
           a->rbp_off == b->rbp_off;
}

static PyObject *packed(struct rows *rows, uint32_t functions)
{
    uint64_t *first = calloc(functions ? functions : 1, sizeof(*first));
    if (!first)
        return PyErr_NoMemory();
    for (size_t i = rows->len; i-- > 0;)
        first[rows->at[i].order] = rows->at[i].pc; /* the lowest pc: each function's first */
    starts = first;
    qsort(rows->at, rows->len, sizeof(*rows->at), by_pc);
    starts = NULL;
    free(first);
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(rows->len * 12));
    if (!out)
        return NULL;
    uint8_t *p = (uint8_t *)PyBytes_AS_STRING(out);
    size_t kept = 0;
    const struct row *last = NULL;
    for (size_t i = 0; i < rows->len; i++) {
        const struct row *r = &rows->at[i];
        if (i && r->pc == rows->at[i - 1].pc)
            continue; /* the first at an address stands */
        if (last && same_rules(r, last))
            continue;
        last = r;
        uint32_t pc = (uint32_t)r->pc;
        int32_t cfa_off = r->cfa_off;
        int16_t rbp_off = r->rbp_off;
        memcpy(p, &pc, 4);
        memcpy(p + 4, &cfa_off, 4);
        memcpy(p + 8, &rbp_off, 2);
        p[10] = r->cfa;
        p[11] = r->rbp;
        p += 12;
        kept++;
    }
    if (_PyBytes_Resize(&out, (Py_ssize_t)(kept * 12)))
        return NULL;
    return out;
}

static PyObject *cfi_rows(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer eh, debug;
    unsigned long long eh_base;
    if (!PyArg_ParseTuple(args, "y*Ky*", &eh, &eh_base, &debug))
        return NULL;
    struct rows rows = {0};
    struct counts n = {0};
    Py_BEGIN_ALLOW_THREADS
    read_section(eh.buf, (size_t)eh.len, eh_base, 1, &rows, &n);
    if (!rows.failed)
        read_section(debug.buf, (size_t)debug.len, 0, 0, &rows, &n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&eh);
    PyBuffer_Release(&debug);
    PyObject *packed_rows = rows.failed ? PyErr_NoMemory() : packed(&rows, n.order);
    free(rows.at);
    if (!packed_rows)
        return NULL;
    return Py_BuildValue("NIII", packed_rows, n.functions, n.skipped, n.malformed);
}

static PyMethodDef methods[] = {
    {"rows", cfi_rows, METH_VARARGS,
     "rows(eh_frame, eh_frame_address, debug_frame) -> (rows, functions, skipped, malformed)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cfi", "Call-frame information as the unwinder's rows.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cfi(void)
{
    return PyModule_Create(&module);
}
