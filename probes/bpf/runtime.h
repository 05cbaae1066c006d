/* The program's run-time values: settings that change what a handler does,
 * not which handlers and maps there are, so that one compiled program
 * serves every choice of them (the program cache keeps the code once:
 * tracer/bpf/bpf_cache.py).
 *
 * Each is a 64-bit immediate load of a mark of its own (MTL_RUNTIME_MARK in
 * the high half, the value's number in the low half), which the loader
 * replaces with the run's value before the kernel sees the code
 * (bpf_cache.specialize). The verifier then knows each as a constant and
 * walks only the branches it takes, as it did when they were compile-time
 * constants; clang, which cannot see through the load, keeps both.
 *
 * The second argument is the value where the run gives none (probes/program.py
 * reads both from here). A name here must not be given as a -D: the
 * preprocessor cannot test it (#if), which keeps every test of it in C. */
#ifndef MTRACE_RUNTIME_H
#define MTRACE_RUNTIME_H

#define MTL_RUNTIME_MARK 0x6d746c72 /* "mtlr": no constant of the C has it */
#define MTL_RUNTIME(mark, fallback)                                            \
    ({                                                                         \
        u64 __value;                                                           \
        asm volatile("%0 = " #mark " ll" : "=r"(__value));                     \
        __value;                                                               \
    })

/* the process filter (common.bpf.h) */
#define FILTER_PIDS MTL_RUNTIME(0x6d746c7200000001, 1)
#define FOLLOW_FORKS MTL_RUNTIME(0x6d746c7200000002, 1)
#define FIRST_TGID MTL_RUNTIME(0x6d746c7200000003, 0)
#define FILTER_COMM MTL_RUNTIME(0x6d746c7200000004, 0)
#define COMM_LO MTL_RUNTIME(0x6d746c7200000005, 0)
#define COMM_HI MTL_RUNTIME(0x6d746c7200000006, 0)
#define FILTER_CGROUP MTL_RUNTIME(0x6d746c7200000007, 0)
#define CGROUP_ID MTL_RUNTIME(0x6d746c7200000008, 0)
#define CGROUP_LEVEL MTL_RUNTIME(0x6d746c7200000009, 0)
/* processes mtrace-live started may be stopped (common.bpf.h, holds.bpf.c) */
#define HOLDS MTL_RUNTIME(0x6d746c720000000a, 0)
#define HOLD_AT_EXIT MTL_RUNTIME(0x6d746c720000000b, 0)
/* uprobes attached for one process, which may move to another thread */
#define UPROBE_MOVES MTL_RUNTIME(0x6d746c720000000c, 0)
#define ALLOC_ONE_PROCESS MTL_RUNTIME(0x6d746c720000000d, 0)
#define LOCK_ONE_PROCESS MTL_RUNTIME(0x6d746c720000000e, 0)
/* what goes through the ring, and how it is timed */
#define PROBE_EXACT_TIME MTL_RUNTIME(0x6d746c720000000f, 1)
#define ALLOC_EVENTS MTL_RUNTIME(0x6d746c7200000010, 0)
#define LOCK_EVENTS MTL_RUNTIME(0x6d746c7200000011, 0)
/* the allocation functions traced (allocs.bpf.c, vm.bpf.c, holds.bpf.c): a run
 * without them also leaves their handlers out of the load (probes/program.py) */
#define WITH_ALLOCS MTL_RUNTIME(0x6d746c7200000016, 0)
/* byte-based sampling of the allocations (allocs.bpf.c) */
#define SAMPLE_BYTES MTL_RUNTIME(0x6d746c7200000012, 0)
/* the open-addressed tables' index masks: their rows (a power of two) less
 * one, the rows the run made them with (probes/program.py RUNTIME_SIZES) */
#define ALLOC_OUT_MASK MTL_RUNTIME(0x6d746c7200000013, 524287)
#define ALLOC_STACK_MASK MTL_RUNTIME(0x6d746c7200000014, 32767)
#define FRAME_MASK MTL_RUNTIME(0x6d746c7200000015, 32767)
#define PENDING_MASK MTL_RUNTIME(0x6d746c7200000017, 65535)

#endif
