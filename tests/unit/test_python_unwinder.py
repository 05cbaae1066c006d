"""Which targets run CPython (their stack tables are sized for Python's
many stacks): by a running process's mappings, or by a command's file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from mtrace_live.tracer.unwind.python import runs_python

PYENV_312 = Path("/root/.pyenv/versions/3.12.1/bin/python3.12")


@pytest.mark.parametrize(
    ("argv", "python"),
    [
        (["/usr/bin/python3.11"], True),  # Debian's: the interpreter linked into the executable
        ([str(PYENV_312)], True),  # pyenv's: a libpython it needs
        (["ls", "-l"], False),
        (["/no/such/program"], False),
        ([str(Path(__file__))], False),  # a script, not ELF
    ],
)
def test_a_command_runs_python_by_its_file(argv: list[str], python: bool) -> None:
    if argv[0] == str(PYENV_312) and not PYENV_312.is_file():
        pytest.fail(f"{PYENV_312} is missing (scripts/setup.sh installs it)")
    # GIVEN a command not run yet WHEN its file is looked at THEN it is one, or not
    assert runs_python([], argv) is python


def test_a_script_runs_python_by_its_interpreter_line(tmp_path: Path) -> None:
    # GIVEN scripts run by Debian's python3.11, directly and through env, and one by sh
    direct, through_env, shell = (tmp_path / name for name in ("direct", "env", "shell"))
    direct.write_text("#!/usr/bin/python3.11 -u\nprint(1)\n")
    through_env.write_text("#!/usr/bin/env -S /usr/bin/python3.11\nprint(1)\n")
    shell.write_text("#!/bin/sh\necho 1\n")
    for script in (direct, through_env, shell):
        script.chmod(0o755)
    # THEN the first two run Python (a server's launcher script), the third does not
    assert runs_python([], [str(direct)]) and runs_python([], [str(through_env)])
    assert not runs_python([], [str(shell)])


def test_a_running_process_runs_python_by_its_mappings() -> None:
    # GIVEN this interpreter running a child of itself, and a child that is not Python
    with subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                          stdin=subprocess.PIPE) as child, \
         subprocess.Popen(["cat"], stdin=subprocess.PIPE) as cat:  # fmt: skip
        try:
            # THEN the first runs Python, the second does not
            assert runs_python([child.pid], None)
            assert not runs_python([cat.pid], None)
        finally:
            for proc in (child, cat):
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait()
