"""CPython 3.11-3.13 interpreters (x86-64, with the global interpreter
lock): where a thread's Python frames are, for the kernel's walk of them,
and what the frames it stored are called.

``interpreter`` finds an interpreter in an ELF file, or those a process has
mapped, with its ``Layout`` (``layout``: the offsets, best from the
interpreter's own data); ``threads`` finds where the libc keeps a thread's
pthread key values; ``process`` reads a running process from outside to
check the layout against it and to walk and name its frames; ``linetable``
gives an instruction's line; ``image`` and ``symbolic`` read the files'
data and code. The names below are the package's interface. Installed as
``mtrace_live.probes.cpython``; it imports the ELF layer, the errors and
the probes layer's disassembler (``uprobe_sites``).
"""

from .interpreter import Interpreter, find_interpreter, interpreters_of, mapped_path
from .layout import Layout
from .linetable import line_of
from .process import CodeInfo, CodeNames, ProcessView
from .threads import thread_slot

__all__ = [
    "CodeInfo",
    "CodeNames",
    "Interpreter",
    "Layout",
    "ProcessView",
    "find_interpreter",
    "interpreters_of",
    "line_of",
    "mapped_path",
    "thread_slot",
]
