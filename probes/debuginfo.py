"""What a libc's debug information says about malloc's internals.

The derived probes (``derived.py``) need, from DWARF: the code ranges of
static functions, inlined or not (``_int_new_arena`` is a function in one
build and three inlined copies in another); the layout of ``heap_info``; and
where a parameter lives at a given instruction (its location list). Only the
compilation unit that holds ``__libc_malloc`` is read, found through
``.debug_aranges``: about 0.2 s with pyelftools.

The debug file (``elf.debug.find_debug_file``) is the libc itself when it
carries ``.debug_info`` (the SDT build does), else the file the build-id
names under ``/usr/lib/debug`` (Debian's ``libc6-dbg``). A debug file whose
build-id differs from the libc's describes another build, and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .elf.file import elf_failures
from .elf.lazy import lazy_module
from .elf.symbols import symbols_by_name
from .errors import DebugInfoError

if TYPE_CHECKING:
    from elftools.dwarf import dwarf_expr, locationlists, ranges
    from elftools.dwarf.compileunit import CompileUnit
    from elftools.dwarf.die import DIE
    from elftools.elf import elffile
else:  # (pyelftools' DWARF reader: at the first debug file read)
    dwarf_expr = lazy_module("elftools.dwarf.dwarf_expr")
    ranges = lazy_module("elftools.dwarf.ranges")
    locationlists = lazy_module("elftools.dwarf.locationlists")
    elffile = lazy_module("elftools.elf.elffile")

# DWARF register numbers of x86-64 (System V psABI, figure 3.36).
DWARF_REGISTERS = (
    "rax",
    "rdx",
    "rcx",
    "rbx",
    "rsi",
    "rdi",
    "rbp",
    "rsp",
    "r8",
    "r9",
    "r10",
    "r11",
    "r12",
    "r13",
    "r14",
    "r15",
)


@dataclass(frozen=True)
class Code:
    """Where one function's code is: a function, or one inlined copy of it."""

    function: str
    ranges: tuple[tuple[int, int], ...]  # [begin, end) link-time addresses
    inlined_in: str | None  # the function it was inlined into, or None
    die_offset: int

    def __contains__(self, address: int) -> bool:
        return any(begin <= address < end for begin, end in self.ranges)

    def describe(self) -> str:
        where = f"inlined in {self.inlined_in}" if self.inlined_in else "function"
        spans = ", ".join(f"{b:#x}-{e:#x}" for b, e in self.ranges)
        return f"{self.function} ({where}, {spans})"


class DebugInfo:
    """The malloc compilation unit of one debug file, indexed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._stream = path.open("rb")
            self.elf = elffile.ELFFile(self._stream)
            self.symbols = symbols_by_name(self.elf)
            self.dwarf = self.elf.get_dwarf_info()
            malloc = self.symbols.get("__libc_malloc")
            if malloc is None:
                raise DebugInfoError(f"{path}: no __libc_malloc in its symbol table")
            aranges = self.dwarf.get_aranges()
            offset = aranges.cu_offset_at_addr(malloc[0]) if aranges is not None else None
            if offset is None:
                raise DebugInfoError(f"{path}: no .debug_aranges entry for __libc_malloc")
            self.cu: CompileUnit = self.dwarf.get_CU_at(offset)
            self._index()
        except (OSError, *elf_failures()) as exc:
            raise DebugInfoError(f"{path}: unreadable debug information ({exc})") from None

    def close(self) -> None:
        self._stream.close()

    def __enter__(self) -> DebugInfo:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _index(self) -> None:
        self.code: dict[str, list[Code]] = {}
        self.structs: dict[str, DIE] = {}
        self._abstract: dict[int, DIE] = {}
        for die in self.cu.iter_DIEs():
            if die.tag in ("DW_TAG_subprogram", "DW_TAG_inlined_subroutine"):
                name = _name(die)
                ranges = self._ranges(die)
                if name and ranges:
                    outer = None
                    if die.tag == "DW_TAG_inlined_subroutine":
                        outer = _enclosing_function(die)
                    self.code.setdefault(name, []).append(Code(name, ranges, outer, die.offset))
            elif die.tag == "DW_TAG_structure_type" and "DW_AT_name" in die.attributes:
                self.structs.setdefault(die.attributes["DW_AT_name"].value.decode(), die)

    def _ranges(self, die: DIE) -> tuple[tuple[int, int], ...]:
        attrs = die.attributes
        if "DW_AT_low_pc" in attrs and "DW_AT_high_pc" in attrs:
            low = attrs["DW_AT_low_pc"].value
            high = attrs["DW_AT_high_pc"]
            end = high.value if high.form == "DW_FORM_addr" else low + high.value
            return ((low, end),)
        if "DW_AT_ranges" in attrs:
            base = self.cu.get_top_DIE().attributes.get("DW_AT_low_pc")
            base_address = base.value if base is not None else 0
            spans = []
            lists = self.dwarf.range_lists()
            if lists is None:
                return ()
            for entry in lists.get_range_list_at_offset(attrs["DW_AT_ranges"].value, cu=self.cu):
                if isinstance(entry, ranges.RangeEntry):
                    add = 0 if getattr(entry, "is_absolute", False) else base_address
                    spans.append((entry.begin_offset + add, entry.end_offset + add))
                else:
                    base_address = entry.base_address
            return tuple(span for span in spans if span[0] < span[1])
        return ()

    def function_code(self, name: str) -> list[Code]:
        """Every copy of ``name``'s code: the function itself and its inlined copies."""
        return list(self.code.get(name, ()))

    def function(self, name: str) -> tuple[int, int] | None:
        """(address, size) of a function symbol, from the symbol table."""
        return self.symbols.get(name)

    def member_offset(self, struct_name: str, member: str) -> int | None:
        die = self.structs.get(struct_name)
        if die is None:
            return None
        for child in die.iter_children():
            name = child.attributes.get("DW_AT_name")
            location = child.attributes.get("DW_AT_data_member_location")
            if name is not None and name.value.decode() == member and location is not None:
                return int(location.value)
        return None

    def struct_size(self, struct_name: str) -> int | None:
        die = self.structs.get(struct_name)
        size = die.attributes.get("DW_AT_byte_size") if die is not None else None
        return int(size.value) if size is not None else None

    def parameter_register(self, code: Code, parameter: str, pc: int) -> str | None:
        """The register holding ``parameter`` of ``code``'s function at ``pc``,
        from its DWARF location, or None when it is elsewhere or optimized out."""
        die = self.cu.get_DIE_from_refaddr(code.die_offset)
        for child in die.iter_children():
            if child.tag != "DW_TAG_formal_parameter" or _name(child) != parameter:
                continue
            return self._register_at(child, pc)
        return None

    def _register_at(self, die: DIE, pc: int) -> str | None:
        attr = die.attributes.get("DW_AT_location")
        if attr is None:
            return None
        parser = locationlists.LocationParser(self.dwarf.location_lists())
        location = parser.parse_from_attribute(attr, self.cu.header.version, die)
        if not isinstance(location, list):
            return self._register(location.loc_expr)
        base = self.cu.get_top_DIE().attributes.get("DW_AT_low_pc")
        base_address = base.value if base is not None else 0
        for entry in location:
            if isinstance(entry, locationlists.BaseAddressEntry):
                base_address = entry.base_address
            elif isinstance(entry, locationlists.LocationEntry):
                add = 0 if getattr(entry, "is_absolute", False) else base_address
                if entry.begin_offset + add <= pc < entry.end_offset + add:
                    return self._register(entry.loc_expr)
        return None

    def _register(self, expression: list[int]) -> str | None:
        ops = dwarf_expr.DWARFExprParser(self.cu.structs).parse_expr(expression)
        if len(ops) != 1:
            return None
        op = ops[0]
        if op.op_name.startswith("DW_OP_reg") and op.op_name != "DW_OP_regx":
            number = int(op.op_name[len("DW_OP_reg") :])
        elif op.op_name == "DW_OP_regx":
            number = int(op.args[0])
        else:
            return None
        return DWARF_REGISTERS[number] if number < len(DWARF_REGISTERS) else None


def _name(die: DIE) -> str | None:
    seen = 0
    while die is not None and seen < 8:
        attrs = die.attributes
        if "DW_AT_name" in attrs:
            return str(attrs["DW_AT_name"].value.decode())
        origin = "DW_AT_abstract_origin" if "DW_AT_abstract_origin" in attrs else None
        origin = origin or ("DW_AT_specification" if "DW_AT_specification" in attrs else None)
        if origin is None:
            return None
        die = die.get_DIE_from_attribute(origin)
        seen += 1
    return None


def _enclosing_function(die: DIE) -> str | None:
    parent = die.get_parent()
    while parent is not None and parent.tag != "DW_TAG_subprogram":
        parent = parent.get_parent()
    return _name(parent) if parent is not None else None
