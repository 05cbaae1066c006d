"""Where `make sdt-glibc` left the SDT-enabled glibc build.

scripts/sdt-glibc.sh writes the build under a cache directory and records its
location in ``current``; this module reads the same place. The default
directory and the MTRACE_SDT_GLIBC_DIR override match that script.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from mtrace_live.probes.errors import TargetError
from mtrace_live.tracer.processes.target import default_libc

DEFAULT_CACHE = Path("/var/cache/mtrace-live/sdt-glibc")


def cache_dir() -> Path:
    return Path(os.environ.get("MTRACE_SDT_GLIBC_DIR", str(DEFAULT_CACHE)))


@dataclass(frozen=True)
class SdtGlibc:
    """A libc with probes and the command prefix that runs programs under it."""

    libc: Path
    runner: tuple[str, ...]

    def wrap(self, argv: list[str]) -> list[str]:
        return [*self.runner, *argv]


def locate() -> SdtGlibc:
    current = cache_dir() / "current"
    try:
        build = Path(current.read_text(encoding="utf-8").strip())
    except FileNotFoundError:
        raise TargetError(
            f"no SDT-enabled glibc under {cache_dir()}; build it with: make sdt-glibc"
        ) from None
    if build == Path("/"):  # the system libc already carries probes
        return SdtGlibc(libc=default_libc(), runner=())
    libc = build / "libc.so.6"
    testrun = build / "testrun.sh"
    if not libc.is_file() or not testrun.is_file():
        raise TargetError(f"the SDT glibc build in {build} is incomplete; run: make sdt-glibc")
    return SdtGlibc(libc=libc, runner=(str(testrun),))
