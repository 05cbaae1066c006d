"""Tracepoint formats, as the running kernel describes them in tracefs.

The kmem tracepoints differ across kernel versions: Linux 6.1 folded
kmalloc_node and kmem_cache_alloc_node into kmalloc and kmem_cache_alloc
(adding a ``node`` field), later kernels added ``name`` to the cache events
and ``accounted``. mtrace-live reads the format files and compiles only the
variant the kernel has.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mtrace_live.probes.errors import NotPrivilegedError, TracepointMissingError

TRACEFS_ROOTS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))


def tracefs_root() -> Path:
    for root in TRACEFS_ROOTS:
        try:
            if (root / "events").is_dir():
                return root
        except PermissionError:
            raise NotPrivilegedError(f"cannot read {root}: permission denied") from None
    raise TracepointMissingError(
        "tracefs is not mounted; mount it with: mount -t tracefs tracefs /sys/kernel/tracing"
    )


def tracepoint_format(category: str, event: str) -> str:
    fmt = tracefs_root() / "events" / category / event / "format"
    try:
        return fmt.read_text(encoding="ascii", errors="replace")
    except PermissionError:
        raise NotPrivilegedError(f"cannot read {fmt}: permission denied") from None
    except FileNotFoundError:
        raise TracepointMissingError(f"this kernel has no tracepoint {category}:{event}") from None


_FIELD = re.compile(
    r"^\s*field:(?P<decl>[^;]+);\s*offset:(?P<offset>\d+);\s*size:(?P<size>\d+);"
    r"\s*signed:(?P<signed>\d+);",
    re.MULTILINE,
)
_NAME = re.compile(r"(\w+)\s*(?:\[\d*\])?\s*$")


@dataclass(frozen=True)
class Field:
    name: str
    c_type: str
    offset: int
    size: int
    signed: bool


@dataclass(frozen=True)
class TracepointFormat:
    category: str
    event: str
    fields: dict[str, Field]

    def has(self, name: str) -> bool:
        return name in self.fields


def parse_format(category: str, event: str, text: str) -> TracepointFormat:
    """The fields of one tracefs ``format`` file, common_* fields left out."""
    fields = {}
    for match in _FIELD.finditer(text):
        decl = match["decl"].strip()
        name_match = _NAME.search(decl)
        if name_match is None:
            continue
        name = name_match[1]
        if name.startswith("common_"):
            continue
        c_type = decl[: name_match.start()].strip()
        fields[name] = Field(
            name, c_type, int(match["offset"]), int(match["size"]), match["signed"] == "1"
        )
    return TracepointFormat(category, event, fields)


# Tracepoints every kernel mtrace-live supports has, with the fields it reads.
KMEM_REQUIRED = {
    "kmalloc": ("call_site", "ptr", "bytes_req", "bytes_alloc", "gfp_flags"),
    "kfree": ("call_site", "ptr"),
    "kmem_cache_alloc": ("call_site", "ptr", "bytes_req", "bytes_alloc", "gfp_flags"),
    "kmem_cache_free": ("call_site", "ptr"),
    "mm_page_alloc": ("pfn", "order", "gfp_flags"),
    "mm_page_free": ("pfn", "order"),
}
# Variants: present on some kernels only.
KMEM_OPTIONAL = ("kmalloc_node", "kmem_cache_alloc_node", "mm_page_free_batched")


def kmem_defines(read: Callable[[str, str], str]) -> dict[str, int]:
    """kmem.bpf.c's variant switches for this kernel; ``read(category,
    event)`` returns a format file's text or raises TracepointMissingError."""
    formats = {}
    for event, needed in KMEM_REQUIRED.items():
        fmt = parse_format("kmem", event, read("kmem", event))
        absent = [name for name in needed if not fmt.has(name)]
        if absent:
            raise TracepointMissingError(
                f"tracepoint kmem:{event} lacks the fields {', '.join(absent)} mtrace-live reads"
            )
        formats[event] = fmt
    present = {}
    for event in KMEM_OPTIONAL:
        with contextlib.suppress(TracepointMissingError):
            present[event] = parse_format("kmem", event, read("kmem", event))
    return {
        "KMALLOC_HAS_NODE": int(formats["kmalloc"].has("node")),
        "CACHE_ALLOC_HAS_NODE": int(formats["kmem_cache_alloc"].has("node")),
        "HAVE_CACHE_NAME": int(formats["kmem_cache_alloc"].has("name")),
        "HAVE_KMALLOC_NODE": int("kmalloc_node" in present),
        "HAVE_CACHE_ALLOC_NODE": int("kmem_cache_alloc_node" in present),
        "HAVE_PAGE_FREE_BATCHED": int("mm_page_free_batched" in present),
    }
