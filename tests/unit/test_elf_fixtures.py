"""SDT notes of the committed ELF fixtures (tests/fixtures, built from C with
<sys/sdt.h>), and what 'mtrace-live probes' makes of them and of broken files."""

import json
import subprocess
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mtrace_live.probes.errors import MalformedNoteError, NotElfError, TargetError
from mtrace_live.probes.sdt_notes import read_sites

from .cli_runs import assert_one_line, mtrace, mtrace_unprivileged

ELF = Path(__file__).resolve().parents[1] / "fixtures" / "elf"
FIXTURE = ELF / "sdt_fixture.so"


def probes_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return mtrace("probes", *args)


def test_one_probe_with_two_sites_in_different_registers() -> None:
    twice = [s for s in read_sites(FIXTURE) if s.name == "twice"]
    assert len(twice) == 2
    assert twice[0].address != twice[1].address
    assert twice[0].arguments[0] != twice[1].arguments[0]  # %rdi, then %rax
    assert all(a.startswith(("-8@", "-4@")) for s in twice for a in s.arguments)


def test_semaphore_address_lies_in_the_probes_section() -> None:
    (guarded,) = [s for s in read_sites(FIXTURE) if s.name == "guarded"]
    with open(FIXTURE, "rb") as stream:
        section = ELFFile(stream).get_section_by_name(".probes")
        start, size = section["sh_addr"], section["sh_size"]
    assert start <= guarded.semaphore < start + size
    assert all(s.semaphore == 0 for s in read_sites(FIXTURE) if s.name != "guarded")


def test_rip_relative_arguments_are_kept_whole() -> None:
    (site,) = [s for s in read_sites(FIXTURE) if s.name == "global"]
    assert site.arguments == ("-8@demo_counter(%rip)", "-4@demo_level(%rip)")


def test_sites_move_with_the_stapsdt_base_section(tmp_path: Path) -> None:
    # GIVEN a copy whose notes say they were linked with .stapsdt.base 0x40
    # higher than where the section is (as after prelinking)
    data = bytearray(FIXTURE.read_bytes())
    offset, size = note_section()
    first = read_sites(FIXTURE)
    position = offset
    while position < offset + size:
        namesz, descsz = (
            int.from_bytes(data[position + i : position + i + 4], "little") for i in (0, 4)
        )
        desc = position + 12 + (namesz + 3) // 4 * 4
        base = int.from_bytes(data[desc + 8 : desc + 16], "little")
        data[desc + 8 : desc + 16] = (base + 0x40).to_bytes(8, "little")
        position = desc + (descsz + 3) // 4 * 4
    moved = tmp_path / "moved.so"
    moved.write_bytes(bytes(data))
    # WHEN the copy is read
    sites = read_sites(moved)
    # THEN every site (and the semaphore) moves 0x40 back with it
    assert [s.address for s in sites] == [s.address - 0x40 for s in first]
    assert [s.base for s in sites] == [s.base + 0x40 for s in first]
    (guarded,) = [s for s in sites if s.name == "guarded"]
    (original,) = [s for s in first if s.name == "guarded"]
    assert guarded.semaphore == original.semaphore - 0x40


def test_stripped_binary_keeps_every_site() -> None:
    stripped = ELF / "sdt_fixture_stripped.so"
    with open(stripped, "rb") as stream:
        assert ELFFile(stream).get_section_by_name(".symtab") is None
    assert read_sites(stripped) == read_sites(FIXTURE)


def test_probes_lists_sites_and_arguments_as_name_type_location() -> None:
    done = probes_cli("--lib", str(FIXTURE))
    assert done.returncode == 0, done.stderr
    assert "4 probes at 5 sites" in done.stdout
    assert "demo:twice  [not in the catalog]" in done.stdout
    assert "arg1:int64_t@demo_counter(%rip)  arg2:int32_t@demo_level(%rip)" in done.stdout
    assert "semaphore 0x" in done.stdout


def test_probes_json_is_for_scripts() -> None:
    done = probes_cli("--lib", str(FIXTURE), "--json")
    assert done.returncode == 0, done.stderr
    (listing,) = json.loads(done.stdout)
    by_name = {p["name"]: p for p in listing["probes"]}
    assert len(by_name["twice"]["sites"]) == 2
    assert by_name["plain"]["sites"][0]["arguments"] == []
    assert listing["catalog"]["unknown"] == []  # the demo provider is not the catalog's


def test_probes_with_neither_pid_nor_lib_reads_the_system_libc() -> None:
    done = probes_cli()
    # a libc without probes is listed too: its allocation functions are traced
    assert done.returncode == 0, done.stderr
    if "no SDT probes" not in done.stdout:  # Ubuntu, Fedora
        assert "libc:memory_sbrk_more" in done.stdout
    else:  # Debian
        assert "make sdt-glibc" in done.stdout
    assert "malloc" in done.stdout and "seen as realloc" in done.stdout


# ---- bad input: one line, a distinct exit code, never a traceback -----------


def test_no_notes_is_exit_5() -> None:
    assert_one_line(probes_cli("--lib", str(ELF / "no_notes.so")), 5, "has no SDT probes")


def test_not_an_elf_file_is_exit_9(tmp_path: Path) -> None:
    text = tmp_path / "libc.so.6"
    text.write_text("GROUP ( /lib/libc.so.6 )\n")  # a linker script, as /usr/lib/libc.so is
    assert_one_line(probes_cli("--lib", str(text)), 9, "not a readable ELF file")


@pytest.mark.parametrize("keep", [16, 64, 700, 4000])
def test_truncated_elf_is_exit_9(tmp_path: Path, keep: int) -> None:
    cut = tmp_path / "cut.so"
    cut.write_bytes(FIXTURE.read_bytes()[:keep])
    assert_one_line(probes_cli("--lib", str(cut)), 9, "not a readable ELF file")


def note_section() -> tuple[int, int]:
    with open(FIXTURE, "rb") as stream:
        section = ELFFile(stream).get_section_by_name(".note.stapsdt")
        return section["sh_offset"], section["sh_size"]


def test_malformed_note_is_exit_10(tmp_path: Path) -> None:
    data = bytearray(FIXTURE.read_bytes())
    offset, _ = note_section()
    data[offset + 4 : offset + 8] = (0x7FFFFFFF).to_bytes(4, "little")  # descsz past the end
    broken = tmp_path / "broken.so"
    broken.write_bytes(bytes(data))
    assert_one_line(probes_cli("--lib", str(broken)), 10, "runs past its section")


def test_missing_file_is_exit_6(tmp_path: Path) -> None:
    assert_one_line(probes_cli("--lib", str(tmp_path / "nope.so")), 6, "no such library file")


def test_dead_pid_is_exit_6() -> None:
    assert_one_line(probes_cli("--pid", "4194304"), 6, "no process with pid 4194304")


def test_unreadable_process_is_exit_3() -> None:
    # pid 1 belongs to root; another user may not read its maps or root.
    assert_one_line(mtrace_unprivileged("probes", "--pid", "1"), 3, "permission denied")


NOTES_OFFSET, NOTES_SIZE = note_section()


@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(st.integers(0, NOTES_SIZE - 1), st.integers(0, 255)), min_size=1, max_size=8
    ),
    st.sampled_from(["notes", "anywhere"]),
)
def test_damaged_files_give_a_note_error_or_sites_never_a_crash(
    tmp_path: Path, flips: list[tuple[int, int]], where: str
) -> None:
    data = bytearray(FIXTURE.read_bytes())
    for position, value in flips:
        index = NOTES_OFFSET + position if where == "notes" else position * 7 % len(data)
        data[index] = value
    damaged = tmp_path / "damaged.so"
    damaged.write_bytes(bytes(data))
    try:
        sites = read_sites(damaged)
    except (NotElfError, MalformedNoteError, TargetError):
        return
    assert all(site.provider and site.name for site in sites)
