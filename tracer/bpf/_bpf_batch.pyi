"""Types of the batches of bpf(2) calls (tracer/bpf/bpf_batch.c)."""

from collections.abc import Sequence

from _typeshed import WriteableBuffer

def calls(cmd: int, attrs: Sequence[WriteableBuffer], /) -> list[int]:
    """bpf(cmd, attr, len(attr)) for each of ``attrs``, without the
    interpreter lock: each call's result, or minus its errno."""
