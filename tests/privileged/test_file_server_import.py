"""The file server imports pyelftools' parser itself, after its fork
(tracer/unwind/file_server.py): the trace's start no longer does. A module
whose import another thread of the trace had begun at the fork would stay
locked in the child for ever; the server then ends within IMPORT_S (the
trace serves every ask itself, as where it could not be started), and the
trace's close never waits more than ENDING_S for a server that does not end.

Each case runs in an interpreter of its own, where the parser was never
imported: a thread begins importing it and is held there while the server
is forked."""

from __future__ import annotations

import subprocess
import sys

from .conftest import REPO

HELD = """
import importlib.abc, importlib.machinery, os, select, signal, sys, threading
from mtrace_live.tracer.unwind import file_server

assert "elftools.elf.elffile" not in sys.modules
begun, release = threading.Event(), threading.Event()

class Held(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "elftools.elf.elffile":
            return importlib.machinery.ModuleSpec(name, self)
        return None
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        begun.set()
        release.wait()

sys.meta_path.insert(0, Held())
threading.Thread(target=lambda: __import__("elftools.elf.elffile"), daemon=True).start()
begun.wait()
fds = {name: os.open("/dev/null", os.O_RDONLY) for name in file_server.MAPS}
"""

ALARMED_PART = """
file_server.IMPORT_S = 1
server = file_server.FileServer(fds, (0, 1), (0, 1))
ended = os.pidfd_open(server.pid)
print("ended" if select.select([ended], [], [], 120)[0] else "still there", flush=True)
info = os.waitid(os.P_PIDFD, ended, os.WEXITED | os.WNOWAIT)
print("alarmed" if (info.si_code, info.si_status) == (os.CLD_KILLED, signal.SIGALRM)
      else f"ended otherwise {info}", flush=True)
print("alive" if server.alive() else "gone", flush=True)
server.close()
print("closed", flush=True)
release.set()
"""

STUCK_PART = """
file_server.IMPORT_S, file_server.ENDING_S = 3600, 1.0
server = file_server.FileServer(fds, (0, 1), (0, 1))
print("alive" if server.alive() else "gone", flush=True)
server.close()
print("closed", flush=True)
print("gone" if not os.path.exists(f"/proc/{server.pid}") else "still there", flush=True)
release.set()
"""


def scenario(part: str) -> list[str]:
    """What a scenario printed: HELD, then ``part``."""
    done = subprocess.run([sys.executable, "-c", HELD + part], capture_output=True, text=True,
                          timeout=300, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_a_server_whose_parser_import_cannot_end_is_ended() -> None:
    # GIVEN a trace's thread holding the parser's import when the server is forked
    # THEN the server's alarm ends it, it is seen gone, and the trace's close returns
    assert scenario(ALARMED_PART) == ["ended", "alarmed", "gone", "closed"]


def test_the_traces_close_ends_a_server_that_does_not_end() -> None:
    # GIVEN the same, with an alarm far off: the server stuck in its import
    # THEN the trace's close kills it after ENDING_S, and reaps it
    assert scenario(STUCK_PART) == ["alive", "closed", "gone"]
