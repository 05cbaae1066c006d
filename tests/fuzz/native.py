"""The kmemtrace walker's C code fuzzed natively (tests/fuzz/walker_fuzz.c):
built with clang's libFuzzer, AddressSanitizer and UndefinedBehaviorSanitizer,
seeded with a record set written by the tracer's own encoder.

``make fuzz`` runs it (tests/fuzz/fuzz.py, target ``walker-native``) and
tests/unit/test_native_fuzz.py runs a short campaign of it in ``make test``.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "fuzz" / "walker_fuzz.c"
WALKER = ROOT / "exporters" / "kmemtrace" / "walker.c"
IGNORE = ROOT / "tests" / "fuzz" / "walker_ignore.txt"
SUPPRESSIONS = ROOT / "tests" / "fuzz" / "lsan.supp"
SANITIZERS = "fuzzer,address,undefined"

sys.path.insert(0, str(ROOT / "tests" / "unit"))
from fuzz_targets import HEADER_FILES, SEPARATOR, record_set_seed  # noqa: E402


class NoCompiler(RuntimeError):
    """clang or its sanitizer runtimes are missing."""


def compiler() -> str:
    found = shutil.which("clang")
    if found is None:
        raise NoCompiler(
            "clang is missing: make setup installs it (packages clang, libclang-rt-dev)"
        )
    return found


def build_argv(out: Path) -> list[str]:
    """The command that builds the harness into ``out``."""
    include = sysconfig.get_paths()["include"]
    libdir = sysconfig.get_config_var("LIBDIR")
    version = sysconfig.get_config_var("LDVERSION")
    return [
        compiler(), "-g", "-O1", "-fno-omit-frame-pointer", f"-fsanitize={SANITIZERS}",
        "-fno-sanitize-recover=all", f"-fsanitize-coverage-ignorelist={IGNORE}",
        f"-I{include}", str(HARNESS), "-o", str(out), f"-L{libdir}", f"-lpython{version}",
    ]  # fmt: skip


def build(directory: Path) -> Path:
    """The harness, built into ``directory`` unless it is newer than its sources."""
    import subprocess

    directory.mkdir(parents=True, exist_ok=True)
    out = directory / "walker"
    newest = max(p.stat().st_mtime for p in (HARNESS, WALKER, IGNORE))
    if not out.exists() or out.stat().st_mtime < newest:
        done = subprocess.run(build_argv(out), capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise NoCompiler(f"building the native fuzzer failed: {done.stderr.strip()[-2000:]}")
    return out


def environment() -> dict[str, str]:
    """The harness's environment: leaks checked (lsan.supp suppresses none:
    the interpreter allocates through malloc); any error report aborts the input."""
    return {
        **os.environ,
        "LSAN_OPTIONS": f"suppressions={SUPPRESSIONS}:print_suppressions=0",
        "ASAN_OPTIONS": "abort_on_error=1:detect_leaks=1",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    }


def seeds() -> list[bytes]:
    """The cpuN files of the unit fuzz targets' record set, as one input
    (flags 0x02: little-endian, 32-byte chunks)."""
    data = record_set_seed()
    parts = data[1:].split(SEPARATOR)
    present = sum(1 for n in range(len(HEADER_FILES)) if data[0] & (1 << n))
    cpus = parts[present:]
    return [bytes([0x02]) + SEPARATOR.join(cpus), bytes([0x03]) + SEPARATOR.join(cpus[::-1])]
