"""Section 11: real servers, traced while they serve (issue: never break
the process you trace).

1. MariaDB (Debian's mariadb-server: glibc's malloc, libsystemd and
   libgcrypt linked) under its own load generator, ``mariadb-slap`` (16
   clients, ``QUERIES`` generated queries): the load's wall time, hence
   queries a second, untraced, under ``mtrace-live --pid`` in the default
   mode (every allocation, whole stacks by CFI), with ``--contention``, with
   ``--sample-bytes 524288``, and under bpftrace counting the same
   functions' entries and returns; in alternating order. Each traced run
   polls the server's state every 10 ms: it is never stopped.
2. The CFI tables, cold: every file the running server maps, read anew
   (``read_cfi``), with the largest file on the system (libLLVM-15) and
   the whole ELF corpus of /usr/lib/x86_64-linux-gnu, /usr/bin and
   /usr/sbin; and mtrace-live's own count of the time it spent writing the
   server's tables with an empty row cache (``MTRACE_LIVE_DEBUG``).
3. The guardian: the tracer of ``run`` killed with SIGKILL at a random
   point of the churn (which it holds again and again), ``KILLS`` times:
   the time from the kill to the last of the churn's processes seen
   stopped (polled every millisecond).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import alloc_bench
from common import BUILD, MTRACE, QUICK, REPS, Background, Sample, alternate, say, summarise

QUERIES = 4000 if QUICK else 20000
KILLS = 5 if QUICK else 20
LLVM = Path("/usr/lib/x86_64-linux-gnu/libLLVM-15.so.1")
CORPUS = ("/usr/lib/x86_64-linux-gnu", "/usr/bin", "/usr/sbin")


class MariaDB:
    """A server of its own, on a socket in ``tmp``."""

    def __init__(self, tmp: Path) -> None:
        data, self.sock = tmp / "mariadb-data", tmp / "mariadb.sock"
        subprocess.run(["mariadb-install-db", "--no-defaults", "--user=root", f"--datadir={data}",
                        "--auth-root-authentication-method=normal", "--skip-test-db"],
                       check=True, capture_output=True, timeout=600)  # fmt: skip
        self.process = subprocess.Popen(
            ["mariadbd", "--no-defaults", "--user=root", f"--datadir={data}",
             f"--socket={self.sock}", "--skip-networking", f"--log-error={tmp / 'mariadb.err'}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        ping = ["mariadb-admin", "--no-defaults", f"--socket={self.sock}", "-uroot", "ping"]
        while subprocess.run(ping, capture_output=True).returncode != 0:
            if self.process.poll() is not None:
                raise RuntimeError("mariadbd did not start")
            time.sleep(0.2)

    def load(self) -> float:
        """The load's wall time (s)."""
        argv = ["mariadb-slap", "--no-defaults", f"--socket={self.sock}", "-uroot",
                "--concurrency=16", "--iterations=1", f"--number-of-queries={QUERIES}",
                "--auto-generate-sql"]  # fmt: skip
        begun = time.monotonic()
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"mariadb-slap failed: {done.stderr[-300:]}")
        return time.monotonic() - begun

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=120)


class Stopped:
    """Counts the 10 ms polls that found process ``pid`` stopped (state T)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.count, self.done = pid, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(0.01):
            stat = Path(f"/proc/{self.pid}/stat").read_bytes()
            self.count += stat.rpartition(b") ")[2][:1] == b"T"

    def stop(self) -> int:
        self.done.set()
        self.thread.join()
        return self.count


def _throughput(server: MariaDB, tmp: Path) -> dict[str, object]:
    pid = server.process.pid

    def under(argv: list[str] | None, ready: str) -> Callable[[], Sample]:
        def one() -> Sample:
            tracer = Background(argv, ready, tmp / "server-tracer.log") if argv else None
            watch = Stopped(pid)
            try:
                seconds = server.load()
            finally:
                stopped = watch.stop()
                if tracer is not None:
                    tracer.stop()
            return Sample(seconds, {"queries_per_s": QUERIES / seconds, "stopped_polls": stopped})

        return one

    m = [*MTRACE, "-o", "summary", "--pid", str(pid)]
    configs = {
        "untraced": under(None, ""),
        "mtrace-live --pid (default: every allocation, whole stacks)": under(m, "Ctrl-C"),
        "mtrace-live --pid --contention": under([*m, "--contention"], "Ctrl-C"),
        "mtrace-live --pid --sample-bytes 524288": under(
            [*m, "--sample-bytes", "524288"], "Ctrl-C"
        ),
    }
    if shutil.which("bpftrace"):
        configs["bpftrace (the same functions' entries and returns)"] = under(
            alloc_bench.bpftrace_argv(pid), "ready"
        )
    server.load()  # warm: the first load creates the tables
    return summarise(alternate(configs, REPS))


def _read_times(paths: list[Path]) -> dict[str, object]:
    from mtrace_live.probes.elf.cfi import read_cfi

    times, rows, worst = [], 0, ("", 0.0)
    for path in paths:
        begun = time.monotonic()
        table = read_cfi(path)
        took = time.monotonic() - begun
        times.append(took)
        rows += len(table.rows)
        if took > worst[1]:
            worst = (str(path), took)
    return {"files": len(paths), "rows": rows, "total_s": sum(times), "slowest": worst[0],
            "slowest_s": worst[1]}  # fmt: skip


def _elf_files() -> list[Path]:
    found = []
    for directory in CORPUS:
        for root, _, names in os.walk(directory):
            for name in names:
                path = Path(root) / name
                try:
                    if (
                        not path.is_symlink()
                        and path.is_file()
                        and path.open("rb").read(4) == b"\x7fELF"
                    ):
                        found.append(path)
                except OSError:
                    continue
    return found


def _tables(server: MariaDB, tmp: Path) -> dict[str, object]:
    from mtrace_live.tracer.unwind.unwind_tables import exec_mappings, mapped_file

    pid = server.process.pid
    paths = sorted({p for m in exec_mappings(pid) if (p := mapped_file(pid, m)) is not None})
    out: dict[str, object] = {"server": _read_times(paths), "corpus": _read_times(_elf_files())}
    if LLVM.exists():
        out["llvm"] = _read_times([LLVM])
    cache = Path(tempfile.mkdtemp(dir=tmp))
    env = {**os.environ, "MTRACE_LIVE_CFI_CACHE": str(cache), "MTRACE_LIVE_DEBUG": "1"}
    done = subprocess.run([*MTRACE, "-o", "summary", "--pid", str(pid), "--duration", "1"],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    found = re.search(r"unwind tables: (\d+) files, (\d+) rows, written in ([\d.]+) s", done.stderr)
    if found:
        out["trace"] = {"files": int(found[1]), "rows": int(found[2]), "seconds": float(found[3])}
    return out


def _churn_pids() -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if stat.read_bytes().partition(b") ")[0].endswith(b"(churn"):
                found.append(int(stat.parent.name))
        except (OSError, ValueError):
            continue
    return found


def _stopped(pids: list[int]) -> bool:
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_bytes().rpartition(b") ")[2][:1] == b"T":
                return True
        except OSError:
            continue
    return False


def _killed(rng: random.Random, tmp: Path) -> float:
    """One run: the tracer killed at a random point; from the kill to the
    last churn process seen stopped (0 when none was)."""
    churn = [str(BUILD / "churn"), str(BUILD / "libcfi_plugin.so"), "30"]
    log = tmp / "killed.log"
    with open(log, "wb") as sink:
        argv = [*MTRACE, "run", "--follow-forks", "-o", "summary", "--", *churn]
        tracer = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                  stderr=sink)  # fmt: skip
    assert tracer.stdin is not None
    while "Ctrl-C" not in log.read_text(errors="replace"):
        if tracer.poll() is not None:
            raise RuntimeError(f"the tracer did not start: {log.read_text()[-300:]}")
        time.sleep(0.02)
    tracer.stdin.write(b"g")
    tracer.stdin.close()
    time.sleep(rng.uniform(0.05, 0.5))  # a random point of the churn
    killed = time.monotonic()
    tracer.kill()
    last = killed
    while tracer.poll() is None or _stopped(_churn_pids()):
        if _stopped(_churn_pids()):
            last = time.monotonic()
        if time.monotonic() - killed > 60:
            break
        time.sleep(0.001)
    for pid in _churn_pids():
        os.kill(pid, signal.SIGKILL)
    return last - killed


def _guardian(tmp: Path) -> dict[str, object]:
    rng = random.Random(46)
    delays = [_killed(rng, tmp) for _ in range(KILLS)]
    return {
        "kills": len(delays),
        "max_s": max(delays),
        "median_s": sorted(delays)[len(delays) // 2],
    }


def run(tmp: Path, peers: dict[str, str | None]) -> dict[str, object]:
    data: dict[str, object] = {}
    if shutil.which("mariadbd") and shutil.which("mariadb-slap"):
        server = MariaDB(tmp)
        try:
            say("servers: MariaDB under mariadb-slap")
            data["throughput"] = _throughput(server, tmp)
            say("servers: the CFI tables, cold")
            data["tables"] = _tables(server, tmp)
        finally:
            server.close()
    say("servers: the tracer killed while it holds the churn")
    data["guardian"] = _guardian(tmp)
    return data


def render(data: dict) -> tuple[list[str], dict[str, bool | None]]:
    lines = ["## 11. Real servers", ""]
    verdicts: dict[str, bool | None] = {}
    throughput = data.get("throughput")
    if throughput:
        base = throughput["untraced"]["queries_per_s"]
        lines += [f"MariaDB (Debian's mariadb-server) under `mariadb-slap`: 16 clients, "
                  f"{QUERIES:,} generated queries a run; medians of {REPS} runs each, in "
                  "alternating order. The server's state was polled every 10 ms in each run.", "",
                  "| run | queries/s | of untraced | polls that found it stopped |",
                  "|---|---:|---:|---:|"]  # fmt: skip
        for name, row in throughput.items():
            rate = row["queries_per_s"]
            lines.append(f"| {name} | {rate:,.0f} | {rate / base:.0%} | "
                         f"{row['stopped_polls']:.0f} |")  # fmt: skip
        lines.append("")
        verdicts["Servers: a traced server is never stopped"] = all(
            row["stopped_polls"] == 0 for row in throughput.values()
        )
    tables = data.get("tables")
    if tables:
        server, corpus = tables["server"], tables["corpus"]
        lines += ["The CFI tables read anew (`read_cfi`, probes/elf/cfi_rows.c):", "",
                  "| what | files | rows | total (s) | slowest file (s) |",
                  "|---|---:|---:|---:|---:|",
                  f"| every file the MariaDB server maps | {server['files']} | {server['rows']:,} "
                  f"| {server['total_s']:.3f} | {server['slowest_s']:.3f} |"]  # fmt: skip
        if "llvm" in tables:
            llvm = tables["llvm"]
            lines.append(f"| libLLVM-15.so.1, the largest | 1 | {llvm['rows']:,} | "
                         f"{llvm['total_s']:.3f} | {llvm['slowest_s']:.3f} |")  # fmt: skip
        lines.append(f"| every ELF file under {', '.join(CORPUS)} | {corpus['files']:,} | "
                     f"{corpus['rows']:,} | {corpus['total_s']:.2f} | {corpus['slowest_s']:.3f} "
                     f"({Path(corpus['slowest']).name}) |")  # fmt: skip
        trace = tables.get("trace")
        if trace:
            lines += ["", "A trace of the server with an empty row cache wrote its tables "
                      f"({trace['files']} files, {trace['rows']:,} rows) in "
                      f"{trace['seconds']:.3f} s."]  # fmt: skip
            verdicts["Servers: the tables of a large server in at most 1 s, cold"] = (
                trace["seconds"] <= 1.0
            )
        verdicts["Servers: any one file's tables in at most 2 s"] = corpus["slowest_s"] <= 2.0
        lines.append("")
    guardian = data.get("guardian")
    if guardian:
        lines += [f"The tracer of `run` killed with SIGKILL at a random point of the churn, "
                  f"{guardian['kills']} times: from the kill to the last of the churn's "
                  f"processes seen stopped, median {guardian['median_s'] * 1000:.0f} ms, at most "
                  f"{guardian['max_s'] * 1000:.0f} ms.", ""]  # fmt: skip
        verdicts["Servers: every held process continued within 1 s of the tracer's death"] = (
            guardian["max_s"] <= 1.0
        )
    return lines, verdicts
