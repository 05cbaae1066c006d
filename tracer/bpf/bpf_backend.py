"""The one place mtrace-live imports bcc.

Everything else (decoding, aggregation, exporters, listing probes) runs
without root and without bcc; they receive plain data from here.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib.util
import os
import re
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtrace_live.probes.elf.lazy import lazy_module
from mtrace_live.probes.errors import (
    AttachError,
    BccUnavailableError,
    NotPrivilegedError,
    TargetError,
)
from mtrace_live.probes.program import ProgramSource
from mtrace_live.tracer.bpf import (
    bcc_revive,
    bpf_cache,
    bpf_callbacks,
    bpf_syscalls,
    map_table,
    preload,
    uprobe_attach,
    uprobe_multi,
)
from mtrace_live.tracer.bpf.bcc_revive import (
    FALLBACK_PREFIX,
    TYPED_PREFIX,
    Function,
    compiled_of,
    from_cache,
)
from mtrace_live.tracer.bpf.bpf_callbacks import callback_of
from mtrace_live.tracer.bpf.bpf_syscalls import BatchReader
from mtrace_live.tracer.bpf.detacher import detach_in_child
from mtrace_live.tracer.bpf.kernel_btf import BtfUnavailable, KernelBtf
from mtrace_live.tracer.bpf.privileges import require_privileges
from mtrace_live.tracer.bpf.trace_tables import TraceTables
from mtrace_live.tracer.bpf.tracefs import tracefs_root

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # (at the first use: probes/elf/lazy.py)


def compile_only(bcc: Any) -> Any:
    """bcc's BPF class, compiling only: its own start also loads and
    attaches the tracepoint handlers it finds (``_trace_autoload``)."""

    class CompileOnly(bcc.BPF):  # type: ignore[misc]
        def _trace_autoload(self) -> None:
            pass

    return CompileOnly


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
    """The bcc bindings' version, or "unknown": read from its version.py,
    without importing bcc (whose library brings LLVM and clang: a warm
    start needs neither)."""
    try:
        found = importlib.util.find_spec("bcc")
        places = list(found.submodule_search_locations or []) if found is not None else []
        text = (Path(places[0]) / "version.py").read_text() if places else ""
    except (ImportError, ValueError, OSError):
        return "unknown"
    match = re.search(r"""__version__\s*=\s*['"]([^'"]+)['"]""", text)
    return match.group(1) if match else "unknown"


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

    # tail calls asked for inside the first uprobe_batch, set at its end (None: outside it)
    _tail_calls: list[tuple[str, dict[int, str]]] | None = None
    _attached = False  # the first batch attached (what the trace asked for is known)

    def __init__(self, source: ProgramSource, links: bool = True) -> None:
        """``links``: the uprobes may be attached in links (tracer/bpf/uprobe_multi.py),
        where the kernel has them."""
        require_privileges()
        tracefs_root()
        name = source.name
        # bcc compiles the text as /virtual/main.c: its own headers (records.h)
        # are found through the parts' directory.
        cflags = [*source.cflags(), f"-I{source.directory}"]
        # Two warnings every kernel header of 6.x raises under bcc's clang;
        # they say nothing about mtrace-live's own C.
        cflags += ["-Wno-duplicate-decl-specifier", "-Wno-ignored-attributes"]
        self._readers: dict[str, BatchReader] = {}
        self._mapped: dict[str, map_table.MappedArray] = {}  # the arrays mapped (array_copy)
        self._mapping = threading.Lock()  # (a scrape's thread copies while the trace may end)
        self._mapped_closed = False
        self.tables = TraceTables(self)  # the trace program's own tables, by name
        self._typed: dict[str, tuple[int, int]] = {}  # handler -> (program fd, attachment fd)
        # the uprobes' perf events (uprobe_attach), each as it was attached
        self._uprobe_events: list[UprobeEvent] = []
        self._generation = 0  # of the uprobes attached for one thread (retarget)
        # the return probes of generations turned from, kept for the calls they saw enter
        self._kept_returns: dict[int, list[UprobeEvent]] = {}
        # event -> why the kernel refused its BTF-typed handler (its raw one is attached)
        self.typed_refused: dict[str, str] = {}
        text = source.text()
        sources = [text.encode(), *(h.read_bytes() for h in source.headers())]
        key = bpf_cache.cache_key(sources, cflags, bcc_version())
        # What the start-up report says of the load: warnings, and the origin
        # (a debug line, MTRACE_LIVE_DEBUG=1).
        self.warnings: list[str] = []
        started = time.monotonic()
        # Uprobes in links (tracer/bpf/uprobe_multi.py) where the kernel has them:
        # every uprobe program is then loaded here, for them, from its code.
        self.uprobes_apart = uprobe_multi.why_not() if links else uprobe_multi.MAIN_GONE
        # this run's run-time values (probes/bpf/runtime.h), maps' sizes and
        # handlers left out
        given = bpf_cache.Given(source.values(), source.sizes(), source.absent)
        # what the start made of this program meanwhile, if it guessed it (preload)
        early = preload.take(key, given)
        compiled = self._cached(key, given, early)
        self.from_cache = compiled is not None  # loaded from code a previous run compiled
        if compiled is None:  # compiled here, then loaded as a cached one is
            compiled = self._loaded(self._compile(source, text, cflags, key), given)
        self.uprobe_links: uprobe_multi.UprobeLinks | None = None
        try:  # (from here on, what fails closes what was made: the programs loading too)
            self.uprobe_links = self._links(compiled, early)
            how = "loaded from the cache" if self.from_cache else "compiled"
            self.origin = (f"BPF program {name} {how} in {time.monotonic() - started:.2f} s "
                           f"({key[:12]})")  # fmt: skip
            if early is not None and self.from_cache:
                self.origin += ", its maps and uprobe programs made while the start planned"
            # The BTF-typed handlers' code, with this run's map descriptors in it.
            if self._bpf.mtrace_typed:
                self._attach_typed(self._bpf.mtrace_typed, compiled.license)
        except BaseException:
            self.close()
            raise

    def _compile(self, source: ProgramSource, text: str, cflags: list[str],
                 key: str) -> bpf_cache.Compiled:  # fmt: skip
        """Compile with bcc, and keep the code under ``key``: what was
        compiled. bcc loads and attaches nothing (its code loads the
        run-time values' marks, not values): the program is loaded from the
        code read back, as a cached one is."""
        import tempfile  # (a cold start's only: it imports shutil and random)

        bcc = import_bcc()
        if sys.stderr.isatty():  # a cold start says so to whoever waits at a terminal
            print(f"mtrace-live: compiling the BPF program for these options (about "
                  f"{bpf_cache.compile_estimate():.0f} s, once: later starts with them load "
                  "it from the cache)", file=sys.stderr, flush=True)  # fmt: skip
        started = time.monotonic()
        try:
            with tempfile.TemporaryDirectory(prefix="mtrace-live-bpf-") as scratch:
                main = source.main_file(Path(scratch), text)
                compiling = compile_only(bcc)(src_file=str(main).encode(), cflags=cflags)
        except Exception as exc:
            raise AttachError(f"cannot load BPF program {source.name}: {exc}") from None
        try:
            bpf_cache.note_compile(time.monotonic() - started)
            made = compiled_of(bcc, compiling)
        except Exception as exc:
            raise AttachError(f"cannot read back the compiled program {source.name}: "
                              f"{exc}") from None  # fmt: skip
        finally:
            compiling.cleanup()  # (its maps: the load makes its own)
        with contextlib.suppress(Exception):  # the cache is only ever a saving
            bpf_cache.store(key, made)
        return made

    def _loaded(self, compiled: bpf_cache.Compiled, given: bpf_cache.Given) -> bpf_cache.Compiled:
        """``compiled`` (just compiled) loaded as a cached program is:
        ``given`` its run's values and sizes, its maps made and its handlers loaded."""
        try:
            specialized = bpf_cache.specialize(compiled, given)
            self._bpf = from_cache(specialized, self.uprobes_apart is None)
        except Exception as exc:
            raise AttachError(f"cannot load the compiled program: {exc}") from None
        return specialized

    def _links(self, compiled: bpf_cache.Compiled,
               early: preload.Made | None) -> uprobe_multi.UprobeLinks | None:  # fmt: skip
        """The uprobe programs to load for links (loading from two threads
        from now on, or since the start began: ``early``), where this kernel
        has them and their code could be read (else uprobes_apart says why
        not)."""
        links = self._links_of(compiled)
        if early is not None and early.links is not None:
            if links is not None and self.from_cache:
                return early.links  # (the same code, relocated to the same maps)
            early.links.close_programs()
        if links is not None:
            links.prefetch(preload.later(), preload.load_times())
        return links

    def _links_of(self, compiled: bpf_cache.Compiled) -> uprobe_multi.UprobeLinks | None:
        code = self._bpf.mtrace_uprobe_code
        if self.uprobes_apart is not None or code is None:
            return None
        return uprobe_multi.UprobeLinks(code, compiled.license, compiled.kern_version)

    def _cached(self, key: str, given: bpf_cache.Given,
                early: preload.Made | None) -> bpf_cache.Compiled | None:  # fmt: skip
        """The program stored under ``key``, ``given`` its run's values and
        sizes, and loaded (its maps the ones made ``early``, where they
        were); None (with a warning where one was stored) to compile it
        instead."""
        try:
            compiled = early.compiled if early is not None else bpf_cache.load(key)
            if compiled is not None and early is None:
                compiled = bpf_cache.specialize(compiled, given)
            if compiled is not None:
                self._bpf = from_cache(compiled, self.uprobes_apart is None,
                                       early.map_fds if early is not None else None,
                                       early.programs if early is not None else None,
                                       early.links.code if early is not None and early.links
                                       else None)  # fmt: skip
            return compiled
        except Exception as exc:  # any doubt: compile, as without a cache
            if early is not None and early.links is not None:  # (its maps: closed with the rest)
                early.links.close_programs()
                early.links = None
            self.warnings.append(f"warning: the cached BPF program is unusable, compiled "
                                 f"it anew: {exc}")  # fmt: skip
            return None

    def tracepoints_attached(self) -> None:
        """Wait until the program's tracepoints are attached: a cached
        program attaches them on a thread while the start goes on
        (CachedBpf.attach_tracepoints_apart); bcc, at its load. Raises
        AttachError where one could not be (as bcc's attach does: a program
        compiled anew would meet the same kernel)."""
        wait = getattr(self._bpf, "tracepoints_attached", None)
        if wait is None:
            return
        try:
            wait()
        except OSError as exc:
            raise AttachError(exc.strerror or str(exc)) from None
        except Exception as exc:
            raise AttachError(f"cannot attach a tracepoint: {exc}") from None

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
        """In a link (tracer/bpf/uprobe_multi.py), or through perf_event_open
        (tracer/bpf/uprobe_attach.py): the path as given, from this process's
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
        each, at once, where the kernel has no links. In the trace's first
        batch (its gate closed until after it) the tail calls asked for
        inside are set at its end too, after the links, so that the programs
        they call (the unwinder's step, the verifier's longest) finish
        loading while the batch attaches."""
        if self.uprobe_links is None:
            yield
            return
        deferring = not self._attached and self._tail_calls is None
        if deferring:
            self._tail_calls = []
        try:
            with self.uprobe_links.batch():
                yield
            if deferring:
                pending, self._tail_calls = self._tail_calls or [], None
                for table, slots in pending:
                    self._set_tail_calls(table, slots)
        except uprobe_multi.LinkFailure as exc:
            raise _attach_error(exc.uprobe, exc.failure) from None
        except OSError as exc:
            raise AttachError(f"cannot load a uprobe handler: {exc.strerror}") from None
        finally:
            if deferring:
                self._tail_calls = None
        if deferring:
            self._attached = True

    def _prog_fd(self, handler: str) -> int:
        """A uprobe-type program's fd (a uprobe's handler, or a step the
        unwinder tail-calls), loaded for links where they are used."""
        if self.uprobe_links is not None:
            try:
                return self.uprobe_links.program(handler)
            except OSError as exc:
                raise AttachError(f"cannot load the handler {handler}: {exc.strerror}") from None
        name = handler.encode()
        if name not in self._bpf.funcs:
            # a program with a callback: bcc cannot load it (tracer/bpf/bpf_callbacks.py)
            with contextlib.suppress(KeyError):
                code = bpf_callbacks.loaded_code(self._bpf, (handler, callback_of(handler)))
                try:
                    fd = bpf_callbacks.load_linked(
                        code, handler, "GPL", bpf_syscalls.PROG_TYPE_KPROBE, 0
                    )
                except (OSError, ValueError) as exc:
                    raise AttachError(f"cannot load the handler {handler}: {exc}") from None
                self._bpf.funcs[name] = Function(name, fd)
        return int(self._bpf.load_func(name, bcc_revive.PROG_KPROBE).fd)

    @property
    def uprobes_move(self) -> bool:
        """The uprobes of one process are attached for one of its threads,
        and must move when it ends (tracer/processes/retarget.py); in links, they
        follow the process itself."""
        return self.uprobe_links is None

    def retarget(self, old: int, new: int) -> int:
        """The uprobes attached for thread ``old`` attached for thread ``new``
        instead (of the same process). The new events carry the next
        generation as their cookie and are all opened before the program's
        generation turns to it (``uprobe_generation``): till then the old
        events count each call, from then on the new ones, never both. The
        old entry probes are then closed by a detacher child; the old
        return probes are kept (``kept_returns``) for the calls they saw
        enter, whose returns no new one gets on recent kernels, until
        ``close_returns``. Returns how many moved; AttachFailure when one
        could not be opened (the old ones stay in force, the new ones
        opened so far are closed)."""
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
        returns = [event for event in gone if event.retprobe]
        if returns:
            self._kept_returns[self._generation] = returns
        if self.has_table("uprobe_generation"):
            self.fill_array("uprobe_generation", [generation])
        self._generation = generation
        _close_events([event for event in gone if not event.retprobe])
        return len(moved)

    @property
    def kept_returns(self) -> list[int]:
        """The generations turned from whose return probes are still open."""
        return sorted(self._kept_returns)

    def close_returns(self, generation: int) -> None:
        """Close generation ``generation``'s kept return probes (a detacher child)."""
        _close_events(self._kept_returns.pop(generation, []))

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
        got = self.read_all(table)
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

    def array_copy(self, table: str, dtype: Any, unused: tuple[str, Sequence[int]] | None = None
                   ) -> np.ndarray | None:  # fmt: skip
        """A copy of an array map of ``dtype`` rows, read through a shared
        mapping of its memory (an array made BPF_F_MMAPABLE): a copy of
        memory, where a batched read costs the kernel a lookup per row;
        ``unused`` (a field, its values in an unused row): only the rows in
        use are copied (a row may change meanwhile: the caller checks the
        copy again). None where the map cannot be mapped (the caller reads it)."""
        with self._mapping:
            mapped = self._mapped.get(table)
            if mapped is None and self._mapped_closed:
                return None
            if mapped is None:  # (tried again each time: a failure may pass)
                array = self._bpf[table]
                mapped = map_table.MappedArray.of(array.map_fd, array.max_entries,
                                                  ctypes.sizeof(array.Leaf), dtype)  # fmt: skip
                if mapped is None:
                    return None
                self._mapped[table] = mapped
            return mapped.copy(unused)

    def has_table(self, name: str) -> bool:
        try:
            self._bpf[name]
        except KeyError:
            return False
        return True

    def table(self, name: str) -> Any:
        """The bcc table ``name`` (KeyError: the program has none)."""
        return self._bpf[name]

    def map_fd(self, name: str) -> int:
        return int(self._bpf[name].map_fd)

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

    def set_row(self, table: str, key: int, fields: tuple[int, ...],
                only_existing: bool = False) -> bool:  # fmt: skip
        """One entry (u32 key, struct fields) of a hash map; ``only_existing``:
        written only over the entry there is (BPF_EXIST, one step with the
        check). False when the kernel refuses (none there)."""
        bcc_table = self._bpf[table]
        leaf = bcc_table.Leaf(*fields)
        if not only_existing:
            bcc_table[bcc_table.Key(key)] = leaf
            return True
        return bpf_syscalls.update_u32(self.map_fd(table), key, bytes(leaf), only_existing=True)

    def set_entry(self, table: str, key: bytes, value: bytes) -> bool:
        """One entry of any map, as raw bytes of its key and value types;
        False when the kernel refuses (a hash map with no room)."""
        return bpf_syscalls.update(self.map_fd(table), key, value)

    def entry_bytes(self, table: str, key: bytes) -> bytes | None:
        """The raw value at raw ``key`` of a hash map, or None."""
        bcc_table = self._bpf[table]
        return bpf_syscalls.lookup(self.map_fd(table), key, ctypes.sizeof(bcc_table.Leaf))

    def delete_entry(self, table: str, key: bytes) -> bool:
        """Delete one entry of a hash map (raw key bytes); False if none."""
        return bpf_syscalls.delete(self.map_fd(table), key)

    def row_bytes(self, table: str, key: int) -> bytes | None:
        """The raw value at u32 ``key`` of a hash map, or None."""
        bcc_table = self._bpf[table]
        return bpf_syscalls.lookup_u32(self.map_fd(table), key, ctypes.sizeof(bcc_table.Leaf))

    def write_array(self, table: str, first: int, data: bytes | memoryview) -> None:
        """``data``, a run of an array map's values each in its slot
        (map_table.slots), from index ``first`` on: through a mapping of its
        memory where it was made BPF_F_MMAPABLE, else in one
        BPF_MAP_UPDATE_BATCH (map_table.write_mapped)."""
        leaf = ctypes.sizeof(self._bpf[table].Leaf)
        map_table.write_mapped(self.map_fd(table), first, data, leaf)

    def set_tail_calls(self, table: str, slots: Mapping[int, str]) -> None:
        """Each slot of a program array given the uprobe-type program named
        (inside the trace's first uprobe_batch: at its end)."""
        if self._tail_calls is not None:
            self._tail_calls.append((table, dict(slots)))
            return
        self._set_tail_calls(table, slots)

    def _set_tail_calls(self, table: str, slots: Mapping[int, str]) -> None:
        array = self._bpf[table]
        for slot, name in slots.items():
            array[ctypes.c_int(slot)] = ctypes.c_int(self._prog_fd(name))

    def read_all(
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
        got = self.read_all(table)
        if got is not None:
            return [int(v) for v in got[2][:, :, 0].sum(axis=1)]
        values = self._bpf[table]
        return [sum(values[values.Key(i)]) for i in range(len(values))]

    def percpu_struct_totals(self, table: str) -> list[tuple[Any, list[int]]]:
        """Each entry of a per-CPU hash or array of u64-only structs, its
        fields summed over the CPUs: [(key, [field sums in declaration order])]."""
        got = self.read_all(table)
        if got is not None:
            bcc_table, keys, values = got
            sums = values.sum(axis=1).tolist()
            return [(bcc_table.Key.from_buffer_copy(key.tobytes()), [int(v) for v in row])
                    for key, row in zip(keys, sums, strict=True)]  # fmt: skip
        entries = self._bpf[table]
        fields = len(entries.sLeaf._fields_)
        rows = []
        for key, per_cpu in entries.items():
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
        got_keys = self.read_all(keys, used)
        got_stats = self.read_all(stats, used)
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
        about 80 ms per tracepoint, or one link's wait where that is longer:
        the uprobe links, whose waits need no global lock, are closed side
        by side by threads of their own (detacher.detach_in_child). Where no
        child can be started, the events are closed here."""
        with contextlib.suppress(Exception):
            self.tracepoints_attached()  # (a cached program's attach thread: done)
        # The tracepoints are attached as bcc's start attaches them (by bcc, or
        # tracer/bpf/tracepoint_attach.py); the uprobes are this program's own
        # perf events (uprobe_attach), made through the perf PMU: none is in tracefs.
        tracepoints = dict(self._bpf.tracepoint_fds)
        kept = [event for events in self._kept_returns.values() for event in events]
        self._kept_returns = {}
        fds = [*tracepoints.values(), *_event_fds([*self._uprobe_events, *kept])]
        links = self.uprobe_links.take_fds() if self.uprobe_links is not None else []
        self._uprobe_events = []
        if (fds or links) and not detach_in_child(fds, links):
            for fd in [*fds, *links]:
                bpf_syscalls.close_quietly(fd)
        for name in tracepoints:
            self._bpf.tracepoint_fds.pop(name)
        for program, attachment in self._typed.values():
            os.close(attachment)
            os.close(program)
        self._typed.clear()
        if self.uprobe_links is not None:
            # (a start that failed before its first batch ended asked for few
            # handlers: what it asked for says nothing of the next start's)
            with contextlib.suppress(Exception):  # (the facts only ever save time)
                loaded = self.uprobe_links
                if self._attached:
                    preload.keep_handlers(loaded.handlers, set(loaded.programs), loaded.load_ms)
            self.uprobe_links.close_programs()
        with self._mapping:
            for mapped in self._mapped.values():
                mapped.close()
            self._mapped.clear()
            self._mapped_closed = True
        self._bpf.cleanup()


def _attach_error(uprobe: uprobe_multi.Uprobe, failure: uprobe_attach.AttachFailure) -> Exception:
    """What a refused uprobe means to the user."""
    what = "a return probe to" if uprobe.retprobe else "to"
    message = f"cannot attach {what} {uprobe.path} at {uprobe.offset:#x}: {failure}"
    if failure.errno == errno.ESRCH:
        return TargetError(f"process {uprobe.pid} exited")
    if failure.errno in (errno.EPERM, errno.EACCES):
        return NotPrivilegedError(message)
    return AttachError(message)


def _close_events(events: list[UprobeEvent]) -> None:
    """Close uprobes' perf events (and their links), by a detacher child
    where one can be started (closing waits for the kernel: BpfProgram.close)."""
    fds = _event_fds(events)
    if fds and not detach_in_child(fds):
        for fd in fds:
            os.close(fd)


def _event_fds(events: Iterable[UprobeEvent]) -> list[int]:
    """The descriptors of uprobes' perf events and their links."""
    return [fd for event in events for fd in (event.link, event.fd) if fd >= 0]
