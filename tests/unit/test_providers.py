"""Which allocator a process or a command will call (tracer/processes/providers.py):
the libraries preloaded by LD_PRELOAD and by /etc/ld.so.preload, as the
dynamic linker reads them (ld.so(8); glibc's rtld.c: LD_PRELOAD's first,
names split by white space or ':', a '#' comment to the line's end), and a
command asked without a dynamic linker to ask."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from mtrace_live.tracer.processes.providers import _preloaded, of_command, of_process

from .needs import needs

LIBS = Path("/usr/lib/x86_64-linux-gnu")
JEMALLOC = LIBS / "libjemalloc.so.2"
LD_SO = Path("/lib64/ld-linux-x86-64.so.2")


def test_ld_so_preload_is_read_after_ld_preload_without_its_comments(tmp_path: Path) -> None:
    # GIVEN a process's /proc directory: LD_PRELOAD in its environment, and its
    # root's /etc/ld.so.preload with a commented-out line and a trailing comment
    (tmp_path / "environ").write_bytes(
        b"HOME=/root\0LD_PRELOAD=/opt/a/libfirst.so:/opt/b/libsecond.so libthird.so\0TERM=xterm\0"
    )
    (tmp_path / "root" / "etc").mkdir(parents=True)
    (tmp_path / "root" / "etc" / "ld.so.preload").write_text(
        f"# {LIBS}/libtcmalloc_minimal.so.4 (off while db is profiled)\n"
        f"  {JEMALLOC}\n"
        "libmimalloc.so.2:libz.so.1 #trailing: libfake.so\n"
        "\tlibend.so"  # no newline at the end
    )
    # THEN the names are LD_PRELOAD's, then the file's, and no comment's
    assert _preloaded(tmp_path) == [
        "libfirst.so", "libsecond.so", "libthird.so",
        "libjemalloc.so.2", "libmimalloc.so.2", "libz.so.1", "libend.so",
    ]  # fmt: skip


def test_a_process_without_either_preloads_nothing(tmp_path: Path) -> None:
    # GIVEN a /proc directory with no environment readable and no ld.so.preload
    # (a process gone, a root without the file)
    (tmp_path / "root" / "etc").mkdir(parents=True)
    assert _preloaded(tmp_path) == []


def test_a_running_process_s_ld_preload_binds_its_malloc() -> None:
    # GIVEN cat, started with jemalloc in LD_PRELOAD, and past its loading (it
    # echoed a line back)
    needs(JEMALLOC.exists(), f"{JEMALLOC} (make setup installs the allocators' packages)")
    with subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          env={**os.environ, "LD_PRELOAD": str(JEMALLOC)}) as cat:  # fmt: skip
        assert cat.stdin is not None and cat.stdout is not None
        cat.stdin.write(b"loaded\n")
        cat.stdin.flush()
        assert cat.stdout.readline() == b"loaded\n"
        # WHEN its providers are found from /proc
        preloaded = _preloaded(Path(f"/proc/{cat.pid}"))
        found = of_process(cat.pid)
        cat.stdin.close()  # cat ends
    # THEN jemalloc is preloaded, and malloc binds to it, glibc traced beside
    assert preloaded[:1] == ["libjemalloc.so.2"]
    assert found.binding is not None and found.binding.label == "jemalloc (libjemalloc.so.2)"
    assert {p.allocator.name for p in found.all} >= {"jemalloc", "glibc"}


def test_a_command_asked_without_a_dynamic_linker_is_its_executable_alone(
    tmp_path: Path,
) -> None:
    # GIVEN /bin/true, and a program that defines (and exports) its own malloc
    source = tmp_path / "own_malloc.c"
    source.write_text(
        "#include <stddef.h>\n"
        "static char heap[1 << 16]; static size_t used;\n"
        "void *malloc(size_t n) { void *p = heap + used; used += (n + 15) & ~15UL; return p; }\n"
        "void free(void *p) { (void)p; }\n"
        "int main(void) { return malloc(1) == NULL; }\n"
    )
    own = tmp_path / "own_malloc"
    subprocess.run(["gcc", "-rdynamic", "-o", str(own), str(source)], check=True)
    # WHEN each is asked of no dynamic linker (none was found for the libc)
    plain = of_command(["/bin/true"], None)
    built_in = of_command([str(own)], None)
    # THEN no library is guessed: /bin/true binds to nothing known, and the
    # program's own malloc is its binding, an allocator of no one's marks
    assert plain.binding is None and plain.all == ()
    assert built_in.binding is not None and built_in.binding.path == own
    assert built_in.unknown_binding is not None and built_in.all == ()
    # AND asked of the dynamic linker, /bin/true binds to the libc it lists
    needs(LD_SO.exists(), f"{LD_SO}")
    listed = of_command(["/bin/true"], LD_SO)
    assert listed.binding is not None and listed.binding.allocator.name == "glibc"
