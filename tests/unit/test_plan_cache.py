"""The derived probes' plan kept between runs (tracer/loop/plan_cache.py), on
this machine's libc, without root: what is kept is what deriving gives,
a plan is derived anew when what it comes from changes, and a file that
cannot be trusted or read is never used."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from mtrace_live.probes import derived
from mtrace_live.probes.elf import debug
from mtrace_live.tracer.loop import plan_cache
from mtrace_live.tracer.processes.target import default_libc


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    directory = tmp_path / "derived"
    monkeypatch.setenv(plan_cache.ENVIRONMENT, str(directory))
    return directory


def kept(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.json"))


def test_the_plan_kept_is_the_plan_derived(cache: Path) -> None:
    # GIVEN an empty cache: the first plan is derived and kept
    first = plan_cache.derived_plan(default_libc())
    assert len(kept(cache)) == 1
    # WHEN it is asked for again
    again = plan_cache.derived_plan(default_libc())
    # THEN it is read back whole, equal to deriving it now
    assert again == first == derived.plan(default_libc())
    assert len(kept(cache)) == 1
    # AND the file is JSON only this user may write
    (path,) = kept(cache)
    assert json.loads(path.read_text())["libc"] == str(default_libc())
    assert not path.stat().st_mode & 0o077 and not cache.stat().st_mode & 0o077


def test_a_plan_is_derived_anew_for_another_debug_file_choice(
    cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # GIVEN a plan kept with the debug file found by build-id
    searched = debug.DEBUG_ROOT
    with_debug = plan_cache.derived_plan(default_libc())
    # WHEN the debug file is refused (--debug-file none), or none is installed
    without = plan_cache.derived_plan(default_libc(), derived.NO_DEBUG_FILE)
    monkeypatch.setattr(debug, "DEBUG_ROOT", tmp_path / "no-debug")
    uninstalled = plan_cache.derived_plan(default_libc())
    # THEN each is its own plan, as deriving gives it
    assert without == derived.plan(default_libc(), derived.NO_DEBUG_FILE)
    assert uninstalled == derived.plan(default_libc())
    # AND the plan with the debug file is a third one, kept apart
    assert with_debug.debug_file is not None, (
        f"no debug file found for {default_libc()} by its build-id under {searched}: "
        "libc6-dbg is missing (scripts/setup.sh installs it)"
    )
    assert len(kept(cache)) == 3
    assert uninstalled.debug_file is None and with_debug != uninstalled


def test_a_kept_plan_that_another_user_could_write_or_that_does_not_parse_is_not_used(
    cache: Path,
) -> None:
    # GIVEN a kept plan, altered so that it names another libc
    truth = plan_cache.derived_plan(default_libc())
    (path,) = kept(cache)
    document = json.loads(path.read_text())
    document["libc"] = "/elsewhere/libc.so.6"
    path.write_text(json.dumps(document))
    assert plan_cache.derived_plan(default_libc()).libc == Path("/elsewhere/libc.so.6")
    # WHEN anyone may write it, THEN it is not used: the plan is derived
    os.chmod(path, 0o666)
    assert plan_cache.derived_plan(default_libc()) == truth
    # AND WHEN it does not parse, it is derived, and kept again
    path.write_text("{not json")
    os.chmod(path, 0o600)
    assert plan_cache.derived_plan(default_libc()) == truth
    assert json.loads(path.read_text())["libc"] == str(default_libc())


def test_off_keeps_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(plan_cache.ENVIRONMENT, "off")
    monkeypatch.chdir(tmp_path)
    assert plan_cache.derived_plan(default_libc()) == derived.plan(default_libc())
    assert list(tmp_path.iterdir()) == []
