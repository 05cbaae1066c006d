"""The event path without the kernel: ring layout -> bulk read -> typed
events -> allocator model, on records built the way trace.bpf.c writes them."""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator

import numpy as np
import pytest
from mtrace_live.exporters.data.events import EventDecoder, site_info
from mtrace_live.probes.locations import ArgKind, ArgLocation, SiteLayout
from mtrace_live.probes.records import EVENT_DTYPE, EventKind
from mtrace_live.probes.sdt_notes import SdtSite
from mtrace_live.tracer.model import AllocatorModel
from mtrace_live.tracer.ringbuf import BUSY_BIT, RingReader, record_stride

PAGE = mmap.PAGESIZE
DATA = 4 * PAGE
STRIDE = record_stride(EVENT_DTYPE.itemsize)


class FakeRing:
    """A memfd laid out as the kernel maps a BPF ring buffer: consumer page,
    producer page, then the data pages twice in a row."""

    def __init__(self) -> None:
        self.fd = os.memfd_create("ring")
        os.ftruncate(self.fd, 2 * PAGE + 2 * DATA)
        self.map = mmap.mmap(self.fd, 2 * PAGE + 2 * DATA)
        self.producer = 0

    def set_positions(self, consumer: int, producer: int) -> None:
        struct.pack_into("<Q", self.map, 0, consumer)
        struct.pack_into("<Q", self.map, PAGE, producer)
        self.producer = producer

    def consumer(self) -> int:
        return int(struct.unpack_from("<Q", self.map, 0)[0])

    def write(self, events: np.ndarray, busy_from: int | None = None) -> None:
        for index, event in enumerate(events):
            length = EVENT_DTYPE.itemsize | (
                BUSY_BIT if busy_from is not None and index >= busy_from else 0
            )
            record = struct.pack("<II", length, 0) + event.tobytes()
            record += b"\0" * (STRIDE - len(record))
            for copy in (0, DATA):  # the double mapping
                at = 2 * PAGE + copy + (self.producer % DATA)
                end = min(len(record), 2 * PAGE + 2 * DATA - at)
                self.map[at : at + end] = record[:end]
            if (self.producer % DATA) + STRIDE > DATA:  # wrapped: head of the second copy
                tail = (self.producer % DATA) + STRIDE - DATA
                self.map[2 * PAGE : 2 * PAGE + tail] = record[STRIDE - tail :]
            self.producer += STRIDE
        struct.pack_into("<Q", self.map, PAGE, self.producer)

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


@pytest.fixture
def ring() -> Iterator[FakeRing]:
    fake = FakeRing()
    yield fake
    fake.close()


def events(n: int, probe: int = 0, site: int = 0, tgid: int = 100) -> np.ndarray:
    batch = np.zeros(n, dtype=EVENT_DTYPE)
    batch["ts"] = np.arange(n) + 1_000
    batch["tgid"] = tgid
    batch["tid"] = tgid
    batch["probe"] = probe
    batch["site"] = site
    batch["nargs"] = 2
    batch["args"][:, 0] = np.arange(n)
    batch["args"][:, 1] = np.uint64(2**64 - 6)  # -6 when read as signed
    return batch


def test_bulk_read_across_the_wrap(ring: FakeRing) -> None:
    start = DATA - 3 * STRIDE - STRIDE // 2  # the 4th record straddles the end
    start -= start % 8
    ring.set_positions(start, start)
    reader = RingReader(ring.fd, DATA, EVENT_DTYPE)
    written = events(10)
    ring.write(written)
    got = reader.read()
    assert got.tobytes() == written.tobytes()
    assert ring.consumer() == start + 10 * STRIDE
    assert len(reader.read()) == 0
    reader.close()


def test_a_busy_record_stops_the_read_until_committed(ring: FakeRing) -> None:
    ring.set_positions(0, 0)
    reader = RingReader(ring.fd, DATA, EVENT_DTYPE)
    written = events(5)
    ring.write(written, busy_from=3)
    assert reader.read().tobytes() == written[:3].tobytes()
    assert ring.consumer() == 3 * STRIDE
    reader.close()


def layout(name: str, *args: ArgLocation) -> SiteLayout:
    return SiteLayout(SdtSite("libc", name, 0x1000, 0x1000, 0, ()), args)


REG = ArgLocation(ArgKind.REG, 8, False, reg=14)
SIGNED = ArgLocation(ArgKind.REG, 4, True, reg=13)


def test_decoding_applies_names_and_signedness_per_site() -> None:
    from mtrace_live.probes.catalog import load_catalog

    catalog = load_catalog()
    infos = [
        site_info(layout("memory_mallopt", SIGNED, SIGNED), catalog.probe("libc", "memory_mallopt"))
    ]
    batch = events(3)
    batch["args"][:, 0] = np.uint64(2**64 - 6)
    batch["args"][:, 1] = [64, 0, 2**64 - 1]
    decoded = EventDecoder(infos).decode(batch)
    assert [e.args for e in decoded] == [
        {"param_number": -6, "value": 64},
        {"param_number": -6, "value": 0},
        {"param_number": -6, "value": -1},
    ]
    assert decoded[0].probe == "memory_mallopt"


def test_model_counts_in_bulk_and_follows_heaps_and_settings() -> None:
    from mtrace_live.probes.catalog import load_catalog

    catalog = load_catalog()
    names = ["setjmp", "memory_heap_new", "memory_heap_free", "memory_mallopt_arena_max"]
    layouts = [
        layout("setjmp", REG, REG, REG),
        layout("memory_heap_new", REG, REG),
        layout("memory_heap_free", REG, REG),
        layout("memory_mallopt_arena_max", REG, REG),
    ]
    infos = [site_info(lay, catalog.probe("libc", lay.site.name)) for lay in layouts]
    model = AllocatorModel(EventDecoder(infos), names)
    jumps = events(100_000, probe=0, site=0)
    new = events(2, probe=1, site=1)
    new["args"][:, 0] = [0x7F0000000000, 0x7F0004000000]
    new["args"][:, 1] = [65536, 131072]
    free = events(1, probe=2, site=2)
    free["args"][0, :2] = [0x7F0000000000, 65536]
    setting = events(1, probe=3, site=3)
    setting["args"][0, :2] = [8, 0]
    exited = events(1)
    exited["kind"] = EventKind.EXIT
    model.consume(np.concatenate([jumps, new]))
    model.consume(np.concatenate([free, setting, exited]))
    state = model.processes[100]
    assert state.counts["setjmp"] == 100_000
    assert state.heaps == {0x7F0004000000: 131072}
    assert state.heap_bytes_released == 65536
    assert [(c.setting, c.old, c.new) for c in state.settings] == [("M_ARENA_MAX", 0, 8)]
    assert state.exited
