"""The kmemtrace record walker, compiled by numba.

A module of its own so that only ``report`` pays numba's import, and so that
numba's on-disk cache (keyed by module-level function) is hit on every run
after the first. Status codes: 0 done, 1 truncated record, 2 event size
below the core's; ``skipped`` counts exporters.kmemtrace.SKIP_REASONS.
"""
# mypy: disable-error-code="no-untyped-def"

import os
import tempfile
from pathlib import Path


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=directory).close()
    except OSError:
        return False
    return True


def _private_directory(directory: Path) -> bool:
    """A directory of our own: made 0700 if absent; not a link, owned by us."""
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        info = directory.lstat()
    except OSError:
        return False
    return info.st_uid == os.getuid() and (info.st_mode & 0o777) == 0o700 and _writable(directory)


def _cache_place() -> bool:
    """Whether numba can cache the compiled walker, and where.

    Reading records needs no privilege, so any user must be able to run
    ``report``: numba caches beside this file or in the user's cache
    directory, and raises at import when it can write to neither (a
    root-owned checkout and an unwritable HOME). Then a private directory
    under the system's temporary directory is used, and failing that, no
    cache (each run compiles, about a second more)."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return True
    if _writable(Path(__file__).parent / "__pycache__"):
        return True
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path("~/.cache").expanduser()) / "numba"
    if _writable(user):
        return True
    private = Path(tempfile.gettempdir()) / f"mtrace-live-numba-{os.getuid()}"
    if _private_directory(private):
        os.environ["NUMBA_CACHE_DIR"] = str(private)
        return True
    return False


CACHE = _cache_place()

import numba  # noqa: E402  (after NUMBA_CACHE_DIR is settled)
import numpy as np  # noqa: E402


@numba.njit(inline="always", cache=CACHE)
def u16(buf, o, big):
    if big:
        return (np.uint64(buf[o]) << np.uint64(8)) | np.uint64(buf[o + 1])
    return np.uint64(buf[o]) | (np.uint64(buf[o + 1]) << np.uint64(8))


@numba.njit(inline="always", cache=CACHE)
def uint(buf, o, width, big):
    v = np.uint64(0)
    for k in range(width):
        shift = np.uint64(8 * (width - 1 - k)) if big else np.uint64(8 * k)
        v |= np.uint64(buf[o + k]) << shift
    return v


@numba.njit(cache=CACHE, nogil=True)
def scan(buf, big, cpu, out, args, skipped):
    n = buf.shape[0]
    o = 0
    k = 0
    p = 0
    while o < n:
        if n - o < 4:
            return k, p, o, 1
        size = int(u16(buf, o + 2, big))
        if size < 24:
            return k, p, o, 2
        if o + size > n:
            return k, p, o, 1
        eid = buf[o]
        tid = buf[o + 1]
        if eid > 2:
            skipped[0] += 1
            o += size
            continue
        if (eid < 2 and tid > 5 and tid != 7) or (eid == 2 and tid != 6):
            skipped[1] += 1
            o += size
            continue
        if eid == 0 and size < 48:
            skipped[2] += 1
            o += size
            continue
        if eid == 2 and size < 80:
            skipped[2] += 1
            o += size
            continue
        r = out[k]
        r.event_id = eid
        r.type_id = tid
        r.cpu = cpu
        r.seq = np.int64(np.int32(np.uint32(uint(buf, o + 4, 4, big))))
        r.call_site = uint(buf, o + 8, 8, big)
        r.ptr = uint(buf, o + 16, 8, big)
        r.bytes_req = 0
        r.bytes_alloc = 0
        r.gfp_flags = 0
        r.target = -1
        r.probe = 0
        r.has_task = 0
        r.pid = 0
        r.tid = 0
        r.timestamp = 0
        r.fn = 255
        r.aux = 0
        r.weight = 0
        body = 24
        if eid == 0:
            r.bytes_req = uint(buf, o + 24, 8, big)
            r.bytes_alloc = uint(buf, o + 32, 8, big)
            r.gfp_flags = np.uint32(uint(buf, o + 40, 4, big))
            r.target = np.int32(np.uint32(uint(buf, o + 44, 4, big)))
            body = 48
        elif eid == 2:
            r.probe = np.uint16(u16(buf, o + 24, big))
            for a in range(6):
                args[p, a] = uint(buf, o + 32 + 8 * a, 8, big)
            p += 1
            body = 80
        f = o + body
        end = o + size
        while f + 3 <= end:
            fsize = int(u16(buf, f, big))
            if fsize < 3 or f + fsize > end:
                skipped[3] += 1
                break
            if buf[f + 2] == 1 and fsize >= 24:
                r.has_task = 1
                r.pid = np.uint32(uint(buf, f + 4, 4, big))
                r.tid = np.uint32(uint(buf, f + 8, 4, big))
                r.timestamp = uint(buf, f + 16, 8, big)
            elif buf[f + 2] == 2 and fsize >= 24:
                r.fn = buf[f + 3]
                r.aux = uint(buf, f + 8, 8, big)
                r.weight = uint(buf, f + 16, 8, big)
            f += fsize
        k += 1
        o += size
    return k, p, o, 0
