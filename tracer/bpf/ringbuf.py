"""Reading a BPF ring buffer in bulk, straight from its memory map.

bcc's Python ring buffer API calls back into Python once per record, which
caps delivery at a few hundred thousand records a second. The kernel lets the
consumer map the buffer instead. The ring's layout (its pages, each
record's 8-byte header with its busy and discard bits, the records' 8-byte
alignment) is described once, in tracer/bpf/ring_copy.c, and its constants
(``BUSY_BIT``, ``DISCARD_BIT``, ``HEADER_SIZE``) are that extension's.

``RingReader.read()`` copies everything committed since the last call in one
slice, views it as a numpy structured array and advances the consumer
position once. All of mtrace-live's records have one size, so the records sit
at a fixed stride; a record of another size is skipped by walking headers.

With ``buffer_size``, a thread of the C extension (tracer/bpf/ring_copy.c)
empties the ring, every millisecond while records come fast, into a buffer
of that size in user memory, without the interpreter lock, and ``read()``
takes the records from there (the copier maps the ring; this class then
does not): the kernel's ring can be small enough to stay in the CPU's cache
while bursts still have the room the user asked for (docs/live-tracing.md).
``fd`` is then the copier's eventfd, readable once records were copied.
"""

from __future__ import annotations

import functools
import mmap
import struct
from typing import TYPE_CHECKING

from mtrace_live.probes.elf.lazy import lazy_module
from mtrace_live.tracer.bpf._ring_copy import BUSY_BIT, DISCARD_BIT, HEADER_SIZE, Copier

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # (at the first use: probes/elf/lazy.py)

__all__ = ["BUSY_BIT", "DISCARD_BIT", "HEADER_SIZE", "RingReader", "record_stride"]


def record_stride(size: int) -> int:
    return (size + HEADER_SIZE + 7) & ~7


class RingReader:
    """Consumer side of one BPF_MAP_TYPE_RINGBUF map."""

    @functools.cached_property
    def stride(self) -> int:
        """A record's bytes in the ring: its header and the event, in 8-byte units."""
        return record_stride(self.dtype.itemsize)

    @functools.cached_property
    def _record(self) -> np.dtype:
        """A record as the ring holds it (made at the first read: numpy)."""
        record = np.dtype([("len", "<u4"), ("pgoff", "<u4"), ("event", self.dtype)], align=False)
        if record.itemsize == self.stride:
            return record
        pad = self.stride - record.itemsize
        return np.dtype(
            [("len", "<u4"), ("pgoff", "<u4"), ("event", self.dtype), ("pad", f"V{pad}")]
        )

    def __init__(
        self, map_fd: int, data_size: int, dtype: np.dtype, buffer_size: int | None = None
    ) -> None:
        if data_size & (data_size - 1) or data_size % mmap.PAGESIZE:
            raise ValueError("ring buffer size must be a power-of-two multiple of the page size")
        page = mmap.PAGESIZE
        self.fd = map_fd
        self.dtype = dtype
        self._mask = data_size - 1
        self._copier: Copier | None = None
        if buffer_size is not None:
            self._copier = Copier(map_fd, data_size, buffer_size)
            self.fd = self._copier.fd
            return
        self._consumer = mmap.mmap(
            map_fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0
        )
        self._producer = mmap.mmap(
            map_fd, page + 2 * data_size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page
        )
        self._page = page
        # The positions are 8-byte words the kernel reads and writes
        # concurrently; they must be loaded and stored whole. struct's
        # little-endian "<Q" goes byte by byte, and a torn consumer position
        # makes the kernel see a full ring and drop records. A memoryview of
        # native unsigned 64-bit items is one aligned 8-byte access.
        self._consumer_word = memoryview(self._consumer).cast("Q")
        self._producer_word = memoryview(self._producer).cast("Q")

    def _positions(self) -> tuple[int, int]:
        return self._consumer_word[0], self._producer_word[0]

    def read(self, limit: int | None = None) -> np.ndarray:
        """Every record committed since the last call, or the first ``limit``."""
        if self._copier is not None:
            return self._decode(self._copier.take(-1 if limit is None else limit * self.stride))[1]
        consumer, raw = self._committed(limit)
        if not raw:
            return np.zeros(0, dtype=self.dtype)
        consumed, events = self._decode(raw)
        self._advance(consumer + consumed)
        return events

    def read_raw(self, size: int) -> list[bytes]:
        """Every record of ``size`` bytes committed since the last call, as
        bytes (no numpy: the file server reads its asks so)."""
        if self._copier is not None:
            return self._records(self._copier.take(-1), size)[1]
        consumer, raw = self._committed(None)
        consumed, events = self._records(raw, size)
        self._advance(consumer + consumed)
        return events

    def _committed(self, limit: int | None) -> tuple[int, bytes]:
        """The consumer's position, and the ring's bytes from it to the
        producer's (at most ``limit`` records' strides)."""
        consumer, producer = self._positions()
        available = producer - consumer
        if available <= 0:
            return consumer, b""
        if limit is not None:
            available = min(available, limit * self.stride)
        start = self._page + (consumer & self._mask)
        return consumer, bytes(self._producer[start : start + available])

    def _decode(self, raw: bytes) -> tuple[int, np.ndarray]:
        """The events in ``raw`` and how many of its bytes they took: at a
        fixed stride when every record is one of ours, else (slow path) up to
        the first busy record, less discarded or foreign ones."""
        records = np.frombuffer(raw, dtype=self._record, count=len(raw) // self.stride)
        if len(records) * self.stride == len(raw) and not np.any(
            records["len"] != self.dtype.itemsize
        ):
            return len(raw), records["event"].copy()
        offset, keep = self._records(raw, self.dtype.itemsize)
        return offset, np.frombuffer(b"".join(keep), dtype=self.dtype).copy()

    @staticmethod
    def _records(raw: bytes, size: int) -> tuple[int, list[bytes]]:
        """The records of ``size`` bytes in ``raw``, and how many of its bytes
        they took: up to the first busy record, less discarded or foreign ones."""
        offset = 0
        keep: list[bytes] = []
        while offset + HEADER_SIZE <= len(raw):
            (length,) = struct.unpack_from("<I", raw, offset)
            if length & BUSY_BIT:
                break
            found = length & ~(BUSY_BIT | DISCARD_BIT)
            step = record_stride(found)
            if offset + step > len(raw):
                break
            if not length & DISCARD_BIT and found == size:
                keep.append(raw[offset + HEADER_SIZE : offset + HEADER_SIZE + found])
            offset += step
        return offset, keep

    def _advance(self, position: int) -> None:
        self._consumer_word[0] = position

    @property
    def copier_stats(self) -> tuple[int, int] | None:
        """With a copier: (its pulls that moved records, the bytes moved)."""
        return None if self._copier is None else self._copier.stats

    def close(self) -> None:
        if self._copier is not None:
            self._copier.close()
            return
        self._consumer_word.release()
        self._producer_word.release()
        self._consumer.close()
        self._producer.close()
