"""A program made again from the code an earlier run compiled
(tracer/bpf/bpf_cache.py keeps it), without clang and without bcc: the maps
made anew, the programs loaded with their descriptors relocated, the
tracepoint handlers attached as bcc's own start attaches them, and the
maps read and written as bcc's tables (tracer/bpf/map_table.py); and, the
first time, that code read out of what bcc compiled.

bcc is never imported here: its module is handed in by
tracer/bpf/bpf_backend.py, the one place that imports it, to read out what
it compiled.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mtrace_live.tracer.bpf import (
    bpf_cache,
    bpf_callbacks,
    bpf_syscalls,
    map_table,
    tracepoint_attach,
)

# Handlers bcc does not load itself: TYPED_PREFIX + EVENT is a BTF-typed
# tracepoint handler (tp_btf), loaded and attached by BpfProgram, and
# FALLBACK_PREFIX + EVENT the raw handler attached instead where the kernel
# refuses it.
TYPED_PREFIX = "tp_btf__"
FALLBACK_PREFIX = "rawtp__"


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
    ):  # fmt: skip
        getattr(lib, function).restype = result
        getattr(lib, function).argtypes = arguments
    return lib


def compiled_of(bcc: Any, bpf: Any) -> bpf_cache.Compiled:
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


# enum bpf_prog_type
PROG_KPROBE, PROG_TRACEPOINT, PROG_RAW_TRACEPOINT = bpf_syscalls.PROG_TYPE_KPROBE, 5, 17


def handler_type(name: str) -> int:
    """A handler's program type, by its name (bcc's naming)."""
    if name.startswith("tracepoint__"):
        return PROG_TRACEPOINT
    if name.startswith(("raw_tracepoint__", FALLBACK_PREFIX)):
        return PROG_RAW_TRACEPOINT
    return PROG_KPROBE  # the uprobe and uretprobe handlers


def uprobe_code(functions: Mapping[str, bytes]) -> dict[str, bytes]:
    """The uprobe-type programs' code, as bcc compiled it in this run."""
    return {text: code for text, code in functions.items()
            if not text.startswith(TYPED_PREFIX) and handler_type(text) == PROG_KPROBE}  # fmt: skip


def from_cache(compiled: bpf_cache.Compiled, links: bool, map_fds: dict[int, int] | None = None,
               programs: dict[str, int] | None = None,
               uprobe_code: dict[str, bytes] | None = None) -> CachedBpf:  # fmt: skip
    """The program made from cached code instead of clang: the maps made
    anew, the code loaded with their descriptors, the tracepoint handlers
    attached as bcc's own start attaches them; with ``links``, the uprobe
    programs' code kept instead, to load for links. ``map_fds``: the maps,
    made already, and ``programs``: handlers loaded already, now its own
    (tracer/bpf/preload.py), with ``uprobe_code``: the uprobe programs'
    code relocated to those maps already. Raises on anything unexpected,
    with everything made so far closed."""
    bpf = CachedBpf(compiled, links, map_fds, programs, uprobe_code)
    try:
        bpf.load()
        tracepoints = []
        for text in compiled.functions:  # as bcc's _trace_autoload
            if text.startswith("tracepoint__"):
                tracepoint = text[len("tracepoint__") :].replace("__", ":")
                tracepoints.append((tracepoint.encode(), text.encode()))
            elif text.startswith("raw_tracepoint__"):
                bpf.attach_raw_tracepoint(tp=text[len("raw_tracepoint__") :].encode(),
                                          fn_name=text.encode())  # fmt: skip
        bpf.attach_tracepoints_apart(tracepoints)
    except BaseException:
        bpf.cleanup()
        raise
    return bpf


def loaded_here(text: str) -> bool:
    """A handler CachedBpf.load loads itself, with links too: a tracepoint's
    (classic or raw), not a BTF-typed one (BpfProgram's), a uprobe's (for
    links: uprobe_multi.py) or a callback (linked into its program)."""
    return (not text.startswith(TYPED_PREFIX) and handler_type(text) != PROG_KPROBE
            and not bpf_callbacks.is_callback(text))  # fmt: skip


def load_handler(compiled: bpf_cache.Compiled, text: str, map_fds: dict[int, int]) -> int:
    """Load one cached handler with the maps ``map_fds``: its program's fd.
    Raises OSError (the verifier's words)."""
    kind = handler_type(text)
    if bpf_callbacks.has_callback(text, compiled.functions):
        both = {name: bpf_cache.relocate(compiled.functions[name], map_fds)
                for name in (text, bpf_callbacks.callback_of(text))}  # fmt: skip
        return bpf_callbacks.load_linked(both, text, compiled.license, kind, 0,
                                         compiled.kern_version)  # fmt: skip
    return bpf_syscalls.load_program(bpf_cache.relocate(compiled.functions[text], map_fds),
                                     compiled.license, kernel_name(text), kind, 0,
                                     compiled.kern_version)  # fmt: skip


# the prefixes of the handlers here that bcc leaves out of a program's name
# for the kernel (libbpf.c)
BCC_DROPPED_PREFIXES = ("tracepoint__", "raw_tracepoint__")


def kernel_name(text: str) -> str:
    """A handler's name as bcc gives it to the kernel (``bpftool prog`` shows
    it, cut to 15 bytes): those prefixes left out."""
    for prefix in BCC_DROPPED_PREFIXES:
        if text.startswith(prefix):
            return text[len(prefix) :]
    return text


@dataclass(frozen=True)
class Function:
    """A loaded program (as bcc.BPF.Function: its name and fd)."""

    name: bytes
    fd: int


class CachedBpf:
    """A program loaded from cached code: what BpfProgram reaches of a
    bcc.BPF object (its tables by name, ``funcs``, ``tracepoint_fds``,
    ``load_func``, the tracepoint attaches and ``cleanup``), made with the
    project's own system calls (tracer/bpf/map_table.py for the tables)."""

    def __init__(self, compiled: bpf_cache.Compiled, links: bool,
                 map_fds: dict[int, int] | None = None,
                 programs: dict[str, int] | None = None,
                 uprobe_code: dict[str, bytes] | None = None) -> None:  # fmt: skip
        self.compiled = compiled
        self.funcs: dict[bytes, Function] = {}
        self._loaded = dict(programs or {})  # handlers loaded already (preload): taken at load
        self.tracepoint_fds: dict[bytes, int] = {}
        self.raw_tracepoint_fds: dict[bytes, int] = {}
        # BTF-typed handlers: relocated, loaded by BpfProgram
        self.mtrace_typed: dict[str, bytes] = {}
        # the uprobe programs' code, relocated, loaded for links (None: loaded here)
        self.mtrace_uprobe_code: dict[str, bytes] | None = {} if links else None
        self.map_fds: dict[int, int] = dict(map_fds or {})  # (made already: preload)
        # the uprobe programs' code relocated to those maps already (preload)
        self._relocated = dict(uprobe_code or {}) if map_fds else {}
        self._tables: dict[str, map_table.Table] = {}  # every map's, made at load
        self._attaching: threading.Thread | None = None  # (attach_tracepoints_apart)
        self._attach_failure: Exception | None = None

    def load(self) -> None:
        """Make the maps, and load every program with their descriptors."""
        compiled = self.compiled
        self.map_fds.update(bpf_cache.recreate_maps([spec for spec in compiled.maps
                                                     if spec.fd not in self.map_fds]))  # fmt: skip
        for spec in compiled.maps:  # (any type unknown: compiled instead, at once)
            self._tables[spec.name] = self._table(spec)
        for text, code in compiled.functions.items():
            if text.startswith(TYPED_PREFIX):
                self.mtrace_typed[text] = bpf_cache.relocate(code, self.map_fds)
                continue
            if handler_type(text) == PROG_KPROBE and self.mtrace_uprobe_code is not None:
                relocated = self._relocated.get(text)
                if relocated is None:
                    relocated = bpf_cache.relocate(code, self.map_fds)
                self.mtrace_uprobe_code[text] = relocated
                continue
            if bpf_callbacks.is_callback(text):
                continue  # linked into its program's code
            fd = self._loaded.pop(text, None)
            if fd is None:
                fd = load_handler(compiled, text, self.map_fds)
            self.funcs[text.encode()] = Function(text.encode(), fd)

    def __getitem__(self, name: str | bytes) -> map_table.Table:
        """A map's table (KeyError: the program has no such map)."""
        return self._tables[name.decode() if isinstance(name, bytes) else str(name)]

    def _table(self, spec: bpf_cache.MapSpec) -> map_table.Table:
        """The table of a map; UnknownType where its types are not the
        kernel's sizes."""
        key = map_table.decode_type(json.loads(spec.key_desc))
        leaf = map_table.decode_type(json.loads(spec.leaf_desc))
        sizes = (ctypes.sizeof(key), ctypes.sizeof(leaf))
        if spec.type in map_table.SIZED and sizes != (spec.key_size, spec.value_size):
            raise map_table.UnknownType(f"map {spec.name}: its types are not the sizes the "
                                        "kernel has")  # fmt: skip
        return map_table.Table(self.map_fds[spec.fd], spec.type, spec.max_entries, key, leaf)

    def load_func(self, func_name: str | bytes, prog_type: int) -> Function:
        name = func_name if isinstance(func_name, bytes) else str(func_name).encode()
        if name not in self.funcs:
            raise KeyError(f"unknown program {name.decode()}")
        return self.funcs[name]

    def attach_tracepoint(self, tp: bytes, fn_name: bytes) -> None:
        """Attach a tracepoint's handler (``tp``: "category:event")."""
        if tp in self.tracepoint_fds:
            raise ValueError(f"tracepoint {tp.decode()} is attached already")
        category, _, event = tp.decode().partition(":")
        fd = tracepoint_attach.attach_tracepoint(self.load_func(fn_name, PROG_TRACEPOINT).fd,
                                      category, event)  # fmt: skip
        self.tracepoint_fds[tp] = fd

    def attach_tracepoints_apart(self, tracepoints: list[tuple[bytes, bytes]]) -> None:
        """Attach these (tracepoint, handler) on a thread of their own: a
        tracepoint's perf_event_open takes the kernel's event_mutex, which a
        trace that just ended holds while its detacher closes its own, one
        RCU grace period each (docs/performance.md, section 12), so the
        start goes on meanwhile. ``tracepoints_attached`` waits for them."""
        if tracepoints:
            self._attaching = threading.Thread(target=self._attach_all, args=(tracepoints,),
                                               name="mtrace-tracepoints", daemon=True)  # fmt: skip
            self._attaching.start()

    def _attach_all(self, tracepoints: list[tuple[bytes, bytes]]) -> None:
        try:
            for tracepoint, handler in tracepoints:
                self.attach_tracepoint(tp=tracepoint, fn_name=handler)
        except Exception as exc:  # (raised by tracepoints_attached)
            self._attach_failure = exc

    def tracepoints_attached(self) -> None:
        """Wait until every tracepoint is attached; raises what the first
        that could not be raised (OSError: the kernel refused it)."""
        if self._attaching is not None:
            self._attaching.join()
            self._attaching = None
        failure, self._attach_failure = self._attach_failure, None
        if failure is not None:
            raise failure

    def attach_raw_tracepoint(self, tp: bytes, fn_name: bytes) -> None:
        if tp in self.raw_tracepoint_fds:
            raise ValueError(f"raw tracepoint {tp.decode()} is attached already")
        fd = bpf_syscalls.attach_raw_tracepoint(self.load_func(fn_name, PROG_RAW_TRACEPOINT).fd,
                                                tp.decode())  # fmt: skip
        self.raw_tracepoint_fds[tp] = fd

    def cleanup(self) -> None:
        """Close everything still open: attachments, programs, maps."""
        with contextlib.suppress(Exception):
            self.tracepoints_attached()
        for fds in (self.tracepoint_fds, self.raw_tracepoint_fds):
            for fd in fds.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            fds.clear()
        for function in self.funcs.values():
            with contextlib.suppress(OSError):
                os.close(function.fd)
        self.funcs.clear()
        for fd in [*self.map_fds.values(), *self._loaded.values()]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.map_fds.clear()
        self._loaded.clear()
