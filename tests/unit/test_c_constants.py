"""The constants user space shares with the BPF program are read from its C
(probes/program.py ``part_constants``), written once there: the unwinder's
tail-call slots, its page index's shift and its tables' default sizes; the
ring's and the stack map's default sizes, the lock tables', the sampling
table's and the SDT handlers' count. The command line's defaults are the
request's, and those the C's."""

from __future__ import annotations

from mtrace_live.probes.program import bpf_directory, c_constants
from mtrace_live.tracer import unwind_rows, unwind_tables


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


def test_the_unwinder_s_constants_follow_its_c_and_cannot_drift() -> None:
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
    # AND user space holds the shipped C's: the slots it fills (distinct, within the program
    # array's size), the page index's shift (4 KiB pages) and the tables' defaults
    ours = c_constants(text)
    slots = (unwind_tables.STEP, unwind_tables.RESUME_ALLOC, unwind_tables.RESUME_LOCK,
             unwind_tables.VMA_LOOKUP)  # fmt: skip
    assert slots == (ours["UNWIND_STEP"], ours["UNWIND_RESUME_ALLOC"], ours["UNWIND_RESUME_LOCK"],
                     ours["UNWIND_VMA_LOOKUP"])  # fmt: skip
    assert len(set(slots)) == 4 and max(slots) < ours["UNWIND_PROGS"]
    assert unwind_rows.UNWIND_PAGE_SHIFT == ours["UNWIND_PAGE_SHIFT"] == 12
    sizes = (unwind_tables.DEFAULT_ROWS, unwind_tables.DEFAULT_MAPS, unwind_tables.DEFAULT_PAGES)
    assert sizes == (1 << 21, 1 << 16, 1 << 21)
    assert unwind_tables.unwind_defines()["UNWIND_MAPS"] == ours["UNWIND_MAPS"]


def test_the_command_line_s_defaults_are_the_request_s_and_the_c_s() -> None:
    # GIVEN every option of every command, the request's defaults and the C's
    import click
    from mtrace_live.probes.program import part_constants
    from mtrace_live.tracer import alloc_probes, plan
    from mtrace_live.tracer.cli import cli

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
    # C's own default sizes (twice as many rows); the other shared sizes are
    # read from the C (probes/program.py part_constants)
    allocs = part_constants("allocs.bpf.c")
    assert alloc_probes._open_rows(request.max_outstanding) == allocs["ALLOC_OUT_ROWS"]
    assert alloc_probes._open_rows(request.alloc_stacks) == allocs["ALLOC_STACK_ROWS"]
