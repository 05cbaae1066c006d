"""The memory_* probes, derived for a libc built without SDT notes.

Each SDT probe that has an equivalent is rebuilt from what any glibc shows:

- **system calls** (brk, mprotect, madvise, munmap), seen by the kernel's
  syscall tracepoints and classified in BPF (``probes/bpf/derived.bpf.c``,
  DERIVED_SYSCALLS): sbrk growth and shrinkage, and the non-main heaps, which
  glibc reserves ``HEAP_MAX_SIZE``-aligned;
- **exported symbols** (``mallopt``, ``__lll_lock_wait_private``), whose
  arguments follow the calling convention;
- **the debug file** (``debuginfo.py``): the code of static functions,
  inlined or not, their parameters' DWARF locations, and ``heap_info``'s
  layout. A site is an instruction found by disassembly inside that code,
  never a fixed offset.

Every site is a uprobe like an SDT site: an address in the libc and where
each argument lives there (``locations.ArgLocation``), so the same BPF
handlers read it. It is moved, as the allocation functions' sites are, to
the first instruction from the anchor on its straight path that the kernel
emulates (about 0.9 us a hit against 11 us single-stepped), provided no
argument register is written before it and no jump lands on it; where there
is none, the anchor itself is used and marked single-stepped.

Each probe is labelled exact (the same events, the same arguments, as the
SDT probe would give), approximate (and what differs), or unavailable (and
why). docs/derived-probes.md has the table and the measurements.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .debuginfo import Code, DebugInfo
from .elf.debug import find_debug_file
from .elf.file import code_at, elf_failures, file_offset, load_segments
from .elf.lazy import lazy_module
from .elf.symbols import STT_FUNC, symbols_by_name
from .errors import DebugInfoError, NotGlibcError
from .locations import REGISTERS, ArgKind, ArgLocation, SiteLayout
from .sdt_notes import SdtSite
from .uprobe_sites import disassemble, first_emulated, jump_targets, written

if TYPE_CHECKING:
    import capstone
    from capstone import x86
    from elftools.elf import elffile
    from elftools.elf.elffile import ELFFile
else:  # (imported at the first disassembly: mtrace_live.probes.elf.lazy)
    capstone, x86 = lazy_module("capstone"), lazy_module("capstone.x86")
    elffile = lazy_module("elftools.elf.elffile")  # (pyelftools: at a file's first parse)

EXACT, APPROXIMATE, UNAVAILABLE = "exact", "approximate", "unavailable"
SYSCALL, SYMBOL, DEBUG = "syscall", "exported symbol", "debug info"

# glibc's HEAP_MAX_SIZE on 64-bit: 2 * DEFAULT_MMAP_THRESHOLD_MAX (4 MiB *
# sizeof (long)). A macro, so in no debug information.
HEAP_MAX_SIZE = 64 << 20
# heap_info's layout (ar_ptr, prev, size, mprotect_size, ...) when no debug
# file says otherwise: unchanged since glibc 2.26.
HEAP_INFO_DEFAULTS = {"size": 16, "mprotect_size": 24}

# The probes the syscall tracepoints derive, with the arguments they give.
SYSCALL_PROBES = (
    "memory_sbrk_more",
    "memory_sbrk_less",
    "memory_heap_new",
    "memory_heap_more",
    "memory_heap_less",
    "memory_heap_free",
)


@dataclass(frozen=True)
class DerivedArg:
    name: str
    location: ArgLocation
    text: str  # how it was found, e.g. "%rsi (DWARF location of avoid_arena)"


@dataclass(frozen=True)
class DerivedSite:
    """One uprobe: the anchor instruction found, and the site chosen from it."""

    function: str  # the code it is in, as debug info or the symbol table names it
    anchor: str  # what the anchor is, e.g. "the store to thread_arena"
    address: int
    file_offset: int
    instruction: str
    emulated: bool
    args: tuple[DerivedArg, ...]


@dataclass(frozen=True)
class DerivedProbe:
    name: str
    status: str  # EXACT, APPROXIMATE, UNAVAILABLE
    source: str  # SYSCALL, SYMBOL, DEBUG, or "" when unavailable
    derived_from: str  # one line: what it is rebuilt from
    differs: str = ""  # for APPROXIMATE: what differs; for UNAVAILABLE: why
    sites: tuple[DerivedSite, ...] = ()
    syscall_args: tuple[
        DerivedArg, ...
    ] = ()  # for SYSCALL: the arguments as the BPF side gives them


@dataclass
class DerivedPlan:
    libc: Path
    debug_file: Path | None
    debug_problem: str  # why there is no debug file, when there is none
    probes: dict[str, DerivedProbe] = field(default_factory=dict)
    heap_info: dict[str, int] = field(default_factory=lambda: dict(HEAP_INFO_DEFAULTS))
    main_arena: int | None = None  # link-time address, from the debug file's symbols

    def available(self) -> list[str]:
        return [name for name, p in self.probes.items() if p.status != UNAVAILABLE]

    def layouts(self, names: Iterable[str]) -> list[SiteLayout]:
        """One SiteLayout per uprobe site of the named probes, then one per
        syscall-derived probe (file_offset -1: never attached; it names the
        arguments of the events the BPF side sends for it)."""
        chosen = [self.probes[n] for n in names if self.probes[n].status != UNAVAILABLE]
        layouts = []
        for probe in chosen:
            for site in probe.sites:
                layouts.append(_layout(probe.name, site.address, site.file_offset, site.args))
        for probe in chosen:
            if probe.source == SYSCALL:
                layouts.append(_layout(probe.name, 0, -1, probe.syscall_args))
        return layouts


def _layout(name: str, address: int, offset: int, args: Sequence[DerivedArg]) -> SiteLayout:
    texts = tuple(arg.text.split(" ", 1)[0] for arg in args)
    site = SdtSite("libc", name, address, offset, 0, texts)
    return SiteLayout(site, tuple(arg.location for arg in args))


def _reg(name: str, size: int = 8, signed: bool = False) -> ArgLocation:
    slot, _ = REGISTERS[name]
    return ArgLocation(ArgKind.REG, size, signed, reg=slot)


def _missing(why: str) -> ArgLocation:
    return ArgLocation(ArgKind.UNREADABLE, 8, False, why=why)


def _parameter(debug: DebugInfo, code: Code, parameter: str, pc: int, name: str = "") -> DerivedArg:
    """Argument ``name`` (default: the parameter's own) from the register
    DWARF places ``parameter`` of ``code``'s function in at ``pc``, or an
    unreadable one when it is elsewhere there."""
    register = debug.parameter_register(code, parameter, pc)
    if register is None:
        return DerivedArg(
            name or parameter, _missing(f"{parameter}: no register location"), "unknown"
        )
    return DerivedArg(
        name or parameter, _reg(register), f"%{register} (DWARF location of {parameter})"
    )


def _registers(args: Iterable[DerivedArg]) -> set[str]:
    """The registers the arguments are read from."""
    by_slot = {slot: name for name, (slot, width) in REGISTERS.items() if width == 8}
    return {
        by_slot[arg.location.reg]
        for arg in args
        if arg.location.kind in (ArgKind.REG, ArgKind.DEREF_REG)
    }


def _debug_probe(name: str, derived_from: str, sites: Sequence[DerivedSite]) -> DerivedProbe:
    """A probe from the debug file: exact, or approximate when some argument
    has no register at a site."""
    missing = sorted({a.name for site in sites for a in site.args if not a.location.readable})
    if not missing:
        return DerivedProbe(name, EXACT, DEBUG, derived_from, sites=tuple(sites))
    differs = (
        f"{', '.join(missing)} is not recoverable at the site (no DWARF register location): "
        "decoded as unreadable"
    )
    return DerivedProbe(name, APPROXIMATE, DEBUG, derived_from, differs, tuple(sites))


def _syscall_arg(name: str, signed: bool, text: str) -> DerivedArg:
    # The location is never read (the BPF side fills the arguments); it gives
    # the decoder the argument's signedness.
    return DerivedArg(name, ArgLocation(ArgKind.REG, 8, signed, reg=0), text)


# ---- disassembly -----------------------------------------------------------


@dataclass
class _Function:
    name: str
    start: int
    insns: list[capstone.CsInsn]
    targets: set[int]  # addresses some direct jump or call in it lands on


def _function(elf: ELFFile, name: str, start: int, size: int) -> _Function:
    insns = disassemble(code_at(elf, start, start + size)[0], start)
    return _Function(name, start, insns, jump_targets(insns))


def choose_from(fn: _Function, anchor: int, registers: Iterable[str]) -> tuple[int, str, bool]:
    """(address, instruction, emulated): probes/uprobe_sites.py's
    ``first_emulated`` from ``anchor``, in 12 instructions at most, where
    no jump in the function lands; else the anchor."""
    site = first_emulated(fn.insns, anchor, tuple(registers), fn.targets, limit=12)
    return site.address, site.instruction, site.emulated


# ---- the plan --------------------------------------------------------------


class _Deriver:
    def __init__(self, libc: Path, stream_elf: ELFFile, debug: DebugInfo | None) -> None:
        self.libc = libc
        self.elf = stream_elf
        self.segments = load_segments(stream_elf)
        self.debug = debug
        self.dynamic = _dynamic_symbols(stream_elf)
        self._functions: dict[str, _Function] = {}

    def function(self, name: str) -> _Function | None:
        if name in self._functions:
            return self._functions[name]
        found = self.dynamic.get(name)
        if found is None and self.debug is not None:
            found = self.debug.function(name)
        if found is None or not found[1]:
            return None
        fn = self._functions[name] = _function(self.elf, name, *found)
        return fn

    def containing(self, address: int) -> _Function | None:
        """The function (by the debug file's symbols) whose code holds ``address``."""
        if self.debug is None:
            return None
        best = None
        for name, (start, size) in self.debug.symbols.items():
            if start <= address < start + size and size:
                best = name
                break
        return self.function(best) if best else None

    def site(
        self,
        fn: _Function,
        anchor: int,
        what: str,
        args: Sequence[DerivedArg],
        registers: Iterable[str],
    ) -> DerivedSite:
        address, text, fast = choose_from(fn, anchor, registers)
        offset = file_offset(self.segments, address)
        if offset is None:
            raise ValueError(f"{address:#x} is outside {self.libc}")
        return DerivedSite(fn.name, what, address, offset, text, fast, tuple(args))


def _dynamic_symbols(elf: ELFFile) -> dict[str, tuple[int, int]]:
    return symbols_by_name(elf, (".dynsym",), frozenset({STT_FUNC}))


def require_glibc(libc: Path) -> None:
    """Refuse a file that is not a readable ELF libc exporting glibc's
    malloc and mallopt: the system calls alone would then be misread."""
    try:
        with libc.open("rb") as stream:
            exported = _dynamic_symbols(elffile.ELFFile(stream))
    except (OSError, *elf_failures()) as exc:
        raise NotGlibcError(f"{libc} is not a readable ELF file ({exc})") from None
    if not {"malloc", "mallopt"} <= set(exported):
        raise NotGlibcError(f"{libc} is not a glibc: it exports no malloc and mallopt")


NO_DEBUG_FILE = Path("none")  # --debug-file none: derive as if no debug file were installed


def plan(libc: Path, debug_file: Path | None = None) -> DerivedPlan:
    """Derive every memory_* probe (and lll_lock_wait_private) for ``libc``.
    ``debug_file``: given by the user (checked against the libc's build-id);
    else the libc itself or the build-id's file under /usr/lib/debug.
    Raises NotGlibcError, or DebugInfoError for a given debug file that does
    not fit."""
    require_glibc(libc)
    problem = ""
    found = None
    if debug_file == NO_DEBUG_FILE:
        problem = "no debug file used (--debug-file none)"
    else:
        try:
            found = find_debug_file(libc, debug_file)
        except DebugInfoError:
            if debug_file is not None:
                raise
    if found is None and not problem:
        problem = (
            f"no debug file for {libc} (Debian: install libc6-dbg, whose file is found by build-id)"
        )
    debug = None
    if found is not None:
        try:
            debug = DebugInfo(found)
        except DebugInfoError as exc:
            if debug_file is not None:
                raise
            found, problem = None, str(exc)
    result = DerivedPlan(libc, found, problem)
    try:
        with libc.open("rb") as stream:
            deriver = _Deriver(libc, elffile.ELFFile(stream), debug)
            if debug is not None:
                for member in ("size", "mprotect_size"):
                    offset = debug.member_offset("_heap_info", member)
                    if offset is not None:
                        result.heap_info[member] = offset
                arena = debug.function("main_arena")
                result.main_arena = arena[0] if arena else None
            for derive in _DERIVATIONS:
                for probe in derive(deriver, result):
                    result.probes[probe.name] = probe
    finally:
        if debug is not None:
            debug.close()
    return result


# ---- one derivation per probe or family -------------------------------------


def _no_debug(name: str, needs: str, plan_: DerivedPlan) -> DerivedProbe:
    return DerivedProbe(
        name, UNAVAILABLE, "", needs, f"needs the debug file: {plan_.debug_problem}"
    )


def _sbrk(d: _Deriver, p: DerivedPlan) -> list[DerivedProbe]:
    where = "brk system calls of the process (sys_enter_brk, sys_exit_brk)"
    caveat = (
        "also counts brk calls the program makes itself, outside malloc; the first "
        "growth after tracing starts with --all is not seen (the old break is unknown)"
    )
    return [
        DerivedProbe(
            "memory_sbrk_more",
            EXACT,
            SYSCALL,
            f"{where}: the break grew, or a growth failed",
            caveat,
            syscall_args=(
                _syscall_arg("brk", False, "old break (NULL when the brk call failed)"),
                _syscall_arg("size", True, "new break - old break (or the size asked)"),
            ),
        ),
        DerivedProbe(
            "memory_sbrk_less",
            EXACT,
            SYSCALL,
            f"{where}: the break shrank",
            caveat,
            syscall_args=(
                _syscall_arg("new_brk", False, "new break"),
                _syscall_arg("extra", True, "old break - new break"),
            ),
        ),
    ]


def _heap_store(d: _Deriver, p: DerivedPlan, name: str, function: str) -> DerivedProbe | None:
    """A heap probe at the one store of heap_info.size in each copy of
    ``function``'s code: h is the store's base register; size the value
    stored, read from h->size itself once the store is done, so that the
    site can move on to an emulated instruction while only h stays intact
    (else the store itself, single-stepped, with size in its source register)."""
    if d.debug is None:
        return None
    copies = d.debug.function_code(function)
    sites = []
    offset = p.heap_info["size"]
    for code in copies:
        stores = _stores(d, code, displacement=offset)
        fn = d.containing(stores[0][0].address) if len(stores) == 1 else None
        if fn is None:
            return None
        insn, base, source = stores[0]
        what = f"the store to h->size in {code.describe()}"
        h = DerivedArg("h", _reg(base), f"%{base} (base of the store)")
        after = DerivedArg(
            "size",
            ArgLocation(ArgKind.DEREF_REG, 8, False, reg=REGISTERS[base][0], value=offset),
            f"{offset}(%{base}) (h->size, once stored)",
        )
        site = d.site(fn, insn.address, what, (h, after), {base})
        if not site.emulated or site.address == insn.address:
            stored = DerivedArg("size", _reg(source), f"%{source} (the value stored)")
            site = d.site(fn, insn.address, what, (h, stored), {base, source})
        sites.append(site)
    if not sites:
        return None
    return DerivedProbe(
        name, EXACT, DEBUG, f"the store to heap_info.size in {function}", sites=tuple(sites)
    )


def _code(d: _Deriver, code: Code) -> list[capstone.CsInsn]:
    """The instructions of one copy of a function's code, range by range."""
    return [
        insn
        for begin, end in code.ranges
        for insn in disassemble(code_at(d.elf, begin, end)[0], begin)
    ]


def _register_stores(
    d: _Deriver, code: Code
) -> Iterator[tuple[capstone.CsInsn, x86.X86OpMem, str]]:
    """Each 8-byte ``mov %reg, memory`` in ``code``: the instruction, its
    memory operand, and the register stored."""
    for insn in _code(d, code):
        if insn.mnemonic != "mov" or len(insn.operands) != 2:
            continue
        dst, src = insn.operands
        if dst.type == x86.X86_OP_MEM and src.type == x86.X86_OP_REG and dst.size == 8:
            yield insn, dst.mem, insn.reg_name(src.reg)


def _stores(d: _Deriver, code: Code, displacement: int) -> list[tuple[capstone.CsInsn, str, str]]:
    """Stores ``mov %src, disp(%base)`` of 8 bytes inside ``code``, with the
    base and source registers; not to the stack."""
    return [
        (insn, insn.reg_name(memory.base), source)
        for insn, memory, source in _register_stores(d, code)
        if memory.disp == displacement
        and memory.index == 0
        and memory.segment == 0
        and memory.base not in (0, x86.X86_REG_RIP, x86.X86_REG_RSP)
    ]


def _heaps(d: _Deriver, p: DerivedPlan) -> list[DerivedProbe]:
    mask = f"{HEAP_MAX_SIZE >> 20} MiB"
    size_at = f"heap_info.size at +{p.heap_info['size']}"
    layout = "debug info" if d.debug is not None else "glibc's layout since 2.26 (no debug file)"

    def heap_args(first: str, second: str) -> tuple[DerivedArg, ...]:
        return (_syscall_arg(first, False, "the heap"), _syscall_arg("size", False, second))

    syscall = {
        "memory_heap_new": DerivedProbe(
            "memory_heap_new",
            EXACT,
            SYSCALL,
            f"mprotect(PROT_READ|PROT_WRITE) at a {mask}-aligned address, by a thread whose "
            f"last heap reservation (mmap PROT_NONE, MAP_NORESERVE, {mask} or twice that) "
            "awaits it: (start, len)",
            "a heap reserved before the trace started, and opened after it, is not seen",
            syscall_args=heap_args("h", "len"),
        ),
        "memory_heap_more": DerivedProbe(
            "memory_heap_more",
            APPROXIMATE,
            SYSCALL,
            f"mprotect(PROT_READ|PROT_WRITE) of a heap from its heap_info.mprotect_size on: "
            f"(heap, end - heap); layout from {layout}",
            "a growth into space released by an earlier shrink needs no mprotect and is not seen",
            syscall_args=heap_args("h", "end of the range - heap"),
        ),
        "memory_heap_less": DerivedProbe(
            "memory_heap_less",
            EXACT,
            SYSCALL,
            f"madvise(MADV_DONTNEED) of a heap's top, up to its {size_at}: (heap, start - heap); "
            f"layout from {layout}",
            "with vm.overcommit_memory=2 glibc shrinks heaps with mmap instead: not seen",
            syscall_args=heap_args("h", "start - heap"),
        ),
    }
    found = []
    # alloc_new_heap writes h->size with a vector store (two fields at once) in
    # glibc 2.36: a new heap is its mprotect, which is exact.
    found = [syscall["memory_heap_new"]]
    for name, function in (("memory_heap_more", "grow_heap"), ("memory_heap_less", "shrink_heap")):
        found.append(_heap_store(d, p, name, function) or syscall[name])
    found.append(
        DerivedProbe(
            "memory_heap_free",
            EXACT,
            SYSCALL,
            f"munmap of {mask} at a {mask}-aligned address whose header is readable: "
            f"(heap, {size_at}); layout from {layout}",
            syscall_args=heap_args("heap", "heap_info.size read before the unmap"),
        )
    )
    return found


def _entry_probe(
    d: _Deriver, name: str, function: str, args: Sequence[tuple[str, str, int, bool]], why: str
) -> DerivedProbe:
    """A probe at an exported function's entry, its arguments in the
    calling convention's registers: (name, register, size, signed)."""
    fn = d.function(function)
    if fn is None:
        return DerivedProbe(name, UNAVAILABLE, "", "", f"{d.libc} exports no {function}")
    derived = [
        DerivedArg(n, _reg(r, size, signed), f"%{r} (calling convention)")
        for n, r, size, signed in args
    ]
    site = d.site(fn, fn.start, f"the entry of {function}", derived, [r for _, r, _, _ in args])
    return DerivedProbe(name, EXACT, SYMBOL, f"the exported {function}: {why}", sites=(site,))


def _mallopt_probes(d: _Deriver, p: DerivedPlan) -> list[DerivedProbe]:
    return [
        _entry_probe(
            d,
            "memory_mallopt",
            "mallopt",
            [("param_number", "rdi", 4, True), ("value", "rsi", 4, True)],
            "every call, with its two int arguments",
        )
    ]


def _lock_wait(d: _Deriver, p: DerivedPlan) -> list[DerivedProbe]:
    name, function = "lll_lock_wait_private", "__lll_lock_wait_private"
    fn = d.function(function)
    if fn is None:
        return [DerivedProbe(name, UNAVAILABLE, "", "", f"{d.libc} exports no {function}")]
    calls = [i for i, insn in enumerate(fn.insns) if insn.mnemonic == "syscall"]
    if len(calls) != 1 or any("rdi" in written(fn.insns[i]) for i in range(calls[0])):
        return [
            DerivedProbe(
                name,
                UNAVAILABLE,
                "",
                "",
                f"{function} does not have one futex system call with its argument kept in %rdi",
            )
        ]
    # The start of the block that ends in the futex call: where the wait loop
    # goes back to, once per sleep.
    head = calls[0]
    while (
        head > 0
        and fn.insns[head].address not in fn.targets
        and not fn.insns[head - 1].mnemonic.startswith("j")
    ):
        head -= 1
    arg = DerivedArg("futex", _reg("rdi"), "%rdi (calling convention, kept)")
    site = d.site(
        fn,
        fn.insns[head].address,
        "the start of the block ending in the futex call",
        [arg],
        ["rdi"],
    )
    return [
        DerivedProbe(
            name,
            EXACT,
            SYMBOL,
            f"the exported {function}: once per futex sleep of its wait loop",
            sites=(site,),
        )
    ]


def _arenas(d: _Deriver, p: DerivedPlan) -> list[DerivedProbe]:
    """memory_arena_new, _reuse and _reuse_free_list: each function's one
    store to the thread-local thread_arena, whose value is the arena."""
    wanted = (
        ("memory_arena_new", "_int_new_arena", ("a", "size"), "size"),
        ("memory_arena_reuse", "reused_arena", ("result", "avoid_arena"), "avoid_arena"),
        ("memory_arena_reuse_free_list", "get_free_list", ("result",), None),
    )
    found = []
    for name, function, names, parameter in wanted:
        if d.debug is None:
            found.append(_no_debug(name, f"the store to thread_arena in {function}", p))
            continue
        copies = d.debug.function_code(function)
        sites = []
        for code in copies:
            stores = _tls_stores(d, code)
            fn = d.containing(stores[0][0].address) if len(stores) == 1 else None
            if fn is None:
                continue
            insn, source = stores[0]
            args = [DerivedArg(names[0], _reg(source), f"%{source} (the value stored)")]
            if parameter is not None:
                args.append(_parameter(d.debug, code, parameter, insn.address))
            what = f"the store to thread_arena in {code.describe()}"
            sites.append(d.site(fn, insn.address, what, args, _registers(args)))
        if not copies or len(sites) != len(copies):
            why = f"{function}'s code has no single store to thread_arena"
            found.append(DerivedProbe(name, UNAVAILABLE, "", "", why))
            continue
        found.append(_debug_probe(name, f"the store to thread_arena in {function}", sites))
    return found


def _reuse_wait(d: _Deriver, p: DerivedPlan) -> list[DerivedProbe]:
    """memory_arena_reuse_wait: in reused_arena's code, the lock of the
    chosen arena that the trylock loop could not take: the `lock cmpxchg` on
    the register whose value the slow path hands to __lll_lock_wait_private
    (the free-list lock's is a global, loaded rip-relative)."""
    name = "memory_arena_reuse_wait"
    if d.debug is None:
        return [_no_debug(name, "the arena lock in reused_arena", p)]
    wait = d.dynamic.get("__lll_lock_wait_private")
    if wait is None or d.debug.member_offset("malloc_state", "mutex") != 0:
        why = "no __lll_lock_wait_private, or the arena's mutex is not its first member"
        return [DerivedProbe(name, UNAVAILABLE, "", "", why)]
    copies = d.debug.function_code("reused_arena")
    sites = []
    for code in copies:
        locked = _arena_lock(_code(d, code), wait[0])
        fn = d.containing(locked[0].address) if locked else None
        if locked is None or fn is None:
            continue
        insn, register = locked
        args = [
            DerivedArg("mutex", _reg(register), f"%{register} (the lock's address)"),
            DerivedArg("result", _reg(register), f"%{register} (the arena: its mutex is first)"),
            _parameter(d.debug, code, "avoid_arena", insn.address),
        ]
        anchor = f"the lock of the chosen arena in {code.describe()}"
        sites.append(d.site(fn, insn.address, anchor, args, _registers(args)))
    if not copies or len(sites) != len(copies):
        why = "reused_arena's code has no lock of an arena with a slow path"
        return [DerivedProbe(name, UNAVAILABLE, "", "", why)]
    return [_debug_probe(name, "the lock of the arena reused_arena waits for", sites)]


def _arena_lock(insns: list[capstone.CsInsn], wait: int) -> tuple[capstone.CsInsn, str] | None:
    """The `lock cmpxchg` on (%reg) whose slow path calls ``wait`` with
    %rdi = %reg, and reg's name."""
    for i, insn in enumerate(insns):
        target = insn.operands[0] if insn.mnemonic == "call" and insn.operands else None
        if target is None or target.type != x86.X86_OP_IMM or target.imm != wait:
            continue
        moves = [
            m
            for m in insns[max(0, i - 3) : i]
            if m.mnemonic == "mov"
            and len(m.operands) == 2
            and m.operands[0].type == x86.X86_OP_REG
            and m.reg_name(m.operands[0].reg) == "rdi"
            and m.operands[1].type == x86.X86_OP_REG
        ]
        if not moves:
            continue
        register = moves[-1].reg_name(moves[-1].operands[1].reg)
        for back in reversed(insns[:i]):
            if (
                "cmpxchg" in back.mnemonic
                and back.operands
                and back.operands[0].type == x86.X86_OP_MEM
            ):
                memory = back.operands[0].mem
                if back.reg_name(memory.base) == register and memory.disp == 0:
                    return back, register
                break
    return None


def _tls_stores(d: _Deriver, code: Code) -> list[tuple[capstone.CsInsn, str]]:
    """Stores of a register to thread-local memory (%fs) inside ``code``."""
    return [
        (insn, source)
        for insn, memory, source in _register_stores(d, code)
        if memory.segment == x86.X86_REG_FS
    ]


_RETRY_CALLERS = (
    ("memory_malloc_retry", "__libc_malloc", (("bytes", "bytes"),)),
    ("memory_calloc_retry", "__libc_calloc", (("sz", "bytes"),)),
    ("memory_memalign_retry", "_mid_memalign", (("bytes", "bytes"), ("alignment", None))),
)


def _retries(d: _Deriver, p: DerivedPlan) -> list[DerivedProbe]:
    """memory_arena_retry at arena_get_retry's entry; the per-function retry
    probes at each call of arena_get_retry from that function."""
    names = ["memory_arena_retry", *(c[0] for c in _RETRY_CALLERS)]
    if d.debug is None:
        return [_no_debug(n, "arena_get_retry and its callers", p) for n in names]
    retry = d.function("arena_get_retry")
    copies = d.debug.function_code("arena_get_retry")
    whole = [c for c in copies if c.inlined_in is None]
    if (
        retry is None
        or len(whole) != 1
        or any(c.inlined_in not in (None, "arena_get_retry") for c in copies)
    ):
        why = "arena_get_retry is inlined (or absent) in this build"
        return [DerivedProbe(n, UNAVAILABLE, "", "", why) for n in names]
    registers = {q: d.debug.parameter_register(whole[0], q, retry.start)
                 for q in ("bytes", "ar_ptr")}  # fmt: skip
    if None in registers.values():
        why = "arena_get_retry's parameters have no register location at its entry"
        return [DerivedProbe(n, UNAVAILABLE, "", "", why) for n in names]
    by = {q: DerivedArg(q, _reg(r), f"%{r} (DWARF location at entry)")
          for q, r in registers.items() if r is not None}  # fmt: skip
    used = {r for r in registers.values() if r is not None}
    entry = d.site(retry, retry.start, "the entry of arena_get_retry",
                   (by["bytes"], by["ar_ptr"]), used)  # fmt: skip
    found = [DerivedProbe("memory_arena_retry", EXACT, DEBUG,
                          "the entry of arena_get_retry (bytes, ar_ptr by DWARF)",
                          sites=(entry,))]  # fmt: skip
    for name, caller, args in _RETRY_CALLERS:
        found.append(_retry_caller(d, retry, registers, name, caller, args))
    return found


def _retry_caller(
    d: _Deriver, retry: _Function, registers: dict[str, str | None], name: str, caller: str,
    args: tuple[tuple[str, str | None], ...],
) -> DerivedProbe:  # fmt: skip
    """The retry probe of one caller: a site at each of its calls of
    arena_get_retry, each argument the callee's parameter register or the
    caller's own parameter."""
    assert d.debug is not None
    calls = []
    for caller_code in d.debug.function_code(caller):
        for insn in _code(d, caller_code):
            operand = insn.operands[0] if insn.operands else None
            if (
                insn.mnemonic in ("call", "jmp")
                and operand is not None
                and operand.type == x86.X86_OP_IMM
                and operand.imm == retry.start
            ):
                calls.append((insn, caller_code))
    if not calls:
        return DerivedProbe(
            name, UNAVAILABLE, "", "", f"no call of arena_get_retry found in {caller}"
        )
    sites = []
    for call, caller_code in calls:
        derived = []
        for arg_name, callee_param in args:
            if callee_param is None:  # the caller's own parameter
                derived.append(_parameter(d.debug, caller_code, arg_name, call.address))
                continue
            register = registers[callee_param] or ""
            text = f"%{register} (arena_get_retry's {callee_param})"
            derived.append(DerivedArg(arg_name, _reg(register), text))
        fn = d.containing(call.address)
        if fn is None:
            continue
        what = f"the call of arena_get_retry in {caller}"
        sites.append(d.site(fn, call.address, what, derived, _registers(derived)))
    return _debug_probe(name, f"the call of arena_get_retry in {caller}", sites)


# The SDT probes with no equivalent here, and why.
_UNAVAILABLE = {
    "memory_realloc_retry": "its retry is a call of malloc from realloc, not told apart from "
    "realloc's other calls of malloc",
    "memory_tcache_double_free": "a branch inside _int_free with no instruction of its own",
    "memory_mallopt_free_dyn_thresholds": "a branch inside free with no instruction of its own",
}
_SETTINGS = (
    "mxfast",
    "trim_threshold",
    "top_pad",
    "mmap_threshold",
    "mmap_max",
    "perturb",
    "arena_test",
    "arena_max",
)
_TUNABLES = ("tcache_max_bytes", "tcache_count", "tcache_unsorted_limit")


def _unavailable(d: _Deriver, p: DerivedPlan) -> list[DerivedProbe]:
    found = [DerivedProbe(n, UNAVAILABLE, "", "", why) for n, why in _UNAVAILABLE.items()]
    for setting in _SETTINGS:
        found.append(
            DerivedProbe(
                f"memory_mallopt_{setting}",
                UNAVAILABLE,
                "",
                "",
                "the do_set_* functions are inlined into mallopt and the "
                "tunables' start-up; memory_mallopt gives the parameter and value",
            )
        )
    for tunable in _TUNABLES:
        found.append(
            DerivedProbe(
                f"memory_tunable_{tunable}",
                UNAVAILABLE,
                "",
                "",
                "applied once at start-up, inlined into ptmalloc_init",
            )
        )
    return found


_DERIVATIONS = (
    _sbrk,
    _heaps,
    _arenas,
    _reuse_wait,
    _retries,
    _mallopt_probes,
    _lock_wait,
    _unavailable,
)


def plan_document(plan_: DerivedPlan) -> dict[str, object]:
    """``plan_`` as JSON-ready data (``plan_from_document`` reads it back)."""
    document = asdict(plan_)
    document["libc"] = str(plan_.libc)
    document["debug_file"] = str(plan_.debug_file) if plan_.debug_file is not None else None
    return document


def plan_from_document(document: dict[str, Any]) -> DerivedPlan:
    """The plan ``plan_document`` wrote; KeyError, TypeError or ValueError
    where the data is not one."""

    def arg(data: dict[str, Any]) -> DerivedArg:
        location = dict(data["location"])
        location["kind"] = ArgKind(location["kind"])
        return DerivedArg(str(data["name"]), ArgLocation(**location), str(data["text"]))

    def site(data: dict[str, Any]) -> DerivedSite:
        return DerivedSite(**{**data, "args": tuple(arg(a) for a in data["args"])})

    def probe(data: dict[str, Any]) -> DerivedProbe:
        sites = tuple(site(s) for s in data["sites"])
        syscall_args = tuple(arg(a) for a in data["syscall_args"])
        return DerivedProbe(**{**data, "sites": sites, "syscall_args": syscall_args})

    debug = document["debug_file"]
    return DerivedPlan(
        libc=Path(document["libc"]),
        debug_file=Path(debug) if debug is not None else None,
        debug_problem=str(document["debug_problem"]),
        probes={str(name): probe(data) for name, data in document["probes"].items()},
        heap_info={str(k): int(v) for k, v in document["heap_info"].items()},
        main_arena=None if document["main_arena"] is None else int(document["main_arena"]),
    )
