"""``mtrace-live doctor``: can a trace of this target work here, and if not, why.

Each check gives one line. A failed check says how to fix it, and is either
"not permitted" (exit 3) or "not supported here" (exit 8). A source that the
target's libc lacks but a trace does without (its SDT notes, its debug file)
is "unavailable": said, with what it would add and how to get it, and not a
failure.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from mtrace_live.probes.catalog import Catalog
from mtrace_live.probes.errors import (
    MtraceError,
    NotPrivilegedError,
    TracepointMissingError,
)
from mtrace_live.probes.listing import no_probes_error
from mtrace_live.probes.sdt_notes import read_sites
from mtrace_live.tracer.bpf import bpf_backend, privileges, tracefs, uprobe_multi
from mtrace_live.tracer.bpf.kmem_attach import kmem_attach
from mtrace_live.tracer.bpf.tracefs import kmem_defines, parse_format

OK, NOT_PERMITTED, NOT_SUPPORTED = "ok", "not permitted", "not supported"
UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str

    @property
    def passed(self) -> bool:
        return self.status in (OK, UNAVAILABLE)

    def __str__(self) -> str:
        mark = "ok  " if self.status == OK else ("--  " if self.passed else "FAIL")
        return f"{mark}  {self.name}: {self.detail}"


def run_checks(libc: Path, catalog: Catalog) -> Iterator[Check]:
    yield _privileges()
    yield _kernel_support()
    yield _guarded("tracefs", lambda: f"mounted at {tracefs.tracefs_root()}")
    yield _headers()
    yield _guarded("bcc", _bcc)
    yield _alloc_functions(libc)
    yield _libc_notes(libc, catalog)
    yield _debug_file(libc)
    yield _derived_probes(libc)
    yield _lock_times(libc)
    for tracepoint in catalog.tracepoints.values():
        yield _tracepoint_check(tracepoint.category, tracepoint.name,
                          [f.name for f in tracepoint.fields if f.required])  # fmt: skip
    yield _raw_tracepoints()
    yield _uprobe_attach()


def exit_code(checks: list[Check]) -> int:
    if all(c.passed for c in checks):
        return 0
    if any(c.status == NOT_PERMITTED for c in checks):
        return NotPrivilegedError.exit_code
    return TracepointMissingError.exit_code  # "not supported here"


def _guarded(name: str, probe: Callable[[], str]) -> Check:
    try:
        return Check(name, OK, probe())
    except NotPrivilegedError as exc:
        return Check(name, NOT_PERMITTED, str(exc))
    except MtraceError as exc:
        return Check(name, NOT_SUPPORTED, str(exc))


def _privileges() -> Check:
    problem = privileges.privilege_problem()
    if problem:
        return Check("privileges", NOT_PERMITTED, problem)
    return Check("privileges", OK, "root" if os.geteuid() == 0 else "CAP_BPF and CAP_PERFMON")


def _kernel_support() -> Check:
    # Each file exists only when the kernel was built with the feature.
    needs = {
        "BPF (CONFIG_BPF_SYSCALL)": Path("/proc/sys/kernel/unprivileged_bpf_disabled"),
        "uprobes (CONFIG_UPROBE_EVENTS)": Path("/sys/bus/event_source/devices/uprobe"),
        "tracepoints (CONFIG_TRACEPOINTS)": Path("/sys/bus/event_source/devices/tracepoint"),
    }
    missing = [what for what, path in needs.items() if not path.exists()]
    release = platform.release()
    if missing:
        lacks = ", ".join(missing)
        return Check(
            "kernel", NOT_SUPPORTED, f"Linux {release} lacks {lacks}; use one built with them"
        )
    return Check("kernel", OK, f"Linux {release} has BPF, uprobes and tracepoints")


def _uprobe_attach() -> Check:
    """How a trace attaches its uprobes (tracer/bpf/uprobe_multi.py)."""
    name = "uprobe attach"
    why = uprobe_multi.why_not()
    if why is None:
        return Check(name, OK, "in BPF links (uprobe_multi), one per handler and file, made and "
                               "closed in one call each")  # fmt: skip
    return Check(name, UNAVAILABLE, f"one perf event per uprobe, each closed under the kernel's "
                                    f"event_mutex: no uprobe_multi links ({why})")  # fmt: skip


def _headers() -> Check:
    build = Path("/lib/modules") / platform.release() / "build"
    if (build / "include").is_dir():
        return Check("kernel headers", OK, f"{build} -> {build.resolve()}")
    return Check("kernel headers", NOT_SUPPORTED,
                 f"bcc needs headers at {build}; run scripts/setup.sh (it links the newest "
                 "headers package when the running kernel has none)")  # fmt: skip


def _bcc() -> str:
    bcc = bpf_backend.import_bcc()
    return f"bcc importable from {Path(bcc.__file__).parent}"


def _libc_notes(libc: Path, catalog: Catalog) -> Check:
    name = "libc probes"
    try:
        sites = read_sites(libc)
    except MtraceError as exc:
        return Check(name, NOT_SUPPORTED, str(exc))
    ours = [s for s in sites if s.provider == "libc"]
    if not ours:
        return Check(name, UNAVAILABLE, f"{no_probes_error(libc)}; the allocation functions are "
                     "traced without them, and the memory_* probes are derived (see 'derived "
                     "probes')")  # fmt: skip
    known = sum(1 for n in {s.name for s in ours} if catalog.probe("libc", n))
    return Check(name, OK, f"{libc}: {len({s.name for s in ours})} probes at {len(ours)} sites, "
                           f"{known} in the catalog")  # fmt: skip


def _alloc_functions(libc: Path) -> Check:
    """The allocation functions: exported, and where each probe sits."""
    from mtrace_live.tracer.loop.alloc_probes import plan_sites

    name = "allocation functions"
    try:
        chosen = plan_sites(libc)
    except (OSError, ValueError, MtraceError) as exc:
        return Check(name, NOT_SUPPORTED, f"{libc}: cannot read its functions: {exc}")
    if not chosen.sites:
        return Check(name, NOT_SUPPORTED, f"{libc} exports none of malloc, free & co")
    stepped = chosen.stepped
    sites = ", ".join(f"{n}+{s.offset}" for n, s in chosen.sites.items())
    slow = f"; single-stepped (slow): {', '.join(stepped)}" if stepped else ""
    return Check(name, OK, f"{len(chosen.sites)} probed at {sites}{slow} "
                           "('mtrace-live probes' shows each instruction)")  # fmt: skip


def _debug_file(libc: Path) -> Check:
    """Names of frames inside the libc: its own symbols, or a debug file."""
    from mtrace_live.exporters.data.symbolize import module_symbols

    name = "libc debug info"
    symbols = module_symbols(libc)
    if symbols.has_lines:
        return Check(name, OK, f"functions and lines inside {libc.name} are named "
                               f"({symbols.source})")  # fmt: skip
    return Check(name, UNAVAILABLE, f"{libc} has no line tables or full symbol table, and no "
                 f"debug file by build-id {symbols.build_id or '?'} was found: frames inside "
                 "it show as addresses; install its debug package (Debian: libc6-dbg)")  # fmt: skip


def _derived_probes(libc: Path) -> Check:
    """What the derived memory_* probes can rebuild for this libc, and the
    package that provides its debug file."""
    from mtrace_live.probes.derived import APPROXIMATE, EXACT, plan
    from mtrace_live.probes.errors import DebugInfoError, NotGlibcError

    name = "derived probes"
    try:
        derived = plan(libc)
    except (OSError, ValueError, MtraceError, DebugInfoError, NotGlibcError) as exc:
        return Check(name, NOT_SUPPORTED, f"{libc}: {exc}")
    count = {status: sum(1 for p in derived.probes.values() if p.status == status)
             for status in (EXACT, APPROXIMATE)}  # fmt: skip
    summary = (f"{count[EXACT]} exact, {count[APPROXIMATE]} approximate, "
               f"{len(derived.probes) - sum(count.values())} unavailable "
               "('mtrace-live probes --derived' says why)")  # fmt: skip
    if derived.debug_file is None:
        return Check(name, UNAVAILABLE, f"{summary}; {derived.debug_problem}; the package that "
                     f"provides it: {debug_package(libc)}")  # fmt: skip
    return Check(name, OK, f"{summary}; debug file {derived.debug_file}, from "
                           f"{debug_package(derived.debug_file)}")  # fmt: skip


def _lock_times(libc: Path) -> Check:
    """Whether lock waits can be timed, and told to be on arenas."""
    from mtrace_live.tracer.loop.lock_waits import timing_report

    report = timing_report(libc)
    return Check("lock wait times", OK if report.timed and report.arenas_told else UNAVAILABLE,
                 report.text)  # fmt: skip


def debug_package(path: Path) -> str:
    """The Debian package that owns ``path`` (dpkg -S), or that would
    provide a libc's debug file (the libc's package name with -dbg)."""
    import subprocess

    def owner(file: Path) -> str | None:
        try:
            done = subprocess.run(["dpkg-query", "-S", str(file)], capture_output=True,
                                  text=True, timeout=10)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode != 0 or ":" not in done.stdout:
            return None
        return done.stdout.split(":", 1)[0].strip()

    found = owner(path) or owner(path.resolve())
    if found is None:
        return "none installed (not a Debian package file)"
    if path.suffix == ".debug" or "/usr/lib/debug/" in str(path):
        return f"package {found}"
    return f"package {found.split(':')[0]}-dbg (apt-get install {found.split(':')[0]}-dbg)"


def _tracepoint_check(category: str, event: str, required: list[str]) -> Check:
    name = f"tracepoint {category}:{event}"
    try:
        fmt = tracefs.tracepoint_format(category, event)
    except NotPrivilegedError as exc:
        return Check(name, NOT_PERMITTED, str(exc))
    except MtraceError as exc:
        return Check(name, NOT_SUPPORTED, str(exc))
    fields = parse_format(category, event, fmt).fields
    absent = [f for f in required if f not in fields]
    if absent:
        return Check(name, NOT_SUPPORTED, f"lacks the fields {', '.join(absent)} mtrace-live needs")
    return Check(name, OK, f"has {', '.join(required)}")


def _raw_tracepoints() -> Check:
    """Which kmem tracepoints are attached raw (their offsets from BTF), and
    why the others stay classic."""
    name = "raw kmem tracepoints"
    try:
        plan = kmem_attach(kmem_defines(tracefs.tracepoint_format))
    except NotPrivilegedError as exc:
        return Check(name, NOT_PERMITTED, str(exc))
    except MtraceError as exc:
        return Check(name, UNAVAILABLE, f"classic tracepoints only: {exc}")
    reasons: dict[str, list[str]] = {}
    for event, why in plan.classic.items():
        reasons.setdefault(why, []).append(event)
    classic = "; ".join(f"classic {', '.join(events)} ({why})" for why, events in reasons.items())
    if not plan.raw:
        return Check(name, UNAVAILABLE, classic)
    raw = f"raw {', '.join(plan.raw)} (arguments and struct kmem_cache offsets from BTF)"
    if plan.typed:
        typed = ", ".join(plan.typed)
        raw += f", {typed} BTF-typed (tp_btf: struct kmem_cache read without a copy)"
    return Check(name, OK, f"{raw}; {classic}" if classic else raw)
