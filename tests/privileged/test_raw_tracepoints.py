"""The kmem tracepoints attached raw (their arguments and struct kmem_cache's
offsets from the running kernel's BTF) against the classic ones, on the
same workload, and against what the workload did."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from mtrace_live.tracer.bpf import bpf_syscalls
from mtrace_live.tracer.bpf.kernel_btf import KernelBtf
from mtrace_live.tracer.loop.hit_counts import CountRequest, HitCounter, run_count

from .conftest import MTRACE

PROG_TYPE_TRACING = 26  # enum bpf_prog_type: what a tp_btf program is

SOCKETS = 400
PIPES = 300
# call site -> (type, allocations per socket or pipe made): one socket inode
# per socket(); one pipe_inode_info (kmalloc) per pipe()
SITES = {"sock_alloc_inode": ("cache", SOCKETS), "alloc_pipe_info": ("kmalloc", PIPES)}


def kernel_sites(kmem_exerciser: Path, tmp: Path, *flags: str) -> dict[str, list[int]]:
    """The summary's call-site rows of a `run --kmem-only` of the exerciser:
    symbol+offset -> [allocs, requested bytes, allocated bytes]."""
    done = subprocess.run(
        [*MTRACE, "run", "--kmem-only", "-o", "summary", *flags, "--", str(kmem_exerciser),
         "--sockets", str(SOCKETS), "--pipes", str(PIPES), "--out", str(tmp / "truth.json")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = {}
    for line in done.stdout.splitlines():
        cells = line.split()
        if len(cells) >= 7 and "+0x" in cells[0] and cells[1] in ("cache", "kmalloc"):
            rows[cells[0]] = [cells[1], int(cells[2]), int(cells[4]), int(cells[5])]
    return rows


def test_raw_and_classic_tracepoints_count_the_same_allocations(
    kmem_exerciser: Path, tmp_path: Path
) -> None:
    # GIVEN the doctor says which kmem tracepoints this kernel lets be raw
    doctor = subprocess.run([*MTRACE, "doctor"], capture_output=True, text=True, timeout=120)
    line = next(x for x in doctor.stdout.splitlines() if "raw kmem tracepoints" in x)
    assert line.startswith("ok"), line
    assert "raw kmalloc, kfree, kmem_cache_alloc, kmem_cache_free" in line
    # WHEN the same workload is traced with raw, then with classic tracepoints
    raw = kernel_sites(kmem_exerciser, tmp_path)
    classic = kernel_sites(kmem_exerciser, tmp_path, "--classic-tracepoints")
    # THEN each of the workload's own call sites made one allocation per
    # socket or pipe, with the same sizes, whichever way it was attached
    for function, (kind, made) in SITES.items():
        found = {site: row for site, row in raw.items() if site.startswith(function + "+")}
        assert found, (function, sorted(raw))
        for site, row in found.items():
            assert row[0] == kind and row[1] == made, (site, row)
            assert classic[site] == row, (site, row, classic.get(site))
    # AND every call site both saw allocated as often, with the same bytes per
    # allocation (requested: the cache's object_size; allocated: its size)
    for site in raw.keys() & classic.keys():
        r, c = raw[site], classic[site]
        if r[1] and c[1]:
            assert (r[2] // r[1], r[3] // r[1]) == (c[2] // c[1], c[3] // c[1]), site


def test_count_names_each_cache_from_its_raw_tracepoint_pointer(
    kmem_exerciser: Path, tmp_path: Path
) -> None:
    # WHEN count attaches kmem_cache_alloc raw (the cache's name read once
    # per cache, from BTF's struct kmem_cache)
    done = subprocess.run(
        [*MTRACE, "count", "--kmem-only", "--json", "--", str(kmem_exerciser),
         "--sockets", str(SOCKETS), "--pipes", "0", "--out", str(tmp_path / "t.json")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    counted = json.loads(done.stdout)["kmem_cache_allocs"]
    truth = json.loads((tmp_path / "t.json").read_text())
    # THEN the socket inode cache counts exactly the sockets made
    expected = truth["expected"]["kmem_cache_alloc"]["sock_inode_cache"]
    assert counted["sock_inode_cache"] == expected == SOCKETS
    # AND every name is a whole cache name (no empty or cut names)
    assert all(name and name.isprintable() for name in counted), counted


def count_sockets(kmem_exerciser: Path, tmp: Path) -> int:
    """`count --kmem-only` of the exerciser making SOCKETS sockets, in this
    process: the socket inode cache's allocations."""
    request = CountRequest(pid=None, command=[str(kmem_exerciser), "--sockets", str(SOCKETS),
                           "--pipes", "0", "--out", str(tmp / "truth.json")], lib=None,
                           sdt_glibc=False, patterns=[], kmem=True, usdt=False,
                           follow_forks=True, duration=None)  # fmt: skip
    return run_count(request).kmem_cache_allocs["sock_inode_cache"]


def test_kmem_cache_alloc_is_btf_typed_and_falls_back_to_raw_where_the_kernel_refuses(
    kmem_exerciser: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN the kmem tracepoints as count attaches them on this kernel
    typed = HitCounter(None, [], kmem=True)
    try:
        # THEN kmem_cache_alloc's handler is the BTF-typed one, loaded as such
        programs = typed._program.program_fds()
        assert typed._program.typed_refused == {}
        assert bpf_syscalls.program_type(programs["tp_btf__kmem_cache_alloc"]) == PROG_TYPE_TRACING
    finally:
        typed.close()
    # AND it counts one socket inode per socket made
    assert count_sockets(kmem_exerciser, tmp_path) == SOCKETS
    # WHEN BTF gives kfree's tracepoint type instead (two arguments, where
    # the handler reads a third), so that the kernel's verifier refuses it
    real = KernelBtf.tracepoint_type_id
    monkeypatch.setattr(KernelBtf, "tracepoint_type_id", lambda btf, event: real(btf, "kfree"))
    refused = HitCounter(None, [], kmem=True)
    try:
        # THEN the raw handler is attached instead, and the refusal kept, with its reason
        assert "kmem_cache_alloc" in refused._program.typed_refused
        assert refused._program.typed_refused["kmem_cache_alloc"]
        assert "tp_btf__kmem_cache_alloc" not in refused._program.program_fds()
    finally:
        refused.close()
    # AND it counts the same
    assert count_sockets(kmem_exerciser, tmp_path) == SOCKETS
