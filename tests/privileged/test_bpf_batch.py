"""A start's maps made in one batch of bpf(2) calls (tracer/bpf/bpf_batch.c,
bpf_syscalls.create_maps, bpf_cache.recreate_maps): real maps, which the
kernel then describes (map_info) and bpftool (the peer) shows as asked for;
a definition the kernel refuses says why, and leaves nothing made."""

from __future__ import annotations

import errno
import os

import pytest
from mtrace_live.tracer.bpf import bpf_cache, bpf_syscalls
from mtrace_live.tracer.bpf.bpf_syscalls import MapInfo

from .tracing import bpf_fdinfo, bpftool_show

HASH, ARRAY = 1, 2  # enum bpf_map_type


def spec(fd: int, name: str, kind: int, key: int, value: int, entries: int) -> bpf_cache.MapSpec:
    return bpf_cache.MapSpec(name, fd, fd, kind, key, value, entries, 0, name, "", "")


def open_maps() -> set[int]:
    """The map ids this process holds (its fdinfo)."""
    return {int(fields["map_id"]) for fields in bpf_fdinfo(os.getpid(), "bpf-map").values()
            if "map_id" in fields}  # fmt: skip


def test_each_map_of_a_batch_is_made_as_defined_and_a_refused_one_says_why() -> None:
    # GIVEN three definitions, the second one the kernel refuses (a hash with no key)
    infos = [MapInfo(ARRAY, 4, 24, 1000, 0, "batch_array"),
             MapInfo(HASH, 0, 8, 64, 0, "batch_refused"),
             MapInfo(HASH, 8, 16, 4096, 0, "batch_hash")]  # fmt: skip
    # WHEN they are made in one batch
    results = bpf_syscalls.create_maps(infos)
    try:
        # THEN the refused one gives its errno, and the others are maps
        assert results[1] == -errno.EINVAL
        made = {infos[i].name: results[i] for i in (0, 2)}
        assert all(fd >= 0 for fd in made.values())
        # AS the kernel describes them, and bpftool shows them
        for name, fd in made.items():
            info = bpf_syscalls.map_info(fd)
            assert info == next(i for i in infos if i.name == name)
        fdinfo = bpf_fdinfo(os.getpid(), "bpf-map")
        for name, fd in made.items():
            shown = bpftool_show("map", int(fdinfo[fd]["map_id"]))
            wanted = next(i for i in infos if i.name == name)
            assert (shown["name"], shown["bytes_key"], shown["bytes_value"],
                    shown["max_entries"]) == (name, wanted.key_size, wanted.value_size,
                                              wanted.max_entries)  # fmt: skip
    finally:
        for fd in results:
            if fd >= 0:
                os.close(fd)


def test_a_programs_maps_are_made_by_their_descriptors_or_none_is_left() -> None:
    # GIVEN a program's maps as a compiling run had them (its descriptors 7 and 9)
    before = open_maps()
    specs = [spec(7, "kept_a", ARRAY, 4, 8, 16), spec(9, "kept_b", HASH, 4, 8, 16)]
    # WHEN they are made again
    fds = bpf_cache.recreate_maps(specs)
    assert len(open_maps() - before) == 2
    try:
        # THEN each descriptor has a map of its own, made as defined
        assert sorted(fds) == [7, 9]
        assert bpf_syscalls.map_info(fds[9]) == MapInfo(HASH, 4, 8, 16, 0, "kept_b")
    finally:
        for fd in fds.values():
            os.close(fd)
    # AND where one of them is refused, the error names it and no map is left made
    refused = [*specs, spec(11, "kept_refused", HASH, 0, 8, 16)]
    with pytest.raises(OSError) as raised:
        bpf_cache.recreate_maps(refused)
    assert raised.value.errno == errno.EINVAL and "kept_refused" in str(raised.value)
    assert open_maps() == before
