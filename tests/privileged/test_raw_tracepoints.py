"""The kmem tracepoints attached raw (their arguments and struct kmem_cache's
offsets from the running kernel's BTF) against the classic ones, on the
same workload, and against what the workload did."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from .conftest import MTRACE

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
