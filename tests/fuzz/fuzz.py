"""``make fuzz``: every reader of untrusted input under atheris, and the
results written to docs/fuzzing.md.

Each target (tests/unit/fuzz_targets.py) runs in its own libFuzzer process
for RUNS inputs (default 250,000, so 1.25 M in all), from its seeds and the
corpus kept in build/fuzz/corpus/TARGET from earlier runs, with a time limit
per input and a memory limit for the process. Any finding (an exception the
target lets through, a time-out, too much memory) is saved under
build/fuzz/findings/ and makes the run fail.

    make fuzz                 # every target, RUNS inputs each
    make fuzz RUNS=20000      # a short run
    make fuzz TARGETS=json    # some targets (comma-separated)

One more target, ``walker-native``, is the kmemtrace walker's C code built
natively with libFuzzer, AddressSanitizer and UndefinedBehaviorSanitizer
(tests/fuzz/native.py); it runs NATIVE_RUNS inputs (default 1,000,000).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build" / "fuzz"
DOC = ROOT / "docs" / "fuzzing.md"
TIMEOUT_S = 10  # per input
RSS_LIMIT_MB = 2048  # for the whole fuzzing process
MAX_LEN = 65536  # bytes per input

sys.path.insert(0, str(ROOT / "tests" / "unit"))
sys.path.insert(0, str(ROOT / "tests" / "fuzz"))
import native  # noqa: E402
from fuzz_targets import TARGETS  # noqa: E402

NATIVE = "walker-native"

# What the harness found when it was first run, each fixed with a unit test
# that replays it; kept on the page by every later run.
FOUND = [
    "## Found so far",
    "",
    '- `json`: records of a CPU this machine lacks (`"cpu": 5` on a 2-CPU',
    "  machine) made `convert --to kmemtrace` fail with a KeyError: the writer",
    "  opened files for this machine's CPUs only. A converted record set now has",
    "  a file for each CPU its records name, and its `cpus` file lists them",
    "  (`5,70`). Test: `test_json_records_of_cpus_this_machine_lacks_convert_...`.",
    "- `webconfig`: a YAML mapping with keys of mixed types (`~: 1` beside",
    "  strings) failed with a TypeError while sorting the unknown keys. Keys",
    "  are now named as text. Test: `test_a_bad_web_config_is_one_clear_error`.",
    "- `cfi`: an ELF file whose `.eh_frame` header claims a size near 2^63 made",
    "  pyelftools raise OverflowError, which the CFI reader let through. It is",
    "  now read as damaged: no rows, and why. Test:",
    "  `test_a_section_larger_than_any_file_gives_no_rows_and_says_so`.",
]
DONE = re.compile(r"Done (\d+) runs in (\d+) second")
STATS = re.compile(r"cov: (\d+) ft: (\d+) corp: (\d+)/\S+ .*exec/s: (\d+) rss: (\d+)Mb")


@dataclass
class Result:
    target: str
    runs: int
    seconds: int
    coverage: int
    features: int
    corpus: int
    peak_rss_mb: int
    findings: list[str]
    exit_code: int


def run(target: str, runs: int) -> Result:
    corpus = BUILD / "corpus" / target
    findings = BUILD / "findings" / target
    corpus.mkdir(parents=True, exist_ok=True)
    findings.mkdir(parents=True, exist_ok=True)
    seeds = BUILD / "seeds" / target
    seeds.mkdir(parents=True, exist_ok=True)
    for n, seed in enumerate(native.seeds() if target == NATIVE else TARGETS[target][1]()):
        (seeds / f"seed-{n}").write_bytes(seed)
    before = set(findings.iterdir())
    if target == NATIVE:
        command = [str(native.build(BUILD / "native"))]
    else:
        command = [sys.executable, str(ROOT / "tests" / "fuzz" / "driver.py"), target]
    argv = [*command, f"-runs={runs}", f"-timeout={TIMEOUT_S}", f"-rss_limit_mb={RSS_LIMIT_MB}",
            f"-max_len={MAX_LEN}", f"-artifact_prefix={findings}/", "-print_final_stats=1",
            str(corpus), str(seeds)]  # fmt: skip
    print(f"fuzz: {target}: {runs} inputs", flush=True)
    log = BUILD / f"{target}.log"
    with open(log, "w") as out:
        done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False,
                              env=native.environment() if target == NATIVE else None)  # fmt: skip
    text = log.read_text(errors="replace")
    ran = DONE.search(text)
    stats = STATS.findall(text)
    last = stats[-1] if stats else ("0", "0", "0", "0", "0")
    peak = max((int(s[4]) for s in stats), default=0)
    new = sorted(str(p.relative_to(ROOT)) for p in set(findings.iterdir()) - before)
    return Result(
        target, int(ran[1]) if ran else 0, int(ran[2]) if ran else 0, int(last[0]), int(last[1]),
        int(last[2]), peak, new, done.returncode,
    )  # fmt: skip


INTRO = [
    "# Fuzzing the readers of untrusted input",
    "",
    "Written by `make fuzz` (tests/fuzz/fuzz.py); the targets are in",
    "`tests/unit/fuzz_targets.py`, and CI runs the same targets under hypothesis",
    "(`tests/unit/test_fuzz_readers.py`, 150 examples each).",
    "",
    f"`{NATIVE}` is the C code every record set goes through (the kmemtrace",
    "walker, `exporters/kmemtrace/walker.c`), built by clang with libFuzzer,",
    "AddressSanitizer and UndefinedBehaviorSanitizer (`tests/fuzz/walker_fuzz.c`):",
    "any out-of-bounds access, use after free, leak or undefined behaviour is a",
    "finding, and so is a pass finding more records than its bytes can hold.",
    "`tests/unit/test_native_fuzz.py` runs a short campaign of it in `make test`.",
    "",
    "Each target takes bytes and must either refuse them with mtrace-live's own",
    "error (the one line and exit code a user sees) or give a result that passes",
    "its checks: a report or a record set reads back as it was written, totals",
    "are consistent, an accepted address formats back to itself. Anything else",
    "is a finding: an exception let through, an input that takes more than",
    f"{TIMEOUT_S} s, or a process above {RSS_LIMIT_MB} MiB of memory (libFuzzer's",
    f"`-timeout` and `-rss_limit_mb`). Inputs are at most {MAX_LEN} bytes.",
    "",
]


def write_doc(results: list[Result], runs: int) -> None:
    total = sum(r.runs for r in results)
    lines = [
        *INTRO,
        "| target | what it reads | inputs | seconds | inputs/s | coverage (edges) | features "
        "| corpus | peak RSS (MiB) | findings |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]  # fmt: skip
    what = {
        "sprtrace": "sp-rtrace text: read, leaks and compress filters, written and read back",
        "json": "JSON lines into a record set, read back field by field",
        "recordset": "a kmemtrace record set with every header file: report, JSON, sp-rtrace",
        "webconfig": "a `--web.config.file`",
        "listen": "a `--web.listen-address`",
        "cfi": "an ELF file's call-frame information into unwind rows",
        NATIVE: "the kmemtrace walker's C code (walker.c), native, under AddressSanitizer and "
        "UndefinedBehaviorSanitizer: scan, report_records and report_pass (small chunks)",
    }
    for r in results:
        rate = r.runs // r.seconds if r.seconds else r.runs
        found = ", ".join(f"`{f}`" for f in r.findings) or "none"
        if r.exit_code and not r.findings:
            found = f"libFuzzer exited {r.exit_code}"
        lines.append(
            f"| {r.target} | {what.get(r.target, '')} | {r.runs:,} | {r.seconds} | {rate:,} | "
            f"{r.coverage} | {r.features} | {r.corpus} | {r.peak_rss_mb} | {found} |"
        )
    lines += [
        "",
        f"In all: {total:,} inputs ({runs:,} asked of each target under atheris, "
        f"{max((r.runs for r in results if r.target == NATIVE), default=0):,} natively), "
        f"{sum(len(r.findings) for r in results)} findings.",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}, "
        f"Python {platform.python_version()}; run on {time.strftime('%Y-%m-%d')}.",
        "",
        "The corpus each target built is kept in `build/fuzz/corpus/`, so a later",
        "run starts where this one ended; findings go to `build/fuzz/findings/`.",
        "",
        *FOUND,
    ]
    DOC.write_text("\n".join(lines) + "\n")


def kept(results: list[Result], known: list[str]) -> list[Result]:
    """These results, and each other target's last (build/fuzz/results/), so
    that a run of some targets leaves the others' rows on the page."""
    saved = BUILD / "results"
    saved.mkdir(parents=True, exist_ok=True)
    for r in results:
        (saved / f"{r.target}.json").write_text(json.dumps(dataclasses.asdict(r)))
    ran = {r.target: r for r in results}
    for target in known:
        path = saved / f"{target}.json"
        if target not in ran and path.exists():
            ran[target] = Result(**json.loads(path.read_text()))
    return [ran[t] for t in known if t in ran]


def main() -> int:
    runs = int(os.environ.get("RUNS") or 250_000)
    native_runs = int(os.environ.get("NATIVE_RUNS") or 1_000_000)
    known = [*TARGETS, NATIVE]
    wanted = [t for t in (os.environ.get("TARGETS") or "").split(",") if t] or known
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        print(f"fuzz: error: no target {', '.join(unknown)} (of {', '.join(known)})")
        return 2
    try:
        results = [run(t, native_runs if t == NATIVE else runs) for t in wanted]
    except native.NoCompiler as exc:
        print(f"fuzz: error: {exc}")
        return 2
    for r in results:
        print(f"fuzz: {r.target}: {r.runs} inputs in {r.seconds} s, coverage {r.coverage}, "
              f"findings: {', '.join(r.findings) or 'none'}")  # fmt: skip
    write_doc(kept(results, known), runs)
    print(f"fuzz: results in {DOC.relative_to(ROOT)}")
    asked = {r.target: native_runs if r.target == NATIVE else runs for r in results}
    failed = [r for r in results if r.findings or r.exit_code or r.runs < asked[r.target]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
