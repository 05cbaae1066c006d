/* Where an allocation function's uprobe site finds its arguments, and which
 * provider (the allocator's file) it is in: both told by the site's BPF
 * cookie (probes/alloc_sites.py's site_cookie, tracer/loop/alloc_probes.py's
 * attach_allocs). No maps: #included by common.bpf.h. */
#ifndef MTRACE_SITE_COOKIE_H
#define MTRACE_SITE_COOKIE_H

#ifndef SITE_REGISTERS
#define SITE_REGISTERS 0 /* the kernel gives uprobes their link's cookie (Linux 5.15) */
#endif

/* The site's cookie: 0 without SITE_REGISTERS (every argument where the
 * calling convention puts it, and the libc's provider). Read once a call. */
static __always_inline u64 site_cookie(struct pt_regs *ctx)
{
    return SITE_REGISTERS ? bpf_get_attach_cookie(ctx) : 0;
}

/* Argument `slot` of the call: where the site's `cookie` says it went (enum
 * site_reg, SITE_REG_BITS per argument from bit SITE_REG_SHIFT: alloc_sites.py
 * followed it through the moves before the site), else `usual`, the calling
 * convention's register. The provider is the cookie's bits from
 * SITE_PROVIDER_SHIFT. */
static __always_inline u64 site_arg(struct pt_regs *ctx, u64 cookie, u32 slot, u64 usual)
{
    u64 at = (cookie >> (SITE_REG_SHIFT + SITE_REG_BITS * slot)) & ((1 << SITE_REG_BITS) - 1);
    if (at) {
        /* each register read at its own offset of ctx, as the verifier
         * requires, then picked from the stack */
        u64 regs[1 << SITE_REG_BITS] = {
            [SR_RDI] = ctx->di, [SR_RSI] = ctx->si, [SR_RDX] = ctx->dx, [SR_RCX] = ctx->cx,
            [SR_R8] = ctx->r8, [SR_R9] = ctx->r9, [SR_RAX] = ctx->ax, [SR_R10] = ctx->r10,
            [SR_R11] = ctx->r11, [SR_RBX] = ctx->bx, [SR_RBP] = ctx->bp, [SR_R12] = ctx->r12,
            [SR_R13] = ctx->r13, [SR_R14] = ctx->r14, [SR_R15] = ctx->r15,
        };
        return regs[at];
    }
    return usual;
}

#define ARG1(ctx, cookie) site_arg(ctx, cookie, 0, PT_REGS_PARM1(ctx))
#define ARG2(ctx, cookie) site_arg(ctx, cookie, 1, PT_REGS_PARM2(ctx))
#define ARG3(ctx, cookie) site_arg(ctx, cookie, 2, PT_REGS_PARM3(ctx))

#endif
