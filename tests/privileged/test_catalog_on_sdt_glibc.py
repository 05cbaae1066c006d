"""The catalog and the listings against the real SDT-enabled glibc 2.36."""

import json
import os
import re
import subprocess
import time
from pathlib import Path

from mtrace_live.probes.catalog import compare, load_catalog
from mtrace_live.probes.sdt_notes import read_sites
from mtrace_live.tracer.processes.sdt_glibc import SdtGlibc

from .conftest import MTRACE
from .tracing import Reaper


def test_every_libc_entry_matches_the_built_libc_notes(sdt: SdtGlibc) -> None:
    # GIVEN the notes of the built libc, 78 sites under 57 names
    sites = read_sites(sdt.libc)
    assert len(sites) == 78
    # WHEN they are compared with the catalog
    result = compare(load_catalog(), sites, ["libc"])
    # THEN every probe is known, none is missing, and every site's argument
    # count, sizes and signedness equal the catalog's types
    assert result.mismatches == []
    assert result.unknown == []
    assert result.missing == []
    assert len(result.present) == 57


def test_every_rtld_entry_matches_the_built_ld_so(sdt: SdtGlibc) -> None:
    ld_so = sdt.libc.parent / "elf" / "ld.so"
    result = compare(load_catalog(), read_sites(ld_so), ["rtld"])
    assert result.mismatches == []
    assert result.unknown == []
    # dl-load.c's map_failed site is not in this build of ld.so
    assert result.missing == ["rtld:map_failed"]


def readelf_notes(path: Path) -> list[tuple[str, str, int, str]]:
    text = subprocess.run(
        ["readelf", "-n", str(path)], check=True, capture_output=True, text=True
    ).stdout
    pattern = re.compile(
        r"Provider: (\S+)\s+Name: (\S+)\s+Location: (0x[0-9a-f]+).*?\n\s+Arguments: ?([^\n]*)"
    )
    return [(p, n, int(loc, 16), args.strip()) for p, n, loc, args in pattern.findall(text)]


def note_text(arg: dict[str, object]) -> str:
    """An argument back in the note's own form, e.g. -4@%esi."""
    return f"{'-' if arg['signed'] else ''}{arg['size']}@{arg['location']}"


def test_probes_listing_agrees_with_readelf(sdt: SdtGlibc) -> None:
    # GIVEN readelf's view of the notes
    expected = sorted(readelf_notes(sdt.libc))
    assert len(expected) == 78
    # WHEN mtrace-live lists the same file as JSON
    done = subprocess.run(
        [*MTRACE, "probes", "--lib", str(sdt.libc), "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    (listing,) = json.loads(done.stdout)
    ours = sorted(
        (
            p["provider"], p["name"], site["address"],
            " ".join(note_text(a) for a in site["arguments"]),
        )
        for p in listing["probes"]
        for site in p["sites"]
    )  # fmt: skip
    # THEN every site, address and argument string is the same
    assert ours == expected
    assert all(p["known"] for p in listing["probes"])


def test_doctor_passes_for_the_sdt_glibc(sdt: SdtGlibc) -> None:
    done = subprocess.run(
        [*MTRACE, "doctor", "--lib", str(sdt.libc)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    # privileges, kernel, tracefs, headers, bcc, allocation functions, libc
    # probes, libc debug info, derived probes, lock wait times, six
    # tracepoints, which are raw, and how uprobes are attached
    assert len(lines) == 18
    assert all(line.startswith("ok") for line in lines), lines


def test_doctor_names_cause_and_fix_for_the_system_libc() -> None:
    done = subprocess.run([*MTRACE, "doctor"], capture_output=True, text=True, timeout=120)
    libc_line = next(line for line in done.stdout.splitlines() if "libc probes" in line)
    # a libc without probes is not a failure: the allocation functions are traced
    assert done.returncode == 0, done.stdout
    if libc_line.startswith("ok"):  # a distro whose libc has probes
        return
    assert libc_line.startswith("--")  # unavailable, said with its cause and fix
    assert "built without --enable-systemtap" in libc_line
    assert "make sdt-glibc" in libc_line
    allocs = next(line for line in done.stdout.splitlines() if "allocation functions" in line)
    assert allocs.startswith("ok") and "malloc+0" in allocs and "free+3" in allocs


def test_probes_of_a_running_process_list_its_libc_and_ld_so(sdt: SdtGlibc) -> None:
    # GIVEN a process running under the SDT glibc (through its testrun.sh,
    # which execs ld.so in the same pid)
    with Reaper() as reaper:
        proc = reaper.add(subprocess.Popen(sdt.wrap(["/bin/sleep", "60"])))
        # (ld.so is mapped first and maps the libc after it: wait for both;
        # the maps name the libc.so.6 link's file)
        deadline = time.monotonic() + 30
        maps = Path(f"/proc/{proc.pid}/maps")
        while not all(
            path in maps.read_text() for path in ("/elf/ld.so", os.path.realpath(sdt.libc))
        ):
            assert time.monotonic() < deadline, "the process never mapped the SDT ld.so and libc"
            time.sleep(0.05)
        # WHEN its probes are listed by pid
        done = subprocess.run(
            [*MTRACE, "probes", "--pid", str(proc.pid), "--json"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    # THEN both the libc and the ld.so it maps are listed, each fully known
    assert done.returncode == 0, done.stderr
    libc, ld_so = json.loads(done.stdout)
    assert os.path.samefile(libc["path"], sdt.libc)
    assert len(libc["probes"]) == 57
    assert ld_so["path"].endswith("/elf/ld.so")
    assert {p["provider"] for p in ld_so["probes"]} == {"rtld"}
    assert ld_so["catalog"]["missing"] == ["rtld:map_failed"]
