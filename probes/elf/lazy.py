"""A module imported at its first use, not at its importer's; a numpy
dtype made at its first use, not at its module's import.

pyelftools' parser (an ELF file opened), capstone (the allocation sites,
the lock-wait site, the derived probes, an interpreter's layout) and
pyderust (Rust names) are needed only where a fact is not kept yet, or once
the trace names its frames: a start with its facts kept never touches them,
and imports none before the trace is on (docs/performance.md, section 12).
numpy is needed once the trace reads its first events: the modules a start
imports before its line take it through ``lazy_module``, and their record
layouts through ``lazy_dtype``.
Type checkers see the real module (the importers import it under
TYPE_CHECKING)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np


class LazyModule(ModuleType):
    """Stands for module ``name``: its first attribute read imports it, and
    from then on its names are this object's own."""

    def __getattr__(self, attr: str) -> Any:
        module = importlib.import_module(self.__name__)
        self.__dict__.update(module.__dict__)
        return getattr(module, attr)


def lazy_module(name: str) -> Any:
    """Module ``name``, imported at its first use."""
    return LazyModule(name)


class LazyDtype:
    """Stands for ``numpy.dtype(spec)``, made (and numpy imported) at its
    first use. numpy takes any object with a ``dtype`` attribute wherever it
    takes a dtype (np.zeros, np.frombuffer, ndarray.view, a field of
    another dtype, a comparison with a dtype); every other attribute, and
    a field by name, is the dtype's own."""

    __slots__ = ("_made", "_spec")

    def __init__(self, spec: Any) -> None:
        self._spec = spec
        self._made: np.dtype[Any] | None = None

    @property
    def dtype(self) -> np.dtype[Any]:
        made = self._made
        if made is None:
            import numpy

            made = self._made = numpy.dtype(self._spec)
        return made

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.dtype, attr)

    def __getitem__(self, field: Any) -> Any:
        return self.dtype[field]

    def __eq__(self, other: object) -> bool:
        return bool(self.dtype == other)

    def __hash__(self) -> int:
        return hash(self.dtype)

    def __repr__(self) -> str:
        return repr(self.dtype)


def lazy_dtype(spec: Any) -> np.dtype[Any]:
    """``numpy.dtype(spec)``, made at its first use (a spec may hold other
    lazy dtypes: numpy reads their ``dtype``)."""
    made: np.dtype[Any] = LazyDtype(spec)  # type: ignore[assignment]
    return made
