"""Facts of files, kept between runs: what a start reads from ELF files.

A trace's start reads the same files each time for the same answers: the
libc's allocation functions' sites (its code disassembled), exported
functions' offsets, the lock-wait site, the loader's state symbol, the
arena's symbols, each allocator's and interpreter's facts. A function that
reads such a fact from a file is decorated with ``file_fact``: its answer is
kept in one JSON document under the file's identity (device, inode, size
and modification time) and the arguments it was asked with, so that a warm
start reads that one document instead of parsing ELF files, and a changed
file is read again alone (the others' facts stay).

The document (``files/facts-CODE.json``) is kept in the plan cache's directory
(``MTRACE_LIVE_PLAN_CACHE``, default /var/cache/mtrace-live/derived; ``off``
keeps nothing), one per version of the code that read the facts (a
digest of the sources' sizes and times): a new mtrace-live reads them
again, and another install sharing the cache keeps its own. A document
(or directory) another user owns or could write is ignored, as is one that
does not parse; a value is only ever decoded into the types registered for
it (``kept_type``). Writing it is left for ``save``, once the trace is on,
and errors there are ignored: the cache only ever saves time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

DEFAULT_DIR = Path("/var/cache/mtrace-live/derived")
ENVIRONMENT = "MTRACE_LIVE_PLAN_CACHE"
FOLDER = "files"  # in a folder of its own: the plans' files are pruned
KEEP_VERSIONS = 4  # documents of other code (another install, an upgrade) kept beside
FORMAT = 1
LIBRARIES = ("capstone", "elftools")  # what reads the facts beside the project's code
KEEP_FILES = 256  # the files whose facts are kept, the least recently used dropped first
# A fact read is saved again (its file's last use) where its last saved use is
# older than this: a start whose facts are all kept writes nothing at its end.
USED_REFRESH_S = 24 * 3600
TEMPORARY = ".tmp"  # a document being written, renamed once whole
STALE_TEMPORARY_S = 3600

T = TypeVar("T")
_TYPES: dict[str, type] = {}
_MISSING = object()


def plan_cache_dir() -> Path | None:
    """Where start plans are kept; None: not kept (``off``)."""
    configured = os.environ.get(ENVIRONMENT, "")
    if configured == "off":
        return None
    return Path(configured) if configured else DEFAULT_DIR


def private_file(path: Path) -> bool:
    """Owned by this user and writable by no one else."""
    return _private(path.stat())


def _private(status: os.stat_result) -> bool:
    return status.st_uid == os.geteuid() and not status.st_mode & 0o022


def read_private_file(path: Path) -> bytes | None:
    """The bytes of ``path`` where it and its directory are this user's
    alone (``private_file``), else None. Both are checked on the descriptors
    the bytes are read through, so that no one can put another file or
    directory in their place between the check and the read. Raises OSError
    (no such file)."""
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        if not _private(os.fstat(directory)):
            return None
        descriptor = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=directory)
        with os.fdopen(descriptor, "rb") as file:
            return file.read() if _private(os.fstat(file.fileno())) else None
    finally:
        os.close(directory)


def write_private_json(path: Path, document: object) -> None:
    """Write ``document`` to ``path`` atomically, in a directory only this
    user may write. Raises OSError, TypeError or ValueError."""
    write_private_file(path, json.dumps(document).encode())


def write_private_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically, in a directory only this user
    may write; a write that fails (a full disk) leaves no file behind.
    Raises OSError."""
    import tempfile  # (not on a warm start's path: it imports random)

    directory = path.parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    descriptor, name = tempfile.mkstemp(dir=directory, suffix=TEMPORARY)
    try:
        with os.fdopen(descriptor, "wb") as tmp:
            tmp.write(data)
        os.replace(name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise


def remove_stale_temporaries(directory: Path) -> None:
    """Remove what writers killed before their rename left in ``directory``
    (a temporary file older than an hour: no writer takes that long)."""
    now = time.time()
    for stale in directory.glob("*" + TEMPORARY):
        with contextlib.suppress(OSError):
            if now - stale.stat().st_mtime > STALE_TEMPORARY_S:
                stale.unlink()


def kept_type(cls: type[T]) -> type[T]:
    """Register a dataclass or named tuple as a type facts may hold."""
    _TYPES[cls.__qualname__] = cls
    return cls


def identity(path: Path) -> str | None:
    """What tells this file from another, or another version of it; None
    where it cannot be looked at."""
    try:
        status = os.stat(path)
    except (OSError, ValueError):
        return None
    return f"{status.st_dev}:{status.st_ino}:{status.st_size}:{status.st_mtime_ns}"


def encode_fact(value: Any) -> Any:
    """``value`` as JSON. Raises TypeError for what it cannot hold."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Path):
        return {"~p": str(value)}
    if isinstance(value, bytes):
        return {"~b": value.hex()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        members = {f.name: encode_fact(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"~d": type(value).__qualname__, "f": members}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return {"~n": type(value).__qualname__, "f": [encode_fact(item) for item in value]}
    if isinstance(value, tuple):
        return {"~t": [encode_fact(item) for item in value]}
    if isinstance(value, list):
        return [encode_fact(item) for item in value]
    if isinstance(value, (set, frozenset)):
        return {"~s": sorted((encode_fact(item) for item in value), key=json.dumps)}
    if isinstance(value, Mapping):
        return {"~m": [[encode_fact(k), encode_fact(v)] for k, v in value.items()]}
    raise TypeError(f"a fact cannot hold a {type(value).__name__}")


def decode_fact(value: Any) -> Any:
    """What ``encode_fact`` made, made again. Raises TypeError, KeyError or
    ValueError on what it did not make."""
    if isinstance(value, list):
        return [decode_fact(item) for item in value]
    if not isinstance(value, dict):
        return value
    if "~p" in value:
        return Path(value["~p"])
    if "~b" in value:
        return bytes.fromhex(value["~b"])
    if "~d" in value:
        cls = _TYPES[value["~d"]]
        return cls(**{name: decode_fact(item) for name, item in value["f"].items()})
    if "~n" in value:
        return _TYPES[value["~n"]](*(decode_fact(item) for item in value["f"]))
    if "~t" in value:
        return tuple(decode_fact(item) for item in value["~t"])
    if "~s" in value:
        return frozenset(decode_fact(item) for item in value["~s"])
    if "~m" in value:
        return {decode_fact(k): decode_fact(v) for k, v in value["~m"]}
    raise ValueError("not an encoded fact")


@functools.cache
def code_version() -> str:
    """The code that reads the facts: a digest of the project's sources'
    and the libraries' names, sizes and times (a stat each; nothing is read
    or imported)."""
    here = Path(__file__).resolve().parent  # probes/elf
    digest = [str(FORMAT)]
    for library in LIBRARIES:  # their versions: their packages' first files
        with contextlib.suppress(ImportError, ValueError, OSError, TypeError):
            spec = importlib.util.find_spec(library)
            origin = spec.origin if spec is not None else None
            if origin:
                status = os.stat(origin)
                digest.append(f"{origin}:{status.st_size}:{status.st_mtime_ns}")
    for root in (here.parent, here.parent.parent / "tracer"):
        for folder, _, names in sorted(os.walk(root)):
            for name in sorted(names):
                if name.endswith(".py"):
                    with contextlib.suppress(OSError):
                        status = os.stat(os.path.join(folder, name))
                        digest.append(f"{folder}/{name}:{status.st_size}:{status.st_mtime_ns}")
    return hashlib.sha256("\n".join(digest).encode()).hexdigest()


def _entry_shape(entry: dict[str, Any]) -> bool:
    """A file's entry as the store writes it: its facts a map, its time a number."""
    used = entry.get("used", 0)
    return isinstance(entry.get("facts"), dict) and isinstance(used, (int, float))


class FactStore:
    """The document: file identity -> {"used": when, "facts": {key: value}}."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.files: dict[str, dict[str, Any]] = {}
        self.dirty = False
        # the unwinder's threads read and keep facts too (elf_layout) while
        # the trace's thread saves
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        if path is not None:
            self._read(path)

    def _read(self, path: Path) -> None:
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            data = read_private_file(path)
            if data is None:
                return
            document = json.loads(data)
            if document.get("format") == FORMAT and document.get("code") == code_version():
                files = document.get("files")
                if isinstance(files, dict):  # (an entry of another shape: not used)
                    self.files = {ident: entry for ident, entry in files.items()
                                  if isinstance(entry, dict) and _entry_shape(entry)}  # fmt: skip

    def get(self, ident: str, key: str) -> Any:
        with self._lock:
            return self._get(ident, key)

    def _get(self, ident: str, key: str) -> Any:
        entry = self.files.get(ident)
        if not isinstance(entry, dict) or key not in entry.get("facts", {}):
            self.misses += 1
            return _MISSING
        try:
            value = decode_fact(entry["facts"][key])
        except (TypeError, KeyError, ValueError, AttributeError):
            self.misses += 1
            return _MISSING
        now = time.time()
        if now - float(entry.get("used", 0)) > USED_REFRESH_S:
            self.dirty = True  # (its last use saved again: the least recently used go first)
        entry["used"] = now
        self.hits += 1
        return value

    def put(self, ident: str, key: str, value: Any) -> None:
        try:
            encoded = encode_fact(value)
        except TypeError:
            return
        with self._lock:
            entry = self.files.setdefault(ident, {"facts": {}})
            entry["used"] = time.time()
            entry.setdefault("facts", {})[key] = encoded
            self.dirty = True

    def save(self) -> None:
        """Write the document where a fact was added; errors are ignored."""
        if self.path is None or not self.dirty:
            return
        with self._lock:
            self.dirty = False
            kept = sorted(self.files.items(), key=lambda item: -float(item[1].get("used", 0)))
            # (a copy: the entries change under other threads while it is written)
            files = json.loads(json.dumps(dict(kept[:KEEP_FILES])))
        document = {"format": FORMAT, "code": code_version(), "files": files}
        with contextlib.suppress(OSError, TypeError, ValueError):
            write_private_json(self.path, document)
            others = sorted(self.path.parent.glob("facts-*.json"), key=lambda p: -p.stat().st_mtime)
            for stale in others[KEEP_VERSIONS:]:
                stale.unlink()
            remove_stale_temporaries(self.path.parent)


def document_name() -> str:
    """This code's document: one per version of the code, so that two
    installs sharing the cache do not replace each other's facts."""
    return f"facts-{code_version()[:16]}.json"


_STORE: FactStore | None = None
_STORE_LOCK = threading.Lock()  # (the unwinder's threads ask for it too)


def fact_store() -> FactStore:
    """This process's store, read at first use (and again where the plan
    cache's directory was changed since)."""
    global _STORE
    directory = plan_cache_dir()
    path = directory / FOLDER / document_name() if directory is not None else None
    with _STORE_LOCK:
        if _STORE is None or _STORE.path != path:
            _STORE = FactStore(path)
        return _STORE


def save() -> None:
    """Keep what this process learned (once the trace is on: the writing
    is not on the start's path)."""
    if _STORE is not None:
        _STORE.save()


def _argument(value: Any) -> Any:
    """An argument as part of a fact's key: a file by its identity too."""
    if isinstance(value, Path):
        return {"~p": str(value), "id": identity(value)}
    return encode_fact(value)


def _fact_key(function: Callable[..., Any], path: Path, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> tuple[FactStore, str, str] | None:  # fmt: skip
    """Where ``function(path, *args, **kwargs)``'s answer is kept: the store,
    the file's identity, the key; None where it cannot be kept."""
    facts = fact_store()
    ident = identity(path) if facts.path is not None else None
    if ident is None:
        return None
    name = f"{function.__module__}.{function.__qualname__}"
    try:
        key = json.dumps([name, [_argument(a) for a in args],
                          sorted((k, _argument(v)) for k, v in kwargs.items())])  # fmt: skip
    except TypeError:
        return None
    return facts, ident, key


def file_fact(function: Callable[..., T]) -> Callable[..., T]:
    """Keep ``function(path, ...)``'s answers by the file's identity and the
    arguments: a fact of the file's content, whatever path reaches it.
    Where it raises, nothing is kept (it raises again the next time)."""

    @functools.wraps(function)
    def kept(path: Path, *args: Any, **kwargs: Any) -> T:
        where = _fact_key(function, path, args, kwargs)
        if where is None:
            return function(path, *args, **kwargs)
        facts, ident, key = where
        found = facts.get(ident, key)
        if found is not _MISSING:
            return found  # type: ignore[no-any-return]
        value = function(path, *args, **kwargs)
        facts.put(ident, key, value)
        return value

    return kept


def peek(fact: Callable[..., T], path: Path, *args: Any) -> T | None:
    """What ``fact`` (a function decorated ``file_fact``) keeps for the file
    at ``path``, without calling it: None where nothing is kept (so only for
    a fact that is never None itself). For a
    caller that reads the fact, on a miss, from a file it has open already
    for more (and keeps it with ``keep``)."""
    where = _fact_key(fact.__wrapped__, path, args, {})  # type: ignore[attr-defined]
    if where is None:
        return None
    facts, ident, key = where
    found = facts.get(ident, key)
    return None if found is _MISSING else found


def keep(fact: Callable[..., T], value: T, path: Path, *args: Any) -> None:
    """Keep ``value`` as what ``fact(path, *args)`` answers."""
    where = _fact_key(fact.__wrapped__, path, args, {})  # type: ignore[attr-defined]
    if where is not None:
        facts, ident, key = where
        facts.put(ident, key, value)
