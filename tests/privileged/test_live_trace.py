"""The live trace (`run --` and `--pid`) against workloads that know what
they made the probes report: counts, decoded arguments, target selection,
the end of the trace, and loss accounting under overload."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

from mtrace_live.tracer.processes.sdt_glibc import SdtGlibc

from .conftest import MTRACE, built
from .test_usdt_counts import DOCUMENTED_PROBES
from .tracing import Reaper

M_PERTURB = -6
SUMMARY = re.compile(r"events: (\d+) in the kernel, (\d+) delivered, (\d+) lost")


def events_of(stdout: str) -> list[dict]:
    """The event lines of ``-o json`` (the tables at its end left out)."""
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return [line for line in lines if "table" not in line]


def summary_numbers(stderr: str) -> tuple[int, int, int]:
    match = SUMMARY.search(stderr)
    assert match, stderr
    kernel, delivered, lost = (int(x) for x in match.groups())
    return kernel, delivered, lost


def run_traced(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*MTRACE, "run", *args], capture_output=True, text=True, timeout=300, input=input
    )


def matches(known: dict, decoded: dict) -> bool:
    return all(decoded.get(name) == value for name, value in known.items())


def test_every_probe_counted_and_every_known_argument_decoded(
    probe_exerciser: Path, tmp_path: Path
) -> None:
    truth_file = tmp_path / "truth.json"
    done = run_traced(
        "--sdt-glibc", "--probes", "*", "-o", "json", "--",
        str(probe_exerciser), "--out", str(truth_file),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    truth = json.loads(truth_file.read_text())
    events = events_of(done.stdout)
    by_probe: dict[str, list[dict]] = {}
    for event in events:
        by_probe.setdefault(event["probe"], []).append(event["args"])

    counts = {name: len(by_probe.get(name, [])) for name in DOCUMENTED_PROBES}
    assert counts == {name: truth["probes"][name]["count"] for name in DOCUMENTED_PROBES}

    unmatched = []
    for name, entry in truth["probes"].items():
        free = list(by_probe.get(name, []))
        for known in entry["known_args"]:  # mallopt values, sizes, pointers ...
            hit = next((args for args in free if matches(known, args)), None)
            if hit is None:
                unmatched.append((name, known))
            else:
                free.remove(hit)
    for name, known in truth["tunables"].items():  # old -> new, from GLIBC_TUNABLES
        if not any(matches(known, args) for args in by_probe.get(name, [])):
            unmatched.append((name, known))
    assert unmatched == []
    kernel, delivered, lost = summary_numbers(done.stderr)
    assert (kernel, lost) == (delivered, 0)
    assert "ended by exit, command exit code 0" in done.stderr


def test_run_sees_probes_that_fire_before_main(sdt: SdtGlibc) -> None:
    # glibc's __libc_start_call_main calls setjmp once before main; /bin/true
    # calls none itself.
    done = run_traced("--sdt-glibc", "--probes", "setjmp", "-o", "json", "--", "/bin/true")
    assert done.returncode == 0, done.stderr
    setjmps = [e for e in events_of(done.stdout) if e["probe"] == "setjmp"]
    assert len(setjmps) == 1
    assert setjmps[0]["args"]["savemask"] == 0


def test_run_passes_the_exit_code_through(sdt: SdtGlibc) -> None:
    done = run_traced("--sdt-glibc", "--", "/bin/sh", "-c", "exit 7")
    assert done.returncode == 7, done.stderr


class Waiting:
    """mallopt_loop under the SDT glibc, running and waiting for "go"."""

    def __init__(self, sdt: SdtGlibc, reaper: Reaper, *args: str) -> None:
        self.proc = reaper.add(
            subprocess.Popen(
                [*sdt.wrap([str(built("mallopt_loop")), *args])],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline() == b"ready\n"
        self.proc.stdout.close()  # it prints nothing more
        self.pid = self.proc.pid

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.close()


def trace_pid(pid: int, sdt: SdtGlibc, reaper: Reaper, *args: str) -> subprocess.Popen[str]:
    """`mtrace-live --pid PID`, returned once it says it is tracing."""
    proc = reaper.add(
        subprocess.Popen(  # type: ignore[arg-type]
            [*MTRACE, "--pid", str(pid), "--lib", str(sdt.libc), "-o", "json", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    )
    assert proc.stderr is not None
    first = proc.stderr.readline()
    assert "tracing" in first, first + proc.stderr.read()
    return proc  # type: ignore[return-value]


def test_pid_traces_only_its_process_and_ends_when_it_exits(sdt: SdtGlibc) -> None:
    with Reaper() as reaper:
        target = Waiting(sdt, reaper, "100")
        decoy = Waiting(sdt, reaper, "1000")  # same probes, same libc, same time
        tracer = trace_pid(target.pid, sdt, reaper)
        decoy.go()
        target.go()
        assert target.proc.wait(timeout=60) == 0
        stdout, stderr = tracer.communicate(timeout=60)  # ends by itself
        assert tracer.returncode == 0, stderr
        decoy.proc.wait(timeout=60)
    events = [e for e in events_of(stdout) if e["probe"].startswith("memory_")]
    assert {e["pid"] for e in events} == {target.pid}
    mallopts = [e["args"] for e in events if e["probe"] == "memory_mallopt"]
    assert mallopts == [{"param_number": M_PERTURB, "value": i % 256} for i in range(100)] + [
        {"param_number": M_PERTURB, "value": 0}
    ]
    perturbs = [e["args"] for e in events if e["probe"] == "memory_mallopt_perturb"]
    # old is read through a rip-relative operand: perturb_byte(%rip).
    assert perturbs == [{"value": v, "old": max(v - 1, 0)} for v in range(100)] + [
        {"value": 0, "old": 99}
    ]
    assert "ended by exit" in stderr


def test_pid_exec_ends_the_trace_with_its_own_exit_code(sdt: SdtGlibc) -> None:
    with Reaper() as reaper:
        target = Waiting(sdt, reaper, "5", "--exec", "/bin/true")
        tracer = trace_pid(target.pid, sdt, reaper)
        target.go()
        _, stderr = tracer.communicate(timeout=60)
    assert tracer.returncode == 11, stderr
    assert f"pid {target.pid} exec'd" in stderr
    assert "Traceback" not in stderr
    kernel, delivered, lost = summary_numbers(stderr)  # the summary still comes
    assert kernel == delivered == 12 and lost == 0  # 6 mallopt + 6 perturb


def test_overload_is_accounted_exactly(sdt: SdtGlibc) -> None:
    # One 4 KiB page holds 42 records; 2 x 200,000 events overflow it.
    done = run_traced(
        "--sdt-glibc", "--probes", "memory_mallopt*", "--buffer-pages", "1", "-o", "json",
        "--", str(built("mallopt_loop")), "200000", input="go\n",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    kernel, delivered, lost = summary_numbers(done.stderr)
    assert kernel == 2 * 200_001
    assert lost > 0
    assert kernel == delivered + lost
    probe_events = [e for e in events_of(done.stdout) if e["probe"].startswith("memory_")]
    assert len(probe_events) == delivered


def test_closed_output_stops_with_a_summary(sdt: SdtGlibc) -> None:
    proc = subprocess.Popen(
        [*MTRACE, "run", "--sdt-glibc", "--probes", "memory_mallopt", "-o", "text", "--",
         str(built("mallopt_loop")), "100000"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.close()
    proc.stdout.readline()  # the header, then close the pipe as `| head -1` does
    proc.stdout.close()
    assert proc.stderr is not None
    stderr = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 12, stderr
    assert "the output was closed" in stderr
    assert "Traceback" not in stderr
    summary_numbers(stderr)


def test_a_pattern_matching_nothing_is_its_own_error(sdt: SdtGlibc) -> None:
    done = run_traced("--sdt-glibc", "--probes", "no_such_probe*", "--", "/bin/true")
    assert done.returncode == 13
    assert "no libc probe" in done.stderr and "Traceback" not in done.stderr


def test_a_user_without_privileges_gets_one_line(sdt: SdtGlibc) -> None:
    from tests.unit.cli_runs import assert_one_line, mtrace_unprivileged

    done = mtrace_unprivileged("run", "--lib", str(sdt.libc), "--", "/bin/true")
    assert_one_line(done, 3, "loading BPF programs needs root")


def test_ctrl_c_stops_a_trace_whose_output_cannot_keep_up(sdt: SdtGlibc) -> None:
    """The loop unpaced makes events faster than `-o text` writes them; the
    trace must still stop on SIGINT, with its summary, long before the
    workload would end."""
    with Reaper() as reaper:
        loop = reaper.add(
            subprocess.Popen(
                sdt.wrap([str(built("jmp_loop")), "2000000000"]), stdout=subprocess.DEVNULL
            )
        )
        tracer = reaper.add(
            subprocess.Popen(  # type: ignore[arg-type]
                [
                    *MTRACE,
                    "--pid",
                    str(loop.pid),
                    "--lib",
                    str(sdt.libc),
                    "--probes",
                    "setjmp",
                    "--probes",
                    "longjmp",
                    "-o",
                    "text",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        assert tracer.stdout is not None and tracer.stderr is not None
        assert "tracing" in tracer.stderr.readline()
        lines = [0]

        def count_lines() -> None:
            for _ in tracer.stdout:  # type: ignore[union-attr]
                lines[0] += 1

        reader = threading.Thread(target=count_lines, daemon=True)
        reader.start()
        while lines[0] < 200_000:  # well into the flood
            assert tracer.poll() is None, "the trace ended by itself"
            time.sleep(0.05)
        tracer.send_signal(signal.SIGINT)
        tracer.wait(timeout=120)
        reader.join(timeout=120)
        stderr = tracer.stderr.read()
        tracer.stderr.close()
        tracer.stdout.close()
        assert loop.poll() is None  # still looping: the trace did not wait for it
    assert tracer.returncode == 0, stderr
    assert "ended by SIGINT" in stderr
    kernel, delivered, lost = summary_numbers(stderr)
    assert delivered + lost == kernel
    assert lines[0] == delivered + 1  # the header, then every delivered event
