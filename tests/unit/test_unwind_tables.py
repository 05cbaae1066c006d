"""The unwinder's tables as user space makes them (tracer/unwind/unwind_tables.py),
without the kernel: the executable mappings of a live process, the rows
kept on disk by build-id, and each mapping's bias to link-time addresses,
checked against the addresses of the functions of this very process."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest
from mtrace_live.probes.elf.cfi import CFA_RSP, ROW, read_cfi, rule_at
from mtrace_live.probes.elf.file import load_segments, open_elf
from mtrace_live.probes.elf.symbols import symbol_table
from mtrace_live.probes.records import UNWIND_FILE_DTYPE, UNWIND_MAP_DTYPE
from mtrace_live.tracer.unwind.unwind_rows import (
    CACHE_FORMAT,
    RowCache,
    file_key,
    kernel_file_key,
    packed,
)
from mtrace_live.tracer.unwind.unwind_tables import UnwindTables, exec_mappings

# the layout of each array the tables write (records.h, unwind.bpf.c)
LAYOUTS = {"unwind_rows": ROW, "unwind_pages": "<u4", "unwind_maps": UNWIND_MAP_DTYPE,
           "unwind_rtld": "<i8", "unwind_files_gen": "<u4"}  # fmt: skip


class Recorder:
    """What the tables write into the program's maps."""

    def __init__(self, vma: bool = False) -> None:
        """``vma``: a program that looks mappings up in the kernel (UNWIND_VMA)."""
        self.arrays: dict[str, dict[int, np.void]] = {}
        self.rows: dict[str, dict[int, tuple[int, ...]]] = {}
        self.entries: dict[str, dict[bytes, bytes]] = {}  # set_entry's, raw
        self.writes = 0  # every write_array and set_row call
        self.vma = vma

    def has_table(self, table: str) -> bool:
        return self.vma and table in ("unwind_files", "unwind_files_gen", "unwind_exec_paths")

    def set_entry(self, table: str, key: bytes, value: bytes) -> bool:
        self.writes += 1
        self.entries.setdefault(table, {})[key] = value
        return True

    def entry_bytes(self, table: str, key: bytes) -> bytes | None:
        return self.entries.get(table, {}).get(key)

    def delete_entry(self, table: str, key: bytes) -> bool:
        return self.entries.get(table, {}).pop(key, None) is not None

    def row_bytes(self, table: str, key: int) -> bytes | None:
        return None

    def write_array(self, table: str, first: int, data: bytes) -> None:
        """Each value of ``data`` (in its array's slots) as a record of its layout."""
        self.writes += 1
        layout = np.dtype(LAYOUTS[table])
        slotted = np.dtype({"names": ["value"], "formats": [layout], "offsets": [0],
                            "itemsize": -(-layout.itemsize // 8) * 8})  # fmt: skip
        target = self.arrays.setdefault(table, {})
        for i, value in enumerate(np.frombuffer(data, dtype=slotted)["value"]):
            target[first + i] = value

    def set_row(self, table: str, key: int, fields: tuple[int, ...],
                only_existing: bool = False) -> bool:  # fmt: skip
        """As the kernel does: with ``only_existing``, refused where there is none."""
        self.writes += 1
        entries = self.rows.setdefault(table, {})
        if only_existing and key not in entries:
            return False
        entries[key] = fields
        return True

    def read_table(self, table: str, key_dtype: str,
                   value_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """A hash map's entries as structured arrays, as BpfProgram reads them."""
        entries = self.rows.get(table, {})
        values = np.array([tuple(v) for v in entries.values()], dtype=value_dtype)
        return np.array(list(entries), dtype=key_dtype), values


@pytest.fixture(scope="module")
def rows_cache(tmp_path_factory: pytest.TempPathFactory) -> RowCache:
    """One cache for the module: each library of this process is read once."""
    return RowCache(tmp_path_factory.mktemp("cfi-rows"))


def libc_mapping() -> Path:
    return next(Path(m.path) for m in exec_mappings(os.getpid()) if "/libc.so" in m.path)


def test_the_executable_mappings_of_a_process_are_its_code() -> None:
    mappings = exec_mappings(os.getpid())
    # THEN this Python's libc is among them, once per executable mapping, as /proc says
    assert any("/libc.so" in m.path for m in mappings)
    assert all(m.end > m.start and m.inode[1] > 0 for m in mappings)
    assert exec_mappings(2**22 + 1) == []  # no such process (above the largest pid_max)


def test_rows_are_kept_by_build_id_and_read_back_only_from_a_private_file(tmp_path: Path) -> None:
    # GIVEN rows at 0x1010, 0x1020 and 0x3030: pages 0x1000 to 0x3000
    cache = RowCache(tmp_path / "cfi")
    rows = np.zeros(3, dtype=ROW)
    rows["pc"], rows["cfa_off"], rows["rbp"] = [0x1010, 0x1020, 0x3030], [8, -16, 24], [1, 2, 3]
    # WHEN they are kept, and read back
    cache.store("ab12", packed(rows))
    kept = cache.load("ab12")
    # THEN they are the same rows, each in its 16 bytes as the kernel's array
    # holds it, and the page index: the row in force at each page's start
    slotted = np.dtype({"names": ["row"], "formats": [ROW], "offsets": [0], "itemsize": 16})
    assert kept is not None and np.array_equal(np.frombuffer(kept.rows, slotted)["row"], rows)
    assert (kept.count, len(kept.rows), kept.page_base) == (3, 48, 0x1000)
    assert bytes(kept.rows[16:28]) == rows[1].tobytes() and bytes(kept.rows[28:32]) == bytes(4)
    assert [int.from_bytes(kept.pages[i : i + 4], "little") for i in (0, 8, 16)] == [0, 1, 1]
    assert cache.load("cd34") is None and cache.load(None) is None
    path = tmp_path / "cfi" / f"ab12.v{CACHE_FORMAT}.rows"
    # a file cut short, or longer than its header says, is not read
    whole = path.read_bytes()
    for damaged in (whole[:-1], whole + bytes(8), whole[:20]):
        path.write_bytes(damaged)
        assert cache.load("ab12") is None
    path.write_bytes(whole)
    assert cache.load("ab12") is not None
    # a file others could have written is not trusted
    os.chmod(path, 0o666)
    assert cache.load("ab12") is None
    # a name that is no build-id makes no path
    cache.store("../x", packed(rows))
    assert not (tmp_path / f"x.v{CACHE_FORMAT}.rows").exists()


def test_a_mapping_s_bias_turns_a_pc_into_the_address_the_cfi_rows_use(
    rows_cache: RowCache,
) -> None:
    # GIVEN this process's libc, and the address of its malloc in this process
    recorder = Recorder()
    # room for every library this test process maps (numpy, capstone, ...), libc among them
    tables = UnwindTables(recorder, rows=1 << 24, pages=1 << 24, cache=rows_cache)  # type: ignore[arg-type]
    assert tables.load(os.getpid())
    libc = ctypes.CDLL(str(libc_mapping()))  # its own malloc, not a PLT entry of the executable
    runtime = ctypes.cast(libc.malloc, ctypes.c_void_p).value
    assert runtime is not None
    with open_elf(libc_mapping()) as elf:
        dynsym = symbol_table(elf, ".dynsym")
        assert dynsym is not None
        linked = next(s.value for s in dynsym if s.name == "malloc" and s.value)
        assert load_segments(elf)
    # WHEN the mapping holding it is found as the BPF search finds it
    maps = recorder.arrays["unwind_maps"]
    first, count, inherited, _ = recorder.rows["unwind_procs"][os.getpid()]
    assert inherited == 0  # its own, written by user space
    entries = [maps[first + i] for i in range(count)]
    assert [int(e["start"]) for e in entries] == sorted(int(e["start"]) for e in entries)
    entry = next(e for e in entries if int(e["start"]) <= runtime < int(e["end"]))
    # THEN its bias gives malloc's link-time address, and its rows are libc's
    assert (runtime - int(entry["bias"])) % (1 << 64) == linked
    rows = np.array([recorder.arrays["unwind_rows"][int(entry["first"]) + i]
                     for i in range(int(entry["count"]))], dtype=ROW)  # fmt: skip
    assert np.array_equal(rows, read_cfi(libc_mapping()).rows)
    assert rule_at(rows, linked)["cfa"] == CFA_RSP  # at a function's entry: %rsp + 8
    # AND writing again with nothing changed writes nothing at all
    assert recorder.writes > 0
    before = recorder.writes
    assert tables.load(os.getpid()) and recorder.writes == before


def test_files_that_do_not_fit_are_counted_and_left_to_frame_pointers(
    rows_cache: RowCache,
) -> None:
    # GIVEN tables with room for 1,000 rows only (libc alone has some 28,000)
    recorder = Recorder()
    tables = UnwindTables(recorder, rows=1000, cache=rows_cache)  # type: ignore[arg-type]
    assert tables.load(os.getpid())
    counts = tables.table_counts()
    # THEN what did not fit is counted, and those mappings have no rows (frame pointers there)
    assert counts["files_not_fitting"] >= 1 and counts["rows_not_fitting"] > 1000
    assert counts["rows"] <= 1000
    first, count, inherited, _ = recorder.rows["unwind_procs"][os.getpid()]
    assert inherited == 0  # its own, written by user space
    maps = recorder.arrays["unwind_maps"]
    malloc = ctypes.cast(ctypes.CDLL(str(libc_mapping())).malloc, ctypes.c_void_p).value
    assert malloc is not None
    entries = [maps[first + i] for i in range(count)]
    libc = next(e for e in entries if int(e["start"]) <= malloc < int(e["end"]))
    assert int(libc["count"]) == 0


def test_mappings_that_do_not_fit_are_counted_and_the_process_left_to_frame_pointers(
    rows_cache: RowCache,
) -> None:
    # GIVEN tables with room for 3 mappings (this process has dozens)
    recorder = Recorder()
    assert len(exec_mappings(os.getpid())) > 3
    tables = UnwindTables(recorder, maps=3, cache=rows_cache)  # type: ignore[arg-type]
    # WHEN its tables are written
    assert not tables.load(os.getpid())
    # THEN nothing is written for it (its stacks are walked by frame
    # pointers), and that is counted
    assert tables.table_counts()["processes_not_fitting"] == 1
    assert os.getpid() not in recorder.rows.get("unwind_procs", {})
    assert "unwind_maps" not in recorder.arrays


def is_free(tables: UnwindTables, block: tuple[int, int]) -> bool:
    """The block's rows of unwind_maps are all in a free run."""
    first, size = block
    return any(f <= first and first + size <= f + n for f, n in tables.maps_room.free)


def test_a_block_a_forked_process_was_given_is_freed_only_once_no_entry_names_it(
    rows_cache: RowCache,
) -> None:
    # GIVEN this process's tables (in a block that does not start at 0), and
    # a child given its block at its fork (the kernel's unwind_fork: the same
    # first and count, marked inherited, with its parent's pid)
    recorder = Recorder()
    tables = UnwindTables(recorder, rows=1 << 24, pages=1 << 24, cache=rows_cache)  # type: ignore[arg-type]
    assert tables._take(5) == (0, 5)
    parent, child = os.getpid(), 2**22 + 7
    assert tables.load(parent)
    block = tables.blocks[parent]
    assert block[0] == 5
    procs = recorder.rows["unwind_procs"]
    procs[child] = (block[0], block[1], 1, parent)
    # WHEN the parent's tables go (it exec'd: the kernel deleted its entry)
    tables.forget(parent)
    del procs[parent]
    # THEN its block is not free while the child's entry names it, however many sweeps
    for _ in range(4):
        tables.sweep()
        assert not is_free(tables, block)
    # AND once the child's entry is gone too, it is freed when two sweeps
    # in a row have found no entry naming it, not before
    del procs[child]
    tables.sweep()
    assert not is_free(tables, block)
    tables.sweep()
    assert is_free(tables, block) and not tables.retired


def retired_block(rows_cache: RowCache) -> tuple[Recorder, UnwindTables, tuple[int, int]]:
    """This process's tables written, then its block retired (it exec'd or
    exited); its entry is still in the recorder, for the test to change."""
    recorder = Recorder()
    tables = UnwindTables(recorder, rows=1 << 24, pages=1 << 24, cache=rows_cache)  # type: ignore[arg-type]
    assert tables.load(os.getpid())
    block = tables.blocks[os.getpid()]
    tables.forget(os.getpid())
    return recorder, tables, block


def test_an_entry_asking_for_its_tables_names_no_block(rows_cache: RowCache) -> None:
    # GIVEN a retired block starting at 0, and a process's empty entry (its
    # tables asked for, not written yet: first and count 0)
    recorder, tables, block = retired_block(rows_cache)
    assert block[0] == 0
    recorder.rows["unwind_procs"] = {os.getpid(): (0, 0, 0, 0)}
    # WHEN swept twice, THEN it is free: the empty entry does not hold it
    for _ in range(2):
        tables.sweep()
    assert is_free(tables, block)


def test_a_retired_block_is_not_freed_by_one_sweep_alone(rows_cache: RowCache) -> None:
    # GIVEN a block retired just now, which no entry names yet (a fork that
    # read the parent's entry just as it was replaced may not have written its own)
    recorder, tables, block = retired_block(rows_cache)
    del recorder.rows["unwind_procs"][os.getpid()]
    # WHEN swept once, it is kept; WHEN the fork's entry then names it, the
    # count starts again
    tables.sweep()
    assert not is_free(tables, block)
    recorder.rows["unwind_procs"][2**22 + 9] = (block[0], block[1], 1, os.getpid())
    tables.sweep()
    del recorder.rows["unwind_procs"][2**22 + 9]
    tables.sweep()
    assert not is_free(tables, block)
    # THEN the second sweep in a row that finds it unnamed frees it
    tables.sweep()
    assert is_free(tables, block)


def test_tables_asked_for_are_written_only_over_the_entry_that_asked(
    rows_cache: RowCache,
) -> None:
    # GIVEN a process that asked for its tables (its empty entry in the
    # kernel), and then one whose entry the kernel deleted (it exec'd or
    # exited after its maps were read)
    recorder = Recorder()
    tables = UnwindTables(recorder, rows=1 << 24, pages=1 << 24, cache=rows_cache)  # type: ignore[arg-type]
    pid = os.getpid()
    recorder.rows["unwind_procs"] = {pid: (0, 0, 0, 0)}
    # WHEN each is written as an ask is
    assert tables.load(pid, new=False)
    _, count, inherited, _ = recorder.rows["unwind_procs"][pid]
    assert count > 0 and inherited == 0
    del recorder.rows["unwind_procs"][pid]
    tables.forget(pid)  # as tables_wanted does for an entry not in force
    room = tables.maps_room.used
    # THEN one whose entry is gone gets none: the block taken for it is free
    # again (as much room as before), and only its old block is retired
    assert not tables.load(pid, new=False)
    assert pid not in recorder.rows["unwind_procs"]
    assert tables.maps_room.used == room
    assert pid not in tables.blocks and len(tables.retired) == 1


def test_a_file_s_entry_gives_a_walk_in_the_kernel_the_bias_the_process_s_tables_give(
    rows_cache: RowCache,
) -> None:
    # GIVEN tables of a program that looks mappings up in the kernel (UNWIND_VMA)
    recorder = Recorder(vma=True)
    tables = UnwindTables(recorder, rows=1 << 24, pages=1 << 24, cache=rows_cache)  # type: ignore[arg-type]
    # WHEN this process's are written
    assert tables.load(os.getpid())
    libc = next(m for m in exec_mappings(os.getpid()) if "/libc.so" in m.path)
    maps = recorder.arrays["unwind_maps"]
    first, count, _, _ = recorder.rows["unwind_procs"][os.getpid()]
    entry = next(
        maps[first + i] for i in range(count) if int(maps[first + i]["start"]) == libc.start
    )
    # THEN libc's entry of unwind_files, by the kernel's (device, inode), names the same rows
    key = file_key(kernel_file_key(libc.inode))
    raw = recorder.entries["unwind_files"][key]
    file = np.frombuffer(raw, dtype=UNWIND_FILE_DTYPE)[0]
    assert file["written"] == 1
    assert (int(file["first"]), int(file["count"])) == (int(entry["first"]), int(entry["count"]))
    # AND the bias unwind_vma_map works out from the VMA (start, page offset) is the entry's
    assert int(file["seg_start"]) <= libc.offset < int(file["seg_end"])
    bias = (libc.start - libc.offset - int(file["seg_delta"])) % (1 << 64)
    assert bias == int(entry["bias"])
    # AND the generation the kernel compares its unwritten files with was told
    assert int(recorder.arrays["unwind_files_gen"][0]) == len(recorder.entries["unwind_files"])


def test_mappings_without_rows_are_left_to_the_kernel_s_lookup(tmp_path: Path) -> None:
    # GIVEN a process mapping a file of no CFI (an empty rows cache, room for no row)
    for vma in (False, True):
        recorder = Recorder(vma=vma)
        tables = UnwindTables(recorder, rows=1, pages=1, cache=RowCache(tmp_path / str(vma)))  # type: ignore[arg-type]
        # WHEN its tables are written (no file fits: none has rows)
        tables.load(os.getpid())
        _, count, _, _ = recorder.rows["unwind_procs"][os.getpid()]
        # THEN without lookups in the kernel, each mapping is there, walked by frame
        # pointers; with them, none is: the kernel looks them up
        assert count == (0 if vma else len(exec_mappings(os.getpid())))


def copies(tmp_path: Path, *names: str) -> list[Path]:
    """Copies of libraries of the machine: files no process maps."""
    made = []
    for name in names:
        made.append(tmp_path / name)
        made[-1].write_bytes(Path("/usr/lib/x86_64-linux-gnu", name).read_bytes())
    return made


def file_of(tables: UnwindTables, path: Path) -> tuple[int, int] | None:
    """The file's run of rows in the tables (first, count), if it has one."""
    status = path.stat()
    known = tables.by_inode.get((status.st_dev, status.st_ino))
    return None if known is None or not known.count else (known.first, known.count)


def test_a_file_no_process_maps_is_evicted_for_one_that_does_not_fit(
    tmp_path: Path, rows_cache: RowCache
) -> None:
    # GIVEN tables with room for the larger of two files, not both, neither
    # mapped by any process
    libm, libz = copies(tmp_path, "libm.so.6", "libz.so.1")
    sizes = len(read_cfi(libm).rows), len(read_cfi(libz).rows)
    recorder = Recorder(vma=True)
    tables = UnwindTables(recorder, rows=max(sizes) + 10, cache=rows_cache)  # type: ignore[arg-type]
    tables.publish_path(libm)
    first = file_of(tables, libm)
    assert first is not None and first[1] == sizes[0]
    # WHEN the second is written
    tables.publish_path(libz)
    # THEN the first was evicted for it: its rows given to the second, its
    # entry for the kernel's lookups gone (asked for again if it is met)
    second = file_of(tables, libz)
    assert second is not None and second[1] == sizes[1] and second[0] == 0
    assert file_of(tables, libm) is None
    counts = tables.table_counts()
    assert counts["files_evicted"] == 1 and counts["files_not_fitting"] == 0
    status = libm.stat()
    key = file_key(kernel_file_key((status.st_dev, status.st_ino)))
    assert recorder.entry_bytes("unwind_files", key) is None
    assert counts["rows"] == sizes[1]


def test_a_file_a_process_maps_is_never_evicted(tmp_path: Path, rows_cache: RowCache) -> None:
    # GIVEN tables with room for this process's libc alone, written
    libc = libc_mapping()
    (libz,) = copies(tmp_path, "libz.so.1")
    recorder = Recorder(vma=True)
    tables = UnwindTables(recorder, rows=len(read_cfi(libc).rows) + 10, cache=rows_cache)  # type: ignore[arg-type]
    tables.publish_path(libc)
    assert file_of(tables, libc) is not None
    # WHEN a file that does not fit beside it is written
    tables.publish_path(libz)
    # THEN the libc, which this process maps, keeps its rows and its entry,
    # and the other file is counted as not fitting
    assert file_of(tables, libc) is not None and file_of(tables, libz) is None
    counts = tables.table_counts()
    assert counts["files_evicted"] == 0 and counts["files_not_fitting"] == 1
    status = libc.stat()
    key = file_key(kernel_file_key((status.st_dev, status.st_ino)))
    assert recorder.entry_bytes("unwind_files", key) is not None
