"""The kmemtrace walker's C code under libFuzzer, AddressSanitizer and
UndefinedBehaviorSanitizer (tests/fuzz/walker_fuzz.c): a short campaign in
make test; ``make fuzz`` runs a million inputs (docs/fuzzing.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuzz"))
import native  # type: ignore[import-not-found]

from .fuzz_targets import JSON_SEED

RUNS = 3000
SHOWN = re.compile(r"walker records: scan (-?\d+), report_records (-?\d+), report_pass (-?\d+)")


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The harness built with the sanitizers (clang is part of make setup:
    its absence fails the test and says so)."""
    try:
        built: Path = native.build(tmp_path_factory.mktemp("native") / "build")
    except native.NoCompiler as exc:
        pytest.fail(str(exc))
    return built


def write_seeds(directory: Path) -> list[Path]:
    directory.mkdir()
    paths = [directory / f"seed-{n}" for n in range(len(native.seeds()))]
    for path, seed in zip(paths, native.seeds(), strict=True):
        path.write_bytes(seed)
    return paths


def test_the_seeds_reach_the_walker_s_records(harness: Path, tmp_path: Path) -> None:
    # GIVEN the seeds: the record set the tracer's encoder wrote from
    # JSON_SEED's events, read as written (little-endian) and as big-endian
    seeds = write_seeds(tmp_path / "seeds")
    written = len(JSON_SEED.splitlines())
    # WHEN the harness runs each once, saying each input's record counts
    done = subprocess.run([str(harness), *map(str, seeds)], capture_output=True, text=True,
                          env={**native.environment(), "WALKER_FUZZ_SHOW": "1"}, check=False,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    counts: dict[str, set[tuple[int, ...]]] = {}
    for run in done.stderr.split("Running: ")[1:]:
        name = Path(run.splitlines()[0].strip()).name
        counts[name] = {tuple(map(int, m)) for m in SHOWN.findall(run)}
    # THEN the seed as written gives every event it was written with, in each
    # of the walker's three passes; the other is refused by none of them
    assert counts["seed-0"] == {(written, written, written)}
    (big,) = counts["seed-1"]
    assert min(big) >= 0 and len(set(big)) == 1, big


def test_the_walker_runs_clean_under_sanitizers_from_its_seeds(
    harness: Path, tmp_path: Path
) -> None:
    # GIVEN the harness and its seeds
    seeds = write_seeds(tmp_path / "seeds")[0].parent
    # WHEN it runs from the seeds for a few thousand inputs
    argv = [str(harness), f"-runs={RUNS}", "-seed=1", f"-artifact_prefix={tmp_path}/",
            str(tmp_path / "corpus"), str(seeds)]  # fmt: skip
    (tmp_path / "corpus").mkdir()
    done = subprocess.run(argv, capture_output=True, text=True, env=native.environment(),
                          check=False, timeout=600)  # fmt: skip
    # THEN no sanitizer or check fired (a leak, or an error other than OSError
    # or MemoryError, aborts), every input ran, and the seeds reached the
    # walker's record handling (coverage beyond the argument checks)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"Done {RUNS} runs" in done.stderr
    assert not list(tmp_path.glob("crash-*")) and not list(tmp_path.glob("leak-*"))
    covered = [int(line.split("cov: ")[1].split()[0]) for line in done.stderr.splitlines()
               if "cov: " in line]  # fmt: skip
    assert covered and max(covered) > 250, covered[-3:]
