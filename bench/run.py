"""`make bench`: every benchmark side by side with the peers, in one run, and
docs/performance.md written from it.

    python bench/run.py                 # the full run: 5 repetitions each, < 20 min on 2 CPUs
    QUICK=1 python bench/run.py         # one repetition each, smaller workloads, no section 7
    python bench/run.py --only usdt,kmem
    python bench/run.py --rewrite       # docs/performance.md again from docs/bench.json

Run as root after `make sdt-glibc exercisers`. Sections: usdt (1), kmem (2
and 4), events (3), scrape (5), cost (6), rates (7: probe hit rates),
allocs (8: every malloc and free, against bpftrace, memleak and heaptrack),
stacks (8b: whole stacks, unwound by CFI), python (8c: Python frames in
allocation stacks, against native frames only and the floor),
contention (9: lock waits in time, and the tracer's observer effect),
profiles (10: serve's heap profiles: building them, /metrics beside them,
serve's default sampling), servers (11: a real server's throughput traced,
the CFI tables cold, the guardian after a killed tracer), startup (12: the
whole wait from the command to a trace attached, warm and cold). The
peers (bpftrace, bcc's trace, perf) are looked for first; a missing one is
named, its configurations left out, and the rest still runs.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import alloc_bench
import common
import contention_bench
import cost_bench
import event_bench
import kmem_bench
import profile_bench
import python_bench
import rates_bench
import scrape_bench
import servers_bench
import stacks_bench
import startup_bench
import usdt_bench
from common import PEERS, QUICK, REPO, REPS, machine, peer_versions, say

# Kept with the page it renders, so that a later `--only` run on a fresh
# machine merges its sections into the committed figures.
RESULTS = REPO / "docs" / "bench.json"
SECTIONS = (
    "usdt",
    "kmem",
    "events",
    "scrape",
    "cost",
    "rates",
    "allocs",
    "stacks",
    "python",
    "contention",
    "profiles",
    "servers",
    "startup",
)
# The page's sections in order, each from its part of the results.
PAGE: tuple[tuple[str, Callable[[Any], tuple[list[str], dict[str, bool | None]]]], ...] = (
    ("usdt", usdt_bench.render),
    ("kmem", kmem_bench.render_slowdown),
    ("events", event_bench.render),
    ("kmem", kmem_bench.render_report),
    ("scrape", scrape_bench.render),
    ("cost", cost_bench.render),
    ("rates", rates_bench.render),
    ("allocs", alloc_bench.render),
    ("stacks", stacks_bench.render),
    ("python", python_bench.render),
    ("contention", contention_bench.render),
    ("profiles", profile_bench.render),
    ("servers", servers_bench.render),
    ("startup", startup_bench.render),
)


def measure(only: set[str]) -> dict[str, object]:
    started = time.monotonic()
    peers = peer_versions()
    missing = [p for p in PEERS if peers[p.name] is None]
    for peer in missing:
        say(f"mtrace-live bench: {peer.command} not found: its configurations are left out "
            f"(Debian package {peer.package})")  # fmt: skip
    data: dict[str, object] = {"machine": machine(), "peers": peers, "quick": QUICK,
                               "reps": REPS}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="mtrace-bench-") as name:
        tmp = Path(name)
        runs: dict[str, Callable[[], object]] = {
            "usdt": lambda: usdt_bench.run(tmp, peers),
            "kmem": lambda: kmem_bench.run(tmp, peers),
            "events": event_bench.run,
            "scrape": lambda: scrape_bench.run(tmp),
            "cost": lambda: cost_bench.run(tmp, peers),
            "rates": rates_bench.run,
            "allocs": lambda: alloc_bench.run(tmp, peers),
            "stacks": lambda: stacks_bench.run(tmp, peers),
            "python": lambda: python_bench.run(tmp, peers),
            "contention": lambda: contention_bench.run(tmp, peers),
            "profiles": lambda: profile_bench.run(tmp),
            "servers": lambda: servers_bench.run(tmp, peers),
            "startup": lambda: startup_bench.run(tmp, peers),
        }
        durations = {}
        failed: dict[str, dict[str, str]] = {}
        for section, run in runs.items():
            if section in only:
                begun = time.monotonic()
                before = set(common.FAILED)
                data[section] = run()
                durations[section] = round(time.monotonic() - begun, 1)
                failed[section] = {name: why for name, why in common.FAILED.items()
                                   if name not in before}  # fmt: skip
                say(f"   ({section}: {durations[section]:.0f} s)")
    data["durations"] = durations
    data["failed"] = failed
    data["seconds"] = time.monotonic() - started
    return data


def mark(ok: bool | None) -> str:
    return "not measured" if ok is None else ("met" if ok else "**NOT met**")


def render(data: dict) -> str:
    m = data["machine"]
    peers = data["peers"]
    lines = [
        "# Performance",
        "",
        f"Written by `make bench{' QUICK=1' if data['quick'] else ''}` (`bench/run.py`) in "
        f"{data['seconds'] / 60:.1f} minutes. Every configuration ran {data['reps']} times, in "
        "alternating order (forward, then backward); the tables give medians."
        + (
            f" Measured again afterwards, alone (`--only`): {', '.join(data['rerun'])}."
            if data.get("rerun")
            else ""
        ),
        "",
        "## The machine",
        "",
        *_described(m),
        "- peers: "
        + "; ".join(f"{name} {version or 'NOT INSTALLED'}" for name, version in peers.items()),
        "",
    ]
    lines += [
        "The tables and the verdicts are this run's. Figures the text gives as measured by "
        "hand come from the change that each describes, measured when it was made, most on "
        "an Intel Xeon of 2 CPUs under KVM: they compare the two sides of that change, not "
        "this machine's figures.",
        "",
        *_noise(data),
    ]
    elsewhere = {section: where for section, where in (data.get("measured_on") or {}).items()
                 if where != m and section in data}  # fmt: skip
    for where in [dict(t) for t in {tuple(w.items()) for w in elsewhere.values()}]:
        named = ", ".join(sorted(s for s, w in elsewhere.items() if w == where))
        lines += [f"Sections measured on another machine ({named}); compare their figures "
                  "only with each other:", "", *_described(where), ""]  # fmt: skip
    targets: dict[str, bool | None] = {}
    sections = [render(data[key]) for key, render in PAGE if key in data]
    for _, found in sections:
        targets.update(found)
    failed = _failures(data.get("failed") or {})
    if failed:
        lines += ["Configurations that failed and were left out:", ""]
        lines += [f"- {name}: {why}" for name, why in failed.items()]
        lines.append("")
    lines += ["## Targets", "", "| target | |", "|---|---|"]
    lines += [f"| {name} | {mark(ok)} |" for name, ok in targets.items()]
    lines.append("")
    for section, _ in sections:
        lines += section
    return "\n".join(lines)


def _spreads(node: object) -> list[float]:
    """(max - min) / median of every configuration's repeated times in a
    part of the results."""
    if isinstance(node, dict):
        samples, median = node.get("samples"), node.get("median_s")
        if isinstance(samples, list) and len(samples) >= 3 and median:
            return [(max(samples) - min(samples)) / median]
        return [spread for value in node.values() for spread in _spreads(value)]
    return []


def _noise(data: dict) -> list[str]:
    spreads = sorted(_spreads({key: data[key] for key in SECTIONS if key in data}))
    if not spreads:
        return []
    typical = spreads[len(spreads) // 2]
    return [f"The runs of one configuration spread (slowest less fastest, over their median) "
            f"by {typical:.0%} for the typical configuration here, {spreads[-1]:.0%} at most "
            f"(docs/bench.json keeps every run's figure): differences of a few percent "
            "between rows are within that.", ""]  # fmt: skip


def _failures(failed: dict[str, Any]) -> dict[str, str]:
    """Configuration -> why it failed, from the failures kept by section (or,
    as runs before that kept them, by configuration alone)."""
    flat: dict[str, str] = {}
    for key, value in failed.items():
        flat.update(value if isinstance(value, dict) else {key: value})
    return flat


def _names(node: object) -> set[str]:
    """Every key in a part of the results (among them, its configurations)."""
    if isinstance(node, dict):
        return set(node).union(*(_names(value) for value in node.values()))
    return set()


def _described(m: dict[str, str]) -> list[str]:
    return [
        f"- CPU: {m['cpu']}; memory {m['memory']}; virtualisation: {m['virtualisation']}",
        f"- {m['kernel']}; {m['glibc']}",
        f"- {m['bcc']}; {m['python']}",
    ]


def merged(kept: dict[str, Any], data: dict[str, Any], only: set[str]) -> dict[str, Any]:
    """The results of an --only run over those kept: its sections, their
    machine and their failures replace the kept ones."""
    where = kept.get("measured_on") or {s: kept["machine"] for s in SECTIONS if s in kept}
    # Failures kept by section go with its figures; those kept by
    # configuration alone (runs before that) stay unless this run measured it.
    ran = _names({k: data[k] for k in only})
    failed = {
        k: v
        for k, v in (kept.get("failed") or {}).items()
        if k not in only and (isinstance(v, dict) or k not in ran)
    }
    return {
        **kept,
        **{k: v for k, v in data.items() if k in only},
        "failed": {**failed, **data["failed"]},
        "rerun": sorted(set(kept.get("rerun", [])) | only),
        "measured_on": {**where, **data["measured_on"]},
    }


def main(argv: list[str]) -> int:
    if argv == ["--rewrite"]:
        data = json.loads(RESULTS.read_text())
    else:
        only = set(SECTIONS) - ({"rates"} if QUICK else set())  # rates: 30 s of start-ups
        if argv[:1] == ["--only"] and len(argv) == 2:
            only = set(argv[1].split(","))
            unknown = only - set(SECTIONS)
            if unknown:
                say(f"mtrace-live bench: unknown section {sorted(unknown)[0]!r}; "
                    f"sections: {', '.join(SECTIONS)}")  # fmt: skip
                return 2
        elif argv:
            say(__doc__ or "")
            return 2
        data = measure(only)
        data["measured_on"] = {section: data["machine"] for section in only}
        if only != set(SECTIONS) and RESULTS.exists():
            # --only: the other sections' figures stay those of the last run
            data = merged(json.loads(RESULTS.read_text()), data, only)
        RESULTS.write_text(json.dumps(data, indent=1))
        say(f"wrote {RESULTS} ({data['seconds'] / 60:.1f} minutes)")
    out = REPO / "docs" / "performance.md"
    out.write_text(render(data))
    say(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
