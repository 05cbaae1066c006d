"""The file server imports pyelftools' parser itself, after its fork
(tracer/unwind/file_server.py): the trace's start no longer does. A module
whose import another thread of the trace had begun at the fork would stay
locked in the child for ever; the server then ends within IMPORT_S (the
trace serves every ask itself, as where it could not be started), and the
trace's close does not wait on it.

Run in an interpreter of its own, where the parser was never imported: a
thread begins importing it and is held there while the server is forked."""

from __future__ import annotations

import subprocess
import sys

from .conftest import REPO

SCENARIO = """
import importlib.abc, importlib.machinery, os, select, sys, threading
from mtrace_live.tracer.unwind import file_server

assert "elftools.elf.elffile" not in sys.modules
file_server.IMPORT_S = 1
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
server = file_server.FileServer(fds, (0, 1), (0, 1))
ended = os.pidfd_open(server.pid)
print("ended" if select.select([ended], [], [], 120)[0] else "still there", flush=True)
print("alive" if server.alive() else "gone", flush=True)
server.close()
print("closed", flush=True)
release.set()
"""


def test_a_server_whose_parser_import_cannot_end_is_ended() -> None:
    # GIVEN a trace's thread holding the parser's import when the server is forked
    done = subprocess.run([sys.executable, "-c", SCENARIO], capture_output=True, text=True,
                          timeout=300, cwd=REPO)  # fmt: skip
    assert done.returncode == 0, done.stderr
    # THEN the server ends (its import stopped by its alarm), is seen gone,
    # and the trace's close returns
    assert done.stdout.split() == ["ended", "gone", "closed"], (done.stdout, done.stderr)
