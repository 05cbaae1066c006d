"""sp-rtrace text reports: each record's syntax against the protocol text,
round trips, the leaks and compress filters, and malformed input."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from mtrace_live.exporters.sprtrace import text as sprtrace
from mtrace_live.exporters.sprtrace.text import Call, Comment, Frame, Resource, Trace
from mtrace_live.probes.errors import SpRtraceError

from .cli_runs import assert_one_line, mtrace

# The protocol's record syntax, transcribed from the sections of
# sp-rtrace-text-protocol.txt (the shared specs), numbered as there.
HEADER = re.compile(r"^[^=,]+=[^,]*(,[^=,]+=[^,]*)*$")  # 1. <key>=<value>[,<key>=<value>...]
MMAP = re.compile(r"^: [^ \t\n\r\v\f]+ => 0x[0-9a-f]+-0x[0-9a-f]+$")  # 2. (a C %s word)
ALLOC = re.compile(
    r"^\d+\. (@[0-9a-f]+ )?(\[\d\d:\d\d:\d\d\.\d+\] )?\w+(<\w+>)?\(\d+\) = 0x[0-9a-f]+$"
)
FREE = re.compile(r"^\d+\. (@[0-9a-f]+ )?(\[\d\d:\d\d:\d\d\.\d+\] )?\w+(<\w+>)?\(0x[0-9a-f]+\)$")
FRAME = re.compile(r"^\t0x[0-9a-f]+( in \S+\(\))?( from \S+| at \S+:\d+)?$")  # 6.
CONTEXT = re.compile(r"^@ [0-9a-f]+ : .+$")  # 7.
ARG = re.compile(r"^\t\$\d+ = \S+$")  # 8.
RESOURCE = re.compile(r"^<[0-9a-f]+> : \S+ \([^)]*\)( \[\w+(\|\w+)*\])?$")  # 9.


def sample() -> Trace:
    trace = Trace(
        header={"version": "1.0", "arch": "x86_64", "timestamp": "2026.11.21 08:30:00",
                "process": "app", "pid": "42", "backtrace depth": "2",
                "origin": "mtrace-live 0.1.0"},
        resources=[Resource(1, "kmalloc", "kernel kmalloc objects"),
                   Resource(2, "arena", "malloc arenas", refcount=True)],
        contexts={1: "startup"},
        mmaps=[("/usr/lib/libc.so.6", 0x7F0000000000, 0x7F0000200000)],
    )  # fmt: skip
    trace.items = [
        Comment("## a permanent comment"),
        Call(1, "kmalloc", "kmalloc", 0xFFFF888004A1C000, 192, 1250, 0, ["256", "0xcc0"],
             [Frame(0xFFFFFFFF81A2B3C4, "sock_alloc_inode", "[kernel.kallsyms]"),
              Frame(0x7F0000001234, "main", None, "app.c:12"), Frame(0x7F0000005678)]),
        Call(2, "kfree", "kmalloc", 0xFFFF888004A1C000, None, 3_723_004, 1),
        Call(3, "memory_arena_new", "arena", 0x7F0000100000, 2048),
    ]  # fmt: skip
    return trace


def text_of(trace: Trace, compressed: bool = False) -> list[str]:
    return list(sprtrace.lines(trace, compressed))


def test_every_record_has_the_protocols_syntax() -> None:
    lines = text_of(sample())
    assert HEADER.match(lines[0]) and ", " not in lines[0]
    assert lines[0].startswith("version=1.0,arch=x86_64,timestamp=2026.11.21 08:30:00,process=app,")
    assert "backtrace depth=2" in lines[0] and lines[0].endswith("origin=mtrace-live 0.1.0")
    assert lines[1] == "@ 1 : startup" and CONTEXT.match(lines[1])
    assert lines[2] == "<1> : kmalloc (kernel kmalloc objects)" and RESOURCE.match(lines[2])
    assert lines[3] == "<2> : arena (malloc arenas) [refcount]" and RESOURCE.match(lines[3])
    assert lines[4] == ": /usr/lib/libc.so.6 => 0x7f0000000000-0x7f0000200000" and MMAP.match(
        lines[4]
    )
    assert lines[5] == "## a permanent comment"
    assert lines[6] == "1. [00:00:01.250] kmalloc<kmalloc>(192) = 0xffff888004a1c000"
    assert ALLOC.match(lines[6])
    assert lines[7:9] == ["\t$1 = 256", "\t$2 = 0xcc0"] and all(ARG.match(x) for x in lines[7:9])
    assert lines[9:12] == [
        "\t0xffffffff81a2b3c4 in sock_alloc_inode() from [kernel.kallsyms]",
        "\t0x7f0000001234 in main() at app.c:12",
        "\t0x7f0000005678",
    ]
    assert all(FRAME.match(x) for x in lines[9:12]) and lines[12] == ""
    assert lines[13] == "2. @1 [01:02:03.004] kfree<kmalloc>(0xffff888004a1c000)" and FREE.match(
        lines[13]
    )
    assert lines[15] == "3. memory_arena_new<arena>(2048) = 0x7f0000100000"


def test_a_report_reads_back_to_the_same_records() -> None:
    trace = sample()
    back = sprtrace.parse(text_of(trace), "sample")
    assert back.header == trace.header
    assert back.resources == trace.resources and back.contexts == trace.contexts
    assert back.mmaps == trace.mmaps and back.items == trace.items
    assert text_of(back) == text_of(trace)


def test_temporary_comments_are_dropped_and_others_pass_through() -> None:
    lines = [*text_of(sample()), "# temporary", "## kept", "not a record at all"]
    back = sprtrace.parse(lines, "sample")
    comments = [item.text for item in back.items if isinstance(item, Comment)]
    assert comments == ["## a permanent comment", "## kept", "not a record at all"]


def calls(*specs: tuple[str, int, int | None]) -> Trace:
    """A trace of (resource, id, size or None for a free) calls with one frame each."""
    trace = Trace(header={"version": "1.0"},
                  resources=[Resource(1, "kmalloc", "objects"),
                             Resource(2, "arena", "arenas", True)])  # fmt: skip
    trace.items = [
        Call(
            i,
            "alloc" if size is not None else "free",
            res,
            ident,
            size,
            frames=[Frame(0x1000 + i % 2)],
        )
        for i, (res, ident, size) in enumerate(specs, 1)
    ]
    return trace


def test_leaks_filter_keeps_what_was_not_freed_as_sp_rtrace_does() -> None:
    # GIVEN 3 freed blocks, 2 leaked ones, a free of an unknown id, an id
    # allocated twice before its free, and a refcounted arena taken twice
    trace = calls(
        ("kmalloc", 0xA, 10), ("kmalloc", 0xB, 20), ("kmalloc", 0xA, None), ("kmalloc", 0xC, 30),
        ("kmalloc", 0xB, None), ("kmalloc", 0xD, 40), ("kmalloc", 0xC, None),
        ("kmalloc", 0xE, None),
        ("kmalloc", 0xF, 50), ("kmalloc", 0xF, 60), ("kmalloc", 0xF, None),
        ("arena", 0x100, 1), ("arena", 0x100, 1), ("arena", 0x100, None),
    )  # fmt: skip
    # WHEN the leaks filter runs
    sprtrace.filter_leaks(trace)
    # THEN what is left: the never-freed 0xD, the older 0xF, the arena still held once
    assert [(c.res_id, c.size) for c in trace.calls] == [(0xD, 40), (0xF, 50), (0x100, 1)]
    assert trace.header["filter"] == "leaks"
    assert sprtrace.leak_summary(trace) == [
        "# Resource - kmalloc (objects):", "# 2 block(s) leaked with total size of 90 bytes",
        "# Resource - arena (arenas):", "# 1 block(s) leaked with total size of 1 bytes",
    ]  # fmt: skip


def test_compress_groups_calls_by_backtrace_with_a_summary() -> None:
    # GIVEN 5 allocations from two backtraces (3 from one, 2 from the other)
    trace = calls(("kmalloc", 1, 100), ("kmalloc", 2, 10), ("kmalloc", 3, 100),
                  ("kmalloc", 4, 10), ("kmalloc", 5, 100))  # fmt: skip
    # WHEN written compressed
    trace.add_filter("compress")
    out = text_of(trace, compressed=True)
    # THEN each backtrace is written once, after its calls and their summary
    summaries = [line for line in out if line.startswith("# allocation summary")]
    assert summaries == ["# allocation summary: 3 block(s) with total size 300",
                         "# allocation summary: 2 block(s) with total size 20"]  # fmt: skip
    assert [line for line in out if line.startswith("\t0x")] == ["\t0x1001", "\t0x1000"]
    assert "filter=compress" in out[0]


@pytest.mark.parametrize(
    ("lines", "words"),
    [
        (["hello world", "1. kmalloc(1) = 0x1"], "line 1: not an sp-rtrace text report"),
        ([], "empty, not an sp-rtrace text report"),
        (["version=1.0", "1x. kmalloc(16) = 0x10"], "line 2: record index '1x'"),
        (["version=1.0", "\t0x1000 in main()"],
         "line 2: a backtrace or argument line before any record"),
        (["version=1.0", "1. kmalloc(16) = 0xZZ"], "line 2: '0xZZ' is not a 64-bit hex id"),
        (["version=1.0", "1. kfree(1234)"], "line 2: '1234' is not a 64-bit hex id"),
        (["version=1.0", "1. kmalloc(9223372036854775808) = 0x10"],
         "line 2: resource size 9223372036854775808 is over"),
        (["version=1.0", "1. kmalloc(16) = 0x10", "\tnot-an-address"],
         "line 3: a backtrace address"),
        (["version=1.0", "<3> : two (x)"], "line 2: resource id <3> is not a single bit"),
    ],
)  # fmt: skip
def test_malformed_records_are_errors_with_their_line(lines: list[str], words: str) -> None:
    with pytest.raises(SpRtraceError, match=re.escape(words)):
        sprtrace.parse(lines, "report.txt")


def test_convert_of_a_bad_report_is_one_line_and_exit_19(tmp_path: Path) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("version=1.0\n\t0x10\n")
    assert_one_line(mtrace("convert", str(bad)), 19, "line 2")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00binary")
    assert_one_line(mtrace("convert", str(binary)), 19, "not an sp-rtrace text report")


def test_convert_post_processes_a_report_again(tmp_path: Path) -> None:
    # GIVEN a report written by mtrace-live, with a temporary comment in it
    source = tmp_path / "in.txt"
    trace = calls(("kmalloc", 1, 100), ("kmalloc", 1, None), ("kmalloc", 2, 7))
    source.write_text("\n".join([*text_of(trace), "# to be dropped"]) + "\n")
    # WHEN convert filters its leaks
    done = mtrace("convert", str(source), "--leaks")
    # THEN only the leak remains, the header says so, and the summary follows
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert "filter=leaks" in out[0] and "# to be dropped" not in out
    back = sprtrace.parse(io.StringIO(done.stdout), "out")
    assert [(c.res_id, c.size) for c in back.calls] == [(2, 7)]
    assert out[-3:] == ["# 1 block(s) leaked with total size of 7 bytes",
                        "# Resource - arena (arenas):",
                        "# 0 block(s) leaked with total size of 0 bytes"]  # fmt: skip


# ---- sp-rtrace's own tools' reading of the protocol -----------------------------


def test_a_record_set_lists_every_resource_its_records_use() -> None:
    from mtrace_live.exporters.kmemtrace.abi import TypeId
    from mtrace_live.exporters.sprtrace.convert import resources

    # GIVEN the types present, as a one-pass iterable (what from_record_set gives)
    present = iter([int(TypeId.KMALLOC), int(TypeId.CACHE), int(TypeId.ARENA)])
    # THEN each is a resource, and arenas keep their refcount flag
    listed = resources(present)
    assert [r.name for r in listed] == ["kmalloc", "kmem_cache", "arena"]
    assert [r.refcount for r in listed] == [False, False, True]


@pytest.mark.parametrize(
    "module", ["/memfd:sealed-91173221a7ea (deleted)", "/opt/app\u3000x/lib.so", "/a\\b\tc"]
)
def test_module_paths_with_spaces_are_one_word_and_read_back(module: str) -> None:
    # GIVEN a module path with white space (a deleted memfd, a Unicode space,
    # a backslash and a tab) in a map line and in a frame
    trace = calls(("kmalloc", 1, 8))
    trace.mmaps = [(module, 0x7F0000000000, 0x7F0000001000)]
    trace.items[0].frames = [Frame(0x7F0000000010, "jit", module)]  # type: ignore[union-attr]
    text = text_of(trace)
    # THEN the path is one word, as sp-rtrace's `: %s => 0x%lx-0x%lx` reads it
    (line,) = [x for x in text if x.startswith(": ")]
    assert len(line.split(" ")) == 4 and "\t" not in line and MMAP.match(line)
    if module.startswith("/memfd"):
        assert line == ": /memfd:sealed-91173221a7ea\\040(deleted) => 0x7f0000000000-0x7f0000001000"
    # AND it reads back as it was
    back = sprtrace.parse(text, "report")
    assert back.mmaps == trace.mmaps
    assert back.calls[0].frames[0].module == module


@pytest.mark.parametrize(
    ("line", "function", "module", "location"),
    [
        ("\t0x400100 in ??", None, None, None),
        ("\t0x7f00001234 malloc() from /usr/lib/x86_64-linux-gnu/libc.so.6",
         "malloc", "/usr/lib/x86_64-linux-gnu/libc.so.6", None),
        ("\t0x7f00001234 sysmalloc() at malloc.c:214", "sysmalloc", None, "malloc.c:214"),
        ("\t0x7f00001234 from /usr/lib/libfoo.so", None, "/usr/lib/libfoo.so", None),
        ("\t0x7f00001234 Foo::bar(int) const at foo.cc:9", "Foo::bar(int) const", None, "foo.cc:9"),
    ],
)  # fmt: skip
def test_every_frame_form_of_sp_rtrace_resolve_is_read_and_written_back(
    line: str, function: str | None, module: str | None, location: str | None
) -> None:
    report = ["version=1.0", "1. malloc(16) = 0x1000", line, ""]
    trace = sprtrace.parse(report, "resolved")
    frame = trace.calls[0].frames[0]
    assert (frame.function, frame.module, frame.location) == (function, module, location)
    assert text_of(trace)[-2] == line


def test_frees_are_matched_in_timestamp_then_index_order() -> None:
    # GIVEN a free listed before its allocation, but stamped after it
    report = [
        "version=1.0",
        "<1> : memory (memory)",
        "2. [00:00:02.000] free(0x1000)",
        "",
        "1. [00:00:01.000] malloc(16) = 0x1000",
        "",
    ]
    trace = sprtrace.parse(report, "ordered")
    # WHEN its leaks are filtered
    sprtrace.filter_leaks(trace)
    # THEN the allocation was freed, as sp-rtrace-postproc (which sorts the
    # calls by timestamp, then index) finds
    assert trace.calls == []


def test_untyped_calls_belong_to_the_first_resource_and_unknown_ones_are_errors() -> None:
    # GIVEN two resources, a typed allocation and an untyped free of it
    report = [
        "version=1.0",
        "<1> : memory (memory)",
        "<2> : fd (file descriptors)",
        "1. malloc<memory>(5) = 0x1000",
        "2. free(0x1000)",
        "3. open<fd>(1) = 0x3",
        "4. malloc(7) = 0x2000",
    ]
    trace = sprtrace.parse(report, "typed")
    sprtrace.filter_leaks(trace)
    # THEN the free matched, and the untyped leak counts as memory
    assert [(c.index, c.res_id) for c in trace.calls] == [(3, 3), (4, 0x2000)]
    assert sprtrace.leak_summary(trace) == [
        "# Resource - memory (memory):",
        "# 1 block(s) leaked with total size of 7 bytes",
        "# Resource - fd (file descriptors):",
        "# 1 block(s) leaked with total size of 1 bytes",
    ]
    # AND a call of a resource the registry does not list is an error
    with pytest.raises(SpRtraceError, match="line 3: resource <socket> is not in the resource"):
        sprtrace.parse(["version=1.0", "<1> : memory (memory)", "1. x<socket>(1) = 0x1"], "r")


def test_a_line_whose_index_is_not_a_number_is_a_comment_as_sp_rtrace_reads_it() -> None:
    trace = sprtrace.parse(["version=1.0", "Note. malloc(1) = 0x10", "\u00b2. free(0x10)"], "r")
    assert trace.calls == []
    assert [item.text for item in trace.items] == ["Note. malloc(1) = 0x10", "\u00b2. free(0x10)"]  # type: ignore[union-attr]


def test_a_context_that_is_not_hex_is_part_of_the_function_as_sp_rtrace_reads_it() -> None:
    trace = sprtrace.parse(["version=1.0", "<1> : memory (m)", "1. @zz malloc<memory>(5) = 0x1000"],
                           "r")  # fmt: skip
    assert [(c.function, c.resource, c.size, c.context) for c in trace.calls] == [
        ("@zz malloc", "memory", 5, 0)
    ]


@pytest.mark.parametrize(
    "line",
    ["1. malloc(\u00b2) = 0x10", "1\u00b2. malloc(1) = 0x10",
     "1. malloc(" + "9" * 5000 + ") = 0x10", "9" * 5000 + ". free(0x10)",
     "1. [" + "1" * 5000 + ":00:00.000] free(0x10)", "1. free(0x" + "f" * 17 + ")"],
)  # fmt: skip
def test_numbers_python_would_choke_on_are_clean_errors(line: str) -> None:
    with pytest.raises(SpRtraceError, match="line 2"):
        sprtrace.parse(["version=1.0", line], "numbers")


def test_convert_resolves_kernel_frames_and_compresses_from_the_command_line(
    tmp_path: Path,
) -> None:
    # GIVEN a report of five kmallocs from two unnamed kernel backtraces
    # (three of 100 bytes from one, two of 10 from the other), and kallsyms
    frames = {100: [Frame(0xFFFFFFFF81000010)], 10: [Frame(0xFFFFFFFF81000208)]}
    trace = calls(*(("kmalloc", n, size) for n, size in enumerate((100, 10, 100, 10, 100), 1)))
    for call in trace.calls:
        call.frames = frames[call.size]  # type: ignore[index]
    source = tmp_path / "in.txt"
    source.write_text("\n".join(text_of(trace)) + "\n")
    kallsyms = tmp_path / "kallsyms"
    kallsyms.write_text("ffffffff81000000 T sock_alloc_inode\nffffffff81000200 t alloc_pipe_info\n")
    # WHEN convert resolves and compresses it
    done = mtrace("convert", str(source), "--resolve", "--kallsyms", str(kallsyms), "--compress")
    # THEN each backtrace is written once, named, after its calls and their
    # summary, largest group first, and the header names both filters
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert "filter=compress|resolve" in out[0]
    summaries = [line for line in out if line.startswith("# allocation summary")]
    assert summaries == ["# allocation summary: 3 block(s) with total size 300",
                         "# allocation summary: 2 block(s) with total size 20"]  # fmt: skip
    assert [line for line in out if line.startswith("\t")] == [
        "\t0xffffffff81000010 in sock_alloc_inode() from [kernel.kallsyms]",
        "\t0xffffffff81000208 in alloc_pipe_info() from [kernel.kallsyms]",
    ]
    back = sprtrace.parse(io.StringIO(done.stdout), "out")
    assert sorted(c.size for c in back.calls) == [10, 10, 100, 100, 100]
