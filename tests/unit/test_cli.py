"""The command line without root and without bcc: help, version, bad input."""

import os
import subprocess
from pathlib import Path

from .cli_runs import MTRACE, assert_one_line, mtrace_unprivileged
from .cli_runs import mtrace as run


def test_version_and_help_need_neither_root_nor_bcc(tmp_path: Path) -> None:
    # GIVEN a Python that cannot import bcc (the module is shadowed)
    shadow = tmp_path / "bcc"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('no bcc here')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    for args in (["--version"], ["--help"], ["count", "--help"]):
        # WHEN mtrace-live is asked for its version or help
        done = subprocess.run([*MTRACE, *args], capture_output=True, text=True, env=env)
        # THEN it answers
        assert done.returncode == 0, done.stderr
    assert "mtrace-live, version" in run("--version").stdout


def test_the_version_a_trace_reports_is_the_installed_distributions() -> None:
    # GIVEN the installed distribution's metadata (the version pip installed)
    from importlib.metadata import version

    from mtrace_live.tracer.loop import package_version

    installed = version("mtrace-live")
    # THEN the version a trace writes in its outputs, read without the
    # metadata, and the one --version prints are that one
    assert package_version() == installed
    assert run("--version").stdout.strip() == f"mtrace-live, version {installed}"


def test_dead_pid_is_one_line_and_exit_code_6() -> None:
    # pid_max is at most 2^22, so this pid cannot exist
    done = run("count", "--pid", "4194304")
    assert done.returncode == 6
    assert done.stderr.strip() == "mtrace-live: error: no process with pid 4194304"


def test_unknown_command_is_one_line_and_exit_code_6() -> None:
    done = run("count", "--", "/nonexistent/program")
    assert done.returncode == 6
    assert done.stderr.count("\n") == 1
    assert "command not found" in done.stderr


def test_neither_pid_nor_command_is_a_usage_error() -> None:
    done = run("count")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr


def test_non_root_user_gets_one_line_and_exit_code_3() -> None:
    done = mtrace_unprivileged("count", "--kmem-only", "--", "/bin/true")
    assert_one_line(done, 3, "mtrace-live: error: loading BPF programs needs root")


def test_libc_without_probes_is_one_line_and_exit_code_5(tmp_path: Path) -> None:
    # The distro's own libc has no SDT probes on Debian; a copy of any ELF
    # file without notes stands for it on systems whose libc has them.
    plain = tmp_path / "libc.so.6"
    (tmp_path / "plain.c").write_text("int main(void) { return 0; }\n")
    subprocess.run(["gcc", "-o", str(plain), str(tmp_path / "plain.c")], check=True)
    done = run("count", "--lib", str(plain), "--", "/bin/true")
    assert done.returncode == 5, done.stderr
    assert "has no libc SDT probes" in done.stderr
    assert "Traceback" not in done.stderr


def test_doctor_without_privileges_says_not_permitted_exit_3() -> None:
    done = mtrace_unprivileged("doctor")
    assert done.returncode == 3, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("FAIL  privileges: loading BPF programs needs root")
    assert "Traceback" not in done.stderr


def test_count_on_a_file_that_is_not_elf_is_exit_9_as_for_probes(tmp_path: Path) -> None:
    text = tmp_path / "libc.so.6"
    text.write_text("GROUP ( /lib/libc.so.6 )\n")
    assert_one_line(
        run("count", "--lib", str(text), "--", "/bin/true"), 9, "not a readable ELF file"
    )


def test_trace_of_a_dead_pid_is_exit_6() -> None:
    assert_one_line(run("--pid", "4194304"), 6, "no process with pid 4194304")


def test_trace_of_a_pid_whose_libc_has_no_probes_points_to_doctor(tmp_path: Path) -> None:
    # GIVEN a "libc" with no SDT notes that is no glibc either (a plain
    # program: nothing to derive the probes from), traced without the
    # allocation functions (--no-allocs: the libc probes are all that is asked for)
    plain = tmp_path / "libc.so.6"
    subprocess.run(["cp", "/bin/true", str(plain)], check=True)
    done = run("--pid", str(os.getpid()), "--lib", str(plain), "--no-allocs")
    # THEN one line says why, and where to look
    assert_one_line(done, 5, "has no libc SDT probes")
    assert "is not a glibc" in done.stderr
    assert "mtrace-live doctor" in done.stderr


def test_a_library_with_neither_probes_nor_allocation_functions_is_refused(
    tmp_path: Path,
) -> None:
    # GIVEN a "libc" that is a plain program: no SDT notes, no malloc exported
    plain = tmp_path / "libc.so.6"
    subprocess.run(["cp", "/bin/true", str(plain)], check=True)
    # WHEN it is traced
    done = run("--pid", str(os.getpid()), "--lib", str(plain))
    # THEN one line names both missing sources, before anything is attached
    assert_one_line(done, 5, "exports none of the allocation functions")
    assert "no libc SDT probes" in done.stderr


def test_trace_needs_pid_all_or_run() -> None:
    done = run()
    assert done.returncode == 2
    assert "give --pid N or --all" in done.stderr
    assert "Traceback" not in done.stderr


def test_trace_options_are_checked_before_anything_runs() -> None:
    done = run("run", "--buffer-pages", "3", "--", "/bin/true")
    assert done.returncode == 2 and "power of two" in done.stderr


def test_a_missing_command_under_the_sdt_glibc_is_exit_6_before_anything_is_written(
    tmp_path: Path,
) -> None:
    # GIVEN an SDT glibc build where mtrace-live looks for one
    build = tmp_path / "build"
    build.mkdir()
    (build / "libc.so.6").write_bytes(b"\x7fELF")
    (build / "testrun.sh").write_text('#!/bin/sh\nexec "$@"\n')
    (build / "testrun.sh").chmod(0o755)
    (tmp_path / "current").write_text(f"{build}\n")
    env = dict(os.environ, MTRACE_SDT_GLIBC_DIR=str(tmp_path))
    out = tmp_path / "out.d"
    for args in (["run", "--sdt-glibc"], ["record", "-o", str(out), "--libc", "--sdt-glibc"]):
        # WHEN the command to run does not exist
        done = subprocess.run([*MTRACE, *args, "--", "/nonexistent/cmd"], capture_output=True,
                              text=True, env=env, timeout=120)  # fmt: skip
        # THEN it is one line and exit 6, as without --sdt-glibc, and no record set is left
        assert_one_line(done, 6, "command not found or not executable: /nonexistent/cmd")
        assert not out.exists()


def test_every_example_in_a_commands_help_stands_on_a_line_of_its_own() -> None:
    # GIVEN each command's help text, as click wraps it for the terminal
    from mtrace_live.tracer import cli

    for name in cli.COMMANDS:
        command = cli.cli.get_command(None, name)  # type: ignore[arg-type]
        assert command is not None and command.help is not None, name
        examples = [line.strip() for line in command.help.splitlines()
                    if line.strip().startswith("mtrace-live ")]  # fmt: skip
        shown = [line.strip() for line in run(name, "--help").stdout.splitlines()]
        # THEN it has examples, and each is a whole line of the help, as written
        assert examples, f"{name}'s help has no example"
        for example in examples:
            assert example in shown, (name, example)


# The command line run as the console entry runs it, with an object whose
# finalizer says when the interpreter tears its modules down, and an exit
# function; argv[1]: "thread" keeps a non-daemon thread running to the end.
_LEAVING = """
import atexit, os, sys, threading
import mtrace_live.tracer.cli as cli
class Finalized:
    def __del__(self):
        os.write(2, b"torn down\\n")
kept = Finalized()
atexit.register(lambda: os.write(2, b"exit function\\n"))
if sys.argv[1] == "thread":  # (let go as the interpreter's ending begins)
    gate = threading.Event()
    threading.Thread(target=gate.wait).start()
    threading._register_atexit(gate.set)
sys.argv = ["mtrace-live", *sys.argv[2:]]
cli.main_and_leave()
"""


def test_the_command_ends_without_the_interpreters_teardown() -> None:
    # GIVEN the command line as the console entry runs it
    for args, code in ((["--version"], 0), (["count", "--pid", "4194304"], 6)):
        # WHEN it ends (an answer, then an error)
        done = subprocess.run([*MTRACE[:1], "-c", _LEAVING, "plain", *args], capture_output=True,
                              text=True, timeout=120)  # fmt: skip
        # THEN its exit code and output are whole, its exit functions ran,
        # and the interpreter freed nothing (no finalizer ran)
        assert done.returncode == code, done.stderr
        assert ("mtrace-live, version" in done.stdout) == (code == 0)
        assert "exit function" in done.stderr
        assert "torn down" not in done.stderr
    # AND with a thread still running at the end, the interpreter ends as
    # usual: the thread waited for, then everything torn down
    done = subprocess.run([*MTRACE[:1], "-c", _LEAVING, "thread", "--version"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and "mtrace-live, version" in done.stdout
    assert "exit function" in done.stderr and "torn down" in done.stderr


def test_a_command_started_with_its_output_or_errors_closed_ends_as_it_should() -> None:
    # GIVEN the command line started with its standard output closed, then
    # its standard error (as some service managers start programs)
    for closed in (">&-", "2>&-"):
        done = subprocess.run(["sh", "-c", f'exec "$0" "$@" {closed}', *MTRACE, "--version"],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        # THEN it ends with its exit code, 0 (and, where its errors are still
        # open, no traceback on them)
        assert done.returncode == 0, done.stderr
        if closed == ">&-":
            assert "Traceback" not in done.stderr
