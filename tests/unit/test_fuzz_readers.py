"""Every reader of untrusted input under hypothesis: random bytes, and
mutations of a valid input. The only outcomes allowed are a clean error or
a result that passes the target's checks (fuzz_targets.py). CI runs a
bounded number of examples; ``make fuzz`` runs the same targets under
atheris for a million inputs and more (docs/fuzzing.md)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .fuzz_targets import TARGETS

EXAMPLES = int(os.environ.get("MTRACE_FUZZ_EXAMPLES", "150"))


@st.composite
def mutated(draw: st.DrawFn, seed: bytes) -> bytes:
    """The seed with a few byte-level edits, as a mutation fuzzer makes them."""
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 8))):
        at = draw(st.integers(0, len(data)))
        edit = draw(st.sampled_from(["replace", "insert", "delete", "repeat", "digits"]))
        if edit == "replace" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif edit == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif edit == "delete":
            del data[at : at + draw(st.integers(1, 32))]
        elif edit == "repeat":
            chunk = data[at : at + draw(st.integers(1, 64))]
            data[at:at] = chunk * draw(st.integers(1, 50))
        else:  # numbers that are large, signed, or not ASCII digits
            data[at:at] = draw(st.sampled_from(
                [b"9" * 25, b"-1", b"\xc2\xb2", b"18446744073709551616", b"0x", b"1e9", b" "]
            ))  # fmt: skip
    return bytes(data)


def inputs(name: str) -> st.SearchStrategy[bytes]:
    seeds = TARGETS[name][1]()
    return st.one_of(
        st.binary(max_size=512),
        st.sampled_from(seeds),
        st.sampled_from(seeds).flatmap(mutated),
    )


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_a_reader_gives_a_clean_error_or_a_consistent_result(name: str) -> None:
    target = TARGETS[name][0]

    @settings(
        max_examples=EXAMPLES,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(inputs(name))
    def check(data: bytes) -> None:
        target(data)

    check()


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_the_seeds_are_accepted(name: str) -> None:
    """The fuzzers start from valid inputs, and the targets check them."""
    target, seeds = TARGETS[name]
    for seed in seeds():
        target(seed)
