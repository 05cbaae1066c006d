"""The one reader of a process's mappings (probes/elf/maps.py)."""

from __future__ import annotations

import os
from pathlib import Path

from mtrace_live.probes.elf.maps import Mapping, parse_maps, read_maps

LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
TEXT = "\n".join([
    "00400000-00401000 r-xp 00000000 fd:01 1234       /usr/bin/prog",
    f"7f0000000000-7f0000028000 r--p 00000000 08:02 5678   {LIBC}",
    f"7f0000028000-7f00001bd000 r-xp 00028000 08:02 5678   {LIBC}",
    "01b4f000-01b70000 rw-p 00000000 00:00 0          [heap]",
    "7f0000300000-7f0000400000 rw-p 00000000 00:00 0 ",  # anonymous: the kernel pads with a space
    "7f0000500000-7f0000501000 r-xp 00000000 00:05 99     /tmp/gone (deleted)",
    "not a mapping line",
])  # fmt: skip


def test_each_line_is_read_as_the_kernel_writes_it() -> None:
    found = parse_maps(TEXT)
    assert len(found) == 6
    prog, libc_ro, libc_text, heap, anonymous, deleted = found
    assert prog == Mapping(0x400000, 0x401000, 0, "/usr/bin/prog", True,
                           (os.makedev(0xFD, 1), 1234), "r-xp")  # fmt: skip
    assert not libc_ro.executable and libc_text.executable and libc_text.offset == 0x28000
    assert libc_text.inode == (os.makedev(8, 2), 5678) and libc_text.is_file
    assert heap.path == "[heap]" and not heap.is_file and heap.end == 0x1B70000
    assert anonymous.path == "" and anonymous.inode[1] == 0 and not anonymous.is_file
    assert deleted.path == "/tmp/gone (deleted)"
    # the map_files link's name has no leading zeros, where maps pads to 8 digits
    assert prog.map_files == "400000-401000"


def test_this_process_s_maps_are_read_and_its_map_files_links_open_them() -> None:
    mine = read_maps(Path("/proc/self"))
    libc = next(m for m in mine if "/libc.so" in m.path and m.executable)
    status = os.stat(libc.path)
    assert libc.inode == (status.st_dev, status.st_ino)
    assert os.path.exists(f"/proc/self/map_files/{libc.map_files}")
