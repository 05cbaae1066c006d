"""mtrace_live.probes.elf.lazy: a module imported at its first use."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from mtrace_live.probes.elf.lazy import lazy_module


@pytest.fixture
def counted_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A module of its own that appends a line to a file each time it runs."""
    runs = tmp_path / "runs"
    (tmp_path / "lazy_probe_module.py").write_text(
        f"with open({str(runs)!r}, 'a') as runs:\n    runs.write('ran\\n')\nANSWER = 42\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lazy_probe_module", raising=False)
    return runs


def test_the_module_runs_at_its_first_attribute_read_and_once(counted_module: Path) -> None:
    # GIVEN a module named lazily
    module = lazy_module("lazy_probe_module")
    # THEN it has not run
    assert not counted_module.exists()
    assert "lazy_probe_module" not in sys.modules
    # WHEN its names are read twice
    assert module.ANSWER == 42
    assert module.ANSWER == 42
    # THEN it ran once, and is the module imported
    assert counted_module.read_text() == "ran\n"
    assert sys.modules["lazy_probe_module"].ANSWER == 42


def test_a_missing_name_raises_attribute_error_and_a_missing_module_import_error(
    counted_module: Path,
) -> None:
    with pytest.raises(AttributeError):
        _ = lazy_module("lazy_probe_module").NOT_THERE
    with pytest.raises(ImportError):
        _ = lazy_module("no_such_module_here").ANYTHING
