"""The program a start is about to load, made while the start plans.

A warm start's kernel work is mostly making the program's maps and the
verifier's passes over its uprobe programs (docs/performance.md, section
12), and the start can only ask for them once it has planned: its
imports, its probes, its program's text and so its cache key. But a start
with the same options as an earlier one almost always loads the same
program. So each start's options (and its target's program) are kept with
the key of the program it loaded (the facts' document, probes/elf/facts.py),
and the next start with those options begins at once, on a thread of its
own, to make that program's maps, load its uprobe programs (from two
threads, uprobe_multi.UprobeLinks.prefetch) and its tracepoints' handlers,
while it imports and plans.
When the start's own key is that one, it takes what was made
(``take``); otherwise it is closed and the start makes its own (a wasted
guess costs only the other CPU's time). Nothing is attached here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mtrace_live.probes.elf import facts
from mtrace_live.tracer.bpf import bpf_cache, uprobe_multi

# the facts' entry of a start's options: {"program": key, "given": {"values": [[mark,
# value], ...], "sizes": {map: entries}}, "unused": [handler, ...], "load_ms": {handler:
# ms}} (given: its run-time values, probes/bpf/runtime.h, and maps' sizes: bpf_cache.Given;
# unused: the uprobe handlers that start never asked for, loaded by the next only when
# first asked for; load_ms: how long its LONGEST slowest handlers took to load, loaded
# first by the next)
_START = "start"


@dataclass
class Made:
    """A program's maps made and its uprobe programs loading."""

    key: str
    given: bpf_cache.Given  # its run-time values and maps' sizes
    compiled: bpf_cache.Compiled  # (given them)
    map_fds: dict[int, int]  # the stored map's fd (in its code) -> the map made
    links: uprobe_multi.UprobeLinks | None
    # the tracepoints' handlers loaded (bcc_revive.loaded_here), by name
    programs: dict[str, int] = field(default_factory=dict)

    def close(self) -> None:
        if self.links is not None:
            self.links.close_programs()
        for fd in [*self.map_fds.values(), *self.programs.values()]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.map_fds, self.programs = {}, {}


class _Preload:
    def __init__(self, key: str, given: bpf_cache.Given, later: frozenset[str],
                 times: dict[str, float]) -> None:  # fmt: skip
        self.key, self.given, self.later, self.times = key, given, later, times
        self.made: Made | None = None
        self._thread = threading.Thread(target=self._make, name="mtrace-preload", daemon=True)
        self._thread.start()

    def _make(self) -> None:
        from mtrace_live.tracer.bpf import bcc_revive  # (its import: on this thread)

        with contextlib.suppress(Exception):  # (any doubt: the start makes its own)
            compiled = bpf_cache.load(self.key)
            if compiled is None:
                return
            compiled = bpf_cache.specialize(compiled, self.given)
            made = Made(self.key, self.given, compiled, {}, None)
            try:
                made.map_fds.update(bpf_cache.recreate_maps(compiled.maps))
                if uprobe_multi.why_not() is None:
                    uprobes = bcc_revive.uprobe_code(compiled.functions)
                    code = {text: bpf_cache.relocate(code, made.map_fds)
                            for text, code in uprobes.items()}  # fmt: skip
                    made.links = uprobe_multi.UprobeLinks(code, compiled.license,
                                                          compiled.kern_version)  # fmt: skip
                    made.links.prefetch(self.later, self.times)
                self._load_tracepoint_handlers(made)
            except BaseException:
                made.close()
                raise
            self.made = made

    @staticmethod
    def _load_tracepoint_handlers(made: Made) -> None:
        """The tracepoints' handlers, loaded on this thread while the
        uprobe programs load on theirs (the start's main thread loaded them
        itself). One the verifier refuses is left to the start, which says
        why."""
        from mtrace_live.tracer.bpf import bcc_revive

        for text in made.compiled.functions:
            if bcc_revive.loaded_here(text):
                with contextlib.suppress(OSError):
                    made.programs[text] = bcc_revive.load_handler(made.compiled, text,
                                                                  made.map_fds)  # fmt: skip

    def result(self) -> Made | None:
        self._thread.join()
        return self.made


_PENDING: _Preload | None = None


def options_key(options: dict[str, Any], program: str | None) -> str:
    """What a start's program follows from, as known before it plans: its
    command's options, its target's program, the kernel."""
    document = json.dumps([options, program, os.uname().release], sort_keys=True, default=str)
    return hashlib.sha256(document.encode()).hexdigest()


# Subcommands that trace (with the group's own --pid and --all), and the
# options that say the command line is only asking for help or a version.
TRACING = ("run", "record", "serve")
_PID = ("--pid", "-p")
_ASKING = ("--help", "-h", "--version", "-V")
# An option that ends a trace without changing its program (make setup's
# starts end so: scripts/warm-caches.sh), left out of the key.
UNKEYED = "--duration"
# The handlers whose load times are kept: two threads load them, so the order
# of the first few (the verifier's longest) is what decides when the last ends.
LONGEST = 3


def command_line_options(argv: list[str]) -> str | None:
    """The key of a start's options read from its command line as typed,
    before anything parses it (tracer/entry.py): each --pid's value replaced
    by the program the process runs, and the command after ``--`` by its
    program's name; its --duration left out; its options in one order
    whatever order they were typed in (``_in_one_order``). None where the
    line starts no trace (nothing then begins). Two lines that mean the same
    but are spelled differently (``-o`` and ``--output``) have keys of their
    own: each is guessed from its own last start."""
    typed = argv.index("--") if "--" in argv else len(argv)
    head = argv[:typed]
    if any(token in _ASKING for token in head):
        return None
    tokens: list[str] = []
    tracing = False
    replace = False
    skip = False
    for token in head:
        if skip or token.startswith(UNKEYED + "="):
            skip = False
            continue
        if replace:
            tokens.append(_program_of(token))
            replace = False
            continue
        if token == UNKEYED:
            skip = True
            continue
        if token in _PID:
            replace = tracing = True
        elif token.startswith("--pid="):
            token, tracing = "--pid=" + _program_of(token[len("--pid=") :]), True
        elif token.startswith("-p") and token[2:].isdigit():
            token, tracing = "-p" + _program_of(token[2:]), True
        elif token == "--all" or token in TRACING:
            tracing = True
        tokens.append(token)
    if not tracing:
        return None
    tokens = _in_one_order(tokens)
    command = argv[typed + 1 :]
    if command:
        tokens += ["--", os.path.basename(command[0])]
    return "argv:" + options_key({"argv": tokens}, None)


def _in_one_order(tokens: list[str]) -> list[str]:
    """The words before the first option (a subcommand) first, then each
    option with the values after it, these groups sorted: make setup's
    ``--pid N --contention -o live`` is a user's ``--pid N -o live
    --contention``. (A guess only: preload.take checks what was made. Lines
    it takes for one may mean two things: the words of a command typed
    without ``--`` move with the option before them, and ``-o a -o b`` is
    ``-o b -o a``.)"""
    lead: list[str] = []
    groups: list[list[str]] = []
    for token in tokens:
        if token.startswith("-") and token != "-":
            groups.append([token])
        elif groups:
            groups[-1].append(token)
        else:
            lead.append(token)
    return [*lead, *(token for group in sorted(groups) for token in group)]


def begin_from_command_line(argv: list[str]) -> None:
    """Begin the program the last start with this command line loaded,
    where it starts a trace, as root (tracer/entry.py: before click is
    imported; else the trace's own start begins it after parsing,
    tracer/commands/trace.py)."""
    if os.geteuid() != 0:
        return
    with contextlib.suppress(Exception):  # (only ever a saving: the start makes its own)
        options = command_line_options(argv)
        if options is not None:
            begin(options)


def _program_of(pid: str) -> str:
    try:
        return os.readlink(f"/proc/{int(pid)}/exe")
    except (OSError, ValueError):
        return "?"


def begun() -> bool:
    """A guess is being made already (begin found a program kept)."""
    return _PENDING is not None


def begin(options: str) -> None:
    """Start making the program the last start with these options loaded,
    where one is kept (and the programs kept are used: uprobe links). A
    start may begin under two keys (its command line's, then its parsed
    options', where the first had nothing kept): what it loads is kept
    under both."""
    global _PENDING, _later, _times
    if bpf_cache.program_cache_dir() is None or os.geteuid() != 0:
        return
    _begun_options.append(options)
    if _PENDING is not None:
        return
    entry = f"{_START}:{options}"
    unused = facts.fact_store().get(entry, "unused")
    _later = frozenset(h for h in (unused if isinstance(unused, list) else [])
                       if isinstance(h, str))  # fmt: skip
    times = facts.fact_store().get(entry, "load_ms")
    _times = {h: float(ms) for h, ms in (times.items() if isinstance(times, dict) else [])
              if isinstance(h, str) and isinstance(ms, (int, float))}  # fmt: skip
    kept = facts.fact_store().get(entry, "program")
    given = bpf_cache.Given.from_kept(facts.fact_store().get(entry, "given"))
    if isinstance(kept, str) and kept.isalnum() and given is not None:
        _PENDING = _Preload(kept, given, _later, _times)


_begun_options: list[str] = []  # this start's keys: the program it loads is kept under each
_taken_options: list[str] = []  # (those keys, once take kept it: keep_handlers')
_later: frozenset[str] = frozenset()  # its handlers loaded at their first use
_times: dict[str, float] = {}  # its handlers' load times the last time, in ms


def later() -> frozenset[str]:
    """The uprobe handlers this start loads only when first asked for (the
    last start with its options never asked for them)."""
    return _later


def load_times() -> dict[str, float]:
    """How long each handler took to load at the last start with these
    options, in ms (the longest are loaded first)."""
    return _times


def keep_handlers(handlers: Iterable[str], asked: set[str], times: Mapping[str, float]) -> None:
    """Keep, for the next start with these options, which of its uprobe
    ``handlers`` this trace never asked for (``asked``: those it did) and
    the load times (``times``, in ms) of the LONGEST that took longest (the
    rest go by size: the facts' document is read at every start)."""
    unused = sorted(h for h in handlers if h not in asked)
    loaded = {h: round(times[h], 1) for h in _by_time(times)[:LONGEST]}
    for options in _taken_options:
        store = facts.fact_store()
        if store.get(f"{_START}:{options}", "unused") != unused:
            store.put(f"{_START}:{options}", "unused", unused)  # (saved at the trace's end)
        kept = store.get(f"{_START}:{options}", "load_ms")
        # (a time alone moving is not worth a write at every trace's end)
        if not isinstance(kept, dict) or _by_time(kept) != _by_time(loaded):
            store.put(f"{_START}:{options}", "load_ms", loaded)


def _by_time(times: Mapping[str, Any]) -> list[str]:
    """The handlers, the longest to load first."""
    return sorted(times, key=lambda h: (-float(times[h]), h))


def take(key: str, given: bpf_cache.Given) -> Made | None:
    """What was made for ``key`` and ``given``, now the start's own; None
    where nothing was (or something else was: closed). Both are kept for
    these options."""
    global _PENDING
    pending, _PENDING = _PENDING, None
    _taken_options[:] = dict.fromkeys(_begun_options)
    _begun_options.clear()  # (a later program of this process is not this start's)
    store = facts.fact_store()
    kept = given.kept()
    for options in _taken_options:
        if store.get(f"{_START}:{options}", "program") != key:  # (unchanged: nothing to save)
            store.put(f"{_START}:{options}", "program", key)
        if store.get(f"{_START}:{options}", "given") != kept:
            store.put(f"{_START}:{options}", "given", kept)
    if pending is None:
        return None
    made = pending.result()
    if made is not None and (made.key != key or made.given != given):
        made.close()
        return None
    return made
