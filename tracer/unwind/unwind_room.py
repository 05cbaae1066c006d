"""The room of the unwinder's fixed-size tables (unwind_rows and
unwind_pages: BPF arrays do not grow), shared out among files: each file
takes one run of entries, and gives it back when the file is evicted (no
process maps it any more, tracer/unwind/unwind_tables.py), for the next file that
fits in it. First fit, with the runs given back merged with their
neighbours. Sizes are fixed at start (``--unwind-rows``): this is the
mechanism by which every table of the unwinder shares its room."""

from __future__ import annotations

import bisect


class Extents:
    """The free runs of the entries [start, end) of one table."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.free: list[tuple[int, int]] = [(start, end - start)] if end > start else []

    def take(self, size: int) -> int | None:
        """The first entry of a run of ``size`` entries taken, or None where
        no free run is that long (0 entries take nothing, at ``start``)."""
        if size <= 0:
            return self.start
        for i, (first, room) in enumerate(self.free):
            if room >= size:
                if room == size:
                    del self.free[i]
                else:
                    self.free[i] = (first + size, room - size)
                return first
        return None

    def give(self, first: int, size: int) -> None:
        """The run [first, first + size) taken before is free again."""
        if size <= 0:
            return
        i = bisect.bisect(self.free, (first, size))
        if i > 0 and sum(self.free[i - 1]) == first:  # after the one before
            i -= 1
            first, size = self.free[i][0], self.free[i][1] + size
            del self.free[i]
        if i < len(self.free) and first + size == self.free[i][0]:  # before the one after
            size += self.free[i][1]
            del self.free[i]
        self.free.insert(i, (first, size))

    def grow(self, end: int) -> None:
        """The table's entries up to ``end`` are this one's too (the file
        server's share, where the server could not start)."""
        if end > self.end:
            old, self.end = self.end, end
            self.give(old, end - old)

    @property
    def used(self) -> int:
        """Entries taken."""
        return self.end - self.start - sum(room for _, room in self.free)
