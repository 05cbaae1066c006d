"""bpf(2) calls that bcc's Python bindings do not offer, made through
file descriptors bcc already holds.

Batched map reads: a whole map in one BPF_MAP_LOOKUP_BATCH into a numpy
buffer, instead of bcc's one lookup (and one ctypes conversion) per key. A
scrape reads every map it needs this way.

Maps' kernel definitions read and maps made from them (for the compiled
programs kept between runs, tracer/bpf/bpf_cache.py).

A BTF-typed tracepoint program (tp_btf) loaded from code bcc compiled, and
attached: bcc 0.26 offers neither.

BPF programs' run time, as the kernel counts it (``bpftool prog`` shows the
same ``run_time_ns`` and ``run_cnt``). The kernel counts only while
statistics are enabled: the sysctl ``kernel.bpf_stats_enabled``, or as long
as someone holds the file descriptor BPF_ENABLE_STATS returned. Both cost a
little on every program run, so mtrace-live enables them only when asked
(``serve --bpf-stats``).
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import os
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mtrace_live.tracer.bpf import _bpf_batch

if TYPE_CHECKING:  # (imported where used: a start's first calls need neither)
    import numpy as np
    from mtrace_live.exporters.data.sink import RunStats

SYS_BPF = {"x86_64": 321, "aarch64": 280, "riscv64": 280, "ppc64le": 361, "s390x": 351}
BPF_MAP_CREATE = 0
BPF_MAP_LOOKUP_ELEM = 1
BPF_MAP_UPDATE_ELEM = 2
BPF_MAP_DELETE_ELEM = 3
BPF_EXIST = 2  # the update's flag: only over an existing entry
BPF_MAP_GET_NEXT_KEY = 4
BPF_PROG_LOAD = 5
BPF_RAW_TRACEPOINT_OPEN = 17
BPF_LINK_CREATE = 28
BPF_PERF_EVENT = 41  # enum bpf_attach_type
BPF_PROG_GET_NEXT_ID = 11
BPF_PROG_GET_FD_BY_ID = 13
BPF_MAP_GET_FD_BY_ID = 14
BPF_OBJ_GET_INFO_BY_FD = 15
BPF_MAP_LOOKUP_BATCH = 24
BPF_MAP_UPDATE_BATCH = 26
BPF_ENABLE_STATS = 32
BPF_STATS_RUN_TIME = 0
STATS_SYSCTL = Path("/proc/sys/kernel/bpf_stats_enabled")
# struct bpf_prog_info (include/uapi/linux/bpf.h): run_time_ns, run_cnt and
# recursion_misses are the u64s at bytes 192, 200 and 208; the kernel fills
# min(info_len, its own size) and leaves the rest zero.
_INFO_SIZE = 216
_RUN_TIME_AT = 192
# struct bpf_map_info: type, id, key_size, value_size, max_entries,
# map_flags (u32 each), then name[16].
_MAP_INFO = struct.Struct("=6I16s")
# union bpf_attr for BPF_MAP_CREATE: map_type, key_size, value_size,
# max_entries, map_flags, inner_map_fd, numa_node (u32 each), map_name[16].
_MAP_CREATE = struct.Struct("=7I16s")
# union bpf_attr for BPF_PROG_LOAD, from prog_type to attach_btf_id: prog_type,
# insn_cnt, insns, license, log_level, log_size, log_buf, kern_version,
# prog_flags, prog_name[16], prog_ifindex, expected_attach_type, prog_btf_fd,
# func_info_rec_size, func_info, func_info_cnt, line_info_rec_size, line_info,
# line_info_cnt, attach_btf_id; the kernel wants the rest zero.
_PROG_LOAD = struct.Struct("=IIQQIIQII16sIIIIQIIQII")
_PROG_TYPE_TRACING = 26  # enum bpf_prog_type
PROG_TYPE_KPROBE = 2  # the uprobes' programs too
_TRACE_RAW_TP = 23  # enum bpf_attach_type
TRACE_UPROBE_MULTI = 48  # enum bpf_attach_type: Linux 6.6
_LOG_SIZE = 1 << 20
_FUNC_INFO = 8  # struct bpf_func_info: insn_off, type_id
BPF_BTF_LOAD = 18
# union bpf_attr for BPF_BTF_LOAD: btf, btf_log_buf, btf_size, btf_log_size, btf_log_level
_BTF_LOAD = struct.Struct("=QQIII")


# PyDLL: the call keeps the interpreter lock. These syscalls take
# microseconds; releasing the lock for each would hand it to the tracing
# loop, which under a flood of events keeps it for the whole switch interval
# (5 ms) before the scrape gets it back.
_LIBC = ctypes.PyDLL(None, use_errno=True)
# CDLL: the call lets the lock go, for the calls that take long (a file's
# rows written, a map made, a program verified: milliseconds), so that the
# other threads run meanwhile (programs load from two threads: uprobe_multi).
_LIBC_RELEASING = ctypes.CDLL(None, use_errno=True)


MACHINE = os.uname().machine  # (the system calls' numbers are this machine's)


def _bpf(cmd: int, attr: ctypes.Array[ctypes.c_char], long: bool = False) -> int:
    number = SYS_BPF.get(MACHINE)
    if number is None:
        ctypes.set_errno(errno.ENOSYS)
        return -1
    libc = _LIBC_RELEASING if long else _LIBC
    return int(libc.syscall(number, cmd, ctypes.byref(attr), len(attr)))


def _elem(cmd: int, map_fd: int, key: ctypes._CData | None, value: ctypes._CData,
          flags: int = 0) -> bool:  # fmt: skip
    """One BPF_MAP_*_ELEM or GET_NEXT_KEY call: map_fd, key, value (or the
    next key), flags."""
    attr = ctypes.create_string_buffer(32)
    key_at = ctypes.addressof(key) if key is not None else 0
    struct.pack_into("=IIQQQ", attr, 0, map_fd, 0, key_at, ctypes.addressof(value), flags)
    return _bpf(cmd, attr) == 0


def u32_keys(map_fd: int) -> list[int]:
    """Every key of a hash map keyed by u32, one system call a key (a map
    read by a process that holds no bcc object: the guardian)."""
    keys: list[int] = []
    key, following = None, ctypes.create_string_buffer(4)
    while _elem(BPF_MAP_GET_NEXT_KEY, map_fd, key, following) and len(keys) < 1 << 20:
        keys.append(struct.unpack("=I", following.raw)[0])
        key, following = following, ctypes.create_string_buffer(4)
    return keys


def lookup_u32(map_fd: int, key: int, value_size: int) -> bytes | None:
    """The value at u32 ``key``, or None when there is none."""
    value = ctypes.create_string_buffer(value_size)
    found = _elem(BPF_MAP_LOOKUP_ELEM, map_fd, _u32(key), value)
    return value.raw if found else None


def update_u32(map_fd: int, key: int, value: bytes, only_existing: bool = False) -> bool:
    """Write ``value`` at u32 ``key``; ``only_existing``: only over an entry
    there is (BPF_EXIST: none is made, in one step with the check). False
    when the kernel refuses (with ``only_existing``, ENOENT: none there)."""
    return _elem(BPF_MAP_UPDATE_ELEM, map_fd, _u32(key),
                 ctypes.create_string_buffer(value, len(value)),
                 BPF_EXIST if only_existing else 0)  # fmt: skip


def update(map_fd: int, key: bytes, value: bytes) -> bool:
    """Write ``value`` at ``key`` (raw bytes of the map's types). False when
    the kernel refuses."""
    return _elem(BPF_MAP_UPDATE_ELEM, map_fd, ctypes.create_string_buffer(key, len(key)),
                 ctypes.create_string_buffer(value, len(value)))  # fmt: skip


def lookup(map_fd: int, key: bytes, value_size: int) -> bytes | None:
    """The value at ``key`` (raw bytes), or None when there is none."""
    value = ctypes.create_string_buffer(value_size)
    found = _elem(BPF_MAP_LOOKUP_ELEM, map_fd, ctypes.create_string_buffer(key, len(key)), value)
    return value.raw if found else None


def delete(map_fd: int, key: bytes) -> bool:
    """Delete the entry at ``key`` (raw bytes); False where there was none."""
    return delete_at(map_fd, ctypes.create_string_buffer(key, len(key)))


def lookup_into(map_fd: int, key: ctypes._CData, value: ctypes._CData) -> bool:
    """The value at ``key`` (a ctypes object of the map's key type) read
    into ``value``; False when there is none."""
    return _elem(BPF_MAP_LOOKUP_ELEM, map_fd, key, value)


def update_from(map_fd: int, key: ctypes._CData, value: ctypes._CData) -> bool:
    """``value`` written at ``key`` (ctypes objects); False (errno set) when
    the kernel refuses."""
    return _elem(BPF_MAP_UPDATE_ELEM, map_fd, key, value)


def delete_at(map_fd: int, key: ctypes._CData) -> bool:
    """The entry at ``key`` (a ctypes object) deleted; False where there was none."""
    attr = ctypes.create_string_buffer(32)
    struct.pack_into("=IIQ", attr, 0, map_fd, 0, ctypes.addressof(key))
    return _bpf(BPF_MAP_DELETE_ELEM, attr) == 0


def next_key_into(map_fd: int, key: ctypes._CData | None, following: ctypes._CData) -> bool:
    """The key after ``key`` (the first: None) read into ``following``;
    False after the last."""
    return _elem(BPF_MAP_GET_NEXT_KEY, map_fd, key, following)


def _u32(key: int) -> ctypes.Array[ctypes.c_char]:
    return ctypes.create_string_buffer(struct.pack("=I", key), 4)


class BatchReader:
    """Reads a whole BPF hash or array map, per-CPU or not, with
    BPF_MAP_LOOKUP_BATCH into buffers allocated once. ``read`` returns the
    keys as raw bytes (n, key_size) and the values as u64 words, shaped
    (n, cpus, words) for per-CPU maps and (n, 1, words) otherwise; None
    when the kernel cannot (before Linux 5.6), so callers fall back."""

    def __init__(
        self, map_fd: int, key_size: int, value_size: int, max_entries: int, cpus: int
    ) -> None:
        self.map_fd = map_fd
        self.key_size = key_size
        self.words = (value_size + 7) // 8  # per-CPU values are padded to 8 bytes
        self.cpus = cpus
        self.max_entries = max_entries
        import numpy as np

        self._keys = np.zeros((max_entries, key_size), dtype=np.uint8)
        self._values = np.zeros((max_entries, cpus, self.words), dtype=np.uint64)
        self._batch = ctypes.create_string_buffer(8)
        self.supported = True

    def read(self, limit: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        """The map's entries; with ``limit``, an array's first ``limit`` only."""
        if not self.supported:
            return None
        count = self.max_entries if limit is None else max(0, min(limit, self.max_entries))
        if count == 0:
            return self._keys[:0].copy(), self._values[:0].copy()
        attr = ctypes.create_string_buffer(56)
        # in_batch NULL (from the start), out_batch, keys, values, count, map_fd
        pointers = (ctypes.addressof(self._batch), self._keys.ctypes.data, self._values.ctypes.data)
        struct.pack_into("=QQQQII", attr, 0, 0, *pointers, count, self.map_fd)
        if _bpf(BPF_MAP_LOOKUP_BATCH, attr) < 0:
            error = ctypes.get_errno()
            if error != errno.ENOENT:  # ENOENT: that was everything (or the map is empty)
                self.supported = False
                return None
        (count,) = struct.unpack_from("=I", attr, 32)
        return self._keys[:count].copy(), self._values[:count].copy()


def update_array(map_fd: int, first: int, values: bytes | memoryview, count: int) -> None:
    """Write ``count`` values (``values``: the map's value type, back to
    back) into a BPF array at indexes ``first``... in one
    BPF_MAP_UPDATE_BATCH; OSError with the kernel's errno when it refuses."""
    if count == 0:
        return
    keys = array.array("I", range(first, first + count))
    key_buffer = (ctypes.c_char * (4 * count)).from_buffer(keys)
    value_buffer = (ctypes.c_char * len(values)).from_buffer_copy(values)
    attr = ctypes.create_string_buffer(56)
    # in_batch, out_batch (unused), keys, values, count, map_fd, elem_flags, flags
    struct.pack_into("=QQQQIIQQ", attr, 0, 0, 0, ctypes.addressof(key_buffer),
                     ctypes.addressof(value_buffer), count, map_fd, 0, 0)  # fmt: skip
    if _bpf(BPF_MAP_UPDATE_BATCH, attr, long=count > 4096) < 0:
        error = ctypes.get_errno()
        raise OSError(error, f"BPF_MAP_UPDATE_BATCH: {os.strerror(error)}")
    (done,) = struct.unpack_from("=I", attr, 32)
    if done != count:
        raise OSError(errno.EIO, f"BPF_MAP_UPDATE_BATCH wrote {done} of {count}")


def sysctl_enabled() -> bool:
    try:
        return STATS_SYSCTL.read_text(encoding="ascii").strip() == "1"
    except OSError:
        return False


def enable_run_time_stats() -> int | None:
    """Turn run-time counting on for as long as the returned fd is open;
    None when this kernel cannot (before Linux 5.8) or we may not."""
    attr = ctypes.create_string_buffer(int(BPF_STATS_RUN_TIME).to_bytes(4, sys.byteorder), 8)
    fd = _bpf(BPF_ENABLE_STATS, attr)
    return fd if fd >= 0 else None


def _program_info(prog_fd: int) -> bytes | None:
    """struct bpf_prog_info of a loaded program, or None."""
    info = ctypes.create_string_buffer(_INFO_SIZE)
    attr = ctypes.create_string_buffer(16)
    ctypes.memmove(attr, prog_fd.to_bytes(4, sys.byteorder) + _INFO_SIZE.to_bytes(4, sys.byteorder)
                   + ctypes.addressof(info).to_bytes(8, sys.byteorder), 16)  # fmt: skip
    if _bpf(BPF_OBJ_GET_INFO_BY_FD, attr) < 0:
        return None
    return info.raw


def run_stats(prog_fd: int) -> RunStats | None:
    """What the kernel counted for a loaded program, or None."""
    info = _program_info(prog_fd)
    if info is None:
        return None
    from mtrace_live.exporters.data.sink import RunStats

    words = struct.unpack_from("=QQQ", info, _RUN_TIME_AT)
    return RunStats(words[0], words[1], words[2])


def program_type(prog_fd: int) -> int | None:
    """A loaded program's type (enum bpf_prog_type, bpf_prog_info's first
    word), or None."""
    info = _program_info(prog_fd)
    return None if info is None else int.from_bytes(info[:4], sys.byteorder)


@dataclass(frozen=True)
class MapInfo:
    """A map's definition, as the kernel reports it and takes it to make one."""

    type: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    name: str


def map_info(map_fd: int) -> MapInfo | None:
    """The kernel's definition of the map behind ``map_fd``; None (errno
    set) if it will not say."""
    info = ctypes.create_string_buffer(_MAP_INFO.size)
    attr = ctypes.create_string_buffer(16)
    struct.pack_into("=IIQ", attr, 0, map_fd, _MAP_INFO.size, ctypes.addressof(info))
    if _bpf(BPF_OBJ_GET_INFO_BY_FD, attr) < 0:
        return None
    kind, _, key_size, value_size, max_entries, flags, name = _MAP_INFO.unpack(info.raw)
    return MapInfo(kind, key_size, value_size, max_entries, flags,
                   name.split(b"\0", 1)[0].decode(errors="replace"))  # fmt: skip


def create_map(info: MapInfo) -> int | None:
    """A new map of that definition: its fd, or None (errno set)."""
    (fd,) = create_maps([info])
    if fd < 0:
        ctypes.set_errno(-fd)
        return None
    return fd


def create_maps(infos: Sequence[MapInfo]) -> list[int]:
    """A new map of each definition, in one call that lets the interpreter
    lock go once (tracer/bpf/bpf_batch.c): each one's fd, or minus the
    errno of its refusal."""
    if SYS_BPF.get(MACHINE) is None:
        return [-errno.ENOSYS for _ in infos]
    return _bpf_batch.calls(BPF_MAP_CREATE, [_map_create(info) for info in infos])


def _map_create(info: MapInfo) -> ctypes.Array[ctypes.c_char]:
    attr = ctypes.create_string_buffer(_MAP_CREATE.size)
    _MAP_CREATE.pack_into(attr, 0, info.type, info.key_size, info.value_size, info.max_entries,
                          info.flags, 0, 0, info.name.encode()[:15])  # fmt: skip
    return attr


def program_ids() -> list[int]:
    """The ids of every BPF program loaded on this machine (root only)."""
    ids: list[int] = []
    start = 0
    while True:
        attr = ctypes.create_string_buffer(start.to_bytes(4, sys.byteorder), 12)
        if _bpf(BPF_PROG_GET_NEXT_ID, attr) < 0:
            return ids
        start = int.from_bytes(attr.raw[4:8], sys.byteorder)
        ids.append(start)


def program_fd(prog_id: int) -> int | None:
    """An fd for a loaded program, by id; None once it is gone."""
    return _fd_by_id(BPF_PROG_GET_FD_BY_ID, prog_id)


def map_fd(map_id: int) -> int | None:
    """An fd for a map, by id (root only); None once it is gone."""
    return _fd_by_id(BPF_MAP_GET_FD_BY_ID, map_id)


def _fd_by_id(cmd: int, object_id: int) -> int | None:
    attr = ctypes.create_string_buffer(object_id.to_bytes(4, sys.byteorder), 12)
    fd = _bpf(cmd, attr)
    return fd if fd >= 0 else None


def load_btf_tracepoint(code: bytes, license_: str, name: str, type_id: int) -> int:
    """Load ``code`` as a BTF-typed tracepoint program (tp_btf) for the
    tracepoint whose ``btf_trace_<event>`` type is ``type_id`` in the
    kernel's BTF: its fd. Raises OSError, with the verifier's last words
    when it refused the code."""
    return load_program(code, license_, name, _PROG_TYPE_TRACING, _TRACE_RAW_TP, btf_id=type_id)


LOAD_TRIES = 5  # BPF_PROG_LOAD interrupted (EAGAIN): tries in all


def load_program(code: bytes, license_: str, name: str, prog_type: int, attach_type: int,
                 kern_version: int = 0, btf_id: int = 0, btf_fd: int = 0,
                 func_info: bytes = b"") -> int:  # fmt: skip
    """Load ``code`` as a program of ``prog_type`` for ``attach_type``
    (enum bpf_attach_type, the expected one), for the tracepoint whose BTF
    type is ``btf_id`` where it is one: its fd. ``btf_fd`` and
    ``func_info`` (records of 8 bytes: first instruction, BTF type): its
    functions' types, where it has more than one (tracer/bpf/bpf_callbacks.py).
    Raises OSError, with the verifier's last words when it refused the code."""
    insns = ctypes.create_string_buffer(code, len(code))
    text = ctypes.create_string_buffer(license_.encode())
    infos = ctypes.create_string_buffer(func_info, max(len(func_info), 1))
    info_at = ctypes.addressof(infos) if func_info else 0
    log = ctypes.create_string_buffer(0)
    for level in (0, 1):  # the verifier's log only to say why
        if level:
            log = ctypes.create_string_buffer(_LOG_SIZE)
        attr = ctypes.create_string_buffer(_PROG_LOAD.size + 16)
        _PROG_LOAD.pack_into(attr, 0, prog_type, len(code) // 8, ctypes.addressof(insns),
                             ctypes.addressof(text), level, len(log) if level else 0,
                             ctypes.addressof(log) if level else 0, kern_version, 0,
                             name.encode()[:15], 0, attach_type, btf_fd,
                             _FUNC_INFO if func_info else 0, info_at,
                             len(func_info) // _FUNC_INFO, 0, 0, 0, btf_id)  # fmt: skip
        for _ in range(LOAD_TRIES):
            fd = _bpf(BPF_PROG_LOAD, attr, long=True)  # the verifier: milliseconds
            # (EAGAIN: a signal came while the verifier ran, a child's
            # SIGCHLD to whichever thread; tried again, as libbpf does)
            if fd >= 0 or ctypes.get_errno() != errno.EAGAIN:
                break
        if fd >= 0:
            return fd
        error = ctypes.get_errno()
        if error != errno.EACCES and error != errno.EINVAL:
            break  # not the verifier: its log would say nothing
    words = [line for line in log.value.decode(errors="replace").splitlines() if line.strip()]
    said = f": {words[-2] if len(words) > 1 else words[-1]}" if words else ""
    raise OSError(error, f"{os.strerror(error)}{said}")


def load_btf(blob: bytes) -> int:
    """Load BTF ``blob`` into the kernel: its fd. Raises OSError, with the
    kernel's last words when it refused it."""
    data = ctypes.create_string_buffer(blob, len(blob))
    log = ctypes.create_string_buffer(1 << 16)
    attr = ctypes.create_string_buffer(_BTF_LOAD.size + 4)
    _BTF_LOAD.pack_into(attr, 0, ctypes.addressof(data), ctypes.addressof(log), len(blob),
                        len(log), 1)  # fmt: skip
    fd = _bpf(BPF_BTF_LOAD, attr, long=True)
    if fd >= 0:
        return fd
    error = ctypes.get_errno()
    words = [line for line in log.value.decode(errors="replace").splitlines() if line.strip()]
    raise OSError(error, f"{os.strerror(error)}{': ' + words[-1] if words else ''}")


def attach_raw_tracepoint(prog_fd: int, name: str | None = None) -> int:
    """Attach a loaded raw tracepoint program to tracepoint ``name`` (a
    tp_btf program: None, its own): the attachment's fd, which detaches it
    when closed. Raises OSError."""
    text = ctypes.create_string_buffer(name.encode()) if name is not None else None
    attr = ctypes.create_string_buffer(16)
    struct.pack_into("=QI", attr, 0, ctypes.addressof(text) if text is not None else 0, prog_fd)
    fd = _bpf(BPF_RAW_TRACEPOINT_OPEN, attr)
    if fd < 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return fd


def close(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


def close_quietly(fd: int) -> None:
    """Close ``fd``, whatever the close says (a descriptor being let go of)."""
    with contextlib.suppress(OSError):
        os.close(fd)


ATTACH_COOKIE_SINCE = (5, 15)  # bpf_get_attach_cookie in a uprobe's program, by a perf event link


def kernel_version() -> tuple[int, int]:
    """The running kernel's (major, minor); (0, 0) when its release is unreadable."""
    release = os.uname().release.split("-", 1)[0].split(".")
    try:
        return int(release[0]), int(release[1])
    except (IndexError, ValueError):
        return 0, 0


def attach_cookies() -> bool:
    """This kernel gives a uprobe's program the cookie of its link."""
    return kernel_version() >= ATTACH_COOKIE_SINCE


def perf_event_link(prog_fd: int, perf_fd: int, cookie: int) -> int:
    """Attach program ``prog_fd`` to perf event ``perf_fd`` through a BPF
    link carrying ``cookie`` (bpf_get_attach_cookie reads it; Linux 5.15):
    the link's fd, or -1 with errno set."""
    # union bpf_attr for BPF_LINK_CREATE: prog_fd, target_fd, attach_type,
    # flags (u32 each), then perf_event.bpf_cookie (u64).
    attr = ctypes.create_string_buffer(64)
    struct.pack_into("=IIIIQ", attr, 0, prog_fd, perf_fd, BPF_PERF_EVENT, 0, cookie)
    return _bpf(BPF_LINK_CREATE, attr)


def link_create(attr: ctypes.Array[ctypes.c_char]) -> int:
    """BPF_LINK_CREATE with ``attr`` (union bpf_attr): the link's fd, or -1
    with errno set."""
    return _bpf(BPF_LINK_CREATE, attr)
