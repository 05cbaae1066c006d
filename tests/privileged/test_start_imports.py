"""What a warm start has imported when it says the trace is on.

A start whose program and facts are kept (the second with the same
options) must not have imported, by its "Ctrl-C to stop" line, what only a
cold start, the trace's events or its end need: numpy (the trace's
first events are read after the line: before it, the unwind rows and every
table are written as raw bytes, probes/elf/lazy.py), bcc (it only compiles: a program from
the cache is loaded, attached and its maps read without it), the
disassembler (capstone: the allocation sites, the lock-wait site and the
derived probes are kept facts), the Rust demangler (pyderust: frames are named after the line), the
live view (rich: -o json has none), the DWARF line reader (_lines:
naming) and pyelftools' parser (the start opens no ELF file: the file
server, forked at the start, imports it itself, tracer/unwind/file_server.py).
The tracer runs under a small wrapper that writes the names in
sys.modules at the moment the line is written to its stderr."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

from .conftest import REPO
from .tracing import Reaper, wait_for_detach, wait_for_line

READY = "Ctrl-C to stop"
# never imported by a warm start before its line
NOT_BEFORE_THE_LINE = ("numpy", "bcc", "capstone", "pyderust", "rich",
                       "mtrace_live.probes.elf._lines",
                       "elftools.elf.elffile", "elftools.dwarf.dwarfinfo",
                       # the standard library's heavier tools, for cold starts, commands
                       # and the end: importlib.resources and tempfile bring zipfile,
                       # shutil, random, bz2 and lzma (about 8 ms in all)
                       "importlib.resources", "tempfile", "shutil", "subprocess")  # fmt: skip
# sys.stderr tapped: at the line, sys.modules' names written to argv[1]
TAP = """
import json, runpy, sys
out, sys.argv = sys.argv[1], ["mtrace-live", *sys.argv[2:]]
class Tap:
    def __init__(self, stream):
        self.stream = stream
    def write(self, text):
        if "Ctrl-C to stop" in text:
            with open(out, "w") as names:
                json.dump(sorted(sys.modules), names)
        return self.stream.write(text)
    def __getattr__(self, name):
        return getattr(self.stream, name)
sys.stderr = Tap(sys.stderr)
runpy.run_module("mtrace_live.tracer.cli", run_name="__main__")
"""


# a Python process that says it runs, then sleeps
PYTHON_SLEEPS = "import sys, time; print('sleeping', flush=True); time.sleep(600)"


def modules_at_the_line(target: int, tmp: Path, run: int, output: str = "json") -> list[str]:
    """A start with --pid ``target`` -o ``output``: the modules loaded at its line."""
    names, err = tmp / f"modules-{run}.json", tmp / f"trace-{run}.err"
    with Reaper() as reaper, open(err, "wb") as errors:
        tracer = reaper.add(subprocess.Popen(
            [sys.executable, "-c", TAP, str(names), "--pid", str(target), "-o", output],
            stdout=subprocess.DEVNULL, stderr=errors, cwd=REPO))  # fmt: skip
        wait_for_line(err, READY, tracer, timeout=120)
        tracer.send_signal(2)  # SIGINT: the trace ends as at Ctrl-C
        assert tracer.wait(timeout=120) == 0, err.read_text()
    loaded: list[str] = json.loads(names.read_text())
    return loaded


def test_a_warm_start_imports_no_numpy_disassembler_demangler_live_view_or_line_reader(
    tmp_path: Path,
) -> None:
    # GIVEN a sleeping process, traced once (the program and its facts kept),
    # and a sleeping Python process (its trace walks Python frames too)
    with Reaper() as reaper:
        sleeper = reaper.add(subprocess.Popen(["sleep", "600"]))
        first = modules_at_the_line(sleeper.pid, tmp_path, 1)
        # WHEN it is traced again with the same options, then with the live
        # view (the default on a terminal: drawn only once the trace is on)
        loaded = modules_at_the_line(sleeper.pid, tmp_path, 2)
        in_view = modules_at_the_line(sleeper.pid, tmp_path, 3, "live")
        # AND the Python process, twice (the first keeps its interpreter's facts)
        python = reaper.add(subprocess.Popen(["/usr/bin/python3", "-c", PYTHON_SLEEPS],
                                             stdout=subprocess.PIPE))  # fmt: skip
        assert python.stdout is not None and python.stdout.readline() == b"sleeping\n"
        python.stdout.close()
        modules_at_the_line(python.pid, tmp_path, 4)
        of_python = modules_at_the_line(python.pid, tmp_path, 5)
    # THEN none of those starts has loaded any of them by its line
    for start, names in (("-o json", loaded), ("-o live", in_view), ("Python", of_python)):
        assert "mtrace_live.tracer.loop.live" in names  # (the names are the tracer's own)
        heavy = [name for name in names if any(name == top or name.startswith(f"{top}.")
                                               for top in NOT_BEFORE_THE_LINE)]  # fmt: skip
        assert heavy == [], f"{start}: imported before the line: {heavy}"
    assert "mtrace_live.exporters.live_view" in in_view  # (its sink made: the module is light)
    assert "mtrace_live.tracer.unwind.python" in of_python
    # (the first start is cold where this code's facts were never kept: it
    # may disassemble; either way it reached its line)
    assert "mtrace_live.tracer.loop.live" in first


def programs_while_tracing(target: int, tmp: Path) -> tuple[list[str], list[int]]:
    """The names of the BPF programs a --pid ``target`` trace holds (bpftool,
    while it is on: those whose ids the tracer's descriptors give), and the
    flags of its map named ``outstanding``."""
    err = tmp / "programs.err"
    with Reaper() as reaper, open(err, "wb") as errors:
        tracer = reaper.add(subprocess.Popen(
            [sys.executable, "-m", "mtrace_live.tracer.cli", "--pid", str(target), "-o", "json"],
            stdout=subprocess.DEVNULL, stderr=errors, cwd=REPO))  # fmt: skip
        wait_for_line(err, READY, tracer, timeout=120)
        listed = json.loads(subprocess.run(["bpftool", "-j", "prog", "show"], capture_output=True,
                                           text=True, check=True).stdout)  # fmt: skip
        maps = json.loads(subprocess.run(["bpftool", "-j", "map", "show"], capture_output=True,
                                         text=True, check=True).stdout)  # fmt: skip
        programs, map_ids = held_ids(tracer.pid, "prog_id"), held_ids(tracer.pid, "map_id")
        tracer.send_signal(2)
        assert tracer.wait(timeout=120) == 0, err.read_text()
    wait_for_detach()
    flags = [int(str(m.get("flags", 0)), 0) for m in maps
             if m.get("name") == "outstanding" and m.get("id") in map_ids]  # fmt: skip
    names = [str(program.get("name", "")) for program in listed if program.get("id") in programs]
    return names, flags


def held_ids(pid: int, field: str) -> set[int]:
    """The ids of the BPF objects process ``pid`` holds a descriptor of
    (``field``: prog_id or map_id in their fdinfo)."""
    ids = set()
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        with contextlib.suppress(OSError):  # (closed meanwhile)
            for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
                if line.startswith(f"{field}:"):
                    ids.add(int(line.split(":", 1)[1]))
    return ids


def test_a_start_whose_options_traced_no_python_loads_no_python_walker_and_maps_its_table(
    tmp_path: Path,
) -> None:
    # GIVEN a sleeping process (no interpreter in it), traced once
    with Reaper() as reaper:
        sleeper = reaper.add(subprocess.Popen(["sleep", "600"]))
        programs_while_tracing(sleeper.pid, tmp_path)
        # WHEN it is traced again with the same options
        loaded, flags = programs_while_tracing(sleeper.pid, tmp_path)
    # THEN the trace's own walker is loaded, but not the Python frames'
    # walker: the last start with these options never asked for it
    assert "unwind_step" in loaded
    assert "unwind_python" not in loaded
    # AND its outstanding allocations' table is one it can map (BPF_F_MMAPABLE)
    assert len(flags) == 1 and flags[0] & 1 << 10
