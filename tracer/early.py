"""What a start does before anything else is imported, click and the
command line's parsing included (tracer/entry.py for the ``mtrace-live``
command, tracer/cli.py's ``python -m``): the program the last start with
the same command line loaded is begun (tracer/bpf/preload.py), so that the
kernel's verifier has the other CPU from the start's first milliseconds.
"""

from __future__ import annotations


def preload_from(argv: list[str]) -> None:
    """``argv``: the command line, less the program's name."""
    if argv:
        from mtrace_live.tracer.bpf.preload import begin_from_command_line

        begin_from_command_line(argv)
