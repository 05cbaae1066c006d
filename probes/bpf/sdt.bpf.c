/* ---- the libc's SDT sites -------------------------------------------------
 * User space attaches SDT site i to handler site_<i> and tells it, as
 * constants, which probe slot the site belongs to and where each argument
 * lives (register, register + displacement, or an address at a constant
 * distance from the site's instruction pointer: the rip-relative operands).
 * One handler body serves every site, inlined into each (bcc 0.26 cannot
 * load BPF-to-BPF calls). */
/* This part's settings (ProgramConfig, probes/program.py), and their defaults. */
#ifndef SITE_COUNT
#define SITE_COUNT 0 /* how many site_<n> handlers to build, at most 128 */
#endif

/* ---- reading arguments ---------------------------------------------------*/
#define PT_REGS_SLOTS (sizeof(struct pt_regs) / sizeof(u64))

static __always_inline u64 extend(u64 v, u8 size, u8 is_signed)
{
    switch (size) {
    case 1: return is_signed ? (u64)(s64)(s8)v : (u8)v;
    case 2: return is_signed ? (u64)(s64)(s16)v : (u16)v;
    case 4: return is_signed ? (u64)(s64)(s32)v : (u32)v;
    }
    return v;
}

/* Where each site's arguments are is known before this program is compiled,
 * so user space defines them as constants (see SITE below): `packed` is
 * kind | size << 8 | is_signed << 16 | pt_regs slot << 24, and `value` the
 * constant, displacement or distance from the site's ip. Once inlined, every
 * test here is decided by the compiler, and a register argument is one load
 * at a fixed offset of the context: no copy of the registers, no descriptor
 * to look up. */
static __always_inline u64 load_arg(struct pt_regs *ctx, const u32 packed, const s64 value)
{
    const u8 kind = packed & 0xff;
    const u8 size = (packed >> 8) & 0xff;
    const u8 is_signed = (packed >> 16) & 0xff;
    const u32 slot = packed >> 24;
    u64 *regs = (u64 *)ctx;
    u64 v = 0;
    u64 addr;
    if (kind == ARG_CONST) {
        v = value;
    } else if (kind == ARG_REG) {
        if (slot < PT_REGS_SLOTS)
            v = regs[slot];
    } else if (kind == ARG_DEREF_REG || kind == ARG_DEREF_IP) {
        if (kind == ARG_DEREF_IP)
            addr = PT_REGS_IP(ctx) + value;
        else
            addr = (slot < PT_REGS_SLOTS ? regs[slot] : 0) + value;
        if (bpf_probe_read_user(&v, size & 0x8 ? 8 : size & 0x7, (void *)addr))
            v = 0;
    } else {
        return 0;
    }
    return extend(v, size, is_signed);
}

/* ---- one body for every site ---------------------------------------------*/
static __always_inline int on_site(struct pt_regs *ctx, const u32 site, const u32 probe,
                                   const u32 nargs, const u32 a0, const s64 v0,
                                   const u32 a1, const s64 v1, const u32 a2, const s64 v2,
                                   const u32 a3, const s64 v3, const u32 a4, const s64 v4,
                                   const u32 a5, const s64 v5)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!admit(id >> 32, probe))
        return 0;
#if WITH_EVENTS
    struct event *e = probe_record(PT_REGS_IP(ctx), id, site, probe, nargs);
    if (!e)
        return 0;
    e->args[0] = load_arg(ctx, a0, v0);
    e->args[1] = load_arg(ctx, a1, v1);
    e->args[2] = load_arg(ctx, a2, v2);
    e->args[3] = load_arg(ctx, a3, v3);
    e->args[4] = load_arg(ctx, a4, v4);
    e->args[5] = load_arg(ctx, a5, v5);
    e->ustack = stack_id(ctx, BPF_F_USER_STACK, 0);
    events.ringbuf_submit(e, 0);
#endif
    return 0;
}

/* site_0 ... site_<SITE_COUNT - 1>, in blocks of ten: site_0 ... site_9,
 * then a tens digit pasted onto 0..9 (site_10 ... site_119), then 120..127.
 * Only the blocks user space needs are compiled: each handler inlines the
 * whole body, and compile time is most of the start-up time. */
/* SP<n> is site n's probe slot, SN<n> its argument count, SA<n>_<i> and
 * SV<n>_<i> its argument i (load_arg): defined by user space for every
 * handler compiled. */
#define SITE(n) int site_##n(struct pt_regs *ctx) { return on_site(ctx, n, SP##n, SN##n, \
    SA##n##_0, SV##n##_0, SA##n##_1, SV##n##_1, SA##n##_2, SV##n##_2, \
    SA##n##_3, SV##n##_3, SA##n##_4, SV##n##_4, SA##n##_5, SV##n##_5); }
#define SITES_OF_TENS(t) \
    SITE(t##0) SITE(t##1) SITE(t##2) SITE(t##3) SITE(t##4) \
    SITE(t##5) SITE(t##6) SITE(t##7) SITE(t##8) SITE(t##9)

#if SITE_COUNT > 0
SITE(0) SITE(1) SITE(2) SITE(3) SITE(4) SITE(5) SITE(6) SITE(7) SITE(8) SITE(9)
#endif
#if SITE_COUNT > 10
SITES_OF_TENS(1)
#endif
#if SITE_COUNT > 20
SITES_OF_TENS(2)
#endif
#if SITE_COUNT > 30
SITES_OF_TENS(3)
#endif
#if SITE_COUNT > 40
SITES_OF_TENS(4)
#endif
#if SITE_COUNT > 50
SITES_OF_TENS(5)
#endif
#if SITE_COUNT > 60
SITES_OF_TENS(6)
#endif
#if SITE_COUNT > 70
SITES_OF_TENS(7)
#endif
#if SITE_COUNT > 80
SITES_OF_TENS(8)
#endif
#if SITE_COUNT > 90
SITES_OF_TENS(9)
#endif
#if SITE_COUNT > 100
SITES_OF_TENS(10)
#endif
#if SITE_COUNT > 110
SITES_OF_TENS(11)
#endif
#if SITE_COUNT > 120
SITE(120) SITE(121) SITE(122) SITE(123) SITE(124) SITE(125) SITE(126) SITE(127)
#endif

