"""The report's analysis on records whose story is known, the tracefs format
reader on another kernel's formats, and kallsyms lookups."""

from __future__ import annotations

import struct
from pathlib import Path

from mtrace_live.exporters.allocinfo import render_allocinfo
from mtrace_live.exporters.data.kallsyms import KernelSymbols
from mtrace_live.tracer.bpf.tracefs import kmem_defines, parse_format

from .report_check import same_report

SITE_A = 0xFFFFFFFF81000100  # kmallocs
SITE_B = 0xFFFFFFFF81000200  # cache allocations
FREER = 0xFFFFFFFF81000300
KALLSYMS = (
    "ffffffff81000000 T alloc_a\nffffffff81000180 t alloc_b\n"
    "ffffffff81000280 T freer\nffffffffc0000000 t mod_fn\t[some_mod]\n"
)


def alloc(seq: int, type_id: int, site: int, ptr: int, req: int, got: int) -> bytes:
    return struct.pack("=BBHiQQQQIi", 0, type_id, 48, seq, site, ptr, req, got, 0, -1)


def free(seq: int, type_id: int, ptr: int) -> bytes:
    return struct.pack("=BBHiQQ", 1, type_id, 24, seq, FREER, ptr)


def test_frees_matched_by_pointer_across_cpus_and_the_errors_kmemtrace_looked_for(
    tmp_path: Path,
) -> None:
    # GIVEN on CPU 0: two kmallocs at A, a cache allocation at B, and one
    # allocation claiming more requested than allocated; on CPU 1: kfree of
    # the first (cross-CPU), kfree of the cache object (mismatched), a free of
    # a pointer never allocated, and kfree(NULL)
    cpu0 = alloc(0, 0, SITE_A, 0x1000, 40, 64) + alloc(1, 0, SITE_A, 0x2000, 100, 128)
    cpu0 += alloc(2, 1, SITE_B, 0x3000, 200, 256) + alloc(3, 0, SITE_A, 0x4000, 90, 64)
    cpu1 = free(4, 0, 0x1000) + free(5, 0, 0x3000) + free(6, 0, 0x9000) + free(7, 0, 0)
    (tmp_path / "abi_version").write_text("1\n")
    (tmp_path / "cpu0").write_bytes(cpu0)
    (tmp_path / "cpu1").write_bytes(cpu1)
    # WHEN the record set is analysed (both ways, to the same answer)
    report = same_report(tmp_path, KernelSymbols(KALLSYMS))
    # THEN per call site: A made 3 allocations, one freed on another CPU
    sites = {(s.symbol, s.type_name): s for s in report.kernel.sites}
    a = sites[("alloc_a+0x100", "kmalloc")]
    assert (a.allocs, a.bytes_req, a.bytes_alloc, a.frees, a.bytes_freed) == (3, 230, 256, 1, 64)
    assert a.cross_cpu_frees == 1 and a.outstanding == 2 and a.outstanding_bytes == 192
    # AND B's object was freed with kfree: a mismatched free, counted at B
    b = sites[("alloc_b+0x80", "cache")]
    assert (b.allocs, b.frees, b.mismatched_frees) == (1, 1, 1)
    # AND the unknown pointer is counted at the freeing site
    assert sites[("freer+0x80", "kmalloc")].unknown_frees == 1
    f = report.findings
    assert (f.mismatched_frees, f.unknown_frees, f.requested_above_allocated, f.null_frees) == (
        1,
        1,
        1,
        1,
    )
    assert report.cross_cpu_frees == 2
    # AND the whole dataset: 430 requested of 512 allocated
    assert report.kernel.total("bytes_req") == 430 and report.kernel.total("bytes_alloc") == 512
    assert abs(report.kernel.fragmentation - (1 - 430 / 512)) < 1e-12
    # AND allocinfo lists what is still live per site
    lines = render_allocinfo(report.kernel)
    assert "         192        2 alloc_a+0x100 func:alloc_a" in lines


def test_kallsyms_names_module_functions_and_leaves_unknown_addresses_in_hex() -> None:
    symbols = KernelSymbols(KALLSYMS)
    assert symbols.describe(0xFFFFFFFFC0000010) == "mod_fn+0x10 [some_mod]"
    assert symbols.describe(0x1000) == "0x1000"
    assert KernelSymbols("0000000000000000 T hidden\n").describe(SITE_A) == hex(SITE_A)


# kmem formats of a Linux 5.10 kernel: no node field in kmalloc, separate
# *_node tracepoints, no cache name.
OLD_KMALLOC = """name: kmalloc
format:
\tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;
\tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;

\tfield:unsigned long call_site;\toffset:8;\tsize:8;\tsigned:0;
\tfield:const void * ptr;\toffset:16;\tsize:8;\tsigned:0;
\tfield:size_t bytes_req;\toffset:24;\tsize:8;\tsigned:0;
\tfield:size_t bytes_alloc;\toffset:32;\tsize:8;\tsigned:0;
\tfield:gfp_t gfp_flags;\toffset:40;\tsize:4;\tsigned:0;
"""
OLD_FREE = OLD_KMALLOC.split("\tfield:size_t")[0]
OLD_PAGES = """\tfield:unsigned long pfn;\toffset:8;\tsize:8;\tsigned:0;
\tfield:unsigned int order;\toffset:16;\tsize:4;\tsigned:0;
\tfield:gfp_t gfp_flags;\toffset:20;\tsize:4;\tsigned:0;
"""


def test_an_older_kernels_formats_select_the_node_tracepoints() -> None:
    formats = {"kmalloc": OLD_KMALLOC, "kmem_cache_alloc": OLD_KMALLOC, "kfree": OLD_FREE,
               "kmem_cache_free": OLD_FREE, "mm_page_alloc": OLD_PAGES, "mm_page_free": OLD_PAGES,
               "kmalloc_node": OLD_KMALLOC + "\tfield:int node;\toffset:44;\tsize:4;\tsigned:1;\n",
               "kmem_cache_alloc_node": OLD_KMALLOC}  # fmt: skip

    def read(category: str, event: str) -> str:
        from mtrace_live.probes.errors import TracepointMissingError

        if event not in formats:
            raise TracepointMissingError(event)
        return formats[event]

    assert kmem_defines(read) == {
        "KMALLOC_HAS_NODE": 0, "CACHE_ALLOC_HAS_NODE": 0, "HAVE_CACHE_NAME": 0,
        "HAVE_KMALLOC_NODE": 1, "HAVE_CACHE_ALLOC_NODE": 1, "HAVE_PAGE_FREE_BATCHED": 0,
    }  # fmt: skip
    fields = parse_format("kmem", "kmalloc", OLD_KMALLOC).fields
    assert list(fields) == ["call_site", "ptr", "bytes_req", "bytes_alloc", "gfp_flags"]
    assert (fields["gfp_flags"].offset, fields["gfp_flags"].size) == (40, 4)
