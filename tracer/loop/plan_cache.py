"""The derived probes' plan (probes/derived.py) kept between runs.

Deriving the memory_* probes of a libc without SDT notes reads its symbols,
its debug file's DWARF and disassembles the functions concerned: about
0.2 s on this machine, at every start, for the same answer. So the plan is
kept, as JSON, under a key made of everything it is derived from: the libc
(its build-id and size, or its inode and time where it has no build-id),
the debug file used (the same, or none), and the deriving code itself (a
hash of the probes package's sources), so a changed libc, a debug package
installed since, or a new mtrace-live derives anew.

The cache is a directory (``MTRACE_LIVE_PLAN_CACHE``, default
/var/cache/mtrace-live/derived; ``off`` disables it) of one file per plan,
at most ``KEEP``, the least recently used removed first. A file (or
directory) another user owns or could write is ignored, as are those that
do not parse: the cache only ever saves time.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from pathlib import Path

from mtrace_live.probes import derived
from mtrace_live.probes.elf.debug import find_debug_file
from mtrace_live.probes.elf.facts import ENVIRONMENT, plan_cache_dir, read_private_file
from mtrace_live.probes.elf.file import build_id_of
from mtrace_live.probes.errors import MtraceError
from mtrace_live.tracer.bpf.bpf_cache import keep_json

__all__ = ["ENVIRONMENT", "derived_plan", "plan_cache_dir"]
KEEP = 16
FORMAT = 1


def derived_plan(libc: Path, debug_file: Path | None = None) -> derived.DerivedPlan:
    """derived.plan(libc, debug_file), from the cache where it holds it."""
    directory = plan_cache_dir()
    key = _key(libc, debug_file) if directory is not None else None
    path = directory / f"{key}.json" if directory is not None and key is not None else None
    if path is not None:
        kept = _read_kept(path)
        if kept is not None:
            return kept
    plan = derived.plan(libc, debug_file)
    if path is not None:
        keep_json(path, derived.plan_document(plan), KEEP)
    return plan


def _identity(path: Path) -> str:
    """What tells this file from another, or another version of it."""
    with contextlib.suppress(MtraceError, OSError):
        build = build_id_of(path)
        if build:
            return f"{build}:{path.stat().st_size}"
    status = path.stat()
    return f"{path.resolve()}:{status.st_dev}:{status.st_ino}:{status.st_size}:{status.st_mtime_ns}"


@functools.cache
def _code_version() -> str:
    """A hash of the probes package's sources: the deriving code."""
    digest = hashlib.sha256()
    root = Path(derived.__file__).parent
    for source in sorted(root.rglob("*.py")):
        digest.update(source.relative_to(root).as_posix().encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()


def _key(libc: Path, debug_file: Path | None) -> str | None:
    """The plan's key; None where it cannot be told (a file unreadable, a
    debug file that does not fit: derived.plan says why)."""
    try:
        used = None
        if debug_file != derived.NO_DEBUG_FILE:
            used = find_debug_file(libc, debug_file)
        parts = [str(FORMAT), _code_version(), _identity(libc), str(debug_file),
                 _identity(used) if used is not None else "none"]  # fmt: skip
    except (MtraceError, OSError):
        return None
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _read_kept(path: Path) -> derived.DerivedPlan | None:
    try:
        data = read_private_file(path)
        if data is None:
            return None
        plan = derived.plan_from_document(json.loads(data))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # recently used
    return plan
