"""Section 7: how often everyday programs hit each libc probe, which chose
the default probe set (memory_* and lll_lock_wait_private)."""

from __future__ import annotations

import json
import tempfile
import time

from common import MTRACE, check, say

WORKLOADS = {
    "python3, JSON encoding": [
        "/usr/bin/python3", "-c",
        "import json\nfor i in range(300000): json.dumps({str(i): [i] * 10})",
    ],
    "python3, 8 threads": [
        "/usr/bin/python3", "-c",
        "import threading, json\n"
        "def work():\n    for i in range(50000): json.dumps([i] * 50)\n"
        "ts = [threading.Thread(target=work) for _ in range(8)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]",
    ],
    "sort -n, 300,000 lines": ["/usr/bin/sort", "-n", "NUMS", "-o", "/dev/null"],
}  # fmt: skip


def run() -> dict[str, dict[str, float]]:
    say("7. probe hit rates ...")
    rates: dict[str, dict[str, float]] = {}
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as nums:
        nums.write("\n".join(str((i * 7919) % 300_000) for i in range(300_000)) + "\n")
        nums.flush()
        for title, argv in WORKLOADS.items():
            argv = [nums.name if a == "NUMS" else a for a in argv]
            start = time.monotonic()
            out = check([*MTRACE, "count", "--sdt-glibc", "--probes", "*", "--json", "--", *argv])
            seconds = time.monotonic() - start
            counts = json.loads(out[out.index("{") :])["usdt"]
            rates[title] = {name: n / seconds for name, n in counts.items() if n}
    return rates


def render(rates: dict[str, dict[str, float]]) -> tuple[list[str], dict[str, bool | None]]:
    lines = [
        "## 7. Probe hit rates of everyday programs",
        "",
        "Hits per second (start-up included), every libc probe counted (`count --probes '*'`), "
        "each program run under the SDT glibc; the eight most frequent:",
        "",
    ]
    for title, by_probe in rates.items():
        top = sorted(by_probe.items(), key=lambda kv: -kv[1])
        lines.append(f"- {title}: " + ", ".join(f"{n} {r:,.0f}/s" for n, r in top[:8]))
    lines += [
        "",
        "The pthread mutex probes and setjmp fire on every call; the memory_* probes and "
        "lll_lock_wait_private (a contended private lock, as arena locks are) fire rarely. So "
        "the default is `memory_*` and `lll_lock_wait_private`; `--probes '*'` adds the rest.",
        "",
    ]
    return lines, {}
