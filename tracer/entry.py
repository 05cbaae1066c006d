"""The ``mtrace-live`` command's entry: the data classes' methods are taken
from the code kept by earlier runs (probes/elf/kept_code.py), then the
program the last start with the same command line loaded is begun
(tracer/bpf/preload.py) before anything else is imported, click and the
command line's parsing included. Then the command line is parsed and run
(tracer/cli.py), and the process ends as soon as it is done
(``main_and_leave``)."""

from __future__ import annotations

import sys


def launch() -> None:
    from mtrace_live.probes.elf import kept_code

    kept_code.install()
    from mtrace_live.tracer.bpf.preload import begin_from_command_line

    begin_from_command_line(sys.argv[1:])
    from mtrace_live.tracer.cli import main_and_leave

    main_and_leave()
