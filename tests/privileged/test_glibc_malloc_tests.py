"""glibc 2.36's own malloc tests, each run under ``run --sdt-glibc -o
summary`` as its harness (``make check``) runs it: a public suite no one
here wrote.

Each must end as it ends untraced (the test driver's exit status: 0 PASS,
77 UNSUPPORTED), with no traceback and no event lost, and its allocations,
frees and failed calls must equal bpftrace's in the same run: the outermost
calls of the allocation functions on the SDT libc's path, in the processes
the tracer started (its command, the test driver, and the child it forks).

The uprobes trap at every call: ``TIMEOUTFACTOR`` lengthens the tests' own
time-outs, as glibc's harness allows. ``make test`` runs the base tests that
take little time traced; the others, and every variant of ``make
subdirs=malloc check`` (185 in malloc/ here: the 190 PASS it prints count
5 header checks besides), run in ``make soak``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from mtrace_live.tracer.processes import sdt_glibc

from .conftest import MTRACE
from .tracing import (
    BPFTRACE_READY,
    Reaper,
    interrupt_bpftrace,
    nm_symbols,
    start_bpftrace,
    wait_for_line,
)

# glibc 2.36's malloc/Makefile `tests`, less mallocbug and the variants
# (-mcheck, -malloc-check, -malloc-hugetlb1/2), the static ones (their
# malloc is not the libc's) and those added on conditions: 35 base tests.
BASE_TESTS = (
    "tst-malloc", "tst-valloc", "tst-calloc", "tst-obstack", "tst-malloc-check",
    "tst-mallocfork", "tst-trim1", "tst-malloc-usable", "tst-realloc", "tst-reallocarray",
    "tst-posix_memalign", "tst-pvalloc", "tst-pvalloc-fortify", "tst-memalign", "tst-mallopt",
    "tst-malloc-backtrace", "tst-malloc-thread-exit", "tst-malloc-thread-fail",
    "tst-malloc-fork-deadlock", "tst-mallocfork2", "tst-mallocfork3", "tst-interpose-nothread",
    "tst-interpose-thread", "tst-alloc_buffer", "tst-free-errno", "tst-malloc-tcache-leak",
    "tst-malloc_info", "tst-mallinfo2", "tst-malloc-too-large", "tst-malloc-stats-cancellation",
    "tst-tcfree1", "tst-tcfree2", "tst-tcfree3", "tst-safe-linking", "tst-mallocalign1",
)  # fmt: skip
# make soak's share of them: those that take seconds even untraced
# (threads, forks, memory exhausted) or long traced. Measured here, traced:
# tst-malloc-thread-fail 112 s, tst-malloc-tcache-leak 97 s, tst-mallocfork2
# 30 s, tst-mallocfork3 19 s, tst-malloc-fork-deadlock 6 s (3 s untraced),
# tst-free-errno and tst-malloc-thread-exit 5 s (1 and 3 s untraced);
# tst-malloc_info holds 524,288 blocks at once (30 s traced in the issue) and
# tst-malloc-too-large exhausts memory (12 s untraced). The other 26 took
# 1.1 to 6.6 s each traced, most of it the tracer's start: about 50 s in all
# on a quiet 2-CPU machine (3 to 13 s each when it ran 12 processes at once).
SOAKED = ("tst-malloc-thread-exit", "tst-malloc-thread-fail", "tst-malloc-fork-deadlock",
          "tst-mallocfork2", "tst-mallocfork3", "tst-free-errno", "tst-malloc-tcache-leak",
          "tst-malloc_info", "tst-malloc-too-large")  # fmt: skip
QUICK = tuple(name for name in BASE_TESTS if name not in SOAKED)
STATIC = {"tst-interpose-static-nothread", "tst-interpose-static-thread"}
# Run by this harness (MALLOC_TRACE=/dev/null, libc_malloc_debug.so
# preloaded), tst-mtrace aborts untraced too ("Didn't expect signal from
# child: got `Aborted'", traced the same, its counts bpftrace's); make
# check's verdict is its script's (tst-mtrace.sh, the trace written to a
# file and read back). Left out until it is run as the script runs it.
SCRIPTED = {"tst-mtrace"}
# The uprobes' cost against the tests' own time-outs (support/test-driver.c):
# tst-malloc-too-large-malloc-hugetlb2 took over 400 s traced (20 x its
# 20 s) while a glibc build ran beside it.
TIMEOUTFACTOR = "40"
# What the allocation functions are on the libc, for bpftrace: which
# argument of a realloc is the old block, and how a request of 0 bytes
# reads (glibc frees the block then); posix_memalign succeeds by returning 0.
REALLOCS = {"realloc": ("arg0", "arg1 == 0"), "reallocarray": ("arg0", "arg1 == 0 || arg2 == 0")}
ALLOCATING = ("malloc", "calloc", "realloc", "reallocarray", "memalign", "posix_memalign",
              "aligned_alloc", "valloc", "pvalloc")  # fmt: skip
SUMMARY_LINE = re.compile(
    r"^allocations: pid (\d+): (\d+) calls, .*?; (\d+) frees.*?; (\d+) failed;"
)


@dataclass(frozen=True)
class Build:
    """The SDT glibc's build tree and how its harness runs a test there."""

    root: Path

    @property
    def malloc(self) -> Path:
        return self.root / "malloc"

    def harness_argv(self, program: str, env: dict[str, str]) -> list[str]:
        """As ``make check`` runs a test (Makeconfig's run-program-env and
        rtld-prefix, then the test's own -ENV), with ``TIMEOUTFACTOR``."""
        rpath = ":".join([str(self.root), *(str(self.root / d) for d in (
            "math", "elf", "dlfcn", "nss", "nis", "rt", "resolv", "mathvec", "support", "crypt",
            "nptl"))])  # fmt: skip
        return ["/usr/bin/env", f"GCONV_PATH={self.root / 'iconvdata'}",
                f"LOCPATH={self.root / 'localedata'}", "LC_ALL=C",
                f"TIMEOUTFACTOR={TIMEOUTFACTOR}", *(f"{k}={v}" for k, v in env.items()),
                str(self.root / "elf" / "ld-linux-x86-64.so.2"), "--library-path", rpath,
                str(self.malloc / program)]  # fmt: skip

    def test_env(self, name: str) -> dict[str, str]:
        """malloc/Makefile's -ENV of a test, and Rules' of its variant."""
        debug = str(self.malloc / "libc_malloc_debug.so")
        if name.endswith("-malloc-check"):
            return {"MALLOC_CHECK_": "3", "LD_PRELOAD": debug}
        if name.endswith("-mcheck"):
            return {"LD_PRELOAD": debug}
        for level in ("1", "2"):
            if name.endswith(f"-malloc-hugetlb{level}"):
                return {"GLIBC_TUNABLES": f"glibc.malloc.hugetlb={level}"}
        own = {
            "tst-malloc-check": {"MALLOC_CHECK_": "3", "LD_PRELOAD": debug},
            "tst-malloc-usable": {"MALLOC_CHECK_": "3", "LD_PRELOAD": debug},
            "tst-malloc-usable-tunables": {"GLIBC_TUNABLES": "glibc.malloc.check=3",
                                           "LD_PRELOAD": debug},
            "tst-mxfast": {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0:glibc.malloc.mxfast=0"},
            "tst-compathooks-on": {"LD_PRELOAD": debug},
            "tst-mallocstate": {"LD_PRELOAD": debug},
            "tst-dynarray": {"MALLOC_TRACE": "/dev/null", "LD_PRELOAD": debug},
            "tst-dynarray-fail": {"MALLOC_TRACE": "/dev/null", "LD_PRELOAD": debug},
            "tst-mtrace": {"MALLOC_TRACE": "/dev/null", "LD_PRELOAD": debug},
        }  # fmt: skip
        return own.get(name, {})


@dataclass(frozen=True)
class Outcome:
    untraced: int  # the test's exit status untraced
    traced: int | None  # ... under the trace, as its summary says
    tracer: int  # mtrace-live's exit status
    summary: str
    stderr: str
    ours: tuple[int, int, int]  # allocations, frees, failed: the summary's, every process summed
    theirs: tuple[int, int, int]  # ... bpftrace's


def counting_script(libc: Path) -> str:
    """bpftrace counting, per process tree started by the test (``$1``: this
    pytest; each of its children is a root), the outermost calls of the
    allocation functions on ``libc`` that returned a block (``@ok``) or
    failed (``@failed``), and the blocks freed: by free, and by a realloc
    that succeeded or was asked for 0 bytes (``@frees``)."""
    functions = [f for f in ALLOCATING if f not in one_alias_each(libc)]
    lines = [
        "tracepoint:sched:sched_process_fork /pid == $1/ "
        "{ @root[args->child_pid] = args->child_pid; }",
        "tracepoint:sched:sched_process_fork /pid != $1 && @root[pid]/ "
        "{ @root[args->child_pid] = @root[pid]; }",
        # a thread's state goes with it: bpftrace's maps hold 4,096 keys, and
        # tst-malloc-thread-fail alone starts thousands of threads
        "tracepoint:sched:sched_process_exit { delete(@root[tid]); delete(@depth[tid]); "
        "delete(@old[tid]); delete(@zero[tid]); delete(@inner[tid]); }",
    ]
    for fn in functions:
        old, zero = REALLOCS.get(fn, ("0", "0"))
        lines.append(
            f"uprobe:{libc}:{fn} /@root[pid]/ {{ if (@depth[tid] == 0) {{ "
            f"@old[tid] = {old}; @zero[tid] = {zero}; @inner[tid] = 0; }} @depth[tid]++; }}"
        )
        ok = "retval == 0" if fn == "posix_memalign" else "retval != 0"
        release = ("if (@old[tid] != 0 && (retval != 0 || @zero[tid])) "
                   "{ @frees[@root[pid]] = count(); } " if fn in REALLOCS else "")  # fmt: skip
        nothing = "!(retval == 0 && @zero[tid])" if fn in REALLOCS else "1"
        if fn == "reallocarray":
            release += ("if (retval == 0 && !@zero[tid] && !@inner[tid]) "
                        "{ @unseen[@root[pid]] = count(); } ")  # fmt: skip
        lines.append(
            f"uretprobe:{libc}:{fn} /@root[pid] && @depth[tid] > 0/ {{ @depth[tid]--; "
            f"if (@depth[tid] == 0) {{ {release}"
            f"if ({ok}) {{ @ok[@root[pid]] = count(); }} "
            f"else if ({nothing}) {{ @failed[@root[pid]] = count(); }} }} }}"
        )
    # glibc's reallocarray multiplies and jumps to realloc: mtrace-live sees it
    # as realloc, and one that overflows (NULL, ENOMEM) calls nothing it sees
    lines.append(f"uprobe:{libc}:realloc /@root[pid] && @depth[tid] > 0/ {{ @inner[tid] = 1; }}")
    lines.append(f"uprobe:{libc}:free /@root[pid] && @depth[tid] == 0 && arg0 != 0/ "
                 "{ @frees[@root[pid]] = count(); }")  # fmt: skip
    lines.append("END { clear(@root); clear(@depth); clear(@old); clear(@zero); clear(@inner); }")
    return "\n".join(lines) + "\n"


def one_alias_each(libc: Path) -> set[str]:
    """The functions at the address of one before them in ALLOCATING
    (glibc 2.36's aligned_alloc is memalign): a probe on each would count
    one call twice."""
    address = {name: at for name, (at, _, _) in nm_symbols(libc, dynamic=True).items()}
    seen: set[int] = set()
    aliases = set()
    for fn in ALLOCATING:
        if address[fn] in seen:
            aliases.add(fn)
        seen.add(address[fn])
    return aliases


def summed(summary: str) -> tuple[int, int, int]:
    """Allocations, frees and failed calls of every process the summary lists."""
    totals = [0, 0, 0]
    for line in summary.splitlines():
        found = SUMMARY_LINE.match(line)
        if found:
            for i in range(3):
                totals[i] += int(found.group(i + 2))
    return totals[0], totals[1], totals[2]


def exit_code(summary: str) -> int | None:
    found = re.search(r"command exit code (-?\d+)", summary)
    return int(found.group(1)) if found else None


def run_all(build: Build, names: list[str], tmp: Path) -> dict[str, Outcome]:
    """Each test untraced, then traced, one bpftrace counting them all."""
    libc = build.root / "libc.so.6"
    done: dict[str, tuple[int, int, str, str, int]] = {}
    with Reaper() as reaper:
        bpftrace, out = start_bpftrace(counting_script(libc), os.getpid(), tmp)
        reaper.add(bpftrace)
        wait_for_line(out, BPFTRACE_READY, bpftrace, timeout=120)
        for name in names:
            argv = build.harness_argv(name, build.test_env(name))
            untraced = subprocess.run(argv, capture_output=True, timeout=900, check=False)
            started = time.monotonic()
            summary, err = tmp / f"{name}.summary", tmp / f"{name}.err"
            with open(summary, "wb") as stdout, open(err, "wb") as stderr:
                tracer = reaper.add(subprocess.Popen(
                    [*MTRACE, "run", "--sdt-glibc", "-o", "summary", "--", *argv],
                    stdout=stdout, stderr=stderr))  # fmt: skip
                status = tracer.wait(timeout=1800)
            print(f"{name}: {time.monotonic() - started:.1f} s traced")  # make test's choice
            done[name] = (untraced.returncode, status, summary.read_text(), err.read_text(),
                          tracer.pid)  # fmt: skip
        interrupt_bpftrace(bpftrace)
    counts: dict[str, dict[str, int]] = {"@ok": {}, "@frees": {}, "@failed": {}, "@unseen": {}}
    for line in out.read_text(errors="replace").splitlines():
        record = json.loads(line) if line.startswith("{") else {}
        if record.get("type") == "map":
            for key, values in record["data"].items():
                if key in counts:
                    counts[key] |= {k: int(v) for k, v in values.items()}
    outcomes = {}
    for name, (before, status, said, errors, root) in done.items():
        ok, frees, failed, unseen = (
            counts[key].get(str(root), 0) for key in ("@ok", "@frees", "@failed", "@unseen")
        )
        theirs = (ok, frees, failed - unseen)  # the failed calls mtrace-live can see
        outcomes[name] = Outcome(before, exit_code(said), status, said, errors,
                                 summed(said), theirs)  # fmt: skip
    return outcomes


def the_build(sdt: sdt_glibc.SdtGlibc) -> Build:
    if not sdt.runner:
        pytest.fail("the system libc carries SDT probes: there is no glibc build tree whose "
                    "malloc tests could run here")  # fmt: skip
    build = Build(sdt.libc.parent)
    missing = [name for name in BASE_TESTS if not (build.malloc / name).is_file()]
    if missing:
        pytest.fail(f"glibc's malloc tests are not built in {build.root} ({missing[0]}, ...): "
                    "make glibc-malloc-tests builds them")  # fmt: skip
    return build


@pytest.fixture(scope="module")
def quick(sdt: sdt_glibc.SdtGlibc, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    return run_all(the_build(sdt), list(QUICK), tmp_path_factory.mktemp("glibc-malloc-quick"))


@pytest.fixture(scope="module")
def slow(sdt: sdt_glibc.SdtGlibc, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    return run_all(the_build(sdt), list(SOAKED), tmp_path_factory.mktemp("glibc-malloc-soaked"))


def assert_as_untraced(name: str, outcome: Outcome) -> None:
    said = f"{name}: {outcome.summary[:2000]}\n{outcome.stderr[-2000:]}"
    # THEN it ends as it does untraced, and the tracer with it, whole
    assert outcome.traced == outcome.untraced, said
    assert outcome.untraced in (0, 77), said  # PASS or UNSUPPORTED, as make check says
    assert outcome.tracer == outcome.untraced, said
    assert "Traceback" not in outcome.stderr, said
    assert re.search(r"^events: \d+ in the kernel, \d+ delivered, 0 lost$", outcome.summary,
                     re.M), said  # fmt: skip
    # AND its allocations, frees and failed calls are bpftrace's, exactly
    assert outcome.ours == outcome.theirs, said
    assert outcome.ours[0] > 0, said  # it did allocate on the SDT libc


@pytest.mark.parametrize("name", QUICK)
def test_a_glibc_malloc_test_passes_traced_with_bpftraces_counts(
    name: str, quick: dict[str, Outcome]
) -> None:
    # GIVEN one of glibc's own malloc tests, run untraced and under the trace
    assert_as_untraced(name, quick[name])


@pytest.mark.soak
@pytest.mark.parametrize("name", SOAKED)
def test_a_slow_glibc_malloc_test_passes_traced_with_bpftraces_counts(
    name: str, slow: dict[str, Outcome]
) -> None:
    # GIVEN one of glibc's base malloc tests left out of make test for its time
    assert_as_untraced(name, slow[name])


@pytest.mark.soak
def test_every_glibc_malloc_test_passes_traced_with_bpftraces_counts(
    sdt: sdt_glibc.SdtGlibc, tmp_path: Path
) -> None:
    # GIVEN every test of glibc's `make subdirs=malloc check` (its variants
    # built by that run), with the verdict it gave untraced
    build = the_build(sdt)
    started = time.monotonic()
    # (with the traced runs' TIMEOUTFACTOR: tst-malloc-too-large-malloc-hugetlb2
    # once overran its own 20 s untraced on a loaded machine)
    checked = subprocess.run(["make", f"-j{(os.cpu_count() or 1) + 1}", "subdirs=malloc", "check"],
                             cwd=build.root, capture_output=True, text=True, timeout=3600,
                             env={**os.environ, "TIMEOUTFACTOR": TIMEOUTFACTOR},
                             check=False)  # fmt: skip
    print(f"make subdirs=malloc check: {time.monotonic() - started:.0f} s")
    sums = (build.malloc / "subdir-tests.sum").read_text()
    verdicts = {test: verdict for verdict, test in re.findall(r"^(\w+): malloc/(\S+)$", sums, re.M)}
    # (185 here: the 190 PASS make prints count 5 header checks outside malloc/)
    failed = {test: verdict for test, verdict in verdicts.items() if verdict in ("FAIL", "ERROR")}
    assert len(verdicts) >= 185 and not failed, (failed, checked.stdout[-3000:])
    # the *-mem checks read a trace file afterwards: their programs run
    # here; tst-mtrace's verdict is its script's (SCRIPTED); the static ones
    # have their own malloc, not the libc's; the check-* entries check
    # headers and ABI lists, no program
    programs = sorted({t.removesuffix("-mem") for t in verdicts if not t.startswith("check-")}
                      - STATIC - SCRIPTED)  # fmt: skip
    assert all((build.malloc / name).is_file() for name in programs), programs
    # WHEN each runs traced
    outcomes = run_all(build, programs, tmp_path)
    # THEN each passes as it did, with bpftrace's counts (every one checked,
    # those that did not said together)
    failures = {}
    for name, outcome in outcomes.items():
        try:
            assert_as_untraced(name, outcome)
        except AssertionError as failure:
            failures[name] = str(failure).splitlines()[:3]
    assert not failures, failures
