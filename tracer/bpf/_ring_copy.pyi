"""Types of the ring copier (tracer/bpf/ring_copy.c)."""

BUSY_BIT: int  # a record's header: the producer is writing it
DISCARD_BIT: int  # ... the producer discarded it
HEADER_SIZE: int  # a record's header, before its data

class Copier:
    """A thread that empties a BPF ring buffer into a buffer in user memory."""

    def __init__(
        self, map_fd: int, ring_size: int, buffer_size: int, interval_us: int = 1000
    ) -> None: ...
    @property
    def fd(self) -> int: ...
    @property
    def stats(self) -> tuple[int, int]: ...
    def take(self, limit: int = -1) -> bytes: ...
    def close(self) -> None: ...
