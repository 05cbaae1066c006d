"""The one place mtrace-live imports bcc.

Everything else (decoding, aggregation, exporters, listing probes) runs
without root and without bcc; they receive plain data from here.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from mtrace_live.exporters.data.sink import ProcessHits
from mtrace_live.probes.errors import (
    AttachError,
    BccUnavailableError,
    NotPrivilegedError,
    TargetError,
    TracepointMissingError,
)
from mtrace_live.probes.program import ProgramSource
from mtrace_live.probes.records import ALLOC_FRAMES_BASE

from . import bpf_cache, bpf_syscalls, uprobe_attach, uprobe_multi
from .bpf_syscalls import BatchReader
from .kernel_btf import BtfUnavailable, KernelBtf

# Handlers bcc does not load itself: TYPED_PREFIX + EVENT is a BTF-typed
# tracepoint handler (tp_btf), loaded and attached here, and FALLBACK_PREFIX
# + EVENT the raw handler attached instead where the kernel refuses it.
TYPED_PREFIX = "tp_btf__"
FALLBACK_PREFIX = "rawtp__"

TRACEFS_ROOTS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))

# Capability bits from include/uapi/linux/capability.h.
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39


def _effective_capabilities() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def privilege_problem() -> str | None:
    """Why BPF programs cannot be loaded by this process, or None."""
    caps = _effective_capabilities()
    has_bpf = caps & (1 << CAP_BPF) and caps & (1 << CAP_PERFMON)
    if os.geteuid() != 0 and not has_bpf and not caps & (1 << CAP_SYS_ADMIN):
        return "loading BPF programs needs root (or CAP_BPF and CAP_PERFMON); run with sudo"
    return None


def require_privileges() -> None:
    """Fail early, with one line, when BPF programs cannot be loaded."""
    problem = privilege_problem()
    if problem:
        raise NotPrivilegedError(problem)


def tracefs_root() -> Path:
    for root in TRACEFS_ROOTS:
        try:
            if (root / "events").is_dir():
                return root
        except PermissionError:
            raise NotPrivilegedError(f"cannot read {root}: permission denied") from None
    raise TracepointMissingError(
        "tracefs is not mounted; mount it with: mount -t tracefs tracefs /sys/kernel/tracing"
    )


def tracepoint_format(category: str, event: str) -> str:
    fmt = tracefs_root() / "events" / category / event / "format"
    try:
        return fmt.read_text(encoding="ascii", errors="replace")
    except PermissionError:
        raise NotPrivilegedError(f"cannot read {fmt}: permission denied") from None
    except FileNotFoundError:
        raise TracepointMissingError(f"this kernel has no tracepoint {category}:{event}") from None


def import_bcc() -> Any:
    try:
        import bcc
    except ImportError:
        raise BccUnavailableError(
            "the bcc Python bindings are not importable; install Debian's python3-bpfcc "
            "(scripts/setup.sh does) and run from a Python that sees the distro's packages"
        ) from None
    return bcc


def bcc_version() -> str:
    """The bcc bindings' version, or "unknown"."""
    try:
        import bcc
    except ImportError:
        return "unknown"
    return str(getattr(bcc, "__version__", "unknown"))


@dataclass(frozen=True)
class UprobeEvent:
    """A uprobe's perf event, and what it was opened with."""

    fd: int
    path: Path
    offset: int
    prog_fd: int
    pid: int  # the thread (a process's id: its first) it is attached for; -1: every process
    retprobe: bool
    link: int = -1  # the BPF link carrying its cookie (-1: none)
    cookie: int = 0  # where its handler reads moved arguments (alloc_sites.site_cookie)


class BpfProgram:
    """A compiled and attached bcc program, built from its bundled parts."""

    def __init__(self, source: ProgramSource, links: bool = True) -> None:
        """``links``: the uprobes may be attached in links (tracer/uprobe_multi.py),
        where the kernel has them."""
        require_privileges()
        tracefs_root()
        bcc = import_bcc()
        name = source.name
        # bcc compiles the text as /virtual/main.c: its own headers (records.h)
        # are found through the parts' directory.
        cflags = [*source.cflags(), f"-I{source.directory}"]
        # Two warnings every kernel header of 6.x raises under bcc's clang;
        # they say nothing about mtrace-live's own C.
        cflags += ["-Wno-duplicate-decl-specifier", "-Wno-ignored-attributes"]
        self._readers: dict[str, BatchReader] = {}
        # alloc_frames rows read: (frames, read the same twice). The frame store
        # never gives a row to another stack, so a row read whole is kept;
        # twice the same, it is whole (a row is written once, when claimed).
        self._frame_rows: dict[int, tuple[tuple[int, ...], bool]] = {}
        self._typed: dict[str, tuple[int, int]] = {}  # handler -> (program fd, attachment fd)
        # the uprobes' perf events (uprobe_attach), each as it was attached
        self._uprobe_events: list[UprobeEvent] = []
        self._generation = 0  # of the uprobes attached for one thread (retarget)
        # event -> why the kernel refused its BTF-typed handler (its raw one is attached)
        self.typed_refused: dict[str, str] = {}
        text = source.text()
        sources = [text.encode(), *(h.read_bytes() for h in source.headers())]
        key = bpf_cache.cache_key(sources, cflags, bcc_version())
        # What the start-up report says of the load: warnings, and the origin
        # (a debug line, MTRACE_LIVE_DEBUG=1).
        self.warnings: list[str] = []
        started = time.monotonic()
        # Uprobes in links (tracer/uprobe_multi.py) where the kernel has them:
        # every uprobe program is then loaded here, for them, from its code.
        self.uprobes_apart = uprobe_multi.why_not() if links else uprobe_multi.MAIN_GONE
        compiled = self._cached(bcc, key)
        self.from_cache = compiled is not None  # loaded from code a previous run compiled
        made = self._compile(bcc, source, text, cflags, key) if compiled is None else None
        self.uprobe_links = self._links(compiled if compiled is not None else made)
        how = "loaded from the cache" if self.from_cache else "compiled"
        self.origin = f"BPF program {name} {how} in {time.monotonic() - started:.2f} s ({key[:12]})"
        # The BTF-typed handlers' code, with this run's map descriptors in it.
        if compiled is not None:
            typed, license_ = self._bpf.mtrace_typed, compiled.license
        else:
            typed, license_ = _typed_handlers(bcc, self._bpf)
        if typed:
            try:
                self._attach_typed(typed, license_)
            except BaseException:
                self.close()
                raise

    def _compile(self, bcc: Any, source: ProgramSource, text: str, cflags: list[str],
                 key: str) -> bpf_cache.Compiled | None:  # fmt: skip
        """Compile with bcc, and keep the code under ``key``: what was
        compiled, or None where it could not be read back."""
        try:
            with tempfile.TemporaryDirectory(prefix="mtrace-live-bpf-") as scratch:
                main = source.main_file(Path(scratch), text)
                self._bpf = bcc.BPF(src_file=str(main).encode(), cflags=cflags)
        except Exception as exc:
            raise AttachError(f"cannot load BPF program {source.name}: {exc}") from None
        made = None
        with contextlib.suppress(Exception):  # the cache is only ever a saving
            made = _compiled(bcc, self._bpf)
            self._bpf.mtrace_uprobe_code = _uprobe_code(bcc, made.functions)
            bpf_cache.store(key, made)
        return made

    def _links(self, compiled: bpf_cache.Compiled | None) -> uprobe_multi.UprobeLinks | None:
        """The uprobe programs to load for links, where this kernel has them
        and their code could be read (else uprobes_apart says why not)."""
        code = getattr(self._bpf, "mtrace_uprobe_code", None)
        if self.uprobes_apart is None and (code is None or compiled is None):
            self.uprobes_apart = "the compiled code could not be read back"
        if self.uprobes_apart is not None or code is None or compiled is None:
            return None
        return uprobe_multi.UprobeLinks(code, compiled.license, compiled.kern_version)

    def _cached(self, bcc: Any, key: str) -> bpf_cache.Compiled | None:
        """The program stored under ``key``, loaded; None (with a warning
        where one was stored) to compile it instead."""
        try:
            compiled = bpf_cache.load(key)
            if compiled is not None:
                self._bpf = _from_cache(bcc, compiled, self.uprobes_apart is None)
            return compiled
        except Exception as exc:  # any doubt: compile, as without a cache
            self.warnings.append(f"warning: the cached BPF program is unusable, compiled "
                                 f"it anew: {exc}")  # fmt: skip
            return None

    def start_up_notes(self) -> list[str]:
        """What the start-up report says of this program: its warnings, and
        where it came from when MTRACE_LIVE_DEBUG is set."""
        debug = os.environ.get("MTRACE_LIVE_DEBUG", "") not in ("", "0")
        how = ("uprobes attached in links (uprobe_multi)" if self.uprobe_links is not None
               else f"uprobes attached one perf event each ({self.uprobes_apart})")  # fmt: skip
        return [*self.warnings, *([f"debug: {self.origin}", f"debug: {how}"] if debug else [])]

    def _attach_typed(self, handlers: dict[str, bytes], license_: str) -> None:
        """Load and attach each BTF-typed tracepoint handler; where the
        kernel refuses one, attach its raw twin instead and keep why."""
        try:
            with KernelBtf() as btf:
                type_ids = {text: btf.tracepoint_type_id(text[len(TYPED_PREFIX) :])
                            for text in handlers}  # fmt: skip
        except BtfUnavailable as exc:
            type_ids = dict.fromkeys(handlers)
            reason = str(exc)
        else:
            reason = "BTF does not name the tracepoint's type"
        for text, code in handlers.items():
            event = text[len(TYPED_PREFIX) :]
            type_id = type_ids[text]
            try:
                if type_id is None:
                    raise OSError(0, reason)
                fd = bpf_syscalls.load_btf_tracepoint(code, license_, text, type_id)
                try:
                    self._typed[text] = (fd, bpf_syscalls.attach_raw_tracepoint(fd))
                except OSError:
                    os.close(fd)
                    raise
            except OSError as exc:
                self.typed_refused[event] = exc.strerror or str(exc)
                fallback = (FALLBACK_PREFIX + event).encode()
                try:
                    self._bpf.attach_raw_tracepoint(tp=event.encode(), fn_name=fallback)
                except Exception as raw:
                    raise AttachError(f"cannot attach to tracepoint {event}: {raw}") from None

    def attach_uprobe(self, path: Path, file_offset: int, handler: str, pid: int = -1,
                      cookie: int = 0) -> None:  # fmt: skip
        """Attach ``handler`` at a file offset of ``path``: in every process
        (pid -1), or only in the threads of process ``pid`` (the kernel then
        places no breakpoint in any other process); through a BPF link
        carrying ``cookie`` when it is not 0."""
        self._attach_uprobe(path, file_offset, handler, pid, False, cookie)

    def attach_uretprobe(self, path: Path, file_offset: int, handler: str, pid: int = -1) -> None:
        """Attach ``handler`` to the returns of the function at a file offset
        of ``path``, in every process or in process ``pid`` only."""
        self._attach_uprobe(path, file_offset, handler, pid, True)

    def _attach_uprobe(self, path: Path, file_offset: int, handler: str, pid: int,
                       retprobe: bool, cookie: int = 0) -> None:  # fmt: skip
        """In a link (tracer/uprobe_multi.py), or through perf_event_open
        (tracer/uprobe_attach.py): the path as given, from this process's
        root, and the kernel's errno in the error."""
        if self.uprobe_links is not None:
            uprobe = uprobe_multi.Uprobe(path, file_offset, handler, pid, retprobe, cookie)
            try:
                self.uprobe_links.add(uprobe)
            except uprobe_multi.LinkFailure as exc:
                raise _attach_error(exc.uprobe, exc.failure) from None
            except OSError as exc:
                raise AttachError(f"cannot load the handler {handler}: {exc.strerror}") from None
            return
        prog_fd = self._prog_fd(handler)
        try:
            fd, link = -1, -1
            if cookie:
                fd, link = uprobe_attach.attach_with_cookie(path, file_offset, prog_fd, pid,
                                                            retprobe, cookie)  # fmt: skip
            else:
                fd = uprobe_attach.attach(path, file_offset, prog_fd, pid, retprobe)
            self._uprobe_events.append(UprobeEvent(fd, path, file_offset, prog_fd, pid, retprobe,
                                                   link, cookie))  # fmt: skip
        except uprobe_attach.AttachFailure as failure:
            uprobe = uprobe_multi.Uprobe(path, file_offset, handler, pid, retprobe, cookie)
            raise _attach_error(uprobe, failure) from None

    @contextlib.contextmanager
    def uprobe_batch(self) -> Iterator[None]:
        """The uprobes attached inside, attached at its end in as few links
        as can be (one per file, handler, process and kind); one perf event
        each, at once, where the kernel has no links."""
        if self.uprobe_links is None:
            yield
            return
        try:
            with self.uprobe_links.batch():
                yield
        except uprobe_multi.LinkFailure as exc:
            raise _attach_error(exc.uprobe, exc.failure) from None
        except OSError as exc:
            raise AttachError(f"cannot load a uprobe handler: {exc.strerror}") from None

    def _prog_fd(self, handler: str) -> int:
        """A uprobe-type program's fd (a uprobe's handler, or a step the
        unwinder tail-calls), loaded for links where they are used."""
        if self.uprobe_links is not None:
            try:
                return self.uprobe_links.program(handler)
            except OSError as exc:
                raise AttachError(f"cannot load the handler {handler}: {exc.strerror}") from None
        return int(self._bpf.load_func(handler.encode(), import_bcc().BPF.KPROBE).fd)

    @property
    def uprobes_move(self) -> bool:
        """The uprobes of one process are attached for one of its threads,
        and must move when it ends (tracer/retarget.py); in links, they
        follow the process itself."""
        return self.uprobe_links is None

    def retarget(self, old: int, new: int) -> int:
        """The uprobes attached for thread ``old`` attached for thread ``new``
        instead (of the same process). The new events carry the next
        generation as their cookie and are all opened before the program's
        generation turns to it (``uprobe_generation``): till then the old
        events count each call, from then on the new ones, never both. The
        old ones are then closed by a detacher child. Returns how many
        moved; AttachFailure when one could not be opened (the old ones
        stay in force, the new ones opened so far are closed)."""
        if self.uprobe_links is not None:
            return 0  # links follow the process: its pthread_exit is not even probed
        generation = self._generation + 1
        moved: list[tuple[int, UprobeEvent]] = []
        try:
            for index, event in enumerate(self._uprobe_events):
                if event.pid == old:
                    cookie = event.cookie | generation
                    fd, link = uprobe_attach.attach_with_cookie(
                        event.path, event.offset, event.prog_fd, new, event.retprobe, cookie
                    )
                    moved.append((index, replace(event, fd=fd, pid=new, link=link)))
        except uprobe_attach.AttachFailure:
            for _, event in moved:
                os.close(event.link)
                os.close(event.fd)
            raise
        gone = []
        for index, event in moved:
            gone.append(self._uprobe_events[index])
            self._uprobe_events[index] = event
        self._turn(generation, [fd for event in gone for fd in (event.link, event.fd) if fd >= 0])
        return len(moved)

    def _turn(self, generation: int, fds: list[int]) -> None:
        """The program's generation turned to the new uprobes', and the old
        ones (``fds``) closed by a detacher child."""
        if self.has_table("uprobe_generation"):
            self.fill_array("uprobe_generation", [generation])
        self._generation = generation
        if fds and not _detach_in_child(fds):
            for fd in fds:
                os.close(fd)

    def clear_pending(self, tids: Iterable[int]) -> int:
        """Forget the calls threads ``tids`` were in (their returns will not
        be seen, their uprobes moved): the allocation functions' pending
        slots and the lock waits'. Returns how many there were."""
        cleared = 0
        if self.has_table("pending"):
            pending = self._bpf["pending"]
            slots = len(pending)
            for tid in tids:
                key = pending.Key(tid & (slots - 1))
                if pending[key].depth and pending[key].tid == tid:
                    pending[key] = pending.Leaf()
                    cleared += 1
        if self.has_table("lock_pending"):
            waits = self._bpf["lock_pending"]
            for tid in tids:
                with contextlib.suppress(KeyError):
                    del waits[waits.Key(tid)]
                    cleared += 1
        return cleared

    def fill_array(self, table: str, values: Sequence[int]) -> None:
        array = self._bpf[table]
        for index, value in enumerate(values):
            array[array.Key(index)] = array.Leaf(value)

    def read_table(
        self, table: str, key_dtype: Any, value_dtype: Any
    ) -> tuple[np.ndarray, np.ndarray]:
        """A whole hash map (not per-CPU) as two structured arrays, in one
        batched read where the kernel can."""
        keys_dt, values_dt = np.dtype(key_dtype), np.dtype(value_dtype)
        got = self._read_all(table)
        if got is not None:
            _, keys, values = got
            if len(keys) == 0:
                return np.zeros(0, dtype=keys_dt), np.zeros(0, dtype=values_dt)
            raw_values = values.reshape(len(values), -1).tobytes()
            return (np.frombuffer(keys.tobytes(), dtype=keys_dt),
                    np.frombuffer(raw_values, dtype=values_dt))  # fmt: skip
        items = list(self._bpf[table].items())
        return (np.frombuffer(b"".join(bytes(k) for k, _ in items), dtype=keys_dt),
                np.frombuffer(b"".join(bytes(v) for _, v in items), dtype=values_dt))  # fmt: skip

    def stack(self, stack_id: int) -> list[int]:
        """The addresses of one stored stack, innermost first: from
        ``alloc_frames`` for an allocation's stack (kept once read whole),
        else from ``stacks``."""
        if stack_id < ALLOC_FRAMES_BASE:
            return self._stack_row(self._bpf["stacks"], stack_id)
        known = self._frame_rows.get(stack_id)
        if known is not None and known[1]:
            return list(known[0])
        frames = tuple(self._stack_row(self._bpf["alloc_frames"], stack_id - ALLOC_FRAMES_BASE))
        self._frame_rows[stack_id] = (frames, known is not None and known[0] == frames)
        return list(frames)

    @staticmethod
    def _stack_row(table: Any, key: int) -> list[int]:
        try:
            frames = list(table[table.Key(key)].ip)
        except (KeyError, IndexError):
            return []
        return frames[: frames.index(0)] if 0 in frames else frames

    def has_table(self, name: str) -> bool:
        try:
            self._bpf[name]
        except KeyError:
            return False
        return True

    def map_fd(self, name: str) -> int:
        return int(self._bpf[name].map_fd)

    def process_hits(self, tgids: set[int] | None = None, take: bool = False) -> list[ProcessHits]:
        """The ``proc_hits`` table: hits by (tgid, probe slot), with the name of
        the thread that hit first. ``tgids`` limits it to those processes;
        ``take`` also deletes what it returns (for processes that are gone)."""
        got = self._read_all("proc_hits")
        if got is None:
            table = self._bpf["proc_hits"]
            entries = [
                (bytes(key), int(value.count), bytes(value.comm)) for key, value in table.items()
            ]
        else:
            table, keys, values = got
            entries = [(key.tobytes(), int(value[0, 0]), value[0, 1:].tobytes())
                       for key, value in zip(keys, values, strict=True)]  # fmt: skip
        rows = []
        for raw_key, count, raw_comm in entries:
            key = table.Key.from_buffer_copy(raw_key)
            tgid = int(key.tgid)
            if tgids is not None and tgid not in tgids:
                continue
            comm = raw_comm.split(b"\0", 1)[0].decode(errors="replace")
            rows.append(ProcessHits(tgid, int(key.probe), count, comm))
            if take:
                del table[key]
        return rows

    def set_gate(self, open_: bool) -> None:
        """Open or close the trace program's ``control`` gate for the site handlers."""
        control = self._bpf["control"]
        control[control.Key(0)] = control.Leaf(int(open_))

    def set_u64(self, table: str, key: int, value: int) -> None:
        """One entry of a hash map of u32 keys and u64 values."""
        bcc_table = self._bpf[table]
        bcc_table[bcc_table.Key(key)] = bcc_table.Leaf(value)

    def add_absent(self, table: str, rows: Iterable[tuple[int, tuple[int, ...]]]) -> None:
        """Rows (u32 key, struct fields) of a hash map, each one only where
        the key has none yet (the kernel's own rows stay)."""
        bcc_table = self._bpf[table]
        for key, fields in rows:
            k = bcc_table.Key(key)
            if k not in bcc_table:
                bcc_table[k] = bcc_table.Leaf(*fields)

    def delete_keys(self, table: str, keys: Iterable[int]) -> None:
        """Entries of a hash map of u32 keys, where they are (a table the
        program does not have is left alone)."""
        if not self.has_table(table):
            return
        bcc_table = self._bpf[table]
        for key in keys:
            with contextlib.suppress(KeyError):  # none, or taken meanwhile
                del bcc_table[bcc_table.Key(key)]

    def row(self, table: str, key: int) -> tuple[int, ...] | None:
        """The fields of the entry of u32 ``key`` in a hash map, or None."""
        bcc_table = self._bpf[table]
        try:
            leaf = bcc_table[bcc_table.Key(key)]
        except KeyError:
            return None
        return tuple(int(getattr(leaf, name)) for name, _ in leaf._fields_)

    def set_row(self, table: str, key: int, fields: tuple[int, ...]) -> None:
        """One entry (u32 key, struct fields) of a hash map."""
        bcc_table = self._bpf[table]
        bcc_table[bcc_table.Key(key)] = bcc_table.Leaf(*fields)

    def write_array(self, table: str, first: int, values: np.ndarray) -> None:
        """``values`` into an array map from index ``first`` on, in one call."""
        bpf_syscalls.update_array(self.map_fd(table), first, values)

    def set_tail_calls(self, table: str, slots: Mapping[int, str]) -> None:
        """Each slot of a program array given the uprobe-type program named."""
        array = self._bpf[table]
        for slot, name in slots.items():
            array[ctypes.c_int(slot)] = ctypes.c_int(self._prog_fd(name))

    def set_first_target(self, pid: int) -> None:
        """Name the process asked for to the trace program (FIRST_TGID)."""
        table = self._bpf["first_target"]
        table[table.Key(0)] = table.Leaf(pid, 1)

    def follow(self, pids: Iterable[int]) -> None:
        followed = self._bpf["followed"]
        for pid in pids:
            followed[followed.Key(pid)] = followed.Leaf(1)

    def _read_all(
        self, table: str, limit: int | None = None
    ) -> tuple[Any, np.ndarray, np.ndarray] | None:
        """(bcc table, raw keys (n, key bytes), u64 values (n, cpus, words))
        of a whole map (an array's first ``limit`` entries) in one batched
        read; None where the kernel cannot."""
        bcc_table = self._bpf[table]
        reader = self._readers.get(table)
        if reader is None:
            percpu = hasattr(bcc_table, "total_cpu")
            leaf = ctypes.sizeof(bcc_table.sLeaf if percpu else bcc_table.Leaf)
            cpus = bcc_table.total_cpu if percpu else 1
            reader = BatchReader(bcc_table.map_fd, ctypes.sizeof(bcc_table.Key), leaf,
                                 bcc_table.max_entries, cpus)  # fmt: skip
            reader.supported = percpu or leaf % 8 == 0
            self._readers[table] = reader
        got = reader.read(limit)
        return None if got is None else (bcc_table, *got)

    def percpu_array_totals(self, table: str) -> list[int]:
        got = self._read_all(table)
        if got is not None:
            return [int(v) for v in got[2][:, :, 0].sum(axis=1)]
        values = self._bpf[table]
        return [sum(values[values.Key(i)]) for i in range(len(values))]

    def percpu_struct_totals(self, table: str) -> list[tuple[Any, list[int]]]:
        """Each entry of a per-CPU hash or array of u64-only structs, its
        fields summed over the CPUs: [(key, [field sums in declaration order])]."""
        got = self._read_all(table)
        if got is not None:
            bcc_table, keys, values = got
            sums = values.sum(axis=1).tolist()
            return [(bcc_table.Key.from_buffer_copy(key.tobytes()), [int(v) for v in row])
                    for key, row in zip(keys, sums, strict=True)]  # fmt: skip
        values = self._bpf[table]
        fields = len(values.sLeaf._fields_)
        rows = []
        for key, per_cpu in values.items():
            summed = np.frombuffer(bytes(per_cpu), dtype=np.uint64).reshape(-1, fields).sum(axis=0)
            rows.append((key, [int(v) for v in summed]))
        return rows

    def slot_struct_totals(
        self, count: str, keys: str, stats: str
    ) -> list[tuple[tuple[int, ...], list[int]]]:
        """A slot table of the trace program: ``count[0]`` slots used, their keys
        in the array ``keys`` (structs of integers) and their u64-only
        structs in the per-CPU array ``stats``. Returns [(key fields,
        [field sums over the CPUs and over the slots of that key])]."""
        used = min(int(self._bpf[count][0].value), self._bpf[stats].max_entries)
        if used == 0:
            return []
        key_table = self._bpf[keys]
        got_keys = self._read_all(keys, used)
        got_stats = self._read_all(stats, used)
        if got_keys is not None and got_stats is not None:
            stride = got_keys[2].shape[-1] * 8
            raw = got_keys[2].tobytes()
            key_rows = [key_table.Leaf.from_buffer_copy(raw, i * stride)
                        for i in range(len(got_keys[2]))]  # fmt: skip
            sums = got_stats[2].sum(axis=1).tolist()
        else:
            key_rows = [key_table[key_table.Key(i)] for i in range(used)]
            table = self._bpf[stats]
            fields = len(table.sLeaf._fields_)
            sums = [np.frombuffer(bytes(table[table.Key(i)]), dtype=np.uint64)
                    .reshape(-1, fields).sum(axis=0).tolist() for i in range(used)]  # fmt: skip
        merged: dict[tuple[int, ...], list[int]] = {}
        for row, values in zip(key_rows, sums, strict=True):
            if not any(values):  # a slot whose key was still being written, or unused
                continue
            key = tuple(int(getattr(row, name)) for name, *_ in row._fields_)
            if key in merged:
                merged[key] = [a + int(b) for a, b in zip(merged[key], values, strict=True)]
            else:
                merged[key] = [int(v) for v in values]
        return list(merged.items())

    def program_fds(self) -> dict[str, int]:
        """The loaded programs (handlers) by function name."""
        fds = {name.decode() if isinstance(name, bytes) else str(name): int(func.fd)
               for name, func in self._bpf.funcs.items()}  # fmt: skip
        fds.update((name, program) for name, (program, _) in self._typed.items())
        if self.uprobe_links is not None:
            fds.update(self.uprobe_links.programs)
        return fds

    def string_keyed_counts(self, table: str) -> dict[str, int]:
        counts = self._bpf[table]
        return {
            bytes(key.name).split(b"\0", 1)[0].decode(errors="replace"): int(value.value)
            for key, value in counts.items()
        }

    def slot_named_counts(self, keys: str, names: str, counts: str) -> dict[str, int]:
        """Counts by name from a set-associative table of the trace program: the
        array ``keys`` of buckets (``cache``: each way's key, 0 if free),
        and per slot (bucket * ways + way) the array ``names`` and the
        per-CPU array ``counts``. Two keys of one name are summed."""
        totals = self.percpu_array_totals(counts)
        named = self._bpf[names]
        out: dict[str, int] = {}
        for index, bucket in self._bpf[keys].items():
            ways = len(bucket.cache)
            for way in range(ways):
                if bucket.cache[way]:
                    slot = index.value * ways + way
                    raw = bytes(named[named.Key(slot)].name)
                    name = raw.split(b"\0", 1)[0].decode(errors="replace")
                    out[name] = out.get(name, 0) + totals[slot]
        return out

    def close(self) -> None:
        """Detach everything, without making the user wait for the kernel.

        Closing the perf event of a uprobe or a tracepoint that carries a
        BPF program waits for RCU grace periods under the kernel's global
        event_mutex: about 80 ms each on this kind of machine, one after
        the other however many threads close them (measured: 48 events,
        4.1 s from 64 threads). A trace of 40 probe sites took 4 to 9 s to
        stop. So, once everything is written (the callers close the program
        last), a child process inherits the perf events and closes them,
        tracepoints first, once this process has closed its own copies,
        which is instant (the child still holds them), and exits. The handlers
        are gated off by then, so the events of those last seconds go
        nowhere. The child is named ``DETACHER_NAME``; it is gone within
        about 80 ms per probe site. Where it cannot be started, the events
        are closed here."""
        lib = import_bcc().libbcc.lib
        # bcc attaches the tracepoints; the uprobes are this program's own
        # perf events (uprobe_attach), made through the perf PMU: none is in tracefs.
        tracepoints = dict(self._bpf.tracepoint_fds)
        fds = [
            *tracepoints.values(),
            *(fd for event in self._uprobe_events for fd in (event.link, event.fd) if fd >= 0),
            *(self.uprobe_links.take_fds() if self.uprobe_links is not None else ()),
        ]
        self._uprobe_events = []
        if fds and not _detach_in_child(fds):
            for fd in fds:
                lib.bpf_close_perf_event_fd(fd)
        for name in tracepoints:
            self._bpf.tracepoint_fds.pop(name)
        for program, attachment in self._typed.values():
            os.close(attachment)
            os.close(program)
        self._typed.clear()
        if self.uprobe_links is not None:
            self.uprobe_links.close_programs()
        self._bpf.cleanup()


def _libbcc(bcc: Any) -> ctypes.CDLL:
    """libbcc with the declarations the cache needs, on a handle of its own
    (bcc's own declarations stay as bcc made them)."""
    lib = ctypes.CDLL(bcc.libbcc.lib._name, use_errno=True)
    size, text, module = ctypes.c_size_t, ctypes.c_char_p, ctypes.c_void_p
    for function, result, arguments in (
        ("bpf_num_functions", size, [module]),
        ("bpf_function_name", text, [module, size]),
        ("bpf_function_start", ctypes.c_void_p, [module, text]),
        ("bpf_function_size", size, [module, text]),
        ("bpf_module_license", text, [module]),
        ("bpf_module_kern_version", ctypes.c_uint, [module]),
        ("bpf_num_tables", size, [module]),
        ("bpf_table_name", text, [module, size]),
        ("bpf_table_fd_id", ctypes.c_int, [module, size]),
        ("bpf_table_key_desc_id", text, [module, size]),
        ("bpf_table_leaf_desc_id", text, [module, size]),
        ("bcc_prog_load", ctypes.c_int, [ctypes.c_int, text, ctypes.c_void_p, ctypes.c_int, text,
                                         ctypes.c_uint, ctypes.c_int, ctypes.c_void_p,
                                         ctypes.c_uint]),
    ):  # fmt: skip
        getattr(lib, function).restype = result
        getattr(lib, function).argtypes = arguments
    return lib


def _typed_handlers(bcc: Any, bpf: Any) -> tuple[dict[str, bytes], str]:
    """The BTF-typed handlers bcc compiled (its code has its maps' descriptors
    in it), and the program's license."""
    lib = _libbcc(bcc)
    module = bpf.module
    names = [lib.bpf_function_name(module, i) for i in range(lib.bpf_num_functions(module))]
    typed = {name.decode(): bytes(bpf.dump_func(name)) for name in names
             if name.decode().startswith(TYPED_PREFIX)}  # fmt: skip
    return typed, lib.bpf_module_license(module).decode()


def _compiled(bcc: Any, bpf: Any) -> bpf_cache.Compiled:
    """What bcc compiled: every function's code and every map's definition."""
    lib = _libbcc(bcc)
    module = bpf.module
    functions = {}
    for index in range(lib.bpf_num_functions(module)):
        name = lib.bpf_function_name(module, index)
        start, size = lib.bpf_function_start(module, name), lib.bpf_function_size(module, name)
        functions[name.decode()] = ctypes.string_at(start, size)
    maps = []
    for index in range(lib.bpf_num_tables(module)):
        fd = lib.bpf_table_fd_id(module, index)
        if fd < 0:
            raise ValueError("a table without a map")
        maps.append(bpf_cache.map_spec(
            fd, lib.bpf_table_name(module, index).decode(), index,
            lib.bpf_table_key_desc_id(module, index).decode(),
            lib.bpf_table_leaf_desc_id(module, index).decode(),
        ))  # fmt: skip
    license_ = lib.bpf_module_license(module).decode()
    return bpf_cache.Compiled(license_, int(lib.bpf_module_kern_version(module)), functions, maps)


class _TableFacts:
    """Stands in for libbcc in bcc.table while one table is made: its type,
    flags and size come from the cached map, everything else from libbcc."""

    def __init__(self, lib: Any, spec: bpf_cache.MapSpec) -> None:
        self._lib, self._spec = lib, spec

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def bpf_table_type_id(self, module: Any, table_id: int) -> int:
        return self._spec.type

    def bpf_table_flags_id(self, module: Any, table_id: int) -> int:
        return self._spec.flags

    def bpf_table_max_entries_id(self, module: Any, table_id: int) -> int:
        return self._spec.max_entries


_TABLE_FACTS_LOCK = threading.Lock()


def _program_type(bcc: Any, name: str) -> int:
    if name.startswith("tracepoint__"):
        return int(bcc.BPF.TRACEPOINT)
    if name.startswith(("raw_tracepoint__", FALLBACK_PREFIX)):
        return int(bcc.BPF.RAW_TRACEPOINT)
    return int(bcc.BPF.KPROBE)  # the uprobe and uretprobe handlers


def _uprobe_code(bcc: Any, functions: Mapping[str, bytes]) -> dict[str, bytes]:
    """The uprobe-type programs' code, as bcc compiled it in this run."""
    kind = int(bcc.BPF.KPROBE)
    return {text: code for text, code in functions.items()
            if not text.startswith(TYPED_PREFIX) and _program_type(bcc, text) == kind}  # fmt: skip


def _attach_error(uprobe: uprobe_multi.Uprobe, failure: uprobe_attach.AttachFailure) -> Exception:
    """What a refused uprobe means to the user."""
    what = "a return probe to" if uprobe.retprobe else "to"
    message = f"cannot attach {what} {uprobe.path} at {uprobe.offset:#x}: {failure}"
    if failure.errno == errno.ESRCH:
        return TargetError(f"process {uprobe.pid} exited")
    if failure.errno in (errno.EPERM, errno.EACCES):
        return NotPrivilegedError(message)
    return AttachError(message)


def _from_cache(bcc: Any, compiled: bpf_cache.Compiled, links: bool) -> Any:
    """A bcc.BPF object made from cached code instead of clang: the maps made
    anew, the code loaded with their descriptors, the tracepoint handlers
    attached as bcc's own start attaches them; with ``links``, the uprobe
    programs' code kept instead, to load for links. Raises on anything
    unexpected, with everything made so far closed."""
    BPF = bcc.BPF
    bpf = BPF.__new__(BPF)
    for table in ("kprobe_fds", "uprobe_fds", "tracepoint_fds", "raw_tracepoint_fds",
                  "kfunc_entry_fds", "kfunc_exit_fds", "lsm_fds", "perf_buffers",
                  "open_perf_events", "funcs", "tables"):  # fmt: skip
        setattr(bpf, table, {})
    bpf._ringbuf_manager, bpf.tracefile, bpf.debug, bpf.module = None, None, 0, None
    bpf.mtrace_typed = {}  # BTF-typed handlers: relocated, loaded by BpfProgram
    bpf.mtrace_uprobe_code = {} if links else None  # relocated, loaded for links
    cached = _CachedParts(bcc, bpf, compiled)
    bpf.close, bpf.load_func, bpf.get_table = cached.close, cached.load_func, cached.get_table
    try:
        cached.load(_libbcc(bcc))
        for text in compiled.functions:  # as bcc's _trace_autoload
            if text.startswith("tracepoint__"):
                tracepoint = text[len("tracepoint__") :].replace("__", ":")
                bpf.attach_tracepoint(tp=tracepoint.encode(), fn_name=text.encode())
            elif text.startswith("raw_tracepoint__"):
                bpf.attach_raw_tracepoint(tp=text[len("raw_tracepoint__") :].encode(),
                                          fn_name=text.encode())  # fmt: skip
    except BaseException:
        with contextlib.suppress(Exception):
            bpf.cleanup()
        cached.close()
        raise
    atexit.register(bpf.cleanup)
    return bpf


class _CachedParts:
    """What a bcc.BPF object made from cached code holds in place of bcc's
    module: the maps made anew, the programs loaded, and the three methods
    (close, load_func, get_table) that reach them."""

    def __init__(self, bcc: Any, bpf: Any, compiled: bpf_cache.Compiled) -> None:
        self.bcc, self.bpf, self.compiled = bcc, bpf, compiled
        self.map_fds: dict[int, int] = {}
        self.specs = {spec.name: spec for spec in compiled.maps}

    def load(self, lib: Any) -> None:
        """Make the maps, and load every program with their descriptors."""
        compiled, bpf = self.compiled, self.bpf
        for spec in compiled.maps:
            self.map_fds[spec.fd] = bpf_cache.recreate_map(spec)
        license_ = compiled.license.encode()
        for text, code in compiled.functions.items():
            if text.startswith(TYPED_PREFIX):
                bpf.mtrace_typed[text] = bpf_cache.relocate(code, self.map_fds)
                continue
            kind = _program_type(self.bcc, text)
            if kind == int(self.bcc.BPF.KPROBE) and bpf.mtrace_uprobe_code is not None:
                bpf.mtrace_uprobe_code[text] = bpf_cache.relocate(code, self.map_fds)
                continue
            insns = ctypes.create_string_buffer(bpf_cache.relocate(code, self.map_fds), len(code))
            fd = lib.bcc_prog_load(kind, text.encode(), insns, len(code),
                                   license_, compiled.kern_version, 0, None, 0)  # fmt: skip
            if fd < 0:
                raise OSError(ctypes.get_errno(), f"cannot load {text}")
            bpf.funcs[text.encode()] = self.bcc.BPF.Function(bpf, text.encode(), fd)

    def close(self) -> None:
        for name, function in list(self.bpf.funcs.items()):
            with contextlib.suppress(OSError):
                os.close(function.fd)
            del self.bpf.funcs[name]
        for fd in self.map_fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.map_fds.clear()

    def load_func(self, func_name: Any, prog_type: int, device: Any = None,
                  attach_type: int = -1) -> Any:  # fmt: skip
        name = func_name if isinstance(func_name, bytes) else str(func_name).encode()
        if name not in self.bpf.funcs:
            raise Exception(f"Unknown program {name.decode()}")
        return self.bpf.funcs[name]

    def get_table(self, name: Any, keytype: Any = None, leaftype: Any = None,
                  reducer: Any = None) -> Any:  # fmt: skip
        bcc, BPF = self.bcc, self.bcc.BPF
        text = name.decode() if isinstance(name, bytes) else str(name)
        spec = self.specs.get(text)
        if spec is None:
            raise KeyError(text)
        keytype = keytype or BPF._decode_table_type(json.loads(spec.key_desc))
        leaftype = leaftype or BPF._decode_table_type(json.loads(spec.leaf_desc))
        with _TABLE_FACTS_LOCK:  # the scrape's thread may make its first table meanwhile
            real = bcc.table.lib
            bcc.table.lib = _TableFacts(real, spec)
            try:
                return bcc.table.Table(self.bpf, spec.table_id, self.map_fds[spec.fd], keytype,
                                       leaftype, text.encode(), reducer=reducer)  # fmt: skip
            finally:
                bcc.table.lib = real


DETACHER_NAME = b"mtrace-detach"
_PR_SET_NAME = 15


def _detach_in_child(perf_fds: list[int]) -> bool:
    """Fork a process that closes ``perf_fds`` (in order) and every other
    descriptor, in a session of its own, and close this process's copies;
    False (nothing closed) if it cannot.

    The child closes the perf events only once this process has closed its
    copies (it waits for the end of a pipe this process holds open until
    then): the last close of an event is the one that waits for the kernel,
    and a child scheduled first would otherwise leave that wait here (a stop
    of 7 s was seen once in five)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    libc = ctypes.CDLL(None)  # looked up here: dlopen in the child could find its lock held
    prctl, fork = libc.prctl, libc.fork
    try:
        released, holding = os.pipe()
    except OSError:
        return False
    try:
        pid = os.fork()
    except OSError:
        os.close(released)
        os.close(holding)
        return False
    if pid:
        for fd in perf_fds:
            os.close(fd)
        os.close(released)
        os.close(holding)  # the child reads the end of file: its copies are the last
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)  # the first child exits at once: no zombie is left
        return True
    try:  # the child: only system calls from here on (other threads' locks are not ours)
        # A grandchild does the work: the first child exits at once and is
        # reaped above, and the grandchild, whose parent is gone, is reaped
        # by init (or the nearest subreaper). A long-lived tracer (serve, a
        # test runner) keeps no zombie per trace. Where it cannot fork, the
        # child does the work itself and the tracer waits for it. The name
        # comes first: the grandchild has it from its start, so that once
        # the tracer is back, a detacher still at work is seen by its name.
        prctl(_PR_SET_NAME, ctypes.c_char_p(DETACHER_NAME), 0, 0, 0)
        if fork() > 0:  # -1: no grandchild, the work is this child's
            os._exit(0)
        os.setsid()
        keep = {*perf_fds, released}
        for entry in os.listdir("/proc/self/fd"):
            fd = int(entry)
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        with contextlib.suppress(OSError):
            os.read(released, 1)  # end of file: the parent's copies are closed, or it is gone
        for fd in perf_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
    finally:
        os._exit(0)
