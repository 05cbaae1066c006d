"""User-space symbolization with pyelftools, checked against binutils
(nm for functions, addr2line for DWARF lines) on the exercisers' own code."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from mtrace_live.exporters.data.alloc_snapshot import FrameNames
from mtrace_live.exporters.data.symbolize import ModuleSymbols, ProcessSymbols

from .needs import needs

BUILD = Path(__file__).resolve().parents[2] / "build"


def built(name: str) -> Path:
    path = BUILD / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: build it with 'make exercisers'")
    return path


def functions(binary: Path) -> dict[str, int]:
    """Text symbols by name, as nm lists them (link-time addresses)."""
    out = subprocess.run(["nm", "--defined-only", str(binary)], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    found = {}
    for line in out.splitlines():
        address, kind, name = line.split()
        if kind in "tT":
            found[name] = int(address, 16)
    return found


def addr2line(binary: Path, address: int) -> str | None:
    """file:line as addr2line says, None where it has no line ("??" or ":?")."""
    out = subprocess.run(["addr2line", "-e", str(binary), f"{address:#x}"], capture_output=True,
                         text=True, check=True).stdout.strip()  # fmt: skip
    path, _, line = out.partition(":")
    line = line.split()[0] if line else "?"
    return None if line == "?" or path == "??" else f"{Path(path).name}:{line}"


def test_functions_and_lines_of_the_exercisers_own_code_match_binutils() -> None:
    # GIVEN the probe exerciser, built with DWARF, and its functions per nm
    binary = built("probe_exerciser")
    symbols = ModuleSymbols(binary)
    named = {
        name: address for name, address in functions(binary).items() if not name.startswith("_")
    }
    assert "main" in named and len(named) > 10
    # WHEN a few bytes into each function is looked up
    for name, address in sorted(named.items()):
        function, offset, location = symbols.lookup(address + 4)
        # THEN the function is nm's, and the file:line is addr2line's
        assert (function, offset) == (name, 4), name
        assert location == addr2line(binary, address + 4), name
    assert symbols.build_id and len(symbols.build_id) == 40


def test_a_stripped_binary_resolves_through_its_build_id_debug_file(tmp_path: Path) -> None:
    # GIVEN a stripped copy, and its debug part under a debug directory by build-id
    binary = built("kmem_exerciser")
    stripped, debug = tmp_path / "kmem_exerciser", tmp_path / "full.debug"
    subprocess.run(["objcopy", "--only-keep-debug", str(binary), str(debug)], check=True)
    subprocess.run(["strip", "-o", str(stripped), str(binary)], check=True)
    bare = ModuleSymbols(stripped, debug_directories=[tmp_path / "nothing"])
    build_id = bare.build_id
    assert build_id is not None
    target = tmp_path / "debug" / ".build-id" / build_id[:2] / f"{build_id[2:]}.debug"
    target.parent.mkdir(parents=True)
    shutil.move(debug, target)
    gate = functions(binary)["gate"]
    # WHEN each is looked up
    found = ModuleSymbols(stripped, debug_directories=[tmp_path / "debug"]).lookup(gate + 4)
    # THEN without the debug file there is no name (and no error); with it, name and line
    assert bare.lookup(gate + 4) == (None, 0, None)
    assert found == ("gate", 4, addr2line(binary, gate + 4))


def test_files_that_are_not_elf_give_nothing_not_an_error(tmp_path: Path) -> None:
    junk = tmp_path / "junk.so"
    junk.write_bytes(b"\x7fELF" + b"\x00" * 10)
    assert ModuleSymbols(junk).lookup(0x1000) == (None, 0, None)
    assert ModuleSymbols(tmp_path / "missing.so").lookup(0x1000) == (None, 0, None)


def test_a_running_process_addresses_resolve_through_its_maps() -> None:
    # GIVEN the kmem exerciser waiting at its gate (a PIE, loaded anywhere)
    binary = built("kmem_exerciser")
    work = subprocess.Popen([str(binary), "--sockets", "1", "--pipes", "0", "--out", "/dev/null",
                             "--gated"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    assert work.stdin is not None and work.stdout is not None
    try:
        assert work.stdout.readline() == b"ready\n"
        process = ProcessSymbols(work.pid)
        exe = next(m for m in process.modules() if m.path == str(binary))
        module = ModuleSymbols(binary)
        load_bias = exe.start - (module.vaddr(exe.offset) or 0)
        gate = functions(binary)["gate"]
        # WHEN an address inside its gate() is resolved
        symbol = process.resolve(load_bias + gate + 4)
        # THEN it is the exerciser's gate(), with its source line
        assert symbol is not None and symbol.module == str(binary)
        assert (symbol.function, symbol.offset) == ("gate", 4)
        assert symbol.location == addr2line(binary, gate + 4)
        # AND an address in libc names libc, and one in no mapping gives None
        libc = next(m for m in process.modules() if "libc.so" in m.path)
        resolved = process.resolve(libc.start + 0x100)
        assert resolved is not None and resolved.module == libc.path
        assert process.resolve(0x10) is None
    finally:
        work.stdin.write(b"go\n")
        work.stdin.flush()
        work.stdout.readline()
        work.stdin.write(b"end\n")
        work.stdin.close()
        work.stdout.close()
        work.wait(timeout=30)


LIBC = Path("/lib/x86_64-linux-gnu/libc.so.6")


def test_libc_lines_come_from_the_units_that_hold_the_addresses_alone() -> None:
    # GIVEN the stock libc, whose lines are in its debug file (libc6-dbg), of ~2,000 units
    needs(shutil.which("addr2line") is not None, "binutils' addr2line is missing")
    module = ModuleSymbols(LIBC)
    needs(module.debug_file is not None, "the libc's debug file (libc6-dbg) is missing")
    assert module.debug_file is not None
    wanted = [address for name, address in functions(module.debug_file).items()
              if name in ("__libc_malloc", "_IO_file_doallocate", "__libc_calloc")]  # fmt: skip
    assert len(wanted) == 3
    # WHEN three addresses inside them are named
    found = [module.lookup(address + 8) for address in wanted]
    # THEN each line is addr2line's, and no more units were read than those holding them
    for (function, _, location), address in zip(found, wanted, strict=True):
        assert function is not None and location is not None
        assert location == addr2line(module.debug_file, address + 8)
    assert module._lines is not None and 1 <= len(module._lines._units) <= 3


ABBREVIATED = {
    "std::basic_istream<char, std::char_traits<char> >": "std::istream",
    "std::basic_ostream<char, std::char_traits<char> >": "std::ostream",
    "std::basic_iostream<char, std::char_traits<char> >": "std::iostream",
    "std::basic_string<char, std::char_traits<char>, std::allocator<char> >": "std::string",
}


def short(name: str) -> str:
    for full, abbreviation in ABBREVIATED.items():
        name = name.replace(full, abbreviation)
    return name.replace(" >", ">")


def cxxfilt_binary(names: list[str]) -> list[str]:
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    return out.splitlines()


def test_names_are_demangled_as_cxxfilt_demangles_them() -> None:
    needs(shutil.which("c++filt") is not None, "binutils' c++filt is missing")
    from mtrace_live.exporters.data.symbolize import demangled
    from mtrace_live.probes.elf.file import open_elf
    from mtrace_live.probes.elf.symbols import symbol_table

    # GIVEN the C++ names libstdc++ exports, and a few that are not C++
    with open_elf(Path("/usr/lib/x86_64-linux-gnu/libstdc++.so.6")) as elf:
        table = symbol_table(elf, ".dynsym")
        assert table is not None
        names = sorted({s.name for s in table if s.name.startswith("_Z")})
    assert len(names) > 3000
    # THEN each is demangled as binutils' c++filt does (which spells out the
    # standard abbreviations, Ss, Si, So, Sd, that the C++ runtime shows as
    # std::string, ...), and a plain name stays as it is
    assert [short(demangled(n)) for n in names] == [short(n) for n in cxxfilt_binary(names)]
    assert demangled("main") == "main" and demangled("_Zbogus") == "_Zbogus"
    # a Rust symbol (legacy mangling) loses its hash, as perf shows it
    rust = "_ZN4core3fmt5write17h5f9c8b5e6d7a8b9cE"
    assert cxxfilt_binary([rust]) == ["core::fmt::write::h5f9c8b5e6d7a8b9c"]
    assert demangled(rust) == "core::fmt::write"


# Functions of a Rust program built with -C symbol-mangling-version=v0: its
# own (m::make, m::main), generic ones instantiated in it, closures, shims.
RUST_V0 = [
    "_RNvCskK7mfDs1mzF_1m4main",
    "_RNvCskK7mfDs1mzF_1m4make",
    "_RNCINvNtCsjrHSEGnQ3l9_3std2rt10lang_startuE0CskK7mfDs1mzF_1m",
    "_RINvNtCsgEmfK2I1SDS_4core3ptr13drop_in_placeINtNtCslNYArtu3iFV_5alloc3vec3VecNtNtBL_6string"
    "6StringEECskK7mfDs1mzF_1m",
    "_RINvYNtNtNtCsjrHSEGnQ3l9_3std4hash6random11RandomStateNtNtCsgEmfK2I1SDS_4core4hash11Build"
    "Hasher8hash_oneRNtNtCslNYArtu3iFV_5alloc6string6StringECskK7mfDs1mzF_1m",
    "_RNSNvYNCINvNtCsjrHSEGnQ3l9_3std2rt10lang_startuE0INtNtNtCsgEmfK2I1SDS_4core3ops8function6Fn"
    "OnceuE9call_once6vtableCskK7mfDs1mzF_1m",
    "_RNvMs3_NtCslNYArtu3iFV_5alloc7raw_vecINtB5_6RawVecINtNtB7_3vec3VechEE8grow_oneCsjrHSEGnQ3l9_3std",
    "_RNvXs1g_NtCsgEmfK2I1SDS_4core3fmtReNtB6_5Debug3fmtCsjrHSEGnQ3l9_3std",
    "_RNvCsfLfy6EI15iL_7___rustc19___rust_alloc_zeroed",
]


def test_rust_v0_names_are_demangled_as_binutils_demangles_them() -> None:
    needs(shutil.which("c++filt") is not None, "binutils' c++filt is missing")
    from mtrace_live.exporters.data.symbolize import demangled

    # GIVEN Rust functions' symbols in the v0 mangling, and c++filt's names
    # for them without the crates' disambiguators ("std[5e1a]::..."), which
    # perf and heaptrack do not show
    expected = [re.sub(r"\[[0-9a-f]+\]", "", n) for n in cxxfilt_binary(RUST_V0)]
    assert all(not n.startswith("_R") for n in expected)
    # THEN mtrace-live names each as binutils does, and a malformed one is left as it is
    assert [demangled(n) for n in RUST_V0] == expected
    assert demangled("_RNvC") == "_RNvC"


def test_a_forked_process_gone_before_its_maps_were_read_is_named_by_its_parent_s() -> None:
    # GIVEN an address of this process's libc (the return address just past
    # malloc's first byte: frames are named by address - 1), and a pid that
    # has no process (a child gone before its maps were read)
    malloc = ctypes.cast(ctypes.CDLL(None).malloc, ctypes.c_void_p).value
    assert malloc is not None
    gone = 2**22 + 11
    # THEN alone it is not named; inherited from this process, it is named
    # by this process's maps; once it ran another program (disinherit), not
    alone = FrameNames()
    assert alone.resolve(gone, malloc + 1) is None
    forked = FrameNames()
    forked.inherit(gone, os.getpid())
    named = forked.resolve(gone, malloc + 1)
    assert named is not None and named.function is not None and "malloc" in named.function
    exec_d = FrameNames()
    exec_d.inherit(gone, os.getpid())
    exec_d.disinherit([gone])
    assert exec_d.resolve(gone, malloc + 1) is None
