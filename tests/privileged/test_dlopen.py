"""A library loaded with dlopen while traced, and used at once: its
constructors' allocations and its first calls whole, down to main.

``llvm_user`` (-O2, no frame pointers, PIE) loads the largest library of
the machine, libLLVM-15 (979,120 CFI rows, more than the whole of a
database server's files), and builds modules through its C API at once:
every allocation after the load is the dynamic loader's or libLLVM's
(through libstdc++'s operator new, itself loaded with it). The dynamic
loader's _dl_debug_state, called once the library is mapped and before its
constructors run, asks for the process's tables again (unwind.bpf.c's
unwind_dl_state), and ``run`` holds its command until they are written.
The smaller plugin of ``cfi_stacks`` is the same case in
``test_cfi_stacks.py``: its first call whole. Checked: every allocating
call of the program counted as bpftrace counts the outermost ones in the
same run, the rows of libLLVM fitted (no "no room"), and at least 99% of
the calls made inside libLLVM reach main."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from mtrace_live.tracer.processes.target import default_libc

from .conftest import MTRACE, built
from .test_allocators import outer_calls_script
from .tracing import (
    BPFTRACE_READY,
    Reaper,
    malloc_stacks,
    start_bpftrace,
    stop_bpftrace,
    wait_for_line,
)

LLVM = Path("/usr/lib/x86_64-linux-gnu/libLLVM-15.so.1")  # make setup installs libllvm15
ROUNDS = 3000


def test_a_library_dlopened_and_used_at_once_is_whole_from_its_constructors_on(
    tmp_path: Path,
) -> None:
    if not LLVM.exists():
        pytest.fail(f"{LLVM} is missing: 'make setup' installs Debian's libllvm15")
    program = built("llvm_user")
    profile = tmp_path / "heap.pb.gz"
    libc = default_libc()
    with Reaper() as reaper:
        script = outer_calls_script(libc, where='comm == "llvm_user"')
        bpftrace, out = start_bpftrace(script, 0, tmp_path)
        reaper.add(bpftrace)
        wait_for_line(out, BPFTRACE_READY, bpftrace, timeout=120)
        # GIVEN a program run under a trace, which loads libLLVM-15 with
        # dlopen and allocates through it at once
        run = subprocess.run(
            [*MTRACE, "run", "-o", "summary", "--pprof", str(profile), "--",
             str(program), str(LLVM), str(ROUNDS)],
            input=b"x", capture_output=True, timeout=600)  # fmt: skip
        counts = stop_bpftrace(bpftrace, out)
    stdout, stderr = run.stdout.decode(), run.stderr.decode()
    assert run.returncode == 0, stderr
    assert f"rounds {ROUNDS}" in stdout, stdout
    # THEN libLLVM's rows fitted beside the others
    assert "no room" not in stdout, stdout
    calls = whole = in_llvm = whole_in_llvm = 0
    for _, n, stack in malloc_stacks(profile, allocator=None):
        names = [name for name, _ in stack]
        reached = "main" in names and names[-1] == "_start"
        inside = any(Path(file).name == LLVM.name for _, file in stack)
        calls += n
        whole += n * reached
        in_llvm += n * inside
        whole_in_llvm += n * (inside and reached)
    # AND every call of the program's is counted, as bpftrace counted the
    # outermost calls of the allocating functions
    assert calls == sum(n for name, n in counts.items() if name != "free"), (calls, counts)
    # AND most of them were made inside libLLVM, at least 99% of which
    # (and of all) reach main
    print(f"whole down to main: {whole / calls:.2%} of {calls} calls; "
          f"{whole_in_llvm / max(in_llvm, 1):.2%} of the {in_llvm} inside libLLVM")  # fmt: skip
    assert in_llvm >= 0.9 * calls, (in_llvm, calls, stdout[-3000:])
    assert whole_in_llvm >= 0.99 * in_llvm, (whole_in_llvm, in_llvm, stdout[-3000:])
    assert whole >= 0.99 * calls, (whole, calls, stdout[-3000:])
