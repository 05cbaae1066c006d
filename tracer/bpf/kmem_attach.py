"""How each kmem tracepoint is attached: raw, or classic.

A classic tracepoint program runs after the kernel has filled the event's
trace record (every field of its format, the cache's name string
included); a raw tracepoint program gets the tracepoint's own arguments and
the kernel fills nothing. On this project's machine six empty raw programs
cost a third of what six empty classic ones do (docs/performance.md,
section 2).

A raw program reads what the record would have held itself, so it needs to
know, for the running kernel:

- the position of each argument (``ctx->args[i]``): the parameters of the
  kernel's ``trace_event_raw_event_<event>``, from BTF;
- for kmem_cache_alloc, where ``struct kmem_cache`` keeps ``object_size``
  (the record's bytes_req), ``size`` (bytes_alloc) and ``name``: from BTF.

Both become compile-time constants of kmem.bpf.c. Where BTF also names
kmem_cache_alloc's tracepoint type (``btf_trace_kmem_cache_alloc``), its
handler is loaded BTF-typed (tp_btf, ``BTF_CACHE_ALLOC``): the verifier then
knows the argument is a ``struct kmem_cache`` and lets the handler load
the members itself, where a raw one copies them with a helper call
(tracer/bpf/bpf_backend.py loads it, and the raw one if the kernel refuses
it). An event whose facts
BTF lacks stays classic, and ``mtrace-live doctor`` says why. The page
events stay classic everywhere: their records give the pfn, and the
arguments a ``struct page *``, which becomes a pfn only through
``vmemmap_base``; with the kernel's memory layout randomised that value is
in neither BTF nor /proc/kallsyms.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mtrace_live.tracer.bpf.kernel_btf import BtfUnavailable, KernelBtf
from mtrace_live.tracer.bpf.tracefs import kmem_defines, tracepoint_format

# event -> (its define's prefix, the arguments read, the optional ones)
_RAW_EVENTS = {
    "kmalloc": (
        "KMALLOC",
        ("call_site", "ptr", "bytes_req", "bytes_alloc", "gfp_flags"),
        ("node",),
    ),
    "kfree": ("KFREE", ("call_site", "ptr"), ()),
    "kmem_cache_alloc": ("CACHE_ALLOC", ("call_site", "ptr", "s", "gfp_flags"), ("node",)),
    "kmem_cache_free": ("CACHE_FREE", ("call_site", "ptr"), ()),
}
# struct kmem_cache's members the raw kmem_cache_alloc reads, with their sizes
_CACHE_MEMBERS = {"size": 4, "object_size": 4}
_CACHE_NAME = ("name", 8)
_MAX_SPAN = 128  # bytes of struct kmem_cache copied per allocation, on the BPF stack
PAGE_EVENTS_WHY = (
    "the argument is a struct page *, and the pfn the record holds needs vmemmap_base, "
    "which neither BTF nor /proc/kallsyms gives when the kernel's memory layout is randomised"
)


@dataclass(frozen=True)
class KmemAttach:
    """kmem.bpf.c's defines for the raw handlers, and each event's way."""

    defines: dict[str, int] = field(default_factory=dict)
    raw: tuple[str, ...] = ()
    typed: tuple[str, ...] = ()  # of the raw ones, those loaded BTF-typed (tp_btf)
    classic: dict[str, str] = field(default_factory=dict)  # event -> why not raw


def _classic_all(events: tuple[str, ...], why: str) -> KmemAttach:
    return KmemAttach(classic={event: why for event in events})


def kmem_attach(variants: dict[str, int], classic: bool = False) -> KmemAttach:
    """Which kmem tracepoints can be raw on this kernel. ``variants`` are
    tracefs.kmem_defines's; ``classic`` keeps every one classic (the
    ``--classic-tracepoints`` option, to compare the two)."""
    events = (*_RAW_EVENTS, "mm_page_alloc", "mm_page_free")
    if variants.get("HAVE_PAGE_FREE_BATCHED"):
        events = (*events, "mm_page_free_batched")
    if classic:
        return _classic_all(events, "asked for (--classic-tracepoints)")
    try:
        btf = KernelBtf()
    except BtfUnavailable as exc:
        return _classic_all(events, str(exc))
    with btf:
        return _raw_plan(btf, variants, events)


def _raw_plan(btf: KernelBtf, variants: dict[str, int], events: tuple[str, ...]) -> KmemAttach:
    defines: dict[str, int] = {}
    raw: list[str] = []
    typed: list[str] = []
    why: dict[str, str] = {}
    for event, (prefix, needed, optional) in _RAW_EVENTS.items():
        if event == "kmalloc" and variants.get("HAVE_KMALLOC_NODE"):
            why[event] = "this kernel has a separate kmalloc_node tracepoint"
            continue
        if event == "kmem_cache_alloc" and variants.get("HAVE_CACHE_ALLOC_NODE"):
            why[event] = "this kernel has a separate kmem_cache_alloc_node tracepoint"
            continue
        args = btf.tracepoint_args(event)
        if args is None:
            why[event] = f"BTF has no trace_event_raw_event_{event} to give its arguments"
            continue
        absent = [name for name in needed if name not in args]
        if absent:
            why[event] = f"its arguments in BTF lack {', '.join(absent)}"
            continue
        offsets = _cache_offsets(btf, bool(variants.get("HAVE_CACHE_NAME")))
        if event == "kmem_cache_alloc" and isinstance(offsets, str):
            why[event] = offsets
            continue
        if event == "kmem_cache_alloc" and isinstance(offsets, dict):
            defines.update(offsets)
            if btf.tracepoint_type_id(event) is not None:
                defines["BTF_CACHE_ALLOC"] = 1
                typed.append(event)
        for name in (*needed, *optional):
            defines[f"{prefix}_ARG_{name.upper()}"] = args.index(name) if name in args else -1
        defines[f"RAW_{prefix}"] = 1
        raw.append(event)
    for event in events:
        if event.startswith("mm_page"):
            why[event] = PAGE_EVENTS_WHY
    return KmemAttach(defines=defines, raw=tuple(raw), typed=tuple(typed), classic=why)


def _cache_offsets(btf: KernelBtf, with_name: bool) -> dict[str, int] | str:
    """CACHE_<MEMBER>_OFF for struct kmem_cache, and the span holding them
    all (CACHE_SPAN_OFF, 8-aligned, and CACHE_SPAN_LEN), read in one copy;
    or why they cannot be used."""
    wanted = dict(_CACHE_MEMBERS)
    if with_name:
        wanted[_CACHE_NAME[0]] = _CACHE_NAME[1]
    offsets: dict[str, int] = {}
    ends = []
    for member, size in wanted.items():
        found = btf.member("kmem_cache", member)
        if found is None or found[1] != size:
            shown = "absent" if found is None else f"{found[1]} bytes, not {size}"
            return f"BTF's struct kmem_cache has no usable member {member} ({shown})"
        offsets[f"CACHE_{member.upper()}_OFF"] = found[0]
        ends.append(found[0] + found[1])
    start = min(offsets.values()) & ~7
    length = (max(ends) - start + 7) & ~7
    if length > _MAX_SPAN:
        return f"BTF's struct kmem_cache spreads the members read over {length} bytes"
    return {**offsets, "CACHE_SPAN_OFF": start, "CACHE_SPAN_LEN": length}


def kmem_switches(classic: bool = False) -> dict[str, int]:
    """The kmem part's defines on this kernel: its tracepoints' variants
    (tracefs) and which handlers are raw (``kmem_attach``)."""
    variants = kmem_defines(tracepoint_format)
    return {**variants, **kmem_attach(variants, classic).defines}
