"""The running kernel's BTF, read through libbpf: member offsets, sizes and
tracepoint arguments, and the plan that turns them into raw kmem handlers.
/sys/kernel/btf/vmlinux is world-readable: no root needed."""

from __future__ import annotations

import re
import subprocess
from collections import defaultdict
from dataclasses import dataclass

import pytest
from mtrace_live.tracer.bpf.kernel_btf import VMLINUX, KernelBtf
from mtrace_live.tracer.bpf.kmem_attach import _RAW_EVENTS, PAGE_EVENTS_WHY, _raw_plan, kmem_attach

from .needs import needs


@pytest.fixture(autouse=True)
def kernel_btf() -> None:
    needs(VMLINUX.exists(), f"this kernel has no BTF ({VMLINUX} is missing)")


VARIANTS = {"HAVE_CACHE_NAME": 1, "HAVE_PAGE_FREE_BATCHED": 1}
EVENTS = ("kmalloc", "kfree", "kmem_cache_alloc", "kmem_cache_free", "mm_page_alloc",
          "mm_page_free")  # fmt: skip


def test_members_are_found_through_anonymous_structs_and_unions() -> None:
    with KernelBtf() as btf:
        # list_head is two pointers, on every kernel
        assert btf.member("list_head", "next") == (0, 8)
        assert btf.member("list_head", "prev") == (8, 8)
        assert btf.struct_size("list_head") == 16
        # struct page's lru sits in an anonymous union of anonymous structs
        found = btf.member("page", "lru")
        assert found is not None and found[1] == 16 and 0 < found[0] < btf.struct_size("page")
        # unknown names are None, not an error
        assert btf.member("page", "no_such_member") is None
        assert btf.member("no_such_struct", "lru") is None


def test_a_tracepoints_arguments_come_in_the_order_of_its_prototype() -> None:
    with KernelBtf() as btf:
        kfree = btf.tracepoint_args("kfree")
        cache_free = btf.tracepoint_args("kmem_cache_free")
        assert btf.tracepoint_args("no_such_tracepoint") is None
    assert kfree is not None and kfree[:2] == ["call_site", "ptr"]
    assert cache_free is not None and cache_free[:2] == ["call_site", "ptr"]


@dataclass
class BtfType:
    kind: str
    name: str
    members: list[tuple[str, int]]  # (name, bit offset; -1 for a prototype's parameters)


@pytest.fixture(scope="module")
def bpftool_btf() -> dict[str, list[BtfType]]:
    """The running kernel's BTF as bpftool dumps it (an independent reader
    of the same file), by type name."""
    dump = subprocess.run(["bpftool", "btf", "dump", "file", str(VMLINUX), "format", "raw"],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    by_id: dict[int, BtfType] = {}
    proto_of: dict[str, int] = {}  # a FUNC's name -> its FUNC_PROTO's id
    current: BtfType | None = None
    for line in dump.splitlines():
        head = re.match(r"\[(\d+)\] (\w+) '([^']*)'(.*)", line)
        if head:
            current = BtfType(head[2], head[3], [])
            by_id[int(head[1])] = current
            if head[2] == "FUNC":
                proto_of[head[3]] = int(re.search(r"type_id=(\d+)", head[4])[1])  # type: ignore[index]
            continue
        member = re.match(r"\s+'([^']*)' type_id=\d+(?: bits_offset=(\d+))?", line)
        if member and current is not None:
            current.members.append((member[1], int(member[2] or -1)))
    named: dict[str, list[BtfType]] = defaultdict(list)
    for kind_name in by_id.values():
        named[kind_name.name].append(kind_name)
    for func, proto in proto_of.items():
        named[f"proto of {func}"].append(by_id[proto])
    return named


def test_the_plan_takes_offsets_and_argument_slots_as_bpftool_reads_them(
    bpftool_btf: dict[str, list[BtfType]],
) -> None:
    plan = kmem_attach(VARIANTS)
    assert plan.raw == ("kmalloc", "kfree", "kmem_cache_alloc", "kmem_cache_free")
    assert set(plan.classic) == {"mm_page_alloc", "mm_page_free", "mm_page_free_batched"}
    assert set(plan.classic.values()) == {PAGE_EVENTS_WHY}
    # every argument slot is the argument's place in the prototype bpftool
    # shows for the tracepoint's event function, less its leading __data
    checked = 0
    for event, (prefix, needed, optional) in _RAW_EVENTS.items():
        (proto,) = bpftool_btf[f"proto of trace_event_raw_event_{event}"]
        params = [name for name, _ in proto.members]
        assert params[0] == "__data"
        for name in (*needed, *optional):
            expected = params.index(name) - 1 if name in params else -1
            assert plan.defines[f"{prefix}_ARG_{name.upper()}"] == expected, (event, name)
            checked += 1
    assert checked >= 8
    # and every struct kmem_cache offset is the member's bit offset / 8
    (cache,) = [t for t in bpftool_btf["kmem_cache"] if t.kind == "STRUCT"]
    offsets = dict(cache.members)
    read = {k: v for k, v in plan.defines.items() if k.startswith("CACHE_") and k.endswith("_OFF")
            and k != "CACHE_SPAN_OFF"}  # fmt: skip
    assert {"CACHE_SIZE_OFF", "CACHE_OBJECT_SIZE_OFF", "CACHE_NAME_OFF"} <= set(read)
    for define, value in read.items():
        member = define[len("CACHE_") : -len("_OFF")].lower()
        assert value * 8 == offsets[member], define
    # kmem_cache_alloc's handler is BTF-typed: BTF names its tracepoint's type
    assert plan.typed == ("kmem_cache_alloc",) and plan.defines["BTF_CACHE_ALLOC"] == 1
    # asked for classic: nothing raw, and each event says why
    asked = kmem_attach(VARIANTS, classic=True)
    assert asked.raw == () and asked.defines == {}
    assert set(asked.classic.values()) == {"asked for (--classic-tracepoints)"}


class _Lacking:
    """The running kernel's BTF, less one struct member or one tracepoint,
    as an older or differently built kernel would be."""

    def __init__(self, btf: KernelBtf, member: str = "", tracepoint: str = "",
                 tracepoint_type: str = "") -> None:  # fmt: skip
        self.btf, self.lacks_member, self.lacks_tracepoint = btf, member, tracepoint
        self.lacks_type = tracepoint_type

    def member(self, struct: str, member: str) -> tuple[int, int] | None:
        return None if member == self.lacks_member else self.btf.member(struct, member)

    def tracepoint_args(self, event: str) -> list[str] | None:
        return None if event == self.lacks_tracepoint else self.btf.tracepoint_args(event)

    def tracepoint_type_id(self, event: str) -> int | None:
        return None if event == self.lacks_type else self.btf.tracepoint_type_id(event)


def test_an_event_whose_facts_btf_lacks_stays_classic_and_says_why() -> None:
    with KernelBtf() as btf:
        no_name = _raw_plan(_Lacking(btf, member="name"), VARIANTS, EVENTS)  # type: ignore[arg-type]
        no_kfree = _raw_plan(_Lacking(btf, tracepoint="kfree"), VARIANTS, EVENTS)  # type: ignore[arg-type]
    assert "kmem_cache_alloc" not in no_name.raw and "RAW_CACHE_ALLOC" not in no_name.defines
    assert "no usable member name" in no_name.classic["kmem_cache_alloc"]
    assert "kmalloc" in no_name.raw
    assert "kfree" not in no_kfree.raw and "RAW_KFREE" not in no_kfree.defines
    assert "trace_event_raw_event_kfree" in no_kfree.classic["kfree"]


def test_without_the_tracepoints_btf_type_kmem_cache_alloc_stays_raw_untyped() -> None:
    with KernelBtf() as btf:
        assert btf.tracepoint_type_id("kmem_cache_alloc") is not None
        assert btf.tracepoint_type_id("no_such_tracepoint") is None
        untyped = _raw_plan(_Lacking(btf, tracepoint_type="kmem_cache_alloc"), VARIANTS, EVENTS)  # type: ignore[arg-type]
    assert "kmem_cache_alloc" in untyped.raw and untyped.typed == ()
    assert untyped.defines["RAW_CACHE_ALLOC"] == 1 and "BTF_CACHE_ALLOC" not in untyped.defines
