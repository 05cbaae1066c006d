"""Choosing libc probe sites and attaching sdt.bpf.c's handlers to them.

One uprobe per SDT site, as bpftrace does: bcc's USDT helper refuses
shared-object probes with several sites unless it is given a pid, and it
cannot read rip-relative operands without one. Site i runs handler site_<i>,
into which its probe slot and argument locations are compiled as constants
(``site_defines``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mtrace_live.exporters.data.events import SiteInfo, site_info
from mtrace_live.probes import derived, sdt_notes
from mtrace_live.probes.catalog import Catalog
from mtrace_live.probes.errors import (
    NoMatchingProbeError,
    NoProbesError,
    UsageError,
)
from mtrace_live.probes.locations import SiteLayout, layout_sites, rip_symbols, symbol_addresses
from mtrace_live.probes.program import part_constants
from mtrace_live.probes.records import MAX_ARGS
from mtrace_live.probes.sdt_notes import SdtSite
from mtrace_live.tracer.bpf.bpf_backend import BpfProgram
from mtrace_live.tracer.loop import plan_cache
from mtrace_live.tracer.processes import sdt_glibc, target
from mtrace_live.tracer.processes.launch import resolve_command

LIBC_PROVIDER = "libc"
# the handlers site_0 ... site_<MAX_SITES - 1> sdt.bpf.c can build, read from the C
MAX_SITES = part_constants("common.bpf.h")["MAX_SITES"]

# The default probe set, chosen by measuring hit rates (docs/performance.md):
# the allocator's own probes and the private-lock wait that arena contention
# goes through fire at most hundreds of times a second even under load, while
# setjmp/longjmp and the pthread mutex probes fire on every call.
DEFAULT_PATTERNS = ("memory_*", "lll_lock_wait_private")

# Symbols the model needs besides the operands', read in the same pass.
SYMBOLS_WANTED = ("main_arena",)


def select_probes(sites: Iterable[SdtSite], patterns: Sequence[str]) -> list[str]:
    """Names of the libc-provider probes matching any glob, in note order, once each."""
    names = dict.fromkeys(site.name for site in sites if site.provider == LIBC_PROVIDER)
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


@dataclass(frozen=True)
class ProbeSelection:
    """The probes chosen in one libc: slot order for probes, index order for sites."""

    libc: Path
    probes: tuple[str, ...]
    layouts: tuple[SiteLayout, ...]
    symbols: Mapping[str, int]  # link-time addresses: the operands' and SYMBOLS_WANTED
    derived: derived.DerivedPlan | None = None  # set when the probes are derived, not SDT

    def site_infos(self, catalog: Catalog) -> list[SiteInfo]:
        return [site_info(lay, catalog.probe(LIBC_PROVIDER, lay.site.name)) for lay in self.layouts]

    def slot(self, name: str) -> int:
        return self.probes.index(name)

    def symbol(self, name: str) -> int | None:
        """Link-time address of one of SYMBOLS_WANTED, e.g. main_arena."""
        return self.symbols.get(name)

    def unreadable(self) -> list[str]:
        """One line per argument the BPF side cannot read, and why."""
        return [
            f"{lay.site.name} at {lay.site.address:#x}: {arg.why}"
            for lay in self.layouts
            for arg in lay.args
            if not arg.readable
        ]


def libc_sites(libc: Path) -> list[SdtSite]:
    sites = sdt_notes.read_sites(libc)
    if not any(site.provider == LIBC_PROVIDER for site in sites):
        raise NoProbesError(
            f"{libc} has no libc SDT probes (glibc built without --enable-systemtap); "
            "build one with 'make sdt-glibc' and use --sdt-glibc or --lib; "
            "'mtrace-live doctor' checks the rest"
        )
    return sites


def choose_sdt(libc: Path, patterns: Sequence[str]) -> ProbeSelection:
    sites = libc_sites(libc)
    probes = select_probes(sites, patterns)
    if not probes:
        raise NoMatchingProbeError(
            f"no libc probe in {libc} matches {', '.join(patterns)}; "
            f"'mtrace-live probes --lib {libc}' lists them"
        )
    chosen = [s for s in sites if s.provider == LIBC_PROVIDER and s.name in probes]
    if len(chosen) > MAX_SITES:
        raise UsageError(
            f"the chosen probes have {len(chosen)} sites; at most {MAX_SITES} can be traced at once"
        )
    symbols = symbol_addresses(libc, rip_symbols(chosen) | set(SYMBOLS_WANTED))
    return ProbeSelection(libc, tuple(probes), tuple(layout_sites(libc, chosen, symbols)), symbols)


def choose_derived(
    libc: Path, patterns: Sequence[str], debug_file: Path | None = None
) -> ProbeSelection:
    """The probes matching ``patterns`` that probes/derived.py can rebuild
    for ``libc``, with their uprobe sites first and one site entry per
    syscall-derived probe after them (never attached)."""
    plan = plan_cache.derived_plan(libc, debug_file)
    names = [n for n in plan.available() if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if not names:
        raise NoMatchingProbeError(
            f"no probe derivable for {libc} matches {', '.join(patterns)}; "
            f"'mtrace-live probes --derived --lib {libc}' lists them"
        )
    layouts = plan.layouts(names)
    if len(layouts) > MAX_SITES:
        raise UsageError(f"the derived probes have {len(layouts)} sites; at most {MAX_SITES}")
    symbols = {"main_arena": plan.main_arena} if plan.main_arena is not None else {}
    return ProbeSelection(libc, tuple(names), tuple(layouts), symbols, plan)


def choose_source(
    libc: Path, patterns: Sequence[str], derive: bool, debug_file: Path | None
) -> ProbeSelection:
    """The SDT probes, or the derived ones: with ``derive``, or when the libc
    has no SDT notes."""
    if not derive:
        try:
            return choose_sdt(libc, patterns)
        except NoProbesError as exc:
            try:
                return choose_derived(libc, patterns, debug_file)
            except NoProbesError as underived:
                raise NoProbesError(f"{exc}; nor can they be derived: {underived}") from None
    return choose_derived(libc, patterns, debug_file)


def derived_defines(selection: ProbeSelection | None) -> dict[str, int]:
    """DERIVED_SYSCALLS and, per syscall-derived probe, its slot (D_<NAME>,
    -1 when not traced) and its site entry (D_<NAME>_SITE); the heap layout."""
    plan = selection.derived if selection is not None else None
    if selection is None or plan is None:
        return {"DERIVED_SYSCALLS": 0}
    traced = {p: i for i, p in enumerate(selection.probes)
              if plan.probes[p].source == derived.SYSCALL}  # fmt: skip
    defines = {
        "DERIVED_SYSCALLS": int(bool(traced)),
        "HEAP_MAX": derived.HEAP_MAX_SIZE,
        "HEAP_SIZE_OFF": plan.heap_info["size"],
        "HEAP_MPROTECT_OFF": plan.heap_info["mprotect_size"],
    }
    for name in derived.SYSCALL_PROBES:
        macro = "D_" + name.removeprefix("memory_").upper()
        defines[macro] = traced.get(name, -1)
        site = [i for i, lay in enumerate(selection.layouts)
                if lay.site.name == name and lay.site.file_offset < 0]  # fmt: skip
        defines[macro + "_SITE"] = site[0] if site else 0
    return defines


def seed_break(program: BpfProgram, selection: ProbeSelection, pid: int) -> None:
    """Tell the BPF side a running process's current break, so that its
    next brk call is compared with it: the end of its [heap] mapping (glibc
    keeps the break page-aligned), else its start_brk."""
    if selection.derived is None or not {"memory_sbrk_more", "memory_sbrk_less"} & set(
        selection.probes
    ):
        return
    current = target.current_break(pid)
    if current is not None:
        program.set_u64("brk_last", pid, current)


def resolve_libc(
    pid: int | None, command: Sequence[str], lib: Path | None, sdt: bool
) -> tuple[Path, list[str] | None]:
    """The libc a trace attaches to, and for a COMMAND the argv to start: the
    SDT build (--sdt-glibc, which wraps the argv), else --lib, else the one
    the pid maps, else the system's."""
    if pid is not None:
        target.require_process(pid)
    argv = list(command) if command else None
    if sdt and argv is not None:
        build = sdt_glibc.locate()
        # The command itself is checked here: once wrapped, the runner is
        # what would be looked for, and a missing command would only fail
        # in the loader, after attaching.
        return build.libc, build.wrap(resolve_command(argv))
    if lib is not None:
        return target.library_file(lib), argv
    if pid is not None:
        return target.mapped_libc(pid), argv
    return target.default_libc(), argv


def handlers_compiled(sites: int) -> int:
    """sdt.bpf.c compiles its site handlers in blocks of ten, up to MAX_SITES."""
    return min(MAX_SITES, -(-sites // 10) * 10)


def site_defines(selection: ProbeSelection | None) -> dict[str, int]:
    """SITE_COUNT, and each compiled handler's probe slot (SP<n>), argument
    count (SN<n>) and argument locations (SA<n>_<i>, SV<n>_<i>; see load_arg
    in sdt.bpf.c). Handlers beyond the sites get zeros: they are compiled
    in a block but never attached."""
    layouts = selection.layouts if selection is not None else []
    slots = {name: slot for slot, name in enumerate(selection.probes)} if selection else {}
    defines = {"SITE_COUNT": len(layouts)}
    for n in range(handlers_compiled(len(layouts))):
        lay = layouts[n] if n < len(layouts) else None
        defines[f"SP{n}"] = slots[lay.site.name] if lay else 0
        defines[f"SN{n}"] = len(lay.args) if lay else 0
        args = list(lay.args[:MAX_ARGS]) if lay else []
        for i in range(MAX_ARGS):
            arg = args[i] if i < len(args) else None
            packed = 0
            if arg is not None:
                packed = int(arg.kind) | arg.size << 8 | int(arg.signed) << 16 | arg.reg << 24
            defines[f"SA{n}_{i}"] = packed
            defines[f"SV{n}_{i}"] = arg.value if arg is not None else 0
    return defines


def attach_sites(program: BpfProgram, selection: ProbeSelection) -> None:
    for index, lay in enumerate(selection.layouts):
        if lay.site.file_offset >= 0:  # < 0: a syscall-derived probe's entry
            program.attach_uprobe(selection.libc, lay.site.file_offset, f"site_{index}")
