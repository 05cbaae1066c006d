"""A bcc BPF object made again from the code an earlier run compiled
(tracer/bpf/bpf_cache.py keeps it), without clang: the maps made anew, the
programs loaded with their descriptors relocated, the tracepoint handlers
attached as bcc's own start attaches them; and, the first time, that code
read out of what bcc compiled.

bcc is never imported here: its module is handed in by
tracer/bpf/bpf_backend.py, the one place that imports it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import threading
from collections.abc import Mapping
from typing import Any

from mtrace_live.tracer.bpf import bpf_cache, bpf_callbacks

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
        ("bcc_prog_load", ctypes.c_int, [ctypes.c_int, text, ctypes.c_void_p, ctypes.c_int, text,
                                         ctypes.c_uint, ctypes.c_int, ctypes.c_void_p,
                                         ctypes.c_uint]),
    ):  # fmt: skip
        getattr(lib, function).restype = result
        getattr(lib, function).argtypes = arguments
    return lib


def typed_handlers(bcc: Any, bpf: Any) -> tuple[dict[str, bytes], str]:
    """The BTF-typed handlers bcc compiled (its code has its maps' descriptors
    in it), and the program's license."""
    lib = _libbcc(bcc)
    module = bpf.module
    names = [lib.bpf_function_name(module, i) for i in range(lib.bpf_num_functions(module))]
    typed = {name.decode(): bytes(bpf.dump_func(name)) for name in names
             if name.decode().startswith(TYPED_PREFIX)}  # fmt: skip
    return typed, lib.bpf_module_license(module).decode()


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


def uprobe_code(bcc: Any, functions: Mapping[str, bytes]) -> dict[str, bytes]:
    """The uprobe-type programs' code, as bcc compiled it in this run."""
    kind = int(bcc.BPF.KPROBE)
    return {text: code for text, code in functions.items()
            if not text.startswith(TYPED_PREFIX) and _program_type(bcc, text) == kind}  # fmt: skip


def from_cache(bcc: Any, compiled: bpf_cache.Compiled, links: bool,
               map_fds: dict[int, int] | None = None) -> Any:  # fmt: skip
    """A bcc.BPF object made from cached code instead of clang: the maps made
    anew, the code loaded with their descriptors, the tracepoint handlers
    attached as bcc's own start attaches them; with ``links``, the uprobe
    programs' code kept instead, to load for links. ``map_fds``: the maps,
    made already (tracer/bpf/preload.py). Raises on anything unexpected,
    with everything made so far closed."""
    BPF = bcc.BPF
    bpf = BPF.__new__(BPF)
    for table in ("kprobe_fds", "uprobe_fds", "tracepoint_fds", "raw_tracepoint_fds",
                  "kfunc_entry_fds", "kfunc_exit_fds", "lsm_fds", "perf_buffers",
                  "open_perf_events", "funcs", "tables"):  # fmt: skip
        setattr(bpf, table, {})
    bpf._ringbuf_manager, bpf.tracefile, bpf.debug, bpf.module = None, None, 0, None
    bpf.mtrace_typed = {}  # BTF-typed handlers: relocated, loaded by BpfProgram
    bpf.mtrace_uprobe_code = {} if links else None  # relocated, loaded for links
    cached = _CachedParts(bcc, bpf, compiled, map_fds)
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

    def __init__(self, bcc: Any, bpf: Any, compiled: bpf_cache.Compiled,
                 map_fds: dict[int, int] | None = None) -> None:  # fmt: skip
        self.bcc, self.bpf, self.compiled = bcc, bpf, compiled
        self.map_fds: dict[int, int] = dict(map_fds or {})  # (made already: preload)
        self.specs = {spec.name: spec for spec in compiled.maps}

    def load(self, lib: Any) -> None:
        """Make the maps, and load every program with their descriptors."""
        compiled, bpf = self.compiled, self.bpf
        for spec in compiled.maps:
            if spec.fd not in self.map_fds:
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
            if bpf_callbacks.is_callback(text):
                continue  # linked into its program's code
            if bpf_callbacks.has_callback(text, compiled.functions):
                both = {name: bpf_cache.relocate(compiled.functions[name], self.map_fds)
                        for name in (text, bpf_callbacks.callback_of(text))}  # fmt: skip
                fd = bpf_callbacks.load_linked(both, text, compiled.license, kind, 0,
                                        compiled.kern_version)  # fmt: skip
                bpf.funcs[text.encode()] = self.bcc.BPF.Function(bpf, text.encode(), fd)
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
