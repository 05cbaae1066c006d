"""Facts of files kept between runs (probes/elf/facts.py), on this machine's
libc, without root: a fact read back is the fact the file gives, a changed
file is read again alone, and a document that cannot be trusted or read is
never used."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import shutil
from pathlib import Path

import pytest
from mtrace_live.probes import alloc_sites as sites_module
from mtrace_live.probes import lock_sites
from mtrace_live.probes.alloc_sites import alloc_sites
from mtrace_live.probes.cpython import interpreter, threads
from mtrace_live.probes.elf import facts
from mtrace_live.probes.elf import file as file_module
from mtrace_live.probes.elf.file import elf_layout, layout_of, open_elf
from mtrace_live.probes.elf.symbols import exported_offset
from mtrace_live.probes.errors import NotElfError, UnknownLayoutError
from mtrace_live.probes.lock_sites import lock_wait_site
from mtrace_live.tracer.processes.target import default_libc

read_sites = inspect.unwrap(alloc_sites)  # the sites read from the file itself, never kept


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The plan cache in a folder of the test's; its document's path."""
    directory = tmp_path / "plans"
    monkeypatch.setenv(facts.ENVIRONMENT, str(directory))
    return directory / facts.FOLDER / facts.document_name()


@pytest.fixture
def libc(tmp_path: Path) -> Path:
    """A copy of this machine's libc, to change."""
    copy = tmp_path / "libc.so.6"
    shutil.copyfile(default_libc(), copy)
    return copy


def next_run() -> facts.FactStore:
    """What the next trace's start reads: the document, anew."""
    facts.save()
    facts._STORE = None
    return facts.fact_store()


def unreadable(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on, reading an ELF file for sites fails: a fact given now
    comes from the document."""

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the file was read again")

    monkeypatch.setattr(sites_module, "open_elf", refuse)
    monkeypatch.setattr(lock_sites, "open_elf", refuse)


def test_facts_read_back_are_what_the_file_gives(
    cache: Path, libc: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN the libc's sites, lock-wait site and an exported offset, read once and kept
    sites = alloc_sites(libc)
    lock = lock_wait_site(libc)
    offset = exported_offset(libc, "pthread_exit")
    assert sites and lock is not None and offset is not None
    store = next_run()
    assert cache.is_file()
    assert not cache.stat().st_mode & 0o077 and not cache.parent.stat().st_mode & 0o077
    # WHEN the next start asks for them, the file unreadable for them
    unreadable(monkeypatch)
    # THEN each is given whole from the document, equal to the file's own
    # (read without the cache before the file was made unreadable)
    assert alloc_sites(libc) == sites
    assert lock_wait_site(libc) == lock
    assert exported_offset(libc, "pthread_exit") == offset
    assert (store.hits, store.misses) == (3, 0)


def test_the_facts_equal_reading_the_file_without_the_cache(cache: Path, libc: Path) -> None:
    kept = alloc_sites(libc, follow_moves=True)
    next_run()
    assert alloc_sites(libc, follow_moves=True) == read_sites(libc, follow_moves=True)
    assert kept == read_sites(libc, follow_moves=True)
    # (other arguments are another fact)
    assert alloc_sites(libc) == read_sites(libc)


def test_a_changed_file_is_read_again_alone(cache: Path, libc: Path, tmp_path: Path) -> None:
    # GIVEN the facts of two files kept
    other = tmp_path / "other.so"
    shutil.copyfile(default_libc(), other)
    alloc_sites(libc)
    alloc_sites(other)
    next_run()
    # WHEN one of them changes (a byte more: another size and time)
    with open(libc, "ab") as file:
        file.write(b"\0")
    store = facts.fact_store()
    # THEN its facts are read again, from the file as it is now
    assert alloc_sites(libc) == read_sites(libc)
    assert (store.hits, store.misses) == (0, 1)
    # AND the other's are still kept
    alloc_sites(other)
    assert (store.hits, store.misses) == (1, 1)


@pytest.mark.parametrize(
    "spoil",
    [
        "writable",
        "garbage",
        "foreign type",
        "other code",
        "entry not a map",
        "facts not a map",
        "time not a number",
        "no files",
    ],
)
def test_a_document_that_cannot_be_trusted_or_read_is_never_used(
    cache: Path, libc: Path, monkeypatch: pytest.MonkeyPatch, spoil: str
) -> None:
    # GIVEN a kept document, then spoiled
    alloc_sites(libc)
    next_run()
    document = json.loads(cache.read_text())
    if spoil == "writable":
        os.chmod(cache, 0o666)  # anyone could have written it
    elif spoil == "garbage":
        cache.write_text("{not json")
    elif spoil == "foreign type":  # a value naming a type never registered
        for entry in document["files"].values():
            for key in entry["facts"]:
                entry["facts"][key] = {"~m": [["malloc", {"~d": "Popen", "f": {"args": "sh"}}]]}
        cache.write_text(json.dumps(document))
    elif spoil == "other code":  # facts read by another version of the code
        document["code"] = "0" * 64
        cache.write_text(json.dumps(document))
    elif spoil == "no files":  # of this code, its files left out
        del document["files"]
        cache.write_text(json.dumps(document))
    else:  # JSON, of this code, but not the document's shape
        for ident, entry in document["files"].items():
            if spoil == "entry not a map":
                document["files"][ident] = [entry]
            elif spoil == "facts not a map":
                entry["facts"] = list(entry["facts"].items())
            else:
                entry["used"] = "yesterday"
        cache.write_text(json.dumps(document))
    facts._STORE = None
    # WHEN the next start asks for the sites
    store = facts.fact_store()
    found = alloc_sites(libc)
    # THEN they are read from the file, not the document, and kept anew
    assert store.hits == 0 and store.misses == 1
    assert found == read_sites(libc)
    store.save()
    facts._STORE = None
    assert alloc_sites(libc) == found and facts.fact_store().hits == 1


def test_nothing_is_kept_with_the_cache_off(monkeypatch: pytest.MonkeyPatch, libc: Path,
                                            tmp_path: Path) -> None:  # fmt: skip
    monkeypatch.setenv(facts.ENVIRONMENT, "off")
    facts._STORE = None
    assert alloc_sites(libc) == read_sites(libc)
    facts.save()
    assert facts.fact_store().path is None and not facts.fact_store().files


def test_an_unwritable_cache_never_fails_a_start(monkeypatch: pytest.MonkeyPatch, libc: Path,
                                                 tmp_path: Path) -> None:  # fmt: skip
    # GIVEN a plan cache whose directory is a file (it cannot be made)
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    monkeypatch.setenv(facts.ENVIRONMENT, str(blocked))
    facts._STORE = None
    # WHEN facts are read and kept, THEN they are the file's, and saving says nothing
    assert alloc_sites(libc) == read_sites(libc)
    facts.save()


@pytest.mark.parametrize("value", [None, 7, "x", (1, "a"), [1, (2, 3)], frozenset({"a", "b"}),
                                   {"k": (1, None)}, {(1, 2): "tuple key"}, b"\x00\xff",
                                   Path("/usr/lib")])  # fmt: skip
def test_plain_values_survive_the_document(value: object) -> None:
    assert facts.decode_fact(json.loads(json.dumps(facts.encode_fact(value)))) == value


def test_a_value_of_an_unknown_kind_is_not_kept() -> None:
    with pytest.raises(TypeError):
        facts.encode_fact(object())


def test_a_layout_kept_is_peeked_without_opening_the_file(
    cache: Path, libc: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN a libc's layout (build-id, PT_LOAD segments) read from the file itself
    with open_elf(libc) as elf:
        truth = layout_of(elf)
    assert truth[0] and truth[1]
    # THEN nothing is kept for it before it is asked
    assert facts.peek(elf_layout, libc) is None
    # WHEN a reader that had it open keeps it, and the next run peeks
    facts.keep(elf_layout, truth, libc)
    next_run()
    monkeypatch.setattr(file_module, "open_elf", None)  # (any open would fail)
    # THEN the next run has it, as the file gives it, without opening the file
    assert facts.peek(elf_layout, libc) == truth
    assert elf_layout(libc) == truth
    # AND another file (a copy: another inode) has none kept
    other = tmp_path / "other.so"
    shutil.copyfile(libc, other)
    assert facts.peek(elf_layout, other) is None


def test_what_a_file_is_to_cpython_is_kept_and_read_without_opening_it(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN files of each kind: an interpreter (Debian's python3.11, libpython
    # linked in), a program that needs a libpython (pyenv's), one with
    # neither, and a file that is not ELF
    pyenv = Path("/root/.pyenv/versions/3.12.1")
    files = {Path("/usr/bin/python3.11"): interpreter.INTERPRETER,
             pyenv / "bin/python3.12": interpreter.LINKS_LIBPYTHON,
             pyenv / "lib/libpython3.12.so.1.0": interpreter.INTERPRETER,
             Path("/bin/true"): interpreter.NO_INTERPRETER}  # fmt: skip
    text = tmp_path / "script.py"
    text.write_text("#!/usr/bin/python3\n")
    files[text] = interpreter.NOT_ELF
    # WHEN a run asks what each is, and the next run asks again with no
    # file able to be opened
    first = {path: interpreter.python_kind(path) for path in files}
    next_run()
    monkeypatch.setattr(interpreter, "open_elf", None)  # (any open would fail)
    again = {path: interpreter.python_kind(path) for path in files}
    # THEN the first run found each file's kind, and the next run the same, kept
    assert first == files
    assert again == files
    # AND a file kept as no interpreter, or as not ELF, is answered without
    # opening it by the interpreter's reader (the one a process's files go through)
    assert interpreter.find_interpreter(Path("/bin/true")) is None
    with pytest.raises(NotElfError):
        interpreter.find_interpreter(text)


def test_an_interpreter_and_the_libc_s_key_slot_are_kept_and_read_without_opening_them(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN a libpython with an interpreter (pyenv's 3.12, with its symbol
    # table), Debian's python3.11 (stripped, libpython linked in), this
    # machine's libc, and Python 3.10's libpython (a layout refused)
    libpython = Path("/root/.pyenv/versions/3.12.1/lib/libpython3.12.so.1.0")
    debian = Path("/usr/bin/python3.11")
    old = Path("/root/.pyenv/versions/3.10.13/lib/libpython3.10.so.1.0")
    # WHEN a run reads their interpreters and the libc's thread-key slot,
    # and the next run reads them again with no file able to be opened
    # (through another path to the same file: a symbolic link)
    first = {path: interpreter.find_interpreter(path) for path in (libpython, debian)}
    segments = interpreter.interpreter_facts(libpython)[1]
    slot = threads.thread_slot(default_libc())
    with pytest.raises(UnknownLayoutError) as refused:
        interpreter.find_interpreter(old)
    next_run()
    monkeypatch.setattr(interpreter, "open_elf", None)  # (any open would fail)
    monkeypatch.setattr(threads, "open_elf", None)
    linked = tmp_path / "libpython-link.so"
    linked.symlink_to(libpython)
    again = interpreter.find_interpreter(linked)
    # THEN each interpreter is the one read, named by the path it was asked by
    assert all(found is not None for found in first.values())
    assert again == dataclasses.replace(first[libpython], path=linked)  # type: ignore[arg-type]
    assert interpreter.find_interpreter(debian) == first[debian]
    assert interpreter.interpreter_facts(linked)[1] == segments and segments
    # AND the slot is the one read; the refusal is said again, in the same words
    assert threads.thread_slot(default_libc()) == slot
    with pytest.raises(UnknownLayoutError) as again_refused:
        interpreter.find_interpreter(old)
    assert str(again_refused.value) == str(refused.value)


def test_a_run_whose_facts_are_all_kept_writes_nothing_but_a_last_use_a_day_old(
    cache: Path, libc: Path
) -> None:
    # GIVEN a fact kept by a first run, its document written
    first = elf_layout(libc)
    next_run()
    written = cache.read_bytes()
    os.utime(cache, (1, 1))  # (an mtime that a write would change)
    # WHEN a second run reads it and ends
    assert elf_layout(libc) == first and facts.fact_store().hits == 1
    store = next_run()
    # THEN the document was not written again
    assert cache.stat().st_mtime == 1 and cache.read_bytes() == written
    # AND WHEN its file's last use, as saved, is over a day old, a run that
    # reads it saves its use again (the least recently used files go first)
    (entry,) = store.files.values()
    entry["used"] -= facts.USED_REFRESH_S + 60
    assert elf_layout(libc) == first
    next_run()
    assert cache.stat().st_mtime != 1
    (saved,) = json.loads(cache.read_text())["files"].values()
    assert saved["used"] > written_use(written)


def written_use(document: bytes) -> float:
    """The last use a document saved of its one file."""
    (entry,) = json.loads(document)["files"].values()
    return float(entry["used"])


# A process whose files may hold 64 bytes (RLIMIT_FSIZE: a disk that fills
# under a write), writing a document larger than that.
FULL_WRITE = """
import resource, signal, sys
from pathlib import Path
from mtrace_live.probes.elf import facts
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
try:
    facts.write_private_json(Path(sys.argv[1]), {"files": "x" * 1000})
except OSError as exc:
    print(exc.errno)
"""


def test_a_write_that_fails_midway_leaves_no_file_behind(tmp_path: Path) -> None:
    # GIVEN a document kept already, and a write of a new one that fails
    # partway (the file may not grow past 64 bytes)
    import errno
    import subprocess
    import sys

    path = tmp_path / "files" / "facts-x.json"
    facts.write_private_json(path, {"kept": 1})
    done = subprocess.run([sys.executable, "-c", FULL_WRITE, str(path)], capture_output=True,
                          text=True, check=True)  # fmt: skip
    # THEN the write said so, the document kept is whole, and no partial file is left
    assert done.stdout.strip() == str(errno.EFBIG)
    assert json.loads(path.read_text()) == {"kept": 1}
    assert sorted(p.name for p in path.parent.iterdir()) == ["facts-x.json"]


def test_a_save_removes_what_killed_writers_left_an_hour_ago(cache: Path, libc: Path) -> None:
    # GIVEN a writer's temporary file from two hours ago, and one being written now
    folder = cache.parent
    folder.mkdir(parents=True, exist_ok=True)
    stale, fresh = folder / "tmpold.tmp", folder / "tmpnew.tmp"
    for path in (stale, fresh):
        path.write_bytes(b"{")
    two_hours_ago = os.stat(stale).st_mtime - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    # WHEN a start keeps a fact and saves
    exported_offset(libc, "malloc")
    facts.save()
    # THEN the old one is gone and the one being written is left alone
    assert not stale.exists() and fresh.exists()
