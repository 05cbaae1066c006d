"""Which allocator a process really calls: the object its ``malloc`` binds to.

The dynamic linker binds ``malloc`` to the first object in its search
order that defines it: the executable, then the ``LD_PRELOAD`` libraries
(and /etc/ld.so.preload's), then the ``DT_NEEDED`` libraries, breadth-first
in load order. A running process's objects are the files it maps (reached
through /proc/PID/map_files, in any mount namespace); a command about to
run is asked of the dynamic linker itself (``ld.so --list``), with the
environment it will run in.

Beside that provider, a process may call others: glibc's ``malloc`` by
``dlsym(RTLD_NEXT)``, an allocator a plugin maps, a copy built into the
executable under prefixed names (``je_malloc``). Every known allocator a
process maps, and one built into its executable, is traced.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mtrace_live.exporters.data.processes import proc_dir
from mtrace_live.probes.allocators import KNOWN, PYMALLOC, UNKNOWN, Allocator, identify
from mtrace_live.probes.elf.facts import file_fact
from mtrace_live.probes.elf.file import elf_failures, needed, open_elf, soname
from mtrace_live.probes.elf.maps import Mapping as ProcessMapping
from mtrace_live.probes.elf.maps import read_maps
from mtrace_live.probes.elf.symbols import defined_functions
from mtrace_live.probes.errors import MtraceError
from mtrace_live.tracer.processes.target import mapped_glibc

# Files that may hold a known allocator: read for their symbols when mapped.
_ALLOCATOR_FILE = re.compile(r"^lib(c|jemalloc|tcmalloc\w*|mimalloc\w*)([.-][\w.-]*)?\.so[\w.]*$")
_PRELOAD_SPLIT = re.compile(r"[:\s]+")
_PRELOAD_COMMENT = re.compile(r"#[^\n]*")  # to the line's end, in /etc/ld.so.preload


@dataclass(frozen=True)
class Provider:
    """An allocator in one file."""

    allocator: Allocator
    path: Path  # readable from here
    name: str  # the file's name, as the process maps it
    tables: tuple[str, ...] = (".dynsym",)  # where its entry points are found

    @property
    def label(self) -> str:
        """As the outputs name it: ``jemalloc (libjemalloc.so.2)``."""
        return f"{self.allocator.name} ({self.name})"

    @property
    def key(self) -> tuple[int, int]:
        """The file's identity: one provider is attached once per file."""
        return file_identity(self.path)


@dataclass(frozen=True)
class Providers:
    """A process's allocators: the one ``malloc`` binds to (None: no object
    defines it, or the one that does is unreadable) and every one it may call."""

    binding: Provider | None
    all: tuple[Provider, ...]  # the known ones (an unknown binding is traced when given)

    @property
    def unknown_binding(self) -> Provider | None:
        """The binding, when it is no allocator mtrace-live knows."""
        known = self.binding is not None and self.binding.allocator.known
        return None if known else self.binding


# The defined names the providers ask about: whether a file defines malloc,
# a known allocator's marks, pymalloc's functions. A file's facts keep only
# these (libLLVM defines some 40,000 functions; every process maps libc).
ASKED = frozenset({"malloc", "PyObject_Malloc", "PyObject_Free",
                   *(mark for allocator in KNOWN for mark in allocator.marks)})  # fmt: skip


def _defines(path: Path, tables: tuple[str, ...] = (".dynsym",)) -> frozenset[str]:
    """Which of the names ASKED the file defines as functions in ``tables``."""
    return _file_facts(path, tables, "defines")  # type: ignore[return-value]


def _needs(path: Path) -> tuple[str, ...]:
    return _file_facts(path, (), "needs")  # type: ignore[return-value]


def soname_or(name: str, path: Path) -> str:
    """A mapped file's name as the outputs give it: its soname
    (libmimalloc.so.2), else the name it is mapped under (libmimalloc.so.2.0)."""
    found = _file_facts(path, (), "soname")
    return str(found[0]) if isinstance(found, tuple) and found and found[0] else name


_FILE_FACTS: dict[tuple[object, ...], frozenset[str] | tuple[str, ...]] = {}


def _file_facts(path: Path, tables: tuple[str, ...], what: str) -> frozenset[str] | tuple[str, ...]:
    """What a file defines, needs or is named (its soname), read once per file (its identity and
    change time, whatever path reaches it): every process of a machine maps
    much the same files."""
    empty: frozenset[str] | tuple[str, ...] = frozenset() if what == "defines" else ()
    try:
        stat = os.stat(path)
    except OSError:
        return empty
    key = (stat.st_dev, stat.st_ino, stat.st_mtime_ns, tables, what)
    found = _FILE_FACTS.get(key)
    if found is None:
        found = _read_file_facts(path, tables, what)
        if found is None:  # a script, a damaged file: no facts
            found = empty
        if len(_FILE_FACTS) > 4096:
            _FILE_FACTS.clear()
        _FILE_FACTS[key] = found
    return found


@file_fact
def _read_file_facts(path: Path, tables: tuple[str, ...],
                     what: str) -> frozenset[str] | tuple[str, ...] | None:  # fmt: skip
    try:
        with open_elf(path) as elf:
            if what == "defines":
                return frozenset(defined_functions(elf, tables)) & ASKED
            return tuple(needed(elf)) if what == "needs" else (soname(elf) or "",)
    except (OSError, MtraceError, *elf_failures()):
        return None


Objects = list[tuple[str, Path]]  # (the file's name as the process sees it, a path from here)


def search_order(exe: tuple[str, Path], preload: Objects, find: Mapping[str, Path]) -> Objects:
    """The objects in the dynamic linker's search order: ``exe``, the
    ``preload`` libraries, then DT_NEEDED breadth-first (``find``: soname ->
    the file; a soname not found is left out, as one not loaded)."""
    order = [exe, *preload]
    seen = {name for name, _ in order}
    at = 0
    while at < len(order):
        for wanted in _needs(order[at][1]):
            path = find.get(wanted)
            if path is not None and wanted not in seen:
                seen.add(wanted)
                order.append((wanted, path))
        at += 1
    return order


def resolve(order: Objects, mapped: Objects, pymalloc: bool = False) -> Providers:
    """The providers of a process whose objects, in search order, are
    ``order``, and which maps ``mapped`` besides; with ``pymalloc``, each
    CPython interpreter among them too (--pymalloc)."""
    binding = None
    for name, path in order:
        names = _defines(path)
        if "malloc" in names:
            binding = Provider(identify(names) or UNKNOWN, path, name)
            break
    found = [] if binding is None or not binding.allocator.known else [binding]
    if order:
        name, exe = order[0]
        built = identify(_defines(exe, (".dynsym", ".symtab")))
        if built is not None and (not found or found[0].path != exe):
            found.append(Provider(built, exe, name, (".dynsym", ".symtab")))
    for name, path in mapped:
        if _ALLOCATOR_FILE.match(name) and file_identity(path) not in {p.key for p in found}:
            allocator = identify(_defines(path))
            if allocator is not None:
                found.append(Provider(allocator, path, soname_or(name, path)))
    if pymalloc:
        found += _interpreters([*order, *mapped], {p.key for p in found})
    return Providers(binding, tuple(found))


def _interpreters(files: Objects, known: set[tuple[int, int]]) -> list[Provider]:
    """pymalloc in each file of ``files`` that holds a CPython interpreter
    (it defines its object allocator), once per file."""
    found: list[Provider] = []
    for name, path in files:
        key = file_identity(path)
        if key in known or key == (0, 0):
            continue
        if {"PyObject_Malloc", "PyObject_Free"} <= _defines(path):
            known.add(key)
            found.append(Provider(PYMALLOC, path, soname_or(name, path)))
    return found


def file_identity(path: Path) -> tuple[int, int]:
    try:
        stat = os.stat(path)
    except OSError:
        return 0, 0
    return stat.st_dev, stat.st_ino


def of_process(pid: int, pymalloc: bool = False) -> Providers:
    """The providers of running process ``pid`` (none when its maps cannot
    be read: it is gone)."""
    files = _mapped_files(pid)
    if not files:
        return Providers(None, ())
    by_name = _FileNames(files)
    preload = [(name, path) for name in _preloaded(proc_dir(pid))
               if (path := by_name.get(name))]  # fmt: skip
    return resolve(search_order(_exe_of(pid, files), preload, by_name), files, pymalloc)


class _FileNames(dict[str, Path]):
    """The mapped files by name; a soname (libtcmalloc_minimal.so.4) finds
    the file it links to (libtcmalloc_minimal.so.4.5.10)."""

    def __init__(self, files: Objects) -> None:
        super().__init__(reversed(files))  # the first mapping of each name

    def get(self, soname: str, default: Path | None = None) -> Path | None:  # type: ignore[override]
        if soname in self:
            return self[soname]
        return next((path for name, path in self.items() if name.startswith(soname + ".")),
                    default)  # fmt: skip


def of_command(argv: Sequence[str], ld_so: Path | None, pymalloc: bool = False) -> Providers:
    """The providers the command ``argv`` will have, asked of the dynamic
    linker ``ld_so`` with this environment (its LD_PRELOAD included)."""
    import subprocess  # (a command's trace only)

    exe = Path(argv[0])
    listed: Objects = []
    if ld_so is not None:
        try:
            done = subprocess.run([str(ld_so), "--list", str(exe)], capture_output=True,
                                  text=True, timeout=30, check=False)  # fmt: skip
            listed = [(os.path.basename(path), Path(path))
                      for path in re.findall(r"^\s+(?:\S+ => )?(/\S+) \(0x", done.stdout,
                                             re.MULTILINE)]  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            listed = []
    return resolve([(exe.name, exe), *listed], listed, pymalloc)


def _mapped_files(pid: int) -> Objects:
    """The files process ``pid`` maps, each once, in address order, each
    reached through its map_files link (in any mount namespace)."""
    directory = proc_dir(pid)
    try:
        mappings = read_maps(directory)
    except OSError:
        return []
    files: Objects = []
    seen: set[str] = set()
    for mapping in mappings:
        if not mapping.is_file or mapping.path in seen:
            continue
        seen.add(mapping.path)
        files.append((os.path.basename(mapping.path), _reached(directory, mapping)))
    return files


def _reached(directory: Path, mapping: ProcessMapping) -> Path:
    """The file of a mapping: at its path when that is the file here (a
    path that lasts), else through the process's map_files link."""
    shown = Path(mapping.path)
    try:
        if os.stat(shown).st_ino == mapping.inode[1]:
            return shown
    except OSError:
        pass
    return directory / "map_files" / mapping.map_files


def _exe_of(pid: int, files: Objects) -> tuple[str, Path]:
    """The mapping of the executable: the file /proc/PID/exe is."""
    exe = program_of(pid)
    if exe is None:
        return files[0]
    return next(((name, path) for name, path in files if file_identity(path) == exe), files[0])


def _preloaded(directory: Path) -> list[str]:
    """The names of the libraries the process of /proc ``directory`` was
    started with preloaded: its LD_PRELOAD, then its root's /etc/ld.so.preload
    (whose ``#`` comments the dynamic linker skips, as its rtld.c does)."""
    names: list[str] = []
    try:
        environ = (directory / "environ").read_bytes().split(b"\0")
    except OSError:
        environ = []
    for entry in environ:
        if entry.startswith(b"LD_PRELOAD="):
            value = entry.split(b"=", 1)[1].decode(errors="replace")
            names += [os.path.basename(p) for p in _PRELOAD_SPLIT.split(value) if p]
    try:
        text = (directory / "root" / "etc" / "ld.so.preload").read_text(errors="replace")
        text = _PRELOAD_COMMENT.sub(" ", text)
        names += [os.path.basename(p) for p in _PRELOAD_SPLIT.split(text) if p]
    except OSError:
        pass
    return names


def unknown_provider(path: Path) -> Provider:
    """--allocator-lib: a file whose standard names are traced, whoever it is."""
    defined = _defines(path)
    allocator = identify(defined) or UNKNOWN
    return Provider(allocator, path, path.name)


@dataclass(frozen=True)
class TraceProviders:
    """The allocators a trace attaches beside the libc's: what each target
    process calls, and each file beyond the libc, once."""

    per_process: Mapping[int, Providers]
    extra: tuple[Provider, ...]


def for_trace(libc: Path, pids: Sequence[int], command: tuple[int, Sequence[str]] | None,
              everywhere: bool, given: Sequence[Path],
              pymalloc: bool = False) -> TraceProviders:  # fmt: skip
    """The providers of the processes ``pids`` (or of ``command``: its pid
    and argv, not yet run), with every allocator any process maps when the
    trace covers ``everywhere``, and the files ``given`` (--allocator-lib);
    with ``pymalloc``, the CPython interpreters' own allocator too."""
    if command is not None:
        ld_so = mapped_glibc(os.getpid()).ld_so
        per_process = {command[0]: of_command(command[1], ld_so, pymalloc)}
    else:
        per_process = {pid: of_process(pid, pymalloc) for pid in pids}
    found = [p for providers in per_process.values() for p in providers.all]
    if everywhere:
        found += mapped_by(every_pid(), pymalloc)
    found += [unknown_provider(path) for path in given]
    extra: dict[tuple[int, int], Provider] = {}
    for provider in found:
        if provider.key not in extra and provider.key != file_identity(libc):
            extra[provider.key] = provider
    return TraceProviders(per_process, tuple(extra.values()))


def every_pid() -> set[int]:
    return {int(entry) for entry in os.listdir("/proc") if entry.isdigit()}


def mapped_by(pids: Iterable[int], pymalloc: bool = False) -> list[Provider]:
    """Every known allocator but glibc the processes ``pids`` map, once per
    file (with ``pymalloc``, each CPython interpreter's too). The libc a
    trace of many processes attaches is the one it chose (--lib, or this
    machine's): a process on another glibc (a container's) is said by the
    exec watch, not attached behind the user's back."""
    found: dict[tuple[int, int], Provider] = {}
    for pid in pids:
        files = _mapped_files(pid)
        if pymalloc:
            found |= {p.key: p for p in _interpreters(files, set(found))}
        for name, path in files:
            if not _ALLOCATOR_FILE.match(name) or name.startswith("libc"):
                continue
            key = file_identity(path)
            if key not in found and key != (0, 0):
                allocator = identify(_defines(path))
                if allocator is not None and allocator.known and allocator.name != "glibc":
                    found[key] = Provider(allocator, path, soname_or(name, path))
    return list(found.values())


class AllocatorNames:
    """Each process's allocator as the outputs name it (``jemalloc
    (libjemalloc.so.2)``), worked out once per process: its pid and start
    time, and kept once it is gone. ``known``: the targets' providers found
    as the trace started (a command's, asked of the dynamic linker)."""

    def __init__(self, known: Mapping[int, Providers]) -> None:
        self._known = dict(known)
        self._names: dict[tuple[int, int], tuple[str, str]] = {}
        self._last: dict[int, tuple[str, str]] = {}

    def of(self, pid: int) -> tuple[str, str]:
        """(allocator, its file's name) of process ``pid``; ("", "") if not known."""
        started = _started(pid)
        if started is None:  # gone: as it was last named
            return self._last.get(pid) or self._named(self._known.get(pid))
        key = (pid, started)
        names = self._names.get(key)
        if names is None:
            names = self._named(of_process(pid))
            names = names if names[0] else self._named(self._known.get(pid))
            if len(self._names) > 65536:
                self._names.clear()
                self._last.clear()
            self._names[key] = self._last[pid] = names
        return names

    @staticmethod
    def _named(found: Providers | None) -> tuple[str, str]:
        if found is None or found.binding is None:
            return "", ""
        return found.binding.allocator.name, found.binding.name


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), None once gone."""
    try:
        fields = (proc_dir(pid) / "stat").read_bytes().rpartition(b") ")[2].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def program_of(pid: int | None) -> tuple[int, int] | None:
    """The identity of the program process ``pid`` runs; None if gone."""
    if pid is None:
        return None
    try:
        stat = os.stat(proc_dir(pid) / "exe")
    except OSError:
        return None
    return stat.st_dev, stat.st_ino
