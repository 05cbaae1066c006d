"""Running the mtrace-live command line from tests."""

import os
import subprocess
import sys

MTRACE = [sys.executable, "-m", "mtrace_live.tracer.cli"]

# Everything mtrace-live reads from the checkout is loaded while still root;
# only then does the process become "nobody". The tests thus do not depend on
# that user being able to read wherever the checkout lives.
_AS_NOBODY = """
import os, sys
import mtrace_live.tracer.cli as cli
import mtrace_live.tracer.loop.hit_counts, mtrace_live.tracer.loop.checks
import mtrace_live.probes.listing, mtrace_live.tracer.processes.target
import mtrace_live.exporters.probe_list
import mtrace_live.tracer.loop.live, mtrace_live.exporters.live_view
import mtrace_live.exporters.lines, mtrace_live.exporters.summary
import mtrace_live.probes.catalog as catalog
catalog.load_catalog()
for name in cli.COMMANDS:
    cli.cli.get_command(None, name)
os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
sys.argv = ["mtrace-live", *sys.argv[1:]]
cli.main()
"""


def mtrace(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MTRACE, *args], capture_output=True, text=True, timeout=120)


def mtrace_unprivileged(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """mtrace-live as an ordinary user: as 'nobody' when the tests run as root."""
    if os.geteuid() != 0:
        return subprocess.run(
            [*MTRACE, *args], capture_output=True, text=True, timeout=120, env=env
        )
    return subprocess.run(
        [sys.executable, "-c", _AS_NOBODY, *args],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def assert_one_line(done: subprocess.CompletedProcess[str], code: int, words: str) -> None:
    """One clear error line, the expected exit code, never a traceback."""
    assert done.returncode == code, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert words in done.stderr
