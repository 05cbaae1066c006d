"""SDT note reading, against real ELF files compiled here with <sys/sdt.h>."""

import shutil
import subprocess
from pathlib import Path

import pytest
from mtrace_live.probes.errors import NotElfError, TargetError
from mtrace_live.probes.sdt_notes import read_sites

PROGRAM = r"""
#include <sys/sdt.h>
long counter;
__attribute__((noinline)) void twice(long a, int b) {
    DTRACE_PROBE2(demo, pair, a, b);
    counter += a;
    DTRACE_PROBE2(demo, pair, counter, b + 1);
}
int main(void) {
    DTRACE_PROBE(demo, start);
    twice(3, 4);
    DTRACE_PROBE1(demo, done, counter);
    return 0;
}
"""


@pytest.fixture(scope="module")
def sdt_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.fail("gcc is needed: run scripts/setup.sh")
    out = tmp_path_factory.mktemp("sdt")
    source = out / "demo.c"
    source.write_text(PROGRAM)
    binary = out / "demo"
    built = subprocess.run(
        ["gcc", "-O2", "-o", str(binary), str(source)], capture_output=True, text=True
    )
    if built.returncode != 0:
        pytest.fail(
            f"cannot build the SDT test program (systemtap-sdt-dev missing?):\n{built.stderr}"
        )
    return binary


def test_reads_every_site_with_provider_name_and_arguments(sdt_binary: Path) -> None:
    # GIVEN a program with four probe sites, two of them for one probe
    # WHEN its notes are read
    sites = read_sites(sdt_binary)
    # THEN each site is there once, with its provider and argument count
    names = sorted(s.qualified_name for s in sites)
    assert names == ["demo:done", "demo:pair", "demo:pair", "demo:start"]
    by_name = {s.name: s for s in sites}
    assert by_name["start"].arguments == ()
    assert len(by_name["done"].arguments) == 1
    assert all(len(s.arguments) == 2 for s in sites if s.name == "pair")
    assert all(s.semaphore == 0 for s in sites)


def test_site_addresses_agree_with_readelf(sdt_binary: Path) -> None:
    # GIVEN readelf's view of the same notes
    listing = subprocess.run(
        ["readelf", "-n", str(sdt_binary)], check=True, capture_output=True, text=True
    ).stdout
    readelf_locations = sorted(
        int(line.split("Location:")[1].split(",")[0], 16)
        for line in listing.splitlines()
        if "Location:" in line
    )
    # WHEN our reader parses the notes
    ours = sorted(s.address for s in read_sites(sdt_binary))
    # THEN the site addresses are identical
    assert ours == readelf_locations


def test_file_offset_lies_in_the_text_the_address_names(sdt_binary: Path) -> None:
    # A uprobe at the file offset must hit the instruction at the address:
    # both views of the bytes there must be the same.
    data = sdt_binary.read_bytes()
    for site in read_sites(sdt_binary):
        assert 0 < site.file_offset < len(data)
        assert data[site.file_offset] == 0x90  # the nop every SDT site starts with


def test_library_without_notes_has_no_sites(tmp_path: Path) -> None:
    binary = tmp_path / "plain"
    (tmp_path / "plain.c").write_text("int main(void) { return 0; }\n")
    subprocess.run(["gcc", "-o", str(binary), str(tmp_path / "plain.c")], check=True)
    assert read_sites(binary) == []


def test_not_an_elf_file_is_one_clear_error(tmp_path: Path) -> None:
    bogus = tmp_path / "libc.so.6"
    bogus.write_bytes(b"this is not an ELF file")
    with pytest.raises(NotElfError, match="not a readable ELF file"):
        read_sites(bogus)


def test_missing_file_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TargetError, match="No such file"):
        read_sites(tmp_path / "absent.so")
