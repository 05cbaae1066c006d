"""Compiled BPF programs kept between runs, so that a trace starts without
clang.

bcc 0.26 compiles the C program with clang at every start: about 0.35 s for
the trace program with the libc sites alone, 0.6 s with the allocation functions'
handlers, most of a start-up (docs/performance.md, section 6). bcc has no
object file to load instead (no CO-RE in this bcc). But what clang makes is
plain BPF byte code whose only tie to the run that compiled it is the map
file descriptors written into its 64-bit loads (``ld_imm64`` with
``BPF_PSEUDO_MAP_FD``). So the first run with a given program (the source,
its compile-time constants, the kernel and bcc) stores each function's code
and each map's kernel definition (as the kernel reports it for the map bcc
made); a later run creates the same maps, writes their new descriptors into
the code, and loads it: no clang, no kernel headers.

Anything unexpected in a stored program (a cache file that does not parse,
code that refers to anything but a map, a map the kernel will not create)
makes the caller compile it anew, with a warning that says why. A program
just compiled is loaded the same way (the run's values written into it:
``specialize``), so what cannot be loaded so fails the trace with its
reason. Where the program came from (the cache, or clang) is a debug line
of the start-up report (``MTRACE_LIVE_DEBUG=1``).

The cache is a directory (``MTRACE_LIVE_BPF_CACHE``, default
/var/cache/mtrace-live/bpf; ``off`` disables it) of one JSON file per
program, at most ``KEEP`` of them, the least recently used removed first.
The code is loaded into the kernel as root, so a file (or directory) that
another user owns or could write is ignored.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import hashlib
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from mtrace_live.probes.elf.facts import read_private_file, write_private_json
from mtrace_live.tracer.bpf import bpf_syscalls

DEFAULT_DIR = Path("/var/cache/mtrace-live/bpf")
KEEP = 32
FORMAT = 1
_LD_IMM64 = 0x18
_PSEUDO_MAP_FD = 1


@dataclass(frozen=True)
class MapSpec:
    """A map as bcc declared it (name, table id, descriptions of its key and
    value types) and as the kernel made it."""

    name: str
    table_id: int
    fd: int  # in the run that compiled the code
    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    kernel_name: str
    key_desc: str
    leaf_desc: str


@dataclass(frozen=True)
class Compiled:
    """What a compile produced: each function's byte code, and the maps."""

    license: str
    kern_version: int
    functions: dict[str, bytes]
    maps: list[MapSpec]


def program_cache_dir() -> Path | None:
    configured = os.environ.get("MTRACE_LIVE_BPF_CACHE", "")
    if configured == "off":
        return None
    return Path(configured) if configured else DEFAULT_DIR


def cache_key(sources: list[bytes], cflags: list[str], bcc_version: str) -> str:
    """Everything the compiled code depends on: the C, the constants, the
    kernel (its build and the headers bcc compiled against) and bcc."""
    digest = hashlib.sha256()
    uname = os.uname()
    build = Path(f"/lib/modules/{uname.release}/build")
    with contextlib.suppress(OSError):
        build = build.resolve()
    for part in (*sources, *(f.encode() for f in cflags), uname.release.encode(),
                 uname.version.encode(), uname.machine.encode(), str(build).encode(),
                 bcc_version.encode(), str(FORMAT).encode()):  # fmt: skip
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


def map_spec(fd: int, name: str, table_id: int, key_desc: str, leaf_desc: str) -> MapSpec:
    """The kernel's definition of the map behind ``fd``."""
    info = bpf_syscalls.map_info(fd)
    if info is None:
        raise OSError(ctypes.get_errno(), f"cannot read the definition of map {name}")
    return MapSpec(name, table_id, fd, info.type, info.key_size, info.value_size,
                   info.max_entries, info.flags, info.name, key_desc, leaf_desc)  # fmt: skip


def recreate_maps(specs: list[MapSpec]) -> dict[int, int]:
    """A new map like each of ``specs``, made in one call (the interpreter
    lock let go once: tracer/bpf/bpf_batch.c), by the spec's descriptor;
    OSError for the first the kernel refused (none is left made)."""
    fds = bpf_syscalls.create_maps([
        bpf_syscalls.MapInfo(spec.type, spec.key_size, spec.value_size, spec.max_entries,
                             spec.flags, spec.kernel_name) for spec in specs])  # fmt: skip
    refused = next(((spec, -fd) for spec, fd in zip(specs, fds, strict=True) if fd < 0), None)
    if refused is not None:
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        spec, error = refused
        raise OSError(error, f"cannot create map {spec.name}: {os.strerror(error)}")
    return {spec.fd: fd for spec, fd in zip(specs, fds, strict=True)}


def relocate(code: bytes, fds: dict[int, int]) -> bytes:
    """``code`` with each map descriptor of the compiling run replaced by
    the new one; ValueError if it loads anything else by reference."""
    if len(code) % 8:
        raise ValueError("BPF code is not whole instructions")
    out = bytearray(code)
    index = 0
    while index < len(out):
        opcode, regs = out[index], out[index + 1]
        if opcode == _LD_IMM64:
            source = regs >> 4
            if source == _PSEUDO_MAP_FD:
                (old,) = struct.unpack_from("<i", out, index + 4)
                if old not in fds:
                    raise ValueError(f"the code loads map descriptor {old}, not one of its maps")
                struct.pack_into("<i", out, index + 4, fds[old])
            elif source != 0:
                raise ValueError(f"the code loads a reference of kind {source}")
            index += 16  # two instruction slots
        else:
            index += 8
    return bytes(out)


RUNTIME_MARK = 0x6D746C72  # a run-time value's load: this in its high half (runtime.h)


@dataclass(frozen=True)
class Given:
    """What a run gives a compiled program at its load: its run-time values
    by mark (probes/bpf/runtime.h), the sizes (max_entries) of the maps it
    makes at a size of its own, by name (probes/program.py RUNTIME_SIZES),
    and the handlers it leaves out (a name ending in * for every one it
    begins: probes/program.py ALLOC_HANDLERS)."""

    values: Mapping[int, int]
    sizes: Mapping[str, int] = field(default_factory=dict)
    absent: tuple[str, ...] = ()

    def kept(self) -> dict[str, Any]:
        """As a JSON document keeps it (the facts: tracer/bpf/preload.py)."""
        return {"values": [[mark, value] for mark, value in sorted(self.values.items())],
                "sizes": dict(sorted(self.sizes.items())), "absent": list(self.absent)}  # fmt: skip

    def leaves_out(self, handler: str) -> bool:
        return any(handler == name or (name.endswith("*") and handler.startswith(name[:-1]))
                   for name in self.absent)  # fmt: skip

    @staticmethod
    def from_kept(document: Any) -> Given | None:
        """What ``kept`` wrote, or None where ``document`` is not that."""
        if not isinstance(document, dict):
            return None
        pairs, sizes, absent = document.get("values"), document.get("sizes"), document.get("absent")
        if not isinstance(pairs, list) or not isinstance(sizes, dict):
            return None
        if not isinstance(absent, list) or not all(isinstance(name, str) for name in absent):
            return None
        if not all(isinstance(pair, list) and len(pair) == 2
                   and all(isinstance(n, int) for n in pair) for pair in pairs):  # fmt: skip
            return None
        if not all(isinstance(n, int) for n in sizes.values()):
            return None
        return Given({mark: value for mark, value in pairs}, dict(sizes), tuple(absent))


def specialize(compiled: Compiled, given: Given) -> Compiled:
    """``compiled`` with each run-time value's load (a 64-bit immediate whose
    high half is RUNTIME_MARK: probes/bpf/runtime.h) given this run's value,
    the maps the run sizes at its sizes, and without the handlers it leaves
    out; ValueError where the code loads a mark the run does not give."""
    kept = {name: code for name, code in compiled.functions.items() if not given.leaves_out(name)}
    functions = {name: _with_values(code, given.values) for name, code in kept.items()}
    maps = [replace(spec, max_entries=given.sizes[spec.name]) if spec.name in given.sizes else spec
            for spec in compiled.maps]  # fmt: skip
    return replace(compiled, functions=functions, maps=maps)


def _with_values(code: bytes, values: Mapping[int, int]) -> bytes:
    out: bytearray | None = None
    index = 0
    while index + 16 <= len(code):
        if code[index] == _LD_IMM64 and code[index + 1] >> 4 == 0:
            low, high = struct.unpack_from("<I", code, index + 4)[0], struct.unpack_from(
                "<I", code, index + 12)[0]  # fmt: skip
            if high == RUNTIME_MARK:
                mark = high << 32 | low
                if mark not in values:
                    raise ValueError(f"the code loads run-time value {mark:#x}, which is not given")
                if out is None:
                    out = bytearray(code)
                value = values[mark] & 0xFFFF_FFFF_FFFF_FFFF
                struct.pack_into("<I", out, index + 4, value & 0xFFFF_FFFF)
                struct.pack_into("<I", out, index + 12, value >> 32)
            index += 16
        else:
            index += 8
    return code if out is None else bytes(out)


class Unusable(Exception):
    """A stored program that is there but cannot be used (it does not parse,
    or someone else could have written it): the caller compiles, and says so."""


def load(key: str) -> Compiled | None:
    """The compiled program under ``key``, or None where none is stored;
    Unusable where one is stored but cannot be used."""
    directory = program_cache_dir()
    if directory is None:
        return None
    path = directory / f"{key}.json"
    if not path.is_file():
        return None
    try:
        data = read_private_file(path)
        if data is None:
            # code that someone else could have written is never loaded
            raise Unusable(f"{path} could be written by another user")
        document = json.loads(data)
        compiled = Compiled(
            license=str(document["license"]),
            kern_version=int(document["kern_version"]),
            functions={
                str(name): base64.b64decode(code) for name, code in document["functions"].items()
            },
            maps=[MapSpec(**spec) for spec in document["maps"]],
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise Unusable(f"{path} does not read as a stored program ({type(exc).__name__})") from None
    with contextlib.suppress(OSError):
        os.utime(path)  # recently used
    return compiled


def store(key: str, compiled: Compiled) -> None:
    """Keep ``compiled`` under ``key`` (atomically); errors are ignored: the
    cache is only ever a saving."""
    directory = program_cache_dir()
    if directory is None:
        return
    document = {
        "format": FORMAT,
        "license": compiled.license,
        "kern_version": compiled.kern_version,
        "functions": {
            name: base64.b64encode(code).decode() for name, code in compiled.functions.items()
        },
        "maps": [asdict(spec) for spec in compiled.maps],
    }
    keep_json(directory / f"{key}.json", document, KEEP)


COMPILE_ESTIMATE_S = 3.0  # a compile on this kind of machine, until one is measured
_LAST_COMPILE = "last-compile-seconds"


def compile_estimate() -> float:
    """What a compile will take: the last one measured here, else an estimate."""
    directory = program_cache_dir()
    with contextlib.suppress(OSError, ValueError):
        if directory is not None:
            return max(float((directory / _LAST_COMPILE).read_text()), 1.0)
    return COMPILE_ESTIMATE_S


def note_compile(seconds: float) -> None:
    """Keep what a compile took, for the next cold start's estimate."""
    directory = program_cache_dir()
    with contextlib.suppress(OSError):
        if directory is not None:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            (directory / _LAST_COMPILE).write_text(f"{seconds:.2f}\n")


def keep_json(path: Path, document: object, keep: int) -> None:
    """Write ``document`` to ``path`` atomically, in a directory only this
    user may write, and leave its ``keep`` most recently used JSON files
    there; errors are ignored (a cache is only ever a saving)."""
    directory = path.parent
    with contextlib.suppress(OSError, TypeError, ValueError):
        write_private_json(path, document)
        entries = sorted(directory.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
        for stale in entries[keep:]:
            with contextlib.suppress(OSError):
                stale.unlink()
