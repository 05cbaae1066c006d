"""How a trace ends, and the exit codes of what stops one before it starts,
provoked for real as root: --duration, Ctrl-C and SIGTERM passed on by
`run`, --leaks-older-than on a live target, and exit codes 4, 8, 18 and 20
(docs/exit-codes.md)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

from .conftest import MTRACE, built
from .tracing import Reaper, finish, wait_for_line, wait_until

READY = "Ctrl-C to stop"


def assert_one_line(done: subprocess.CompletedProcess[str], code: int, words: str) -> None:
    """One error line with ``words``, exit ``code``, no traceback."""
    assert (done.returncode, done.stderr.count("\n")) == (code, 1), done.stdout + done.stderr
    assert words in done.stderr and "Traceback" not in done.stderr


def held_workload(reaper: Reaper, truth: Path) -> subprocess.Popen[bytes]:
    """The allocation workload, waiting to start and, once done, to exit."""
    argv = [str(built("alloc_workload")), "--wait", "--hold", "--out", str(truth)]
    work = reaper.add(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE))
    assert work.stdout is not None and work.stdout.readline() == b"ready\n"
    return work


def release(work: subprocess.Popen[bytes], expect: bytes) -> None:
    assert work.stdin is not None and work.stdout is not None
    work.stdin.write(b"go\n")
    work.stdin.flush()
    assert work.stdout.readline() == expect


def test_duration_ends_a_trace_of_a_live_process(tmp_path: Path) -> None:
    with Reaper() as reaper:
        # GIVEN a process that stays alive, traced with --duration
        work = held_workload(reaper, tmp_path / "truth.json")
        done = subprocess.run([*MTRACE, "--pid", str(work.pid), "-o", "summary", "--duration",
                               "1"], capture_output=True, text=True, timeout=300)  # fmt: skip
        # THEN the trace ended by the duration, cleanly, the process untouched
        assert done.returncode == 0, done.stderr
        assert re.search(r"^mtrace-live: [\d.]+ s, ended by duration$", done.stdout, re.M), (
            done.stdout)  # fmt: skip
        assert work.poll() is None
        release(work, b"done\n")
        assert finish(work) == 0


@pytest.mark.parametrize("older_than", ["0", "3600"])
def test_leaks_older_than_lists_what_a_live_process_still_holds(
    tmp_path: Path, older_than: str
) -> None:
    truth_file = tmp_path / "truth.json"
    with Reaper() as reaper:
        # GIVEN the workload traced by pid with --leaks-older-than
        work = held_workload(reaper, truth_file)
        err = tmp_path / "trace.err"
        with open(err, "wb") as errors:
            tracer = reaper.add(subprocess.Popen(
                [*MTRACE, "--pid", str(work.pid), "-o", "summary", "--leaks-older-than",
                 older_than], stdout=subprocess.PIPE, stderr=errors, text=True,
            ))  # fmt: skip
        wait_for_line(err, READY, tracer, timeout=120)  # type: ignore[arg-type]
        # WHEN it has done its work, its leaks still held, and the trace is stopped
        release(work, b"done\n")
        tracer.send_signal(signal.SIGINT)
        summary, _ = tracer.communicate(timeout=120)
        assert tracer.returncode == 0, err.read_text()
        assert finish(work) == 0
    # THEN the summary lists what is outstanding for that long, by stack
    heading = f"outstanding for over {older_than} s, by stack:"
    assert heading in summary, summary
    listed = summary.split(heading)[1].splitlines()
    if older_than == "3600":
        assert listed[1] == "(none)", listed
        return
    # each leaking function with the blocks and bytes it leaked
    blocks: dict[str, int] = defaultdict(int)
    for line in listed[2:]:
        fields = line.split()
        if len(fields) >= 6 and (site := re.match(r"(\w+)\+0x", fields[5])):
            blocks[site[1]] += int(fields[1])
    leaked: dict[str, int] = defaultdict(int)
    for site in json.loads(truth_file.read_text())["sites"]:
        leaked[site["function"]] += site["leaked_calls"]
    for function, count in leaked.items():
        assert blocks.get(function, 0) == count, (function, listed)


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def ignored_signals(status: str) -> set[int]:
    """The signal numbers a /proc/PID/status text's SigIgn line holds."""
    line = next(line for line in status.splitlines() if line.startswith("SigIgn:"))
    mask = int(line.split()[1], 16)
    return {sig for sig in range(1, 65) if mask >> (sig - 1) & 1}


def test_run_starts_its_command_with_the_signals_a_shell_would_leave_it(tmp_path: Path) -> None:
    # GIVEN mtrace-live started with SIGINT and SIGQUIT ignored (a script's
    # background job), and a command that saves its own signal dispositions
    status = tmp_path / "status"
    argv = [*MTRACE, "run", "-o", "summary", "--", "sh", "-c", f"cat /proc/$$/status > {status}"]
    ignore = lambda: [signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGQUIT)]  # noqa: E731
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, preexec_fn=ignore)
    assert done.returncode == 0, done.stderr
    ignored = ignored_signals(status.read_text())
    # THEN the signals run passes on, and those Python ignores for itself
    # (a closed pipe, a file too large), reach the command as they would untraced
    assert not ignored & {signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGXFSZ}, ignored
    # AND what run does not pass on stays as the command's caller left it
    assert signal.SIGQUIT in ignored, ignored


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 42), (signal.SIGTERM, 43)])
def test_run_passes_ctrl_c_and_sigterm_on_to_its_command(
    tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    # GIVEN a command that says which signal it got, and exits with a code of its own
    said, ready = tmp_path / "signal", tmp_path / "ready"
    script = (f"trap 'echo INT > {said}; exit 42' INT; trap 'echo TERM > {said}; exit 43' TERM; "
              f"touch {ready}; while :; do sleep 0.05; done")  # fmt: skip
    with Reaper() as reaper:
        # (started with SIGINT ignored, as a script's background job is: the
        # command must still be able to act on a Ctrl-C passed on)
        tracer = reaper.add(subprocess.Popen(
            [*MTRACE, "run", "-o", "summary", "--", "sh", "-c", script],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ignore_sigint,
        ))  # fmt: skip
        # WHEN mtrace-live gets the signal once the command runs (traced: run
        # starts it only once everything is attached)
        wait_until(lambda: ready.exists() or tracer.poll() is not None, "the command started")
        assert tracer.poll() is None, tracer.communicate()
        tracer.send_signal(sig)
        out, err = tracer.communicate(timeout=120)
    # THEN the command got the same signal, and mtrace-live exits with its code
    assert said.exists(), (tracer.returncode, out, err)
    assert said.read_text().strip() == sig.name.removeprefix("SIG")
    assert tracer.returncode == code, err
    assert "Traceback" not in err and "mtrace-live:" in out + err


def test_exit_4_when_bcc_cannot_be_imported(tmp_path: Path) -> None:
    # GIVEN a Python whose bcc module fails to import (shadowed)
    (tmp_path / "bcc").mkdir()
    (tmp_path / "bcc" / "__init__.py").write_text("raise ImportError('no bcc here')\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run([*MTRACE, "count", "--kmem-only", "--", "/bin/true"],
                          capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert_one_line(done, 4, "the bcc Python bindings are not importable")


def test_exit_8_when_tracefs_is_not_mounted() -> None:
    # GIVEN a mount namespace whose tracefs mounts are covered by empty tmpfs
    cover = ("mount -t tmpfs none /sys/kernel/tracing && "
             "{ mount -t tmpfs none /sys/kernel/debug || true; }")  # fmt: skip
    count = [*MTRACE, "count", "--kmem-only", "--", "/bin/true"]
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'{cover} && exec "$0" "$@"', *count]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert_one_line(done, 8, "tracefs is not mounted")


def test_exit_18_when_serve_has_no_such_user() -> None:
    done = subprocess.run([*MTRACE, "serve", "--no-libc", "--user", "nosuch-mtrace-user",
                           "--web.listen-address", "127.0.0.1:0"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert_one_line(done, 18, "no user 'nosuch-mtrace-user' to run as")


def test_exit_20_when_the_pprof_file_cannot_be_written(tmp_path: Path) -> None:
    # GIVEN a --pprof path in a directory that does not exist
    target = tmp_path / "missing" / "heap.pb.gz"
    done = subprocess.run([*MTRACE, "run", "-o", "summary", "--pprof", str(target), "--",
                           "/bin/true"], capture_output=True, text=True, timeout=120)  # fmt: skip
    # THEN it is refused before anything runs, in one line
    assert_one_line(done, 20, f"cannot write {target}")
    assert not target.parent.exists()
