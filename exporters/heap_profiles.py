"""serve's heap profiles, as Go's net/http/pprof serves them: what a query
asks for, and the profile built from the kernel's allocation tables.

- ``/debug/pprof/heap``: the allocations by call stack now; the four sample
  types of exporters/pprof.py, ``inuse_space`` by default;
- ``/debug/pprof/allocs``: the same profile, ``alloc_space`` by default;
- ``?seconds=N`` (1 to ``MAX_SECONDS``): the difference between the tables
  now and N seconds from now, every value (as Go's delta profiles are), dated
  at its end (the second reading, as Go dates it) and lasting N seconds;
- ``?pid=``, ``?comm=`` (the process name, as the metrics' ``process`` label
  gives it) and ``?cgroup=`` (a cgroup v2 path: the processes in it and
  below) select processes; by default every traced process is in it.

Every sample is labelled ``pid`` (a number), ``allocator``, ``comm``,
``cgroup`` and, where the cgroup path names a container, ``container``
(``container_of``). Only processes that are alive have rows in the kernel's
tables (serve retires the others), so a profile holds the live processes.

A query's parameters are checked before anything is read: a malformed
number, a value out of range, a name that is not UTF-8 or a cgroup path
that is not a plain absolute one is refused with one line (``QueryError``,
a 400). A repeated parameter is read by its first value, as Go's
net/http/pprof reads it (``Request.FormValue``): Parca adds ``seconds=N``
to a job's ``params`` once per delta profile, so its URLs carry it twice.

- ``?max_samples=N`` (0: no bound): at most N samples, the largest by the
  profile's sample type, each process's other stacks summed into one
  sample at the function ``(other)`` (so every total stays right);
  by default serve's ``--profile-max-samples`` (``MAX_SAMPLES``, 16,000:
  the most Pyroscope takes).

The builder (``HeapProfiles``) runs in the tracing process, which holds
the tables; exporters/profile_serving.py carries the requests to it from
the serving process.
"""

from __future__ import annotations

import re
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qsl

import numpy as np

from .data.alloc_snapshot import LAST_TS, AllocSnapshot, FrameNames, StackColumns
from .data.processes import process_cgroup
from .pprof import OTHER_STACKS, SAMPLE_TYPES, HeapEncoder

SAMPLE_NAMES = [name for name, _ in SAMPLE_TYPES]

PROFILES = {"heap": "inuse_space", "allocs": "alloc_space"}  # name -> default sample type
PREFIX = "/debug/pprof/"
MAX_SECONDS = 300  # the longest delta profile: its response is held that long
MAX_MARKS = 16  # delta profiles in flight at once; the oldest start is forgotten past that
MAX_NAME_BYTES = 255
# Samples a profile holds at most, by default: Pyroscope refuses a profile
# of more (its max_profile_stacktrace_samples, pkg/validation/limits.go).
MAX_SAMPLES = 16_000
SAMPLES_LIMIT = 10_000_000  # the largest ?max_samples= taken
PID_LIMIT = 1 << 22  # the kernel's PID_MAX_LIMIT
_NUMBER = re.compile(r"[0-9]{1,10}")
# The last component of a cgroup path that names a container, and its id:
# docker-ID.scope (Docker, systemd driver), cri-containerd-ID.scope and
# crio-ID.scope (Kubernetes, systemd driver), libpod-ID.scope (Podman),
# ID alone (Docker's /docker/ID and Kubernetes' /kubepods/.../podUID/ID
# under the cgroupfs driver; Podman's libpod_parent/libpod-ID).
_CONTAINER = re.compile(r"(?:(?:docker|cri-containerd|crio|libpod)-)?([0-9a-f]{64})(?:\.scope)?")

Names = Callable[[int, str], str]  # (pid, the kernel's name for it) -> its process name
T = TypeVar("T")
Reader = Callable[[Callable[[AllocSnapshot, Names], T]], T | None]


class QueryError(ValueError):
    """A query refused: its one line is the 400's body."""


@dataclass(frozen=True)
class ProfileQuery:
    profile: str  # a key of PROFILES
    seconds: int = 0  # 0: the tables as they are; N: their change over N seconds
    pid: int | None = None
    comm: str | None = None
    cgroup: str | None = None
    max_samples: int | None = None  # None: serve's bound; 0: none

    def request(self) -> dict[str, Any]:
        """The query as the tracing process is asked it (JSON)."""
        return {"op": "profile", "profile": self.profile, "pid": self.pid, "comm": self.comm,
                "cgroup": self.cgroup, "max_samples": self.max_samples}  # fmt: skip


def parse_query(profile: str, query: str) -> ProfileQuery:
    """The query of ``/debug/pprof/<profile>?<query>``, or QueryError. The
    query is as the request line held it (undecoded, latin-1 per byte)."""
    # bytes past ASCII, sent raw, read as if percent-encoded
    escaped = "".join(c if ord(c) < 0x80 else f"%{ord(c) & 0xFF:02X}" for c in query)
    try:
        pairs = parse_qsl(escaped, keep_blank_values=True, encoding="utf-8", errors="strict")
    except UnicodeDecodeError:
        raise QueryError("a query parameter is not UTF-8") from None
    given: dict[str, str] = {}
    for key, value in pairs:  # a repeated parameter: its first value, as Go's FormValue
        given.setdefault(key, value)
    if given.get("debug", "0") != "0":
        raise QueryError("debug=N (a text profile) is not served: read the profile with "
                         "go tool pprof")  # fmt: skip
    seconds = _number(given, "seconds", 1, MAX_SECONDS)
    pid = _number(given, "pid", 1, PID_LIMIT)
    comm = given.get("comm")
    if comm is not None and (not 0 < len(comm.encode()) <= MAX_NAME_BYTES or "\0" in comm):
        raise QueryError(f"comm must be a process name of 1 to {MAX_NAME_BYTES} bytes")
    cgroup = given.get("cgroup")
    bound = _number(given, "max_samples", 0, SAMPLES_LIMIT)
    return ProfileQuery(profile, seconds or 0, pid, comm, _cgroup(cgroup), bound)


def bounded(rows: StackColumns, column: int,
            max_samples: int) -> tuple[StackColumns, dict[int, list[int]], int]:  # fmt: skip
    """``rows`` cut to at most ``max_samples`` samples (0: no bound; the
    rows whose values are all 0, which make no sample, left out first): the
    largest by the heap value ``column`` (its magnitude: a delta's may be
    negative) kept, and each process's others summed, its four heap values,
    into one "other" sample counted in the bound; and how many stacks were
    summed so. (A profile of more processes than the bound keeps one sample
    per process.) Where the bound cannot bite, ``rows`` as they are."""
    if not max_samples or len(rows) <= max_samples:
        return rows, {}, 0
    values = rows.heap_values()
    nonzero = np.flatnonzero(values.any(axis=1))
    rows, values = rows.select(nonzero), values[nonzero]
    if len(rows) <= max_samples:
        return rows, {}, 0
    order = np.lexsort((np.arange(len(rows)), -np.abs(values[:, column])))
    tgids = rows.tgids()
    kept = max_samples
    while kept > 0:
        processes = len(np.unique(tgids[order[kept:]]))  # each gets its "other" sample
        if kept + processes <= max_samples:
            break
        kept = max(0, max_samples - processes)
    left = order[kept:]
    others = StackColumns(rows.catalog, rows.ids[left], rows.values[left]).by_process(values[left])
    return rows.select(np.sort(order[:kept])), others, len(left)


def _number(given: Mapping[str, str], key: str, low: int, high: int) -> int | None:
    text = given.get(key)
    if text is None:
        return None
    if not _NUMBER.fullmatch(text) or not low <= int(text) <= high:
        raise QueryError(f"{key} must be a whole number from {low} to {high}")
    return int(text)


def _cgroup(path: str | None) -> str | None:
    """A cgroup v2 path as the kernel writes it: absolute, no empty, . or ..
    component, no NUL; "/" is every cgroup."""
    if path is None:
        return None
    parts = path.split("/")
    if (not path.startswith("/") or len(path.encode()) > 4096 or "\0" in path
            or any(part in (".", "..") for part in parts)
            or (path != "/" and "" in parts[1:])):  # fmt: skip
        raise QueryError("cgroup must be an absolute cgroup v2 path, such as "
                         "/system.slice/nginx.service")  # fmt: skip
    return path


def container_of(cgroup: str) -> str:
    """The container a cgroup path is (or is inside of), as its short id
    (the 12 characters ``docker ps`` and ``podman ps`` show); "" for none."""
    for part in reversed(cgroup.split("/")):
        found = _CONTAINER.fullmatch(part)
        if found:
            return found[1][:12]
    return ""


def in_cgroup(path: str, cgroup: str) -> bool:
    return cgroup == "/" or path == cgroup or path.startswith(cgroup + "/")


def delta(rows: StackColumns, base: StackColumns) -> StackColumns:
    """What ``rows`` counted since ``base``, key by key; a row that counted
    less than its base is a new process under a reused pid, counted from
    nothing, and so is a row its base has not."""
    if base.catalog is rows.catalog:
        where = np.full(len(rows.catalog), -1, np.int64)
        where[base.ids] = np.arange(len(base))
        found = where[rows.ids]
    else:  # numbered apart (the catalog started again): matched by key
        index = {base.catalog.keys[number]: i for i, number in enumerate(base.ids.tolist())}
        found = np.array([index.get(rows.catalog.keys[number], -1)
                          for number in rows.ids.tolist()], np.int64).reshape(-1)  # fmt: skip
    before = np.zeros_like(rows.values)
    before[found >= 0] = base.values[found[found >= 0]]
    fresh = (found < 0) | (before[:, 0] > rows.values[:, 0]) | (before[:, 3] > rows.values[:, 3])
    before[fresh] = 0
    before[:, LAST_TS] = 0
    return StackColumns(rows.catalog, rows.ids, rows.values - before)


DROPPED = (
    ("stacks_full", "allocations kept by their call site alone: the stack table was full "
                    "(--alloc-stacks)"),
    ("frames_full", "allocations kept by their call site alone: the frame store was full"),
    ("outstanding_full", "allocations whose frees cannot be matched: the table of live "
                         "blocks was full (--max-outstanding)"),
)  # fmt: skip


def comments(snapshot: AllocSnapshot, seconds: int, tgids: Collection[int]) -> list[str]:
    """The profile's comments: what it holds, its sampling, what did not fit,
    and the allocator of each of its processes (``tgids``)."""
    since = f"over {seconds} s" if seconds else "since the trace began"
    said = [f"mtrace-live: allocations by call stack; inuse_* live now, alloc_* {since}"]
    if snapshot.sample_bytes:
        said.append(f"sampled: one allocation kept per {snapshot.sample_bytes} bytes on "
                    "average; the values are unbiased estimates")  # fmt: skip
    for key, what in DROPPED:
        if snapshot.misc.get(key, 0):
            said.append(f"{snapshot.misc[key]} {what}")
    return said + snapshot.allocator_lines(tgids)


class HeapProfiles:
    """The tracing process's side: profiles built from the tables that
    ``read`` hands over (under the metrics' read lock, so that a retirement
    never runs in the middle of one)."""

    def __init__(self, read: Reader[Any], names: FrameNames,
                 cgroup_of: Callable[[int], str] = process_cgroup,
                 max_samples: int = MAX_SAMPLES) -> None:  # fmt: skip
        """``max_samples``: a profile's bound where its query gives none (0: none)."""
        self.max_samples = max_samples
        self.read = read
        self.names = names
        self.cgroup_of = cgroup_of
        self.encoder = HeapEncoder(names)
        self.cgroups: dict[int, str] = {}  # the last cgroup seen per process
        self._marks: dict[str, tuple[float, StackColumns]] = {}
        self._lock = threading.Lock()
        # served so far (mtrace_alloc_profiles_total): whole, delta, delta_started
        self.served: Counter[str] = Counter({"whole": 0, "delta": 0, "delta_started": 0})

    def answer(self, request: Mapping[str, Any]) -> tuple[int, bytes]:
        """(HTTP status, body) for one request: ``mark`` (a delta's start:
        the body is its token) or ``profile`` (``since`` a token, or not)."""
        if request.get("op") == "mark":
            return self._mark()
        try:
            query = ProfileQuery(str(request["profile"]), pid=request.get("pid"),
                                 comm=request.get("comm"), cgroup=request.get("cgroup"),
                                 max_samples=request.get("max_samples"))  # fmt: skip
        except (KeyError, TypeError):
            return 400, b"malformed request\n"
        since = request.get("since")
        found: tuple[int, bytes] | None = self.read(
            lambda snapshot, name_of: self._build(snapshot, name_of, query, since)
        )
        if found is None:
            return 404, b"allocations are not traced (--no-allocs or --no-libc)\n"
        return found

    def _mark(self) -> tuple[int, bytes]:
        rows = self.read(lambda snapshot, _: StackColumns.of(snapshot.stacks))
        if rows is None:
            return 404, b"allocations are not traced (--no-allocs or --no-libc)\n"
        token = secrets.token_hex(8)
        with self._lock:
            self._marks[token] = (time.monotonic(), rows)
            while len(self._marks) > MAX_MARKS:
                self._marks.pop(next(iter(self._marks)))
            self.served["delta_started"] += 1
        return 200, token.encode()

    def _take_mark(self, token: Any) -> tuple[float, StackColumns] | None:
        with self._lock:
            return self._marks.pop(str(token), None)

    def _build(self, snapshot: AllocSnapshot, name_of: Names, query: ProfileQuery,
               since: Any) -> tuple[int, bytes]:  # fmt: skip
        mark = self._take_mark(since) if since is not None else None
        comms = {proc.tgid: name_of(proc.tgid, proc.comm) for proc in snapshot.processes}
        if query.pid is not None and query.pid not in comms:
            return 400, f"no traced process has pid {query.pid}\n".encode()
        cgroups = self._cgroups(set(comms))
        keep = {tgid for tgid in comms
                if (query.pid is None or tgid == query.pid)
                and (query.comm is None or comms[tgid] == query.comm)
                and (query.cgroup is None
                     or in_cgroup(cgroups.get(tgid, ""), query.cgroup))}  # fmt: skip
        rows = StackColumns.of(snapshot.stacks)
        rows = rows.select(np.isin(rows.tgids(), list(keep)))
        seconds, duration_ns, ended_ns = 0, 0, None
        if since is not None:
            if mark is None:
                return 503, b"the delta profile's start was forgotten (too many at once)\n"
            started, base = mark
            ended_ns = time.time_ns()
            duration_ns = int((time.monotonic() - started) * 1e9)
            seconds = round(duration_ns / 1e9)
            rows = delta(rows, base)
        labels = {tgid: (("comm", comms[tgid]), ("cgroup", cgroups.get(tgid, "")),
                         ("container", container_of(cgroups.get(tgid, ""))))
                  for tgid in keep}  # fmt: skip
        default = PROFILES.get(query.profile, "inuse_space")
        bound = self.max_samples if query.max_samples is None else query.max_samples
        rows, others, cut = bounded(rows, SAMPLE_NAMES.index(default), bound)
        said = comments(snapshot, seconds, keep)
        if cut:
            said.append(f"{cut} stacks past the bound of {bound} samples "
                        f"(max_samples): summed per process at {OTHER_STACKS}")  # fmt: skip
        with self._lock:
            self.encoder.retain(set(comms))
            body = self.encoder.encode(rows, labels.__getitem__, snapshot.sample_bytes,
                                       default, duration_ns, said, others,
                                       ended_ns)  # fmt: skip
        with self._lock:
            self.served["delta" if since is not None else "whole"] += 1
        return 200, body

    def _cgroups(self, tgids: set[int]) -> dict[int, str]:
        """Each process's cgroup now, or the last one read once it is gone."""
        for tgid in tgids:
            path = self.cgroup_of(tgid)
            if path:
                self.cgroups[tgid] = path
        for tgid in set(self.cgroups) - tgids:
            del self.cgroups[tgid]
        return {tgid: self.cgroups[tgid] for tgid in tgids if tgid in self.cgroups}
