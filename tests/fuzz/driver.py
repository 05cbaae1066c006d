"""One fuzz target under atheris (libFuzzer): ``driver.py TARGET [libFuzzer flags]``.

mtrace-live's modules are instrumented for coverage; the target is called
with each input, and any exception it lets through, a time-out or too much
memory (libFuzzer's -timeout and -rss_limit_mb) is a finding. tests/fuzz/fuzz.py
runs every target and writes docs/fuzzing.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

with atheris.instrument_imports(include=["mtrace_live", "fuzz_targets"]):
    from fuzz_targets import TARGETS


def main() -> None:
    name = sys.argv.pop(1)
    target = TARGETS[name][0]
    atheris.Setup(sys.argv, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
