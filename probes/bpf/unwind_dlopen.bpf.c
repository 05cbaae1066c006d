/* ---- the CFI unwinder at dlopen ---------------------------------------------
 * A library mapped while a process is traced (dlopen, dlmopen): the
 * thread's return address that the kernel's return probe replaced, kept for
 * the walks inside the call (unwind.bpf.c's hijack slots), and the process's
 * ask for its tables again once the library is mapped (at the loader's
 * _dl_debug_state where it has a probe, else at dlopen's return). */
#if WITH_UNWIND
/* The entry of dlopen or dlmopen (where its return probe stands: the
 * kernel replaces the return address after the handlers ran). */
int unwind_dlopen_entry(struct pt_regs *ctx)
{
    u32 tid = (u32)bpf_get_current_pid_tgid(), slot = tid & (HIJACK_SLOTS - 1);
    struct unwind_hijack *h = unwind_hijacks.lookup(&slot);
    if (!h)
        return 0;
    u64 sp = PT_REGS_SP(ctx), ra = 0;
    if (bpf_probe_read_user(&ra, sizeof(ra), (void *)sp))
        return 0;
    h->tid = tid;
    h->ra = ra;
    h->at = sp;
    return 0;
}

/* The process mapped more files (or unmapped some), whose code may soon
 * call. A process whose tables were written asks for them again (a
 * process mtrace-live started stops until they are): its tables stay in
 * force meanwhile, the new library's frames stepped by frame pointers (or
 * found in the kernel) until they are written. */
static __always_inline void unwind_mapped(u32 tgid)
{
    if (gate_closed() || !tgid_is_followed(tgid))
        return;
#if UNWIND_VMA
    unwind_vmas.delete(&tgid); /* a library closed meanwhile may have left its place to this one */
#endif
    struct unwind_proc *proc = unwind_procs.lookup(&tgid);
    if (!proc || !proc->count)
        return; /* never asked, or asked and not written yet: its tables will have the library */
    unwind_ask(tgid, 1, 0);
}

/* The return of dlopen or dlmopen (after the library's constructors ran):
 * the thread's return address is its own again; and, where the loader's
 * _dl_debug_state has no probe (unwind_rtld not written), the process asks
 * here (once per dlopen: unwind_dl_state asked where it has one). */
int unwind_dlopen_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id, slot = tid & (HIJACK_SLOTS - 1), zero = 0;
    struct unwind_hijack *h = unwind_hijacks.lookup(&slot);
    if (h && h->tid == tid)
        h->at = 0;
    s64 *delta = unwind_rtld.lookup(&zero);
    if (!delta || !*delta)
        unwind_mapped(tgid);
    return 0;
}

/* The dynamic loader's _dl_debug_state, the debuggers' breakpoint: called
 * with _r_debug.r_state RT_CONSISTENT (0) once a dlopen's objects are
 * mapped (or a dlclose's unmapped), before their constructors run, which
 * the return of dlopen comes only after: the constructors' calls and the
 * library's first ones are then whole too. Called at a process's start as
 * well, before it has tables (nothing to ask then), and with RT_ADD or
 * RT_DELETE before the change (nothing mapped yet). */
int unwind_dl_state(struct pt_regs *ctx)
{
    u32 zero = 0, tgid = bpf_get_current_pid_tgid() >> 32;
    s64 *delta = unwind_rtld.lookup(&zero);
    int state = 0;
    if (!delta || !*delta || gate_closed() || !tgid_is_followed(tgid))
        return 0; /* (every process's loader calls it, under --all and serve) */
    if (bpf_probe_read_user(&state, sizeof(state), (void *)(PT_REGS_IP(ctx) + *delta)) || state)
        return 0;
    unwind_mapped(tgid);
    return 0;
}
#endif
