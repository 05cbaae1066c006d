"""Events decoded from the BPF program's records.

Records arrive in batches as numpy structured arrays (``EVENT_DTYPE`` in
probes/records.py, struct event in probes/bpf/records.h). Consumers that only count
work on the arrays directly; ``EventDecoder`` turns the rows that need it
into ``Event`` objects, grouped by site so that signedness and argument
names are applied per column, not per value.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mtrace_live.probes.catalog import ProbeSpec
from mtrace_live.probes.elf.lazy import lazy_module
from mtrace_live.probes.locations import SiteLayout
from mtrace_live.probes.records import ALLOC_FN_NAMES, MAX_ARGS, AllocArg, AllocFn, EventKind

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # (at the first use: probes/elf/lazy.py)

# Roles whose values read best in hex.
HEX_ROLES = frozenset(
    {"address", "arena", "heap", "mutex", "jmp_buf", "code_address", "futex", "condvar",
     "rwlock", "attr", "thread", "link_map", "function", "timespec"}
)  # fmt: skip

# mallopt parameter numbers, from glibc's malloc.h.
MALLOPT_PARAMS = {
    1: "M_MXFAST", 2: "M_NLBLKS", 3: "M_GRAIN", 4: "M_KEEP", -1: "M_TRIM_THRESHOLD",
    -2: "M_TOP_PAD", -3: "M_MMAP_THRESHOLD", -4: "M_MMAP_MAX", -5: "M_CHECK_ACTION",
    -6: "M_PERTURB", -7: "M_ARENA_TEST", -8: "M_ARENA_MAX",
}  # fmt: skip


@dataclass(frozen=True)
class ArgInfo:
    name: str
    role: str
    signed: bool
    readable: bool


@dataclass(frozen=True)
class SiteInfo:
    """What user space knows about the site at one index of the sites map."""

    probe: str
    args: tuple[ArgInfo, ...]


def site_info(layout: SiteLayout, spec: ProbeSpec | None) -> SiteInfo:
    """Argument names and roles from the catalog, signedness from the note."""
    args = []
    for index, location in enumerate(layout.args[:MAX_ARGS]):
        named = spec is not None and index < len(spec.args)
        args.append(
            ArgInfo(
                name=spec.args[index].name if named and spec else f"arg{index + 1}",
                role=spec.args[index].role if named and spec else "",
                signed=location.signed,
                readable=location.readable,
            )
        )
    return SiteInfo(layout.site.name, tuple(args))


@dataclass(slots=True)
class Event:
    ts_ns: int
    pid: int
    tid: int
    cpu: int
    probe: str  # a probe name, or "exec" / "exit" for a followed process
    args: dict[str, int | None] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    ip: int = 0  # the site's address in the process

    def as_json(self) -> str:
        return json.dumps(
            {"ts_ns": self.ts_ns, "pid": self.pid, "tid": self.tid, "cpu": self.cpu,
             "probe": self.probe, "args": self.args},
            separators=(",", ":"),
        )  # fmt: skip

    def text(self, t0_ns: int = 0) -> str:
        seconds = (self.ts_ns - t0_ns) / 1e9
        shown = " ".join(
            f"{name}={format_value(value, self.roles.get(name, ''))}"
            for name, value in self.args.items()
        )
        line = f"{seconds:12.6f} {self.pid:>7} {self.tid:>7} {self.cpu:>3} {self.probe} {shown}"
        return line.rstrip()


def format_value(value: int | None, role: str) -> str:
    if value is None:
        return "?"
    if role in HEX_ROLES:
        return hex(value)
    return str(value)


ALLOC_ROLES = {"ptr": "address", "old_ptr": "address", "call_site": "code_address",
               "allocated_at": "code_address"}  # fmt: skip


def _decode_allocs(batch: np.ndarray, rows: np.ndarray) -> list[tuple[int, Event]]:
    """ALLOC and FREE records: the function's name as the probe, and its
    arguments by name (realloc's old pointer, the alignment, a free's
    matched allocation)."""
    chunk = batch[rows]
    args = chunk["args"].tolist()
    columns = (chunk[k].tolist() for k in ("ts", "tgid", "tid", "cpu", "ip", "probe", "kind"))
    out = []
    for i, (ts, tgid, tid, cpu, ip, fn, kind) in enumerate(zip(*columns, strict=True)):
        a = args[i]
        name = ALLOC_FN_NAMES[fn] if fn < len(ALLOC_FN_NAMES) else f"fn{fn}"
        named: dict[str, int | None] = {"ptr": a[AllocArg.PTR]}
        if kind == EventKind.ALLOC:
            named["size"] = a[AllocArg.SIZE]
            if fn in (AllocFn.REALLOC, AllocFn.REALLOCARRAY):
                named["old_ptr"] = a[AllocArg.AUX]
            elif a[AllocArg.AUX]:
                named["alignment"] = a[AllocArg.AUX]
        else:
            name = "free" if fn == AllocFn.FREE else f"{name}:free"
            named["size"] = a[AllocArg.SIZE] or None  # None: allocated before the trace
            named["allocated_at"] = a[AllocArg.SITE] or None
        if a[AllocArg.WEIGHT] != a[AllocArg.SIZE] and kind == EventKind.ALLOC:
            named["weight"] = a[AllocArg.WEIGHT]
        named["call_site"] = ip
        out.append((rows[i].item(), Event(ts, tgid, tid, cpu, name, named, ALLOC_ROLES, ip)))
    return out


LOCK_WAIT_ROLES = {"futex": "address", "caller": "code_address"}


def _decode_lock_waits(batch: np.ndarray, rows: np.ndarray) -> list[tuple[int, Event]]:
    """LOCK_WAIT records (locks.bpf.c): a wait in the libc's lock-wait slow
    path, at its end: the futex, the wait in ns, the code that waited."""
    chunk = batch[rows]
    args = chunk["args"].tolist()
    columns = (chunk[k].tolist() for k in ("ts", "tgid", "tid", "cpu", "ip"))
    out = []
    for i, (ts, tgid, tid, cpu, ip) in enumerate(zip(*columns, strict=True)):
        named: dict[str, int | None] = {"futex": args[i][0], "wait_ns": args[i][1], "caller": ip}
        out.append((rows[i].item(), Event(ts, tgid, tid, cpu, "lock_wait", named,
                                          LOCK_WAIT_ROLES, ip)))  # fmt: skip
    return out


class EventDecoder:
    """Batches of records -> Events, vectorised per site."""

    def __init__(self, sites: Sequence[SiteInfo]) -> None:
        self.sites = list(sites)

    def decode(self, batch: np.ndarray) -> list[Event]:
        if len(batch) == 0:
            return []
        out: list[tuple[int, Event]] = []
        kinds = batch["kind"]
        probe_rows = np.flatnonzero(kinds == EventKind.PROBE)
        if len(probe_rows):
            sites = batch["site"][probe_rows]
            for site in np.unique(sites):
                rows = probe_rows[sites == site]
                out.extend(self._decode_site(int(site), batch, rows))
        alloc_rows = np.flatnonzero((kinds == EventKind.ALLOC) | (kinds == EventKind.FREE))
        if len(alloc_rows):
            out.extend(_decode_allocs(batch, alloc_rows))
        lock_rows = np.flatnonzero(kinds == EventKind.LOCK_WAIT)
        if len(lock_rows):
            out.extend(_decode_lock_waits(batch, lock_rows))
        lifecycle = (kinds == EventKind.EXEC) | (kinds == EventKind.EXIT)
        for row in np.flatnonzero(lifecycle).tolist():
            out.append((row, self._lifecycle(batch[row])))
        out.sort(key=lambda pair: pair[0])
        return [event for _, event in out]

    def _decode_site(
        self, site: int, batch: np.ndarray, rows: np.ndarray
    ) -> list[tuple[int, Event]]:
        info = self.sites[site] if site < len(self.sites) else SiteInfo(f"site{site}", ())
        chunk = batch[rows]
        raw = chunk["args"]
        columns: list[list[int | None]] = []
        for index, arg in enumerate(info.args):
            if not arg.readable:
                columns.append([None] * len(rows))
            else:
                column = raw[:, index].view("<i8") if arg.signed else raw[:, index]
                columns.append(column.tolist())
        names = [arg.name for arg in info.args]
        roles = {arg.name: arg.role for arg in info.args}
        ts, tgid, tid, cpu, ip = (chunk[k].tolist() for k in ("ts", "tgid", "tid", "cpu", "ip"))
        decoded = []
        for i, row in enumerate(rows.tolist()):
            args = {name: column[i] for name, column in zip(names, columns, strict=True)}
            decoded.append(
                (row, Event(ts[i], tgid[i], tid[i], cpu[i], info.probe, args, roles, ip[i]))
            )
        return decoded

    @staticmethod
    def _lifecycle(record: np.void) -> Event:
        kind = EventKind(int(record["kind"]))
        args: dict[str, int | None] = {}
        if kind is EventKind.EXEC:
            args["old_pid"] = int(record["args"][0])
        return Event(
            int(record["ts"]), int(record["tgid"]), int(record["tid"]), int(record["cpu"]),
            kind.name.lower(), args,
        )  # fmt: skip
