"""A unit test's set-up, checked."""

from __future__ import annotations

import pytest


def needs(present: bool, what: str) -> None:
    """Fail (never skip) a test whose set-up is missing: ``make setup``
    installs all it needs on the README's machine, so an absence is a broken
    set-up to be said, not a test to pass over."""
    if not present:
        pytest.fail(f"{what}: the README's set-up (make setup) provides it", pytrace=False)
