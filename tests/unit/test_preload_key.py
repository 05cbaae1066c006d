"""The key a start's program is guessed by, read from its command line as
typed (tracer/bpf/preload.py's command_line_options, used by tracer/entry.py
before click parses anything)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from mtrace_live.probes.elf import facts
from mtrace_live.tracer.bpf import preload
from mtrace_live.tracer.bpf.bpf_cache import Given
from mtrace_live.tracer.bpf.preload import command_line_options


@pytest.fixture
def sleepers() -> Iterator[tuple[int, int, int]]:
    """Two processes running /bin/sleep and one running this Python."""
    python = [sys.executable, "-c", "import time; time.sleep(600)"]
    started = [subprocess.Popen(argv) for argv in (["sleep", "600"], ["sleep", "600"], python)]
    try:
        yield started[0].pid, started[1].pid, started[2].pid
    finally:
        for process in started:
            process.kill()
            process.wait()


@pytest.mark.parametrize("spelled", [
    lambda pid: ["--pid", pid], lambda pid: ["-p", pid], lambda pid: [f"--pid={pid}"],
    lambda pid: [f"-p{pid}"],
])  # fmt: skip
def test_a_pid_is_keyed_by_the_program_it_runs(
    sleepers: tuple[int, int, int], spelled: Callable[[str], list[str]]
) -> None:
    # GIVEN two processes of one program, and one of another
    first, second, other = sleepers
    # WHEN each is traced with the same options
    keys = [command_line_options([*spelled(str(pid)), "-o", "json"])
            for pid in (first, second, other)]  # fmt: skip
    # THEN the two sleeps share a key, and the other program has its own
    assert keys[0] is not None and keys[0] == keys[1]
    assert keys[2] is not None and keys[2] != keys[0]


def test_options_and_subcommands_make_keys_of_their_own(sleepers: tuple[int, int, int]) -> None:
    pid = str(sleepers[0])
    keys = {command_line_options(argv) for argv in (
        ["--pid", pid], ["--pid", pid, "--contention"], ["--all"], ["run", "--", "true"],
        ["record", "--", "true"], ["serve", "--pid", pid])}  # fmt: skip
    assert None not in keys
    assert len(keys) == 6


def test_options_typed_in_any_order_share_a_key(sleepers: tuple[int, int, int]) -> None:
    # GIVEN one trace's options typed in three orders (make setup's first)
    pid = str(sleepers[0])
    orders = [["--pid", pid, "--contention", "-o", "live"],
              ["--pid", pid, "-o", "live", "--contention"],
              ["-o", "live", "--contention", "--pid", pid]]  # fmt: skip
    # THEN one key
    keys = {command_line_options(argv) for argv in orders}
    assert len(keys) == 1 and None not in keys
    # AND another value, another option or another subcommand is another key
    others = {command_line_options(argv) for argv in (
        ["--pid", pid, "--contention", "-o", "text"], ["--pid", pid, "-o", "live"],
        ["serve", "--pid", pid, "--contention", "-o", "live"])}  # fmt: skip
    assert len(others) == 3 and not others & keys


def test_a_command_is_keyed_by_its_program_name_not_its_arguments() -> None:
    # GIVEN one command run with other arguments, and by another path
    same = [command_line_options(["run", "-o", "summary", "--", *command]) for command in (
        ["true"], ["/bin/true", "--flag"], ["/usr/bin/true", "a", "b"])]  # fmt: skip
    # THEN one key: what the program is, not what it was given
    assert same[0] is not None and len(set(same)) == 1
    assert command_line_options(["run", "-o", "summary", "--", "python3"]) != same[0]


@pytest.mark.parametrize("argv", [
    [], ["--help"], ["-h"], ["--version"], ["-V"], ["run", "--help", "--", "true"],
    ["report", "trace.json"], ["convert", "in.jsonl"], ["probes"], ["doctor"],
])  # fmt: skip
def test_a_line_that_starts_no_trace_begins_nothing(argv: list[str]) -> None:
    assert command_line_options(argv) is None


def test_a_dead_pid_still_has_a_key() -> None:
    # GIVEN a pid no process has (the trace then fails with its own error)
    dead = subprocess.Popen(["true"])
    dead.wait()
    # THEN a key, of an unknown program: nothing kept under it to guess from
    key = command_line_options(["--pid", str(dead.pid)])
    assert key is not None
    assert key == command_line_options(["--pid", "not-a-number"])


def test_a_duration_does_not_change_the_key(sleepers: tuple[int, int, int]) -> None:
    # GIVEN make setup's start (ended by --duration) and a user's own
    pid = str(sleepers[0])
    setup = command_line_options(["--pid", pid, "-o", "live", "--duration", "0.1"])
    also = command_line_options(["--pid", pid, "--duration=3", "-o", "live"])
    users = command_line_options(["--pid", pid, "-o", "live"])
    # THEN one key: the user's first trace finds what setup's loaded
    assert users is not None and setup == users == also


@pytest.fixture
def root_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The caches in directories of the test's own, and a start as root
    that has begun nothing yet."""
    monkeypatch.setenv("MTRACE_LIVE_PLAN_CACHE", str(tmp_path / "plans"))
    monkeypatch.setenv("MTRACE_LIVE_BPF_CACHE", str(tmp_path / "bpf"))
    monkeypatch.setattr(preload.os, "geteuid", lambda: 0)
    for name, fresh in (("_begun_options", []), ("_taken_options", []), ("_PENDING", None),
                        ("_later", frozenset()), ("_times", {})):  # fmt: skip
        monkeypatch.setattr(preload, name, fresh)


@pytest.mark.usefixtures("root_start")
def test_a_start_keeps_its_program_under_each_key_it_began_under() -> None:
    # GIVEN the caches in directories of the test's own, a start as root, and
    # a program kept under the parsed options' key only
    store = facts.fact_store()
    store.put("start:parsed", "program", "abc123")
    store.put("start:parsed", "given", Given({7: 1}).kept())
    # WHEN it begins under its command line's key (nothing kept there), then
    # under its parsed options' (a guess: made on a thread), and loads a program
    preload.begin("argv:line")
    assert not preload.begun()
    preload.begin("parsed")
    assert preload.begun()
    assert preload.take("def456", Given({7: 0}, {"events": 4096})) is None  # (none stored)
    # THEN both keys name the program it loaded, its run-time values and its
    # maps' sizes, for the next start either way
    assert store.get("start:argv:line", "program") == "def456"
    assert store.get("start:parsed", "program") == "def456"
    for key in ("start:argv:line", "start:parsed"):
        assert Given.from_kept(store.get(key, "given")) == Given({7: 0}, {"events": 4096})
    # and the handlers it never asked for, and its handlers' load times, are
    # kept under both too
    preload.keep_handlers(["alloc_free", "unwind_python", "alloc_malloc"], {"alloc_malloc"},
                          {"alloc_malloc": 0.5, "alloc_free": 1.25})  # fmt: skip
    for key in ("start:argv:line", "start:parsed"):
        assert store.get(key, "unused") == ["alloc_free", "unwind_python"]
        assert store.get(key, "load_ms") == {"alloc_free": 1.2, "alloc_malloc": 0.5}
    # and a later program of the same process is not this start's
    preload.take("other", Given({}))
    assert store.get("start:argv:line", "program") == "def456"


@pytest.mark.usefixtures("root_start")
def test_a_start_that_loads_the_program_kept_for_its_key_leaves_nothing_to_save() -> None:
    # GIVEN a program kept under a start's key, and saved
    store = facts.fact_store()
    store.put("start:same", "program", "abc123")
    store.put("start:same", "given", Given({1: 0, 2: 5}).kept())
    store.save()
    assert not store.dirty
    # WHEN a start under that key loads that same program
    preload.begin("same")
    preload.take("abc123", Given({2: 5, 1: 0}))
    # THEN the facts have nothing new to write at its end
    assert not store.dirty
    # AND a start that loads the same program with other run-time values keeps them
    preload.begin("same")
    preload.take("abc123", Given({1: 1, 2: 5}))
    assert store.dirty and Given.from_kept(store.get("start:same", "given")) == Given({1: 1, 2: 5})
    # AND a start that loads another program keeps it
    preload.begin("same")
    preload.take("fed987", Given({1: 1, 2: 5}))
    assert store.get("start:same", "program") == "fed987"


@pytest.mark.usefixtures("root_start")
def test_the_next_start_defers_what_the_last_never_asked_for_and_loads_the_longest_first(
) -> None:  # fmt: skip
    # GIVEN a start that loaded a program and asked for two of its four
    # handlers, one of them long to load
    store = facts.fact_store()
    preload.begin("options")
    preload.take("abc123", Given({1: 0}))
    handlers = ["unwind_step", "alloc_return", "alloc_xallocx", "site_12"]
    preload.keep_handlers(handlers, {"unwind_step", "alloc_return"},
                          {"unwind_step": 48.0, "alloc_return": 21.0})  # fmt: skip
    store.save()
    # WHEN the next start with the same options begins (the document read anew)
    facts._STORE = None
    store = facts.fact_store()
    preload.begin("options")
    try:
        # THEN it defers the two never asked for, and knows which loads longest
        assert preload.later() == {"alloc_xallocx", "site_12"}
        assert preload.load_times() == {"unwind_step": 48.0, "alloc_return": 21.0}
    finally:
        preload.take("abc123", Given({1: 0}))  # (what was begun: closed)
    # AND times that moved without changing which loads longest are not written again
    preload.keep_handlers(handlers, {"unwind_step", "alloc_return"},
                          {"unwind_step": 51.0, "alloc_return": 19.5})  # fmt: skip
    assert not store.dirty
    # while an order that changed is
    preload.keep_handlers(handlers, {"unwind_step", "alloc_return"},
                          {"unwind_step": 20.0, "alloc_return": 30.0})  # fmt: skip
    assert store.dirty
    assert store.get("start:options", "load_ms") == {"unwind_step": 20.0, "alloc_return": 30.0}
    # AND of many handlers' times, those of the three longest alone are kept
    preload.keep_handlers(handlers, set(handlers), {"unwind_step": 50.0, "alloc_return": 16.0,
                                                    "alloc_xallocx": 0.4, "site_12": 0.3,
                                                    "lock_wait_enter": 7.5})  # fmt: skip
    assert store.get("start:options", "load_ms") == {"unwind_step": 50.0, "alloc_return": 16.0,
                                                     "lock_wait_enter": 7.5}  # fmt: skip
