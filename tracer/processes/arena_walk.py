"""The arenas a traced process already has, read from its memory.

A trace that attaches to a running process sees no ``memory_arena_new`` for
the arenas made before it. They are found here: ``main_arena``'s address in
the libc (its symbol table, or its debug file's, found by build-id), plus
where the libc is loaded in the process, gives the head of the arena list,
which ``probes/malloc_state.py`` walks in the process's memory
(/proc/PID/mem). ``ArenaFinder`` also tells whether a futex a lock wait
named is an arena's mutex (the mutex is an arena's first member), walking
the list again when it does not know the address yet: an arena made during
the trace, on a libc whose arena probes could not be derived.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mtrace_live.exporters.data.lock_waits import ARENA, MAIN, OTHER, UNKNOWN
from mtrace_live.exporters.data.processes import proc_dir
from mtrace_live.probes.derived import NO_DEBUG_FILE
from mtrace_live.probes.elf.debug import find_debug_file
from mtrace_live.probes.elf.facts import file_fact
from mtrace_live.probes.elf.file import elf_failures, open_elf
from mtrace_live.probes.elf.maps import read_maps
from mtrace_live.probes.elf.symbols import symbols_by_name
from mtrace_live.probes.errors import MtraceError
from mtrace_live.probes.malloc_state import (
    ArenaLayoutError,
    FoundArena,
    arena_limit_setting,
    is_arena,
    walk_arenas,
)

NARENAS_PER_CORE = 8  # glibc's NARENAS_FROM_NCORES on 64-bit
REWALK_S = 1.0  # a process's list is walked again at most this often for an unknown futex


@dataclass(frozen=True)
class LibcArenaSymbols:
    """Link-time addresses of main_arena and mp_ in a libc, or why not."""

    main_arena: int | None
    mp: int | None
    source: str  # the file they came from, or why there are none


def arena_symbols(libc: Path, debug_file: Path | None = None) -> LibcArenaSymbols:
    """main_arena and mp_ from the libc's own symbol table (a build that
    keeps it, as the SDT build does), else its debug file's."""
    candidates = [libc]
    try:
        debug = None if debug_file == NO_DEBUG_FILE else find_debug_file(libc, debug_file)
    except MtraceError:
        debug = None
    if debug is not None and debug != libc:
        candidates.append(debug)
    for path in candidates:
        found = _arena_in(path)
        if found is not None:
            return LibcArenaSymbols(found[0], found[1], str(path))
    return LibcArenaSymbols(None, None, f"no main_arena symbol in {libc} or a debug file for it "
                            "(Debian: install libc6-dbg)")  # fmt: skip


@file_fact
def _arena_in(path: Path) -> tuple[int, int | None] | None:
    """main_arena's and mp_'s addresses in the file's .symtab; None where
    it names no main_arena (or cannot be read)."""
    try:
        with open_elf(path) as elf:
            found = symbols_by_name(elf, (".symtab",))
    except (MtraceError, *elf_failures()):
        return None
    if "main_arena" not in found:
        return None
    mp = found.get("mp_")
    return found["main_arena"][0], mp[0] if mp else None


class ProcessMemory:
    """Reads process ``pid``'s memory through /proc/PID/mem."""

    def __init__(self, pid: int) -> None:
        self.fd = os.open(proc_dir(pid) / "mem", os.O_RDONLY | os.O_CLOEXEC)

    def read(self, address: int, size: int) -> bytes:
        data = os.pread(self.fd, size, address)
        if len(data) != size:
            raise OSError(f"short read at {address:#x}")
        return data

    def close(self) -> None:
        os.close(self.fd)


def libc_base(pid: int, libc: Path) -> int | None:
    """Where ``libc`` (the same file: device and inode) is loaded in ``pid``:
    the start of its mapping at file offset 0."""
    try:
        st = os.stat(libc)
        mappings = read_maps(proc_dir(pid))
    except OSError:
        return None
    return next((m.start for m in mappings if m.offset == 0 and m.inode[1] == st.st_ino
                 and os.path.basename(m.path) == libc.name), None)  # fmt: skip


@dataclass
class ArenaScan:
    """What one process's memory says of its arenas."""

    pid: int
    arenas: list[FoundArena] = field(default_factory=list)
    arena_max: int | None = None  # mp_.arena_max (0: glibc's default)
    problem: str = ""  # why no arena could be read

    @property
    def addresses(self) -> set[int]:
        return {a.address for a in self.arenas}


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


_TUNABLE = re.compile(r"(?:^|:)glibc\.malloc\.arena_max=(\d+)")


def arena_limit(pid: int, arena_max: int | None) -> tuple[int | None, str]:
    """The arena limit in force in ``pid`` and where it comes from: the
    tunable (GLIBC_TUNABLES), the environment (MALLOC_ARENA_MAX), mallopt
    (M_ARENA_MAX), or glibc's default of 8 per core the process may run on."""
    env = _environ(pid)
    if arena_max:
        if _TUNABLE.search(env.get("GLIBC_TUNABLES", "")):
            return arena_max, "tunable glibc.malloc.arena_max"
        if env.get("MALLOC_ARENA_MAX"):
            return arena_max, "environment MALLOC_ARENA_MAX"
        return arena_max, "mallopt M_ARENA_MAX"
    if arena_max is None:
        return None, "unknown (no mp_ symbol)"
    try:
        cores = len(os.sched_getaffinity(pid))
    except OSError:
        return None, "unknown (the process is gone)"
    return NARENAS_PER_CORE * cores, f"default (8 x {cores} cores)"


class ArenaFinder:
    """Each traced process's arenas, from its memory; safe to share between
    the tracing loop and the metrics thread."""

    def __init__(self, libc: Path, symbols: LibcArenaSymbols,
                 clock: Callable[[], float] | None = None,
                 named: Callable[[int], Mapping[int, bool]] | None = None) -> None:  # fmt: skip
        """``named(pid)``: the arenas the events named (memory_arena_new, the
        main arena by a probe site's address), address -> main."""
        self.libc, self.symbols = libc, symbols
        self.named = named
        self._clock = clock or time.monotonic
        self._scans: dict[int, ArenaScan] = {}
        self._others: set[tuple[int, int]] = set()  # (pid, futex) checked: no arena
        self._walked: dict[int, float] = {}
        self._lock = threading.Lock()

    def scan(self, pid: int) -> ArenaScan:
        """Walk ``pid``'s arena list now."""
        found = ArenaScan(pid)
        if self.symbols.main_arena is None:
            found.problem = self.symbols.source
            return self._keep(found)
        base = libc_base(pid, self.libc)
        if base is None:
            found.problem = f"process {pid} does not map {self.libc} (or is gone)"
            return self._keep(found)
        try:
            memory = ProcessMemory(pid)
        except OSError as exc:
            found.problem = f"cannot read process {pid}'s memory: {exc.strerror or exc}"
            return self._keep(found)
        try:
            found.arenas = walk_arenas(memory.read, base + self.symbols.main_arena)
            if self.symbols.mp is not None:
                found.arena_max = arena_limit_setting(memory.read, base + self.symbols.mp)[0]
        except ArenaLayoutError as exc:
            found.problem = f"process {pid}'s arenas do not read as glibc 2.27+'s: {exc}"
        except OSError as exc:
            found.problem = f"cannot read process {pid}'s arenas: {exc}"
        finally:
            memory.close()
        return self._keep(found)

    def _keep(self, scan: ArenaScan) -> ArenaScan:
        with self._lock:
            self._scans[scan.pid] = scan
            self._walked[scan.pid] = self._clock()
        return scan

    def known(self, pid: int) -> ArenaScan | None:
        with self._lock:
            return self._scans.get(pid)

    def kind(self, pid: int, futex: int) -> str:
        """MAIN, ARENA, OTHER (checked in memory: no arena) or UNKNOWN (the
        memory could not be read) for a futex a lock wait of ``pid`` named."""
        scan = self.known(pid)
        if scan is not None and futex in scan.addresses:
            return MAIN if any(a.main and a.address == futex for a in scan.arenas) else ARENA
        named = self.named(pid) if self.named is not None else {}
        if futex in named:
            return MAIN if named[futex] else ARENA
        with self._lock:
            if (pid, futex) in self._others:
                return OTHER
            stale = self._clock() - self._walked.get(pid, float("-inf")) >= REWALK_S
        if stale:
            scan = self.scan(pid)
            if futex in scan.addresses:
                return self.kind(pid, futex)
        if scan is None or scan.problem:
            return UNKNOWN
        found = _arena_in_memory(pid, futex)
        if found is None:
            return UNKNOWN
        if not found:
            with self._lock:
                self._others.add((pid, futex))
        return ARENA if found else OTHER


def _arena_in_memory(pid: int, futex: int) -> bool | None:
    """An arena not in the list when last walked (made since); None when
    the memory cannot be read."""
    try:
        memory = ProcessMemory(pid)
    except OSError:
        return None
    try:
        return is_arena(memory.read, futex)
    except OSError:
        return None
    finally:
        memory.close()
