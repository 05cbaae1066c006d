"""Kernel allocations per call site: the numbers kmem.bpf.c aggregates in
the kernel, and the same shape computed from kmemtrace records by
``mtrace-live report``, so both render through one set of exporters."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from mtrace_live.probes.records import SITE_FIELDS, KmemType

from .kallsyms import KernelSymbols

TYPE_NAMES: dict[int, str] = {KmemType.KMALLOC: "kmalloc", KmemType.CACHE: "cache",
                              KmemType.PAGES: "pages"}  # fmt: skip


@dataclass
class CallSite:
    """One (call site, type): what was allocated there, and what became of it."""

    address: int
    type: int
    allocs: int = 0
    bytes_req: int = 0
    bytes_alloc: int = 0
    failed: int = 0
    cross_node: int = 0
    frees: int = 0
    bytes_freed: int = 0
    cross_cpu_frees: int = 0
    mismatched_frees: int = 0
    unknown_frees: int = 0
    symbol: str = ""  # "func+0x1a [module]", filled in by a Symbolizer

    @classmethod
    def with_counts(cls, address: int, type_: int, counts: Iterable[tuple[str, int]]) -> CallSite:
        site = cls(address, type_)
        for name, value in counts:
            setattr(site, name, value)
        return site

    @property
    def type_name(self) -> str:
        return TYPE_NAMES.get(self.type, f"type {self.type}")

    @property
    def fragmentation(self) -> float:
        """Share of the allocated bytes that were not requested, 0..1."""
        return 1.0 - self.bytes_req / self.bytes_alloc if self.bytes_alloc else 0.0

    @property
    def outstanding(self) -> int:
        return self.allocs - self.failed - self.frees

    @property
    def outstanding_bytes(self) -> int:
        return self.bytes_alloc - self.bytes_freed

    def as_json(self) -> dict[str, object]:
        doc: dict[str, object] = {"call_site": f"{self.address:#x}", "symbol": self.symbol,
                                  "type": self.type_name}  # fmt: skip
        doc.update({name: getattr(self, name) for name in SITE_FIELDS})
        doc["outstanding"] = self.outstanding
        doc["outstanding_bytes"] = self.outstanding_bytes
        doc["fragmentation"] = round(self.fragmentation, 6)
        return doc


@dataclass
class KmemTotals:
    """Whole-dataset figures."""

    sites: list[CallSite]
    page_orders: dict[int, tuple[int, int]] = field(default_factory=dict)  # order: (allocs, frees)
    hits: dict[str, int] = field(default_factory=dict)
    untracked: int = 0  # objects the pointer table had no room for
    sites_dropped: int = 0
    lost_allocs: int = 0  # allocation events the ring buffer had no room for
    lost_frees: int = 0

    def total(self, name: str) -> int:
        return sum(getattr(site, name) for site in self.sites)

    @property
    def fragmentation(self) -> float:
        alloc = self.total("bytes_alloc")
        return 1.0 - self.total("bytes_req") / alloc if alloc else 0.0

    def as_json(self) -> dict[str, object]:
        totals: dict[str, object] = {name: self.total(name) for name in SITE_FIELDS}
        totals["fragmentation"] = round(self.fragmentation, 6)
        return {
            "totals": totals,
            "call_sites": [site.as_json() for site in self.sites],
            "page_orders": {
                str(order): {"allocs": a, "frees": f}
                for order, (a, f) in sorted(self.page_orders.items())
            },
            "untracked_objects": self.untracked,
            "call_sites_dropped": self.sites_dropped,
        }


def sorted_sites(sites: Iterable[CallSite], key: str = "bytes_alloc") -> list[CallSite]:
    """Largest first, as kmemtrace-report sorts; ties by address."""
    if key == "fragmentation":
        return sorted(sites, key=lambda s: (-s.fragmentation, -s.bytes_alloc, s.address))
    return sorted(sites, key=lambda s: (-getattr(s, key), s.address, s.type))


def name_sites(sites: Iterable[CallSite], symbols: KernelSymbols) -> None:
    """Fill in ``symbol``: kernel call sites through kallsyms."""
    for site in sites:
        if site.type > KmemType.PAGES:
            site.symbol = f"{site.address:#x}"  # a libc site: an address in the process
        elif site.address == 0:
            site.symbol = "(pages)" if site.type == KmemType.PAGES else "0x0"
        else:
            site.symbol = symbols.describe(site.address)
