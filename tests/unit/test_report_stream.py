"""The streaming report (one compiled pass, bounded memory) against the
in-memory analysis that sorts every record, and both against what the
records written say: the same answer on random record sets, with
wraparound, records lost mid-stream, skipped and damaged records, and
chunk boundaries anywhere."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mtrace_live.exporters.data.kmem import TYPE_NAMES
from mtrace_live.exporters.kmemtrace.analysis import analyse, report_lines, stream_report
from mtrace_live.exporters.kmemtrace.reader import open_record_set, read_record_set

SITES = (0xFFFFFFFF81000100, 0xFFFFFFFF81000200, 0x401000, 0)
POINTERS = (0, 0x1000, 0x2000, 0x3000, 0xFFFF888000000040)
BYTES = (0, 1, 40, 64, 4096, 3 * 4096, 1 << 20, 2**63, 2**64 - 1)


@dataclass
class Rec:
    kind: str  # alloc, free, probe, junk_event, junk_type, short_alloc, bad_feature
    type_id: int
    site: int
    ptr: int
    req: int
    got: int
    target: int
    pid: int | None
    fn: int | None
    probe: int
    cpu: int
    gap: int  # sequence numbers lost before this record


def pack(rec: Rec, seq: int, big: bool) -> bytes:
    order = ">" if big else "<"
    features = b""
    if rec.pid is not None:
        features += struct.pack(order + "HBBIIIQ", 24, 1, 0, rec.pid, rec.pid, 0, seq)
    if rec.fn is not None:
        features += struct.pack(order + "HBBIQQ", 24, 2, rec.fn, 0, rec.ptr ^ 1, 1)
    if rec.kind == "bad_feature":
        features += struct.pack(order + "HB", 99, 1)
    seq32 = seq % 2**32
    if rec.kind in ("alloc", "short_alloc", "bad_feature"):
        body = struct.pack(order + "QQQQIi", rec.site, rec.ptr, rec.req, rec.got, 0, rec.target)
        if rec.kind == "short_alloc":  # an event size below an allocation's 48
            body, features = body[:16], b""
        eid, tid = 0, rec.type_id
    elif rec.kind == "free":
        body, eid, tid = struct.pack(order + "QQ", rec.site, rec.ptr), 1, rec.type_id
    elif rec.kind == "probe":
        body = struct.pack(order + "QQHBBI6Q", rec.site, rec.ptr, rec.probe, 2, 0, 0, *range(6))
        eid, tid = 2, 6
    elif rec.kind == "junk_event":
        body, eid, tid = struct.pack(order + "QQ", rec.site, rec.ptr), 9, 0
    else:  # junk_type
        body, eid, tid = struct.pack(order + "QQ", rec.site, rec.ptr), 1, 6
    size = 8 + len(body) + len(features)
    return struct.pack(order + "BBHI", eid, tid, size, seq32) + body + features


@st.composite
def records(draw: st.DrawFn, cpus: int) -> Rec:
    kind = draw(st.sampled_from(["alloc"] * 6 + ["free"] * 5 + ["probe", "junk_event",
                                 "junk_type", "short_alloc", "bad_feature"]))  # fmt: skip
    type_id = draw(st.sampled_from([0, 0, 1, 2, 3, 4, 5, 7, 7]))
    user = type_id == 7
    return Rec(
        kind=kind,
        type_id=type_id,
        site=draw(st.sampled_from(SITES)),
        ptr=draw(st.sampled_from(POINTERS)),
        req=draw(st.sampled_from(BYTES)),
        got=draw(st.sampled_from(BYTES)),
        target=draw(st.sampled_from([-1, -1, 0, 1])),
        pid=draw(st.sampled_from([1, 2])) if user or draw(st.booleans()) else None,
        fn=draw(st.integers(0, 8)) if user else None,
        probe=draw(st.sampled_from([0, 1, 5, 65535])),
        cpu=draw(st.integers(0, cpus - 1)),
        gap=draw(st.sampled_from([0, 0, 0, 1, 7])),
    )


@st.composite
def record_sets(draw: st.DrawFn) -> dict[str, object]:
    cpus = draw(st.integers(1, 3))
    return {
        "cpus": cpus,
        "records": draw(st.lists(records(cpus), max_size=120)),
        # near 0, near the sign bit and near the top of 32 bits: wraparound
        "first_seq": draw(st.sampled_from([0, 2**31 - 20, 2**32 - 30])) + draw(st.integers(0, 9)),
        "big": draw(st.booleans()),
        "nodes": draw(st.sampled_from(["", "0 0\n1 1\n", "0 1\n"])),
        "tail": draw(st.sampled_from([b"", b"\x01", b"\x00\x00\x10\x00", b"\x00\x00\x05\x00abc"])),
        "chunk": draw(st.sampled_from([24, 61, 100, 256, 1 << 20])),
    }


def write(directory: Path, spec: dict[str, object]) -> None:
    directory.mkdir()
    files: dict[int, bytearray] = {cpu: bytearray() for cpu in range(spec["cpus"])}  # type: ignore[call-overload]
    seq = spec["first_seq"]
    for rec in spec["records"]:  # type: ignore[attr-defined]
        seq += 1 + rec.gap  # type: ignore[operator]
        files[rec.cpu] += pack(rec, seq, bool(spec["big"]))  # type: ignore[arg-type]
    files[0] += spec["tail"]  # type: ignore[operator]
    for cpu, data in files.items():
        (directory / f"cpu{cpu}").write_bytes(bytes(data))
    (directory / "abi_version").write_text("3\n")
    (directory / "cpu_nodes").write_text(spec["nodes"])  # type: ignore[arg-type]
    (directory / "libc_probes").write_text("".join(f"{name}\n" for name in PROBES))
    (directory / "user_maps").write_text("1 400000 402000 0 x /usr/bin/prog\n")


# The allocation functions by number, as docs/kmemtrace-format.md lists them.
FUNCTIONS = ("malloc", "calloc", "realloc", "reallocarray", "free", "memalign",
             "posix_memalign", "aligned_alloc", "valloc", "pvalloc")  # fmt: skip
KERNEL_COUNTS = ("allocs", "bytes_req", "bytes_alloc", "failed", "cross_node", "frees",
                 "bytes_freed", "cross_cpu_frees", "mismatched_frees", "unknown_frees")  # fmt: skip
LIBC_TYPES = {3: "sbrk", 4: "heap", 5: "arena"}
KEPT = ("alloc", "free", "probe", "bad_feature")  # the kinds a reader keeps
PROBES = ("memory_mallopt", "memory_sbrk_more")  # the set's libc_probes file, in order


class Truth:
    """What the records written say, worked out here from the generator's
    own list in sequence (= list) order, as docs/kmemtrace-format.md defines
    each figure: per kernel (call site, type) every count and byte sum, frees
    matched by pointer; the whole set's errors, cross-CPU frees and
    cross-node allocations; libc's records by type; probe hits; and per user
    (process, function, call site) allocations, bytes and frees matched by
    (process, pointer)."""

    def __init__(self, nodes: str) -> None:
        self.node_of = {int(cpu): int(node) for cpu, node in map(str.split, nodes.splitlines())}
        self.sites: dict[tuple[str, str], dict[str, int]] = {}
        self.live: dict[int, tuple[tuple[str, str], int, int, int]] = {}  # site, type, cpu, bytes
        self.users: dict[tuple[int, str, str], dict[str, int]] = {}
        self.user_live: dict[tuple[int, int], tuple[tuple[int, str, str], int]] = {}
        self.errors = dict.fromkeys(("null_frees", "reallocated_live", "mismatched_frees",
                                     "unknown_frees", "requested_above_allocated"), 0)  # fmt: skip
        self.cross = {"frees": 0, "node_allocs": 0}
        self.libc: dict[str, dict[str, int]] = {}
        self.probes: dict[str, int] = {}
        self.user_unknown = 0

    def figures(self) -> dict[str, object]:
        return {"errors": self.errors, "cross_cpu": self.cross, "libc": self.libc,
                "probes": self.probes, "user_unknown_frees": self.user_unknown,
                "sites": self.sites, "user": self.users}  # fmt: skip

    def record(self, rec: Rec) -> None:
        if rec.kind not in KEPT:
            return
        if rec.kind == "probe":
            name = PROBES[rec.probe] if rec.probe < len(PROBES) else f"probe {rec.probe}"
            self.probes[name] = self.probes.get(name, 0) + 1
        elif rec.type_id in LIBC_TYPES:
            kind = self.libc.setdefault(LIBC_TYPES[rec.type_id],
                                        {"allocs": 0, "bytes": 0, "frees": 0})  # fmt: skip
            kind["allocs" if rec.kind != "free" else "frees"] += 1
            kind["bytes"] += rec.got if rec.kind != "free" else 0
        elif rec.type_id == 7:
            self.user(rec)
        elif rec.kind != "free":
            self.kernel_alloc(rec)
        else:
            self.kernel_free(rec)

    def user(self, rec: Rec) -> None:
        assert rec.pid is not None and rec.fn is not None
        key = (rec.pid, FUNCTIONS[rec.fn], f"{rec.site:#x}")
        if rec.kind != "free":
            user = self.users.setdefault(key, dict.fromkeys(("allocs", "bytes", "frees",
                                                             "bytes_freed"), 0))  # fmt: skip
            user["allocs"] += 1
            user["bytes"] += rec.req
            if rec.ptr:
                self.user_live[(rec.pid, rec.ptr)] = (key, rec.req)
        elif rec.ptr and (rec.pid, rec.ptr) in self.user_live:
            owner, size = self.user_live.pop((rec.pid, rec.ptr))
            self.users[owner]["frees"] += 1
            self.users[owner]["bytes_freed"] += size
        elif rec.ptr:
            self.user_unknown += 1

    def site(self, key: tuple[str, str]) -> dict[str, int]:
        return self.sites.setdefault(key, dict.fromkeys(KERNEL_COUNTS, 0))

    def kernel_alloc(self, rec: Rec) -> None:
        key = (f"{rec.site:#x}", TYPE_NAMES[rec.type_id])
        counts = self.site(key)
        counts["allocs"] += 1
        counts["bytes_req"] += rec.req
        counts["bytes_alloc"] += rec.got
        counts["failed"] += rec.ptr == 0
        far = rec.target >= 0 and rec.target != self.node_of.get(rec.cpu, -1)
        counts["cross_node"] += far
        self.cross["node_allocs"] += far
        self.errors["requested_above_allocated"] += rec.req > rec.got
        if rec.ptr:
            self.errors["reallocated_live"] += rec.ptr in self.live
            self.live[rec.ptr] = (key, rec.type_id, rec.cpu, rec.got)

    def kernel_free(self, rec: Rec) -> None:
        if rec.ptr == 0:
            self.errors["null_frees"] += 1
        elif rec.ptr in self.live:
            owner, type_id, cpu, size = self.live.pop(rec.ptr)
            counts = self.site(owner)
            counts["frees"] += 1
            counts["bytes_freed"] += size
            counts["cross_cpu_frees"] += cpu != rec.cpu
            self.cross["frees"] += cpu != rec.cpu
            counts["mismatched_frees"] += type_id != rec.type_id
            self.errors["mismatched_frees"] += type_id != rec.type_id
        else:
            self.site((f"{rec.site:#x}", TYPE_NAMES[rec.type_id]))["unknown_frees"] += 1
            self.errors["unknown_frees"] += 1


def truth(spec: dict[str, object]) -> dict[str, object]:
    """The figures the records of ``spec`` say (Truth)."""
    worked = Truth(str(spec["nodes"]))
    for rec in spec["records"]:  # type: ignore[attr-defined]
        worked.record(rec)
    return worked.figures()


def reported(report: dict) -> dict[str, object]:  # type: ignore[type-arg]
    """The same figures, as the report's JSON gives them."""
    users: dict[tuple[int, str, str], dict[str, int]] = {}
    for u in report.get("user", []):
        key = (u["pid"], u["allocator"], u["call_site"])
        users[key] = {k: u[k] for k in ("allocs", "bytes", "frees", "bytes_freed")}
    return {
        "errors": report["errors"],
        "cross_cpu": report["cross_cpu"],
        "libc": report.get("libc", {}),
        "probes": report.get("libc_probes", {}),
        "user_unknown_frees": report.get("user_unknown_frees", 0),
        "sites": {
            (s["call_site"], s["type"]): {k: s[k] for k in KERNEL_COUNTS}
            for s in report["kernel"]["call_sites"]
        },
        "user": users,
    }


def both(path: Path, big: bool | None = None, chunk: int | None = None) -> tuple[dict, dict]:
    sorting = analyse(read_record_set(path, big))
    streaming = stream_report(open_record_set(path, big), chunk=chunk)
    assert report_lines(streaming, None, "bytes_alloc") == report_lines(
        sorting, None, "bytes_alloc"
    )
    return streaming.as_json(), sorting.as_json()


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(spec=record_sets())
def test_the_streaming_pass_answers_as_the_sorting_analysis(spec: dict, tmp_path_factory) -> None:  # type: ignore[no-untyped-def]
    # GIVEN a random record set: records of every kind on up to 3 CPUs, some
    # skipped or damaged, sequence numbers lost and wrapping around 32 bits
    directory = tmp_path_factory.mktemp("set") / "set"
    write(directory, spec)
    # WHEN it is analysed by the streaming pass, in chunks of any size,
    # and by sorting every record in memory
    streaming, sorting = both(directory, spec["big"], spec["chunk"])
    # THEN every figure is the same
    assert streaming == sorting
    # AND every figure is what the records written say: kernel sites with
    # their byte sums, cross-CPU and cross-node counts, requested above
    # allocated, libc's records, probe hits, and the user allocations
    assert reported(streaming) == truth(spec)
    # AND on an undamaged set, every record written was read
    if not spec["tail"]:
        assert streaming["records"] == sum(rec.kind in KEPT for rec in spec["records"])


def test_a_file_whose_sequence_numbers_go_backwards_is_sorted_instead(tmp_path: Path) -> None:
    # GIVEN a file whose records are not in sequence order: a kmalloc freed
    # in a record written before it, and an allocation of the same pointer after
    directory = tmp_path / "set"
    order = [(5, "alloc"), (3, "free"), (9, "alloc"), (7, "free")]
    spec_records = []
    for seq, kind in order:
        spec_records.append((seq, Rec(kind, 0, SITES[0], 0x1000, 8, 8, -1, None, None, 0, 0, 0)))
    directory.mkdir()
    (directory / "cpu0").write_bytes(b"".join(pack(rec, seq, False) for seq, rec in spec_records))
    (directory / "abi_version").write_text("3\n")
    # WHEN the streaming report reads it
    streaming, sorting = both(directory)
    # THEN it answers as the sorting analysis does: the frees matched in
    # sequence order (3 before 5: unknown; 7 after 5: matched; 9 live)
    assert streaming == sorting
    assert streaming["errors"]["unknown_frees"] == 1  # type: ignore[index]
    assert streaming["kernel"]["call_sites"][0]["frees"] == 1  # type: ignore[index]


def test_one_cpu_file_alone_reads_as_in_its_set(tmp_path: Path) -> None:
    # GIVEN a record set of two CPUs
    directory = tmp_path / "set"
    recs = [Rec("alloc", 0, SITES[0], 0x1000 * (i + 1), 8, 16, -1, None, None, 0, i % 2, 0)
            for i in range(10)]  # fmt: skip
    write(directory, {"cpus": 2, "records": recs, "first_seq": 0, "big": False, "nodes": "",
                      "tail": b""})  # fmt: skip
    # WHEN one of its files is reported alone
    streaming, sorting = both(directory / "cpu1")
    # THEN it holds that CPU's five allocations, as the sorting analysis says
    assert streaming == sorting and streaming["records"] == 5
