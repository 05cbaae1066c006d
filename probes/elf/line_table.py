"""An ELF file's DWARF line tables: which unit holds an address, and a
unit's rows (address -> file:line).

The DWARF is read by elfutils' libdw through ``_lines``
(probes/elf/line_rows.c, compiled at install). pyelftools decoded one of
libpython's units in 0.2 s, and a summary names frames in dozens of them;
libdw decodes all 146 in 0.14 s. Nothing a file holds makes the reading
raise: what libdw cannot read gives no rows.

The rules are those gdb and addr2line follow, as mtrace-live always had
them: an address's line is that of the row with the greatest address at
or below it in its unit; where several rows share an address, the last
stands; an end of sequence leaves no line until the next row. The unit is
found through .debug_aranges, or, in a file without them, by each unit's
rows (from its first row's address to its last's).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .lazy import lazy_dtype, lazy_module

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # (at the first use: probes/elf/lazy.py)


RANGES = lazy_dtype("<u8")  # (start, end, unit) triples, shape (n, 3)
_LAST = (1 << 64) - 1


@dataclass(frozen=True)
class UnitRows:
    """One unit's rows, one per address: ``addresses`` ascending (<u8);
    ``places`` (n, 2) of (index into ``names``, line), the index -1 where
    no line begins (a sequence ended there); ``names`` the files' base names."""

    addresses: np.ndarray
    places: np.ndarray
    names: tuple[str, ...]

    def location(self, vaddr: int) -> str | None:
        """``basename:line`` of the row at or below ``vaddr``; None before
        the first row, or past an end of sequence."""
        if not 0 <= vaddr <= _LAST:
            return None
        # (the key as the array's type: a Python int would have the array converted)
        row = int(self.addresses.searchsorted(np.uint64(vaddr), side="right")) - 1
        if row < 0:
            return None
        name, line = self.places[row].tolist()
        return f"{self.names[name]}:{line}" if name >= 0 else None

    def valid(self) -> bool:
        """Shapes and name indices that ``location`` can use (a unit read
        back from a cache may be damaged)."""
        addresses, places = self.addresses, self.places
        if addresses.dtype != np.dtype("<u8") or addresses.ndim != 1:
            return False
        if places.dtype != np.dtype("<i4") or places.shape != (len(addresses), 2):
            return False
        names = places[:, 0]
        return not len(names) or (int(names.min()) >= -1 and int(names.max()) < len(self.names))


@functools.cache
def no_rows() -> UnitRows:
    """A unit without rows (its arrays made at the first use: numpy)."""
    return UnitRows(np.zeros(0, dtype="<u8"), np.zeros((0, 2), dtype="<i4"), ())


class LineTables:
    """A file's line tables, open with libdw: OSError if the file cannot be
    opened, ValueError if libdw finds no DWARF in it."""

    def __init__(self, path: Path) -> None:
        from . import _lines  # (libdw is loaded with the first file read, not before)

        self._dwarf = _lines.Dwarf(str(path))

    def unit(self, unit: int) -> UnitRows:
        """The rows of the unit whose first DIE is at ``unit`` (none for a
        unit without a line table, or one libdw cannot read)."""
        addresses, places, names = self._dwarf.rows(unit)
        pairs = np.frombuffer(places, dtype="<i4").reshape(-1, 2)
        return UnitRows(np.frombuffer(addresses, dtype="<u8"), pairs, tuple(names))

    def ranges(self, aranges: bool) -> tuple[np.ndarray, dict[int, UnitRows]]:
        """(start, end, unit) by start (then end, then unit), of RANGES;
        with ``aranges`` from .debug_aranges (the file has the section),
        else from every unit's rows: those rows read on the way are given
        too, by unit."""
        if aranges:
            triples = np.frombuffer(self._dwarf.aranges(), dtype=RANGES).reshape(-1, 3)
            return _sorted(triples), {}
        read = {}
        found = []
        for unit in np.frombuffer(self._dwarf.units(), dtype=RANGES).tolist():
            rows = read[unit] = self.unit(unit)
            if len(rows.addresses):
                end = min(int(rows.addresses[-1]) + 1, _LAST)  # (a damaged file's last row)
                found.append((int(rows.addresses[0]), end, unit))
        return _sorted(np.array(found, dtype=RANGES).reshape(-1, 3)), read


def _sorted(triples: np.ndarray) -> np.ndarray:
    order = np.lexsort((triples[:, 2], triples[:, 1], triples[:, 0]))
    return np.ascontiguousarray(triples[order])
