"""Source lines read with libdw (probes/elf/line_table.py) and kept by
build-id (exporters/data/source_lines.py): the same rows as pyelftools'
reading of the same units under mtrace-live's rules, the same lines as
LLVM's and binutils' symbolizers, and a cache that is only ever a saving."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from elftools.dwarf.dwarfinfo import DWARFInfo
from elftools.elf.elffile import ELFFile
from hypothesis import given, settings
from hypothesis import strategies as st
from mtrace_live.exporters.data import source_lines
from mtrace_live.exporters.data.source_lines import LineCache, LineIndex
from mtrace_live.exporters.data.symbolize import ModuleSymbols
from mtrace_live.probes.elf.file import build_id_of
from mtrace_live.probes.elf.line_table import LineTables

from .needs import needs

LIBPYTHON = Path("/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0")  # full DWARF 5
LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")  # its lines in libc6-dbg's debug file
BUILD = Path(__file__).resolve().parents[2] / "build"


def libpython() -> Path:
    needs(LIBPYTHON.is_file(), f"{LIBPYTHON} (the machine image's pyenv 3.11.7)")
    return LIBPYTHON


def libc_debug_file() -> Path:
    found = ModuleSymbols(LIBC).debug_file
    needs(found is not None, "the libc's debug file (libc6-dbg)")
    assert found is not None
    return found


def built(name: str) -> Path:
    path = BUILD / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: build it with 'make exercisers'")
    return path


# ---- the reference: pyelftools, under the rules mtrace-live always had -------


def reference_rows(dwarf: DWARFInfo, unit_offset: int) -> dict[int, str | None]:
    """A unit's rows as pyelftools decodes its line program: the last row
    at an address stands, an end of sequence leaves no line there unless a
    row begins there."""
    rows: dict[int, str | None] = {}
    program = dwarf.line_program_for_CU(dwarf.get_CU_at(unit_offset))
    if program is None:
        return rows
    files = program["file_entry"]
    base = 1 if program["version"] < 5 else 0
    for entry in program.get_entries():
        state = entry.state
        if state is None:
            continue
        if state.end_sequence:
            rows.setdefault(state.address, None)
            continue
        index = state.file - base
        name = files[index].name.decode(errors="replace") if 0 <= index < len(files) else "?"
        rows[state.address] = f"{os.path.basename(name)}:{state.line}"
    return rows


class Reference:
    """One file's units and rows as pyelftools reads them (units by the
    offset of their first DIE, as libdw names them)."""

    def __init__(self, path: Path) -> None:
        self.stream = open(path, "rb")  # noqa: SIM115 (kept open for the units)
        self.dwarf = ELFFile(self.stream).get_dwarf_info()
        self.units = {cu.cu_die_offset: cu.cu_offset for cu in self.dwarf.iter_CUs()}
        aranges = self.dwarf.get_aranges()
        assert aranges is not None
        self.ranges = sorted((e.begin_addr, e.begin_addr + e.length,
                              self.dwarf.get_CU_at(e.info_offset).cu_die_offset)
                             for e in aranges.entries if e.length)  # fmt: skip

    @cache  # noqa: B019 (a few references, kept for the session)
    def rows(self, unit: int) -> dict[int, str | None]:
        return reference_rows(self.dwarf, self.units[unit])

    def location(self, unit: int, vaddr: int) -> str | None:
        rows = self.rows(unit)
        at = max((a for a in rows if a <= vaddr), default=None)
        return rows[at] if at is not None else None


@cache
def reference(path: Path) -> Reference:
    return Reference(path)


def sampled_units(path: Path, count: int) -> list[int]:
    """``count`` units that hold code, drawn at random (seeded)."""
    units = sorted({unit for _, _, unit in reference(path).ranges})
    return random.Random(60).sample(units, min(count, len(units)))


@pytest.mark.parametrize("which", ["libpython", "libc"])
def test_units_have_the_rows_pyelftools_reads_from_their_line_programs(which: str) -> None:
    # GIVEN a big file with full DWARF 5 (libpython), and the libc's
    # compressed debug file, and a dozen of their units drawn at random
    path = libpython() if which == "libpython" else libc_debug_file()
    ref = reference(path)
    tables = LineTables(path)
    ranges, _ = tables.ranges(aranges=True)
    # THEN libdw's ranges are .debug_aranges' as pyelftools reads them
    assert [tuple(r) for r in ranges.tolist()] == ref.ranges
    for unit in sampled_units(path, 12):
        # AND each unit has the same rows: address, file and line, or no line
        rows = tables.unit(unit)
        assert rows.valid()
        mine = {address: rows.location(address) for address in rows.addresses.tolist()}
        assert mine == ref.rows(unit), f"unit at {unit:#x}"


@settings(max_examples=300)
@given(st.data())
def test_any_address_in_a_unit_has_pyelftools_line(data: st.DataObject) -> None:
    # GIVEN an address anywhere in one of libpython's sampled units' ranges
    path = libpython()
    ref = reference(path)
    units = set(sampled_units(path, 12))
    start, end, unit = data.draw(st.sampled_from([r for r in ref.ranges if r[2] in units]))
    vaddr = data.draw(st.integers(start, end - 1) | st.sampled_from([start, end - 1]))
    # THEN its line is the reference's
    assert index_of(path).location(vaddr) == ref.location(unit, vaddr)


@cache
def index_of(path: Path) -> LineIndex:
    return LineIndex(path, cache=LineCache(None))


def function_addresses(path: Path, count: int) -> list[int]:
    """``count`` addresses inside the file's functions (.symtab), at random."""
    with open(path, "rb") as stream:
        table = ELFFile(stream).get_section_by_name(".symtab")
        functions = [(s["st_value"], s["st_size"]) for s in table.iter_symbols()
                     if s["st_info"]["type"] == "STT_FUNC" and s["st_size"] > 0]  # fmt: skip
    draw = random.Random(6)
    return [start + draw.randrange(size) for start, size in draw.choices(functions, k=count)]


def symbolizer(command: list[str], addresses: list[int]) -> list[str | None]:
    """``file:line`` for each address, from a GNU-style answer a line each."""
    out = subprocess.run(command, input="".join(f"{a:#x}\n" for a in addresses),
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    found: list[str | None] = []
    for line in out.splitlines():
        place, _, number = line.partition(":")
        number = number.split()[0] if number else "?"
        found.append(None if place == "??" or number == "?" else f"{Path(place).name}:{number}")
    assert len(found) == len(addresses)
    return found


@pytest.mark.parametrize("which", ["libpython", "libc"])
def test_lines_are_llvm_symbolizers_and_addr2lines(which: str) -> None:
    needs(shutil.which("llvm-symbolizer") is not None, "LLVM's llvm-symbolizer (Debian's llvm)")
    needs(shutil.which("addr2line") is not None, "binutils' addr2line")
    # GIVEN 2,000 addresses inside the file's functions
    path = libpython() if which == "libpython" else libc_debug_file()
    addresses = function_addresses(path, 2000)
    # WHEN each is named, and LLVM's and binutils' symbolizers name them
    mine = [index_of(path).location(a) for a in addresses]
    llvm = symbolizer(["llvm-symbolizer", "--obj", str(path), "--no-inlines",
                       "--output-style=GNU", "--functions=none"], addresses)  # fmt: skip
    binutils = symbolizer(["addr2line", "-e", str(path)], addresses)
    # THEN each line is LLVM's; binutils' has the same line numbers (its file
    # is the including one where a header's code is inlined: fastsearch.h's
    # lines in unicodeobject.c)
    assert sum(m is not None for m in mine) > 1900
    assert mine == llvm
    assert [m and m.split(":")[1] for m in mine] == [b and b.split(":")[1] for b in binutils]


def test_a_file_without_aranges_finds_units_by_their_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    needs(shutil.which("objcopy") is not None, "binutils' objcopy")
    monkeypatch.setenv("MTRACE_LIVE_LINE_CACHE", "off")
    # GIVEN an exerciser, and a copy of it without .debug_aranges (as clang builds)
    binary = built("probe_exerciser")
    bare = tmp_path / "probe_exerciser"
    subprocess.run(["objcopy", "--remove-section=.debug_aranges", str(binary), str(bare)],
                   check=True)  # fmt: skip
    with_aranges, without = ModuleSymbols(binary), ModuleSymbols(bare)
    addresses = function_addresses(binary, 300)
    # THEN its lines are found all the same, every unit read at once
    assert with_aranges._lines is not None and without._lines is not None
    assert not without._lines._aranges and with_aranges._lines._aranges
    found = [without.lookup(a) for a in addresses]
    assert found == [with_aranges.lookup(a) for a in addresses]
    assert sum(location is not None for _, _, location in found) > 250
    # AND each would be kept apart: one build, its DWARF laid out two ways
    keys = [symbols._lines.key or "" for symbols in (with_aranges, without)]
    assert keys[0] != keys[1] and all(k.startswith(f"{build_id_of(binary)}-") for k in keys)


# ---- the cache ---------------------------------------------------------------------


def warm_cache(tmp_path: Path, path: Path, addresses: list[int]) -> tuple[LineCache, list]:
    """A cache in ``tmp_path`` holding what naming ``addresses`` read."""
    kept = LineCache(tmp_path / "lines")
    names = [LineIndex(path, build_id_of(path), cache=kept).location(a) for a in addresses]
    return kept, names


def test_a_second_reading_comes_from_the_cache_alone(tmp_path: Path) -> None:
    # GIVEN libpython's lines of 200 addresses, read once into a cache
    path = libpython()
    addresses = function_addresses(path, 200)
    kept, names = warm_cache(tmp_path, path, addresses)
    folder = tmp_path / "lines" / f"{build_id_of(path)}.v1"
    assert (folder / "ranges.npz").is_file() and len(list(folder.glob("*.npz"))) > 10
    # WHEN a file of the same build-id that has no DWARF to read (gone) names them
    again = LineIndex(tmp_path / "gone", build_id_of(path), cache=kept)
    # THEN it names them all the same, from the cache
    assert [again.location(a) for a in addresses] == names
    assert again._tables is None


def test_the_cache_is_read_without_loading_libdw(tmp_path: Path) -> None:
    # GIVEN a warm cache
    path = libpython()
    addresses = function_addresses(path, 50)
    _, names = warm_cache(tmp_path, path, addresses)
    # WHEN another process names the same addresses through it
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from mtrace_live.exporters.data.source_lines import LineCache, LineIndex\n"
        f"index = LineIndex(Path({str(path)!r}), {build_id_of(path)!r},"
        f" cache=LineCache(Path({str(tmp_path / 'lines')!r})))\n"
        f"print([index.location(a) for a in {addresses!r}])\n"
        "print('mtrace_live.probes.elf._lines' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout.splitlines()  # fmt: skip
    # THEN it names them, and the DWARF reader (libdw) was never loaded
    assert out == [repr(names), "False"]


def test_importing_the_names_loads_no_dwarf_reader() -> None:
    script = ("import sys, mtrace_live.exporters.data.symbolize, mtrace_live.tracer.cli\n"
              "print('mtrace_live.probes.elf._lines' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    assert out.strip() == "False"


@settings(max_examples=60)
@given(damage=st.sampled_from(["truncate", "flip", "garbage", "empty", "directory"]),
       seed=st.integers(0, 2**32 - 1))  # fmt: skip
def test_a_damaged_cache_is_read_past(
    damage: str, seed: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # GIVEN a warm cache of the probe exerciser's lines, one file of it damaged
    tmp_path = tmp_path_factory.mktemp("damaged")
    binary = built("probe_exerciser")
    addresses = function_addresses(binary, 40)
    kept, names = warm_cache(tmp_path, binary, addresses)
    files = sorted((tmp_path / "lines").glob("*/*.npz"))
    draw = random.Random(seed)
    victim = draw.choice(files)
    data = victim.read_bytes()
    if damage == "directory":
        victim.unlink()
        victim.mkdir()
    else:
        at = draw.randrange(len(data))
        victim.write_bytes({"truncate": data[:at], "empty": b"",
                            "flip": data[:at] + bytes([data[at] ^ 1 << draw.randrange(8)])
                            + data[at + 1:],
                            "garbage": draw.randbytes(len(data))}[damage])  # fmt: skip
    # THEN the lines are read again from the DWARF, the same, without an error
    index = LineIndex(binary, build_id_of(binary), cache=kept)
    assert [index.location(a) for a in addresses] == names


def test_an_unwritable_or_foreign_cache_is_no_error(tmp_path: Path) -> None:
    binary = built("probe_exerciser")
    addresses = function_addresses(binary, 40)
    names = [index_of(binary).location(a) for a in addresses]
    # GIVEN a cache where no directory can be made (a file is in the way;
    # the tests run as root, whom permissions do not stop)
    (tmp_path / "file").write_text("")
    blocked = LineCache(tmp_path / "file" / "lines")
    # THEN naming works as without one
    index = LineIndex(binary, build_id_of(binary), cache=blocked)
    assert [index.location(a) for a in addresses] == names
    # AND a cache that another user could have written is not believed: a
    # file without its DWARF (gone) has no lines from it
    kept, _ = warm_cache(tmp_path, binary, addresses)
    for path in (tmp_path / "lines").glob("*/*"):
        path.chmod(0o666)
    gone = LineIndex(tmp_path / "gone", build_id_of(binary), cache=kept)
    assert {gone.location(a) for a in addresses} == {None}


def test_the_cache_is_where_the_environment_says(monkeypatch: pytest.MonkeyPatch) -> None:
    from mtrace_live.exporters.data.source_lines import DEFAULT_CACHE, line_cache_dir

    monkeypatch.delenv("MTRACE_LIVE_LINE_CACHE", raising=False)
    assert line_cache_dir() == DEFAULT_CACHE == Path("/var/cache/mtrace-live/lines")
    monkeypatch.setenv("MTRACE_LIVE_LINE_CACHE", "off")
    assert line_cache_dir() is None
    monkeypatch.setenv("MTRACE_LIVE_LINE_CACHE", "/somewhere")
    assert line_cache_dir() == Path("/somewhere")


# ---- malformed DWARF ---------------------------------------------------------------


@cache
def debug_sections(path: Path) -> list[tuple[int, int]]:
    with open(path, "rb") as stream:
        return [(s["sh_offset"], s["sh_size"]) for s in ELFFile(stream).iter_sections()
                if s.name.startswith(".debug_") and s["sh_size"]]  # fmt: skip


@settings(max_examples=150)
@given(changes=st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 255)),
                        min_size=1, max_size=16))  # fmt: skip
def test_malformed_dwarf_gives_no_line_and_no_error(
    changes: list[tuple[int, int]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    # GIVEN the probe exerciser with bytes of its DWARF sections changed
    binary = built("probe_exerciser")
    data = bytearray(binary.read_bytes())
    sections = debug_sections(binary)
    for where, value in changes:
        offset, size = sections[where % len(sections)]
        data[offset + (where >> 8) % size] = value
    damaged = tmp_path_factory.mktemp("dwarf") / "probe_exerciser"
    damaged.write_bytes(bytes(data))
    # THEN naming its functions' addresses gives a line or none, never an error
    for aranges in (True, False):
        index = LineIndex(damaged, aranges=aranges, cache=LineCache(None))
        for address in function_addresses(binary, 20):
            found = index.location(address)
            assert found is None or ":" in found


def test_nothing_is_written_into_a_folder_another_user_could_write(tmp_path: Path) -> None:
    # GIVEN a file's folder in the cache made writable by anyone (by whoever
    # wants the tracer, root, to write through a link planted there)
    binary = built("probe_exerciser")
    ident = build_id_of(binary)
    folder = tmp_path / "lines" / f"{ident}.v1"
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    # WHEN its lines are read through the cache
    warm_cache(tmp_path, binary, function_addresses(binary, 40))
    # THEN nothing was written there
    assert list(folder.iterdir()) == []


def test_the_cache_keeps_the_files_most_recently_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN a cache that keeps 3 files, holding 4 old ones
    monkeypatch.setattr(source_lines, "KEEP_FILES", 3)
    lines = tmp_path / "lines"
    old = [lines / f"{n:040x}-1-1-a.v1" for n in range(4)]
    for age, folder in enumerate(old):
        folder.mkdir(parents=True)
        os.utime(folder, (1000 + age, 1000 + age))
    # WHEN a new file's lines are written
    binary = built("probe_exerciser")
    warm_cache(tmp_path, binary, function_addresses(binary, 5))
    # THEN the new one and the 2 most recent old ones are left
    left = sorted(path.name for path in lines.iterdir())
    assert left == sorted([f"{build_id_of(binary)}.v1", old[2].name, old[3].name])
