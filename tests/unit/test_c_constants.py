"""The constants user space shares with the BPF program are read from its C
(probes/program.py ``part_constants``), written once there: the unwinder's
tail-call slots, its page index's shift and its tables' default sizes; the
ring's and the stack map's default sizes, the lock tables', the sampling
table's and the SDT handlers' count. The command line's defaults are the
request's, and those the C's. The C's values are checked against the C
compiler's own reading of them (an object built from the part's macros)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

import pytest
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection
from mtrace_live.probes.program import bpf_directory, c_constants
from mtrace_live.tracer.unwind import unwind_rows, unwind_tables

# unwind.bpf.c's switches under which its slots are defined (unwind_defines()
# and the frame store turn them on in every program that unwinds by CFI)
UNWINDING = {"WITH_UNWIND": 1, "WITH_FRAMES": 1}


def compiled(scratch: Path, part: str, names: Sequence[str],
             defines: Mapping[str, int] | None = None) -> dict[str, int]:  # fmt: skip
    """What the C compiler makes of ``names`` in ``bpf/<part>``, an independent
    reading of its C: the part's macros (clang -E -dM, ``defines`` as -D),
    compiled into an array of an object file, read back from the object's ELF."""
    clang = shutil.which("clang")
    if clang is None:
        pytest.fail("clang is missing: make setup installs it")
    flags = [f"-D{name}={value}" for name, value in (defines or {}).items()]

    def macros(path: str) -> set[str]:
        argv = [clang, "-E", "-dM", "-x", "c", *flags, path]
        return set(subprocess.run(argv, capture_output=True, text=True, check=True).stdout
                   .splitlines())  # fmt: skip

    # the part's own macros: the compiler's predefined ones (and the -D's) left out
    own = sorted(macros(str(bpf_directory() / part)) - macros("/dev/null"))
    values = ", ".join(f"(unsigned long long)({name})" for name in names)
    source = scratch / "values.c"
    source.write_text(
        "\n".join([*own, f"const unsigned long long part_values[] = {{{values}}};", ""])
    )
    out = scratch / "values.o"
    subprocess.run([clang, "-c", "-x", "c", *flags, str(source), "-o", str(out)], check=True)
    with out.open("rb") as file:
        elf = ELFFile(file)
        table = elf.get_section_by_name(".symtab")
        assert isinstance(table, SymbolTableSection)
        symbols = table.get_symbol_by_name("part_values")
        assert symbols
        symbol = symbols[0]
        start = symbol["st_value"]
        data = elf.get_section(symbol["st_shndx"]).data()[start : start + symbol["st_size"]]
        order: Literal["little", "big"] = "little" if elf.little_endian else "big"
    return {name: int.from_bytes(data[8 * i : 8 * i + 8], order) for i, name in enumerate(names)}


def test_defines_are_read_as_c_writes_them() -> None:
    text = """
#ifndef ROWS
#define ROWS 1048576 /* rows, all files together */
#endif
#define SHIFTED (8 << 20)
#define  SPACED\t7
#define EXPRESSION (ROWS * 2)
#if WIDE
#define TWICE 1
#else
#define TWICE 2
#endif
#define SAME 4
#define SAME 4
"""
    assert c_constants(text) == {"ROWS": 1 << 20, "SHIFTED": 8 << 20, "SPACED": 7, "SAME": 4}


def test_the_unwinder_s_constants_follow_its_c_and_cannot_drift(tmp_path: Path) -> None:
    # GIVEN unwind.bpf.c, and a copy with a slot, the page shift and a size changed
    text = (bpf_directory() / "unwind.bpf.c").read_text()
    edits = {"#define UNWIND_RESUME_LOCK 2": "#define UNWIND_RESUME_LOCK 3",
             "#define UNWIND_PAGE_SHIFT 12": "#define UNWIND_PAGE_SHIFT 13",
             "#define UNWIND_MAPS 65536": "#define UNWIND_MAPS 4096"}  # fmt: skip
    changed = text
    for before, after in edits.items():
        assert before in changed
        changed = changed.replace(before, after)
    # THEN what is read from the copy is the copy's: a change on the C side reaches user space
    theirs = c_constants(changed)
    assert (theirs["UNWIND_RESUME_LOCK"], theirs["UNWIND_PAGE_SHIFT"], theirs["UNWIND_MAPS"]) == (
        3, 13, 4096)  # fmt: skip
    # AND user space holds what the C compiler makes of the shipped C: the slots
    # it fills (distinct, within the program array's size), the page index's
    # shift (4 KiB pages) and the tables' defaults, which are those bcc is given
    slot_names = ("UNWIND_STEP", "UNWIND_RESUME_ALLOC", "UNWIND_RESUME_LOCK", "UNWIND_VMA_LOOKUP")
    sizes_names = ("UNWIND_ROWS", "UNWIND_MAPS", "UNWIND_PAGES")
    truth = compiled(tmp_path, "unwind.bpf.c",
                     [*slot_names, "UNWIND_PROGS", "UNWIND_PAGE_SHIFT", *sizes_names],
                     UNWINDING)  # fmt: skip
    slots = (unwind_tables.STEP, unwind_tables.RESUME_ALLOC, unwind_tables.RESUME_LOCK,
             unwind_tables.VMA_LOOKUP)  # fmt: skip
    assert slots == tuple(truth[name] for name in slot_names)
    assert len(set(slots)) == 4 and max(slots) < truth["UNWIND_PROGS"]
    assert unwind_rows.UNWIND_PAGE_SHIFT == truth["UNWIND_PAGE_SHIFT"] == 12
    sizes = (unwind_tables.DEFAULT_ROWS, unwind_tables.DEFAULT_MAPS, unwind_tables.DEFAULT_PAGES)
    assert sizes == tuple(truth[name] for name in sizes_names) == (1 << 21, 1 << 16, 1 << 21)
    given = unwind_tables.unwind_defines()
    assert tuple(given[name] for name in sizes_names) == sizes


def test_the_command_line_s_defaults_are_the_request_s_and_the_c_s(tmp_path: Path) -> None:
    # GIVEN every option of every command, the request's defaults and the C's
    import click
    from mtrace_live.tracer.cli import cli
    from mtrace_live.tracer.loop import alloc_probes, plan

    request = plan.TraceRequest
    fields = {"max_outstanding": request.max_outstanding, "alloc_stacks": request.alloc_stacks,
              "stack_map_size": request.stack_entries}  # fmt: skip
    seen = set()
    context = click.Context(cli)
    commands = [cli, *(cli.get_command(context, name) for name in cli.list_commands(context))]
    for command in commands:
        assert command is not None
        for param in command.params:
            if param.name in fields:
                # THEN each option shows the request's default
                assert param.default == fields[param.name], (command.name, param.name)
                seen.add(param.name)
            if param.name == "buffer_pages" and isinstance(param, click.Option):
                help_text = param.help or ""
                assert f"default {plan.DEFAULT_BUFFER_PAGES} " in help_text
                assert f"and {plan.RECORD_BUFFER_PAGES} " in help_text
    assert seen == set(fields)
    # AND the two tables sized from the request get, from its defaults, the
    # C's own default sizes (twice as many rows), as the C compiler reads them
    allocs = compiled(tmp_path, "allocs.bpf.c", ["ALLOC_OUT_ROWS", "ALLOC_STACK_ROWS"])
    assert alloc_probes._open_rows(request.max_outstanding) == allocs["ALLOC_OUT_ROWS"]
    assert request.alloc_stacks is None  # (ALLOC_STACKS, or more for a Python target)
    assert alloc_probes._open_rows(plan.ALLOC_STACKS) == allocs["ALLOC_STACK_ROWS"]
