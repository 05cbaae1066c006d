"""Types of the reader of DWARF line tables (probes/elf/line_rows.c)."""

class Dwarf:
    """A file's DWARF, open with libdw (OSError: unopenable; ValueError: no DWARF)."""

    def __init__(self, path: str) -> None: ...
    def aranges(self) -> bytes:
        """.debug_aranges as (start, end, unit) u64 triples (b"" without it)."""
    def units(self) -> bytes:
        """Every unit's offset (of its first DIE), u64."""
    def rows(self, unit: int) -> tuple[bytes, bytes, list[str]]:
        """(addresses u64, places (name index, line) i32 pairs, names) of a unit."""
