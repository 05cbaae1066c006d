"""A module imported at its first use, not at its importer's.

pyelftools' parser (an ELF file opened), capstone (the allocation sites,
the lock-wait site, the derived probes, an interpreter's layout) and
pyderust (Rust names) are needed only where a fact is not kept yet, or once
the trace names its frames: a start with its facts kept never touches them,
and imports none before the trace is on (docs/performance.md, section 12).
Type checkers see the real module (the importers import it under
TYPE_CHECKING)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


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
