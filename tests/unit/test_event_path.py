"""The event path without the kernel: ring layout -> bulk read -> typed
events -> allocator model, on records built the way the trace program writes them."""

from __future__ import annotations

import mmap
import os
import select
import struct
import time
from collections.abc import Iterator

import numpy as np
import pytest
from mtrace_live.exporters.data.events import EventDecoder, site_info
from mtrace_live.probes.locations import ArgKind, ArgLocation, SiteLayout
from mtrace_live.probes.records import EVENT_DTYPE, EventKind
from mtrace_live.probes.sdt_notes import SdtSite
from mtrace_live.tracer.bpf.ringbuf import BUSY_BIT, DISCARD_BIT, RingReader, record_stride
from mtrace_live.tracer.loop.model import AllocatorModel

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
            busy = busy_from is not None and index >= busy_from
            self.put(event.tobytes(), BUSY_BIT if busy else 0)
        self.publish()

    def put(self, payload: bytes, flags: int = 0) -> None:
        """One record of ``payload`` (any size: the kernel's ring also holds
        other programs' records), its header's length word with ``flags``
        (BUSY_BIT, DISCARD_BIT), padded to 8 bytes; ``publish`` commits."""
        record = struct.pack("<II", len(payload) | flags, 0) + payload
        stride = record_stride(len(payload))
        record += b"\0" * (stride - len(record))
        for copy in (0, DATA):  # the double mapping
            at = 2 * PAGE + copy + (self.producer % DATA)
            end = min(len(record), 2 * PAGE + 2 * DATA - at)
            self.map[at : at + end] = record[:end]
        if (self.producer % DATA) + stride > DATA:  # wrapped: head of the second copy
            tail = (self.producer % DATA) + stride - DATA
            self.map[2 * PAGE : 2 * PAGE + tail] = record[stride - tail :]
        self.producer += stride

    def publish(self) -> None:
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


def write_with_strangers(ring: FakeRing, written: np.ndarray) -> int:
    """``written`` with a discarded record of ours after each second one and
    a record of a foreign size (12 bytes: 24 with its header) after each
    third; the bytes of ring used."""
    start = ring.producer
    for index, event in enumerate(written):
        ring.put(event.tobytes())
        if index % 2 == 1:
            ring.put(events(1, probe=99).tobytes(), DISCARD_BIT)
        if index % 3 == 2:
            ring.put(b"\xab" * 12)
    ring.publish()
    return ring.producer - start


@pytest.mark.parametrize("copier", [False, True], ids=["direct", "copier"])
def test_discarded_and_foreign_records_are_stepped_over(ring: FakeRing, copier: bool) -> None:
    # GIVEN a ring whose records wrap around its end, among them discarded
    # records and records of another size
    start = DATA - 5 * STRIDE
    ring.set_positions(start, start)
    reader = RingReader(ring.fd, DATA, EVENT_DTYPE, buffer_size=2 * DATA if copier else None)
    written = events(12)
    used = write_with_strangers(ring, written)
    assert used == 12 * STRIDE + 6 * STRIDE + 4 * 24
    # WHEN it is read
    if copier:
        wait_readable(reader.fd)
    got = reader.read()
    # THEN exactly our committed records come out, in order, and the ring
    # is consumed past every record
    assert got.tobytes() == written.tobytes()
    assert ring.consumer() == start + used
    assert len(reader.read()) == 0
    reader.close()


def wait_readable(fd: int) -> None:
    """Until the copier's eventfd says it copied something (a liveness wait:
    the copier pulls every millisecond)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    assert poller.poll(60_000), "the copier never signalled"


def wait_copied(ring: FakeRing) -> None:
    """Until the copier has taken everything committed (a liveness wait)."""
    for _ in range(60_000):
        if ring.consumer() == ring.producer:
            return
        time.sleep(0.001)
    raise AssertionError("the copier never emptied the ring")


def test_the_copier_takes_records_across_the_wrap(ring: FakeRing) -> None:
    # GIVEN a ring whose 4th record straddles the end, read through a copier
    start = DATA - 3 * STRIDE - STRIDE // 2
    start -= start % 8
    ring.set_positions(start, start)
    reader = RingReader(ring.fd, DATA, EVENT_DTYPE, buffer_size=4 * DATA)
    written = events(10)
    # WHEN records are committed and the copier's thread has moved them
    ring.write(written)
    wait_readable(reader.fd)
    # THEN the kernel's consumer position is past them, and a read returns them
    assert ring.consumer() == start + 10 * STRIDE
    assert reader.read().tobytes() == written.tobytes()
    assert len(reader.read()) == 0
    assert reader.copier_stats is not None and reader.copier_stats[1] == 10 * STRIDE
    reader.close()


def test_the_copier_holds_more_than_the_ring_and_reads_in_order(ring: FakeRing) -> None:
    # GIVEN a copier's buffer four times the ring
    ring.set_positions(0, 0)
    reader = RingReader(ring.fd, DATA, EVENT_DTYPE, buffer_size=4 * DATA)
    per_round = DATA // STRIDE - 1
    written = events(3 * per_round)
    # WHEN three ringfuls are committed, each once the ring was emptied
    for start in range(0, len(written), per_round):
        ring.write(written[start : start + per_round])
        wait_copied(ring)
    # THEN the reads give every record in order, at most `limit` at a time
    first = reader.read(limit=5)
    assert first.tobytes() == written[:5].tobytes()
    assert reader.read().tobytes() == written[5:].tobytes()
    reader.close()


def test_a_busy_record_stops_the_copier_until_committed(ring: FakeRing) -> None:
    ring.set_positions(0, 0)
    reader = RingReader(ring.fd, DATA, EVENT_DTYPE, buffer_size=2 * DATA)
    written = events(5)
    ring.write(written, busy_from=3)
    assert reader.read().tobytes() == written[:3].tobytes()
    assert ring.consumer() == 3 * STRIDE
    reader.close()


def test_a_full_copier_leaves_the_records_in_the_ring(ring: FakeRing) -> None:
    # GIVEN a copier whose buffer is the ring's size, holding one ringful
    ring.set_positions(0, 0)
    reader = RingReader(ring.fd, DATA, EVENT_DTYPE, buffer_size=DATA)
    held = DATA // STRIDE
    written = events(2 * held)
    ring.write(written[:held])
    wait_copied(ring)
    # WHEN more records are committed than its buffer has room for
    ring.write(written[held:])
    # THEN they stay in the ring until a read makes room, and none is lost
    assert ring.consumer() == held * STRIDE
    got = [reader.read()]
    while sum(len(g) for g in got) < len(written):
        got.append(reader.read())
    assert np.concatenate(got).tobytes() == written.tobytes()
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
