"""The code of the project's data classes, compiled once and kept between runs.

``dataclasses`` writes each class's methods (``__init__``, ``__repr__``,
``__eq__``, ``__hash__``, a frozen class's ``__setattr__`` and
``__delattr__``) as Python source when the class is made, and compiles that
source there and then: a warm start makes about 100 such classes before its
line, and their compiling was about half of its imports' time
(docs/performance.md, section 12). ``install`` gives ``dataclasses`` an
``exec`` that compiles each text once: the code object is kept, marshalled,
in the plan cache's directory (``files/class-code-TAG.bin``, TAG this
interpreter's cache tag, bytecode magic and optimization level), and a text
kept there is not compiled again. What runs is what ``exec`` would have run:
the text itself is the key, compiled as ``exec`` compiles it (as
``<string>``, inheriting no ``__future__`` flags).

The file is code this process runs, so one that another user owns or could
write (or whose directory is so) is not read, and neither is one whose
digest does not match its contents; any doubt and the classes are compiled
as before. It is written at the process's end, only where this process
compiled a text it did not find, atomically, and its errors are ignored:
the kept code only ever saves time. Installed by the command's entry
(tracer/entry.py), before anything else of the project is imported.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import dataclasses
import hashlib
import importlib.util
import marshal
import sys
from pathlib import Path
from types import CodeType
from typing import Any

from mtrace_live.probes.elf.facts import (
    FOLDER,
    plan_cache_dir,
    read_private_file,
    write_private_file,
)

MAGIC = b"mtrace-live class code 1\n"
DIGEST_SIZE = 32
# Texts kept at most: about 600 are the project's own today. Past this
# (texts of earlier versions of the code pile up), a save keeps only the
# texts its own process used.
KEEP_TEXTS = 4096

_kept: dict[str, CodeType] = {}
_compiled: set[str] = set()  # texts this process compiled (not found kept)
_used: set[str] = set()  # texts this process ran (kept alone past KEEP_TEXTS)
_path: Path | None = None


def file_name() -> str:
    """This interpreter's file: code objects are only valid for the
    bytecode (and optimization level) they were compiled for."""
    tag = sys.implementation.cache_tag or "none"
    return f"class-code-{tag}-{importlib.util.MAGIC_NUMBER.hex()}-O{sys.flags.optimize}.bin"


def install() -> None:
    """From now on, data classes' methods are compiled at most once per
    text, across runs. A second call does nothing."""
    global _path
    if getattr(dataclasses, "exec", None) is _exec:
        return
    directory = plan_cache_dir()
    if directory is not None:
        _path = directory / FOLDER / file_name()
        _kept.update(read(_path))
        atexit.register(keep_compiled)
    dataclasses.exec = _exec  # type: ignore[attr-defined]  # (the module's own name shadows the built-in)


def _exec(source: Any, globals: dict[str, Any], locals: dict[str, Any], /) -> None:
    """``exec`` as ``dataclasses`` calls it (its module's namespace, always
    given, and one of its own), a text compiled at most once."""
    if isinstance(source, str):
        code = _kept.get(source)
        if code is None:
            code = compile(source, "<string>", "exec", dont_inherit=True)
            _kept[source] = code
            _compiled.add(source)
        _used.add(source)
        source = code
    builtins.exec(source, globals, locals)


def read(path: Path) -> dict[str, CodeType]:
    """The texts and code kept in ``path``; nothing where it is not this
    user's alone, or not whole."""
    with contextlib.suppress(OSError, EOFError, ValueError, TypeError):
        data = read_private_file(path)
        if data is None:
            return {}
        body = data[len(MAGIC) + DIGEST_SIZE :]
        if (data[: len(MAGIC)] != MAGIC
                or data[len(MAGIC) : len(MAGIC) + DIGEST_SIZE] != _digest(body)):  # fmt: skip
            return {}
        kept = marshal.loads(body)
        if isinstance(kept, dict) and all(isinstance(text, str) and isinstance(code, CodeType)
                                          for text, code in kept.items()):  # fmt: skip
            return kept
    return {}


def keep_compiled() -> None:
    """Keep what this process compiled, for the next (at its end)."""
    if _path is None or not _compiled:  # (called once: at the process's end)
        return
    # (copies: a thread may still be making classes)
    kept = dict(_kept) if len(_kept) <= KEEP_TEXTS else {t: _kept[t] for t in list(_used)}
    body = marshal.dumps(kept)
    with contextlib.suppress(OSError, ValueError):
        write_private_file(_path, MAGIC + _digest(body) + body)


def _digest(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=DIGEST_SIZE).digest()


def compiled_here() -> int:
    """How many texts this process compiled (found none kept)."""
    return len(_compiled)
