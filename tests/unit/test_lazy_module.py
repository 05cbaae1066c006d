"""mtrace_live.probes.elf.lazy: a module imported, or a numpy dtype made, at its first use."""

from __future__ import annotations

import subprocess
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


# a fresh interpreter: numpy is not imported by the layouts made, and each
# is the dtype it stands for wherever numpy takes a dtype
LAYOUTS_UNUSED = """
import subprocess
import sys
from mtrace_live.probes.elf.lazy import lazy_dtype
inner = lazy_dtype([("pc", "<u4"), ("off", "<i8")])
outer = lazy_dtype([("rows", inner, (2,)), ("count", "<u4")])
assert "numpy" not in sys.modules
import numpy as np
real = np.dtype([("pc", "<u4"), ("off", "<i8")])
assert (inner.itemsize, outer.itemsize, inner.names) == (12, 28, ("pc", "off"))
assert inner == real and real == inner and np.dtype(inner) == real and hash(inner) == hash(real)
assert np.zeros(3, inner).dtype == real and np.frombuffer(bytes(24), inner).dtype == real
assert np.zeros(2, "u1").repeat(12).view(inner).dtype == real
assert np.zeros(1, outer)["rows"].shape == (1, 2) and inner["off"] == np.dtype("<i8")
print("ok")
"""


def test_a_lazy_dtype_imports_numpy_at_its_first_use_and_acts_as_the_dtype() -> None:
    done = subprocess.run([sys.executable, "-c", LAYOUTS_UNUSED], capture_output=True, text=True)
    assert done.stdout == "ok\n", done.stderr
