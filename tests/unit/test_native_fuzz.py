"""The kmemtrace walker's C code under libFuzzer, AddressSanitizer and
UndefinedBehaviorSanitizer (tests/fuzz/walker_fuzz.c): a short campaign in
make test; ``make fuzz`` runs a million inputs (docs/fuzzing.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuzz"))
import native

RUNS = 3000


def test_the_walker_runs_clean_under_sanitizers_from_its_seeds(tmp_path: Path) -> None:
    # GIVEN the harness built with the sanitizers (clang is part of make setup:
    # its absence fails the test and says so)
    try:
        harness = native.build(tmp_path / "build")
    except native.NoCompiler as exc:
        pytest.fail(str(exc))
    seeds = tmp_path / "seeds"
    seeds.mkdir()
    for n, seed in enumerate(native.seeds()):
        (seeds / f"seed-{n}").write_bytes(seed)
    # WHEN it runs from the seeds for a few thousand inputs
    argv = [str(harness), f"-runs={RUNS}", "-seed=1", f"-artifact_prefix={tmp_path}/",
            str(tmp_path / "corpus"), str(seeds)]  # fmt: skip
    (tmp_path / "corpus").mkdir()
    done = subprocess.run(argv, capture_output=True, text=True, env=native.environment(),
                          check=False, timeout=600)  # fmt: skip
    # THEN no sanitizer or check fired, every input ran, and the seeds reached
    # the walker's record handling (coverage beyond the argument checks)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"Done {RUNS} runs" in done.stderr
    assert not list(tmp_path.glob("crash-*")) and not list(tmp_path.glob("leak-*"))
    covered = [int(line.split("cov: ")[1].split()[0]) for line in done.stderr.splitlines()
               if "cov: " in line]  # fmt: skip
    assert covered and max(covered) > 250, covered[-3:]
