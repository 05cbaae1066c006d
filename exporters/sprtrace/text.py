"""sp-rtrace text reports: write, read back, and post-process (leaks,
compress), as ../shared/specs/sp-rtrace-text-protocol.txt defines them.

The line formats follow the protocol and what sp-rtrace's own tools read:

    version=1.0,arch=x86_64,timestamp=2026.11.21 08:30:00,process=app,pid=42,...
    <1> : kmalloc (kernel kmalloc() allocations)
    @ 1 : context name
    : /usr/lib/libc.so.6 => 0x7f0000000000-0x7f0000200000
    12. [00:00:01.250] kmalloc<kmalloc>(192) = 0xffff888004a1c000
    \t$1 = 256
    \t0xffffffff81a2b3c4 in sock_alloc_inode() from [kernel.kallsyms]
    (an empty line ends each backtrace)
    13. kfree<kmalloc>(0xffff888004a1c000)
    # temporary comment (dropped by the next post-processing run)
    ## permanent comment (passed through)

Lines are read the way sp-rtrace's own parser reads them:
- a call's function is everything between the index (with its optional
  ``@context`` and ``[timestamp]``) and the resource type or the size, so
  ``1. @zz malloc<memory>(5) = 0x1000`` is a call of ``@zz malloc``;
- a backtrace frame is a hex address and then any text: unresolved
  (``\t0x400100``), or as a resolver wrote it (``\t0x400100 in ??``,
  ``\t0x... func() from /path/lib.so``, ``\t0x... func() at file.c:214``);
- a call without a resource type belongs to the first registered resource
  (the protocol omits the type when one resource is traced); a call naming
  a resource that no earlier registry line lists is an error, since
  sp-rtrace's tools would read it as no resource at all.
Module paths are written with white space and backslashes as octal escapes
(``\040``, as the kernel writes paths in /proc/mounts), because sp-rtrace
reads a map line's path as one word: ``/memfd:x (deleted)`` is written
``/memfd:x\040(deleted)``, and read back as it was.
Unrecognised lines are comments and are kept as they are; a line that is
plainly a call, backtrace, argument or map record but malformed is an error
naming its line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TextIO

from mtrace_live.probes.errors import SpRtraceError

HEADER_KEYS = (
    "version",
    "arch",
    "timestamp",
    "process",
    "pid",
    "filter",
    "backtrace depth",
    "origin",
)
FILTERS = ("leaks", "compress", "resolve")  # the header's filter tags, in this order
MAX_SIZE = (1 << 63) - 1

MAX_DIGITS = 20  # an index, size or time field longer than this is refused, never parsed
# An index starts with a digit (sp-rtrace reads it with %d); "Note. f(1) = 0x1"
# is a comment, "1x. f(1) = 0x1" a malformed call.
_CALL_HEAD = re.compile(r"^(?P<index>[0-9][^\s.]*)\. (?P<rest>.*)$")
_CONTEXT_FIELD = re.compile(r"@(?P<context>[0-9a-fA-F]+)\S* ")
_TIME_FIELD = re.compile(r"\[(?P<h>[0-9]+):(?P<m>[0-9]+):(?P<s>[0-9]+)\.(?P<ms>[0-9]+)\]\S* ")
_CALL_TAIL = re.compile(r"^\((?P<inner>[^)]*)\)(?: = (?P<id>\S+))?\s*$")
_FRAME = re.compile(r"^\t(?P<address>\S+)(?: (?P<tail>.*?))?\s*$")
_TAIL = re.compile(
    r"^(?:in )?(?P<function>.*?)(?:\(\))?"
    r"(?:(?:^| )from (?P<module>.+)|(?:^| )at (?P<location>\S+))?$"
)
_ARG = re.compile(r"^\t\$(?P<n>[0-9]+) = (?P<value>.*)$")
# The path is one word as C's %s reads it: other Unicode spaces belong to it.
_MMAP = re.compile(r"^: (?P<module>[^ \t\n\r\v\f]+) => (?P<start>\S+)-(?P<end>\S+)\s*$")
_ESCAPED = re.compile(r"\\([0-7]{3})")
_CONTEXT = re.compile(r"^@ (?P<id>[0-9a-fA-F]+) : (?P<name>.+)$")
_RESOURCE = re.compile(
    r"^<(?P<id>[0-9a-fA-F]+)> : (?P<type>\S+) \((?P<desc>[^)]*)\)(?: \[(?P<flags>[^\]]*)\])?\s*$"
)
_ATTACHMENT = re.compile(r"^& (?P<name>\S+) : (?P<path>\S+)\s*$")


_SPLITS = frozenset(" \t\n\r\v\f\\")  # what C's %s stops at (isspace), and the escape itself


def escape_path(path: str) -> str:
    """A module path as one word: ASCII white space and backslashes octal-escaped."""
    return "".join(f"\\{ord(c):03o}" if c in _SPLITS else c for c in path)


def unescape_path(word: str) -> str:
    return _ESCAPED.sub(lambda m: chr(int(m[1], 8)), word)


@dataclass
class Frame:
    address: int
    function: str | None = None
    module: str | None = None
    location: str | None = None  # file:line
    # The text after the address, as read: written back as it was (a resolver's forms).
    written: str | None = field(default=None, compare=False)

    def text(self) -> str:
        line = f"\t{self.address:#x}"
        if self.written is not None:
            return f"{line} {self.written}" if self.written else line
        if self.function:
            line += f" in {self.function}()"
        if self.location:
            line += f" at {self.location}"
        elif self.module:
            line += f" from {escape_path(self.module)}"
        return line


def clock(ms: int) -> str:
    """A call's timestamp, HH:MM:SS.mmm."""
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}.{ms % 1000:03d}"


@dataclass
class Call:
    index: int
    function: str
    resource: str | None  # the resource type's name
    res_id: int
    size: int | None  # None: a deallocation
    timestamp_ms: int = 0  # since the trace began; 0 is not written
    context: int = 0
    args: list[str] = field(default_factory=list)
    frames: list[Frame] = field(default_factory=list)

    @property
    def is_alloc(self) -> bool:
        return self.size is not None

    def head(self) -> str:
        line = f"{self.index}. "
        if self.context:
            line += f"@{self.context:x} "
        if self.timestamp_ms:
            line += f"[{clock(self.timestamp_ms)}] "
        line += self.function + (f"<{self.resource}>" if self.resource else "")
        if self.size is not None:
            return line + f"({self.size}) = {self.res_id:#x}"
        return line + f"({self.res_id:#x})"


@dataclass
class Resource:
    bit: int  # 1-based: the registry writes 1 << (bit - 1)
    name: str
    desc: str
    refcount: bool = False

    def text(self) -> str:
        return f"<{1 << (self.bit - 1):x}> : {self.name} ({self.desc})" + (
            " [refcount]" if self.refcount else ""
        )


@dataclass
class Comment:
    text: str

    @property
    def temporary(self) -> bool:
        return self.text.startswith("# ")


@dataclass
class Trace:
    header: dict[str, str] = field(default_factory=dict)
    resources: list[Resource] = field(default_factory=list)
    contexts: dict[int, str] = field(default_factory=dict)
    mmaps: list[tuple[str, int, int]] = field(default_factory=list)
    attachments: list[tuple[str, str]] = field(default_factory=list)
    items: list[Call | Comment] = field(default_factory=list)  # in file order

    @property
    def calls(self) -> list[Call]:
        return [item for item in self.items if isinstance(item, Call)]

    def add_filter(self, name: str) -> None:
        tags = set(self.header.get("filter", "").split("|")) - {""}
        tags.add(name)
        self.header["filter"] = "|".join(tag for tag in FILTERS if tag in tags)

    def resource(self, name: str | None) -> Resource | None:
        return next((r for r in self.resources if r.name == name), None)

    def resource_of(self, call: Call) -> Resource | None:
        """A call's resource: an untyped call's is the first registered one."""
        if call.resource is None:
            return self.resources[0] if self.resources else None
        return self.resource(call.resource)


# ---- writing ------------------------------------------------------------------


def map_line(module: str, start: int, end: int) -> str:
    return f": {escape_path(module)} => {start:#x}-{end:#x}"


def header_line(header: dict[str, str]) -> str:
    keys = [key for key in HEADER_KEYS if header.get(key)] + sorted(set(header) - set(HEADER_KEYS))
    return ",".join(f"{key}={header[key].replace(',', ';')}" for key in keys)


def lines(trace: Trace, compressed: bool = False) -> Iterator[str]:
    yield header_line(trace.header)
    for context, name in sorted(trace.contexts.items()):
        yield f"@ {context:x} : {name}"
    yield from (resource.text() for resource in trace.resources)
    for name, path in trace.attachments:
        yield f"& {name} : {path}"
    for module, start, end in trace.mmaps:
        yield map_line(module, start, end)
    if compressed:
        yield from _compressed(trace)
        return
    for item in trace.items:
        if isinstance(item, Comment):
            yield item.text
            continue
        yield item.head()
        yield from (f"\t${n} = {value}" for n, value in enumerate(item.args, 1))
        yield from (frame.text() for frame in item.frames)
        yield ""  # an empty line ends the backtrace


def _compressed(trace: Trace) -> Iterator[str]:
    """Calls grouped by backtrace: each group's calls, a summary, the
    backtrace once (sp-rtrace-postproc --compress's layout)."""
    groups: dict[tuple[tuple[int, str | None], ...], list[Call]] = {}
    for item in trace.items:
        if isinstance(item, Comment):
            yield item.text
        else:
            key = tuple((frame.address, frame.function) for frame in item.frames)
            groups.setdefault(key, []).append(item)
    ranked = sorted(
        groups.values(), key=lambda calls: (-sum(c.size or 0 for c in calls), calls[0].index)
    )
    for calls in ranked:
        for call in calls:
            yield call.head()
            yield from (f"\t${n} = {value}" for n, value in enumerate(call.args, 1))
        allocs = [call for call in calls if call.is_alloc]
        total = sum(c.size or 0 for c in allocs)
        yield f"# allocation summary: {len(allocs)} block(s) with total size {total}"
        yield from (frame.text() for frame in calls[0].frames)
        yield ""


def write(trace: Trace, stream: TextIO, compressed: bool = False) -> None:
    for line in lines(trace, compressed):
        stream.write(line + "\n")


# ---- reading ------------------------------------------------------------------


def parse(text: Iterable[str], source: str = "input") -> Trace:
    """Read a report; SpRtraceError names the line of anything malformed.

    Temporary comments ("# ...") are dropped, as the protocol asks of the
    next post-processing run; every other unrecognised line is kept."""
    trace = Trace()
    last: Call | None = None
    for number, raw in enumerate(text, 1):
        line = raw.rstrip("\n")
        where = f"{source}: line {number}"
        if number == 1:
            trace.header = _header(line, where)
            continue
        if not line:
            continue
        if line.startswith("\t"):
            if last is None:
                raise SpRtraceError(f"{where}: a backtrace or argument line before any record")
            arg = _ARG.match(line)
            if arg:
                last.args.append(arg["value"])
                continue
            last.frames.append(_frame(line, where))
            continue
        if line.startswith("# "):
            continue  # a temporary comment: dropped by this run
        call = _call(line, where)
        if call is not None:
            if call.resource is not None and trace.resource(call.resource) is None:
                raise SpRtraceError(
                    f"{where}: resource <{call.resource}> is not in the resource registry before it"
                )
            last = call
            trace.items.append(last)
            continue
        if _record(trace, line, where):
            continue
        trace.items.append(Comment(line))
    if not trace.header:
        raise SpRtraceError(f"{source}: empty, not an sp-rtrace text report")
    return trace


def _header(line: str, where: str) -> dict[str, str]:
    fields = {}
    for part in line.split(","):
        key, sep, value = part.strip().partition("=")
        if sep and key:
            fields[key] = value
    if "version" not in fields or not re.fullmatch(r"\d+\.\d+", fields["version"]):
        raise SpRtraceError(
            f"{where}: not an sp-rtrace text report (no version=MAJOR.MINOR header)"
        )
    return fields


def _hex(text: str, where: str) -> int:
    if not re.fullmatch(r"0[xX][0-9a-fA-F]{1,16}", text):
        raise SpRtraceError(f"{where}: {text[:40]!r} is not a 64-bit hex id (0x...)")
    return int(text, 16)


def _decimal(text: str, what: str, where: str) -> int:
    if not re.fullmatch(r"[0-9]+", text):
        raise SpRtraceError(f"{where}: {what} {text[:40]!r} is not a decimal number")
    if len(text) > MAX_DIGITS:
        raise SpRtraceError(f"{where}: {what} {text[:40]}... has over {MAX_DIGITS} digits")
    return int(text)


def _frame(line: str, where: str) -> Frame:
    match = _FRAME.match(line)
    if match is None or not match["address"].lower().startswith("0x"):
        raise SpRtraceError(f"{where}: a backtrace address that is not hex: {line.strip()[:60]!r}")
    address = _hex(match["address"], where)
    tail = match["tail"] or ""
    named = _TAIL.match(tail)
    frame = Frame(address, written=tail)
    if named is not None:
        function = named["function"] or None
        frame.function = function if function != "??" else None
        frame.module = unescape_path(named["module"]) if named["module"] else None
        frame.location = named["location"]
    return frame


def _call(line: str, where: str) -> Call | None:
    """A call record as sp-rtrace's parser reads one, or None (not a call)."""
    head = _CALL_HEAD.match(line)
    if head is None:
        return None
    rest, context = head["rest"], 0
    found = _CONTEXT_FIELD.match(rest)
    if found:
        context = int(found["context"][:8], 16)  # a 32-bit mask
        rest = rest[found.end() :]
    stamp = 0
    found = _TIME_FIELD.match(rest)
    if found:
        h, m, sec, ms = (_decimal(found[k], "timestamp", where) for k in ("h", "m", "s", "ms"))
        stamp = ((h * 60 + m) * 60 + sec) * 1000 + ms
        rest = rest[found.end() :]
    paren = rest.rfind("(")
    if paren <= 0:
        return None
    name, resource = rest[:paren], None
    if name.endswith(">") and "<" in name:
        name, _, resource = name[:-1].rpartition("<")
    tail = _CALL_TAIL.match(rest[paren:])
    if tail is None or not name:
        return None
    index = _decimal(head["index"], "record index", where)
    inner, res_id = tail["inner"].strip(), tail["id"]
    if res_id is not None:  # allocation: (size) = 0xid
        allocated = _decimal(inner, "resource size", where)
        if allocated > MAX_SIZE:
            raise SpRtraceError(f"{where}: resource size {inner} is over 2^63 - 1")
        size: int | None = allocated
        ident = _hex(res_id, where)
    else:  # deallocation: (0xid)
        size, ident = None, _hex(inner, where)
    return Call(index, name, resource or None, ident, size, stamp, context)


def _record(trace: Trace, line: str, where: str) -> bool:
    found = _MMAP.match(line)
    if found:
        trace.mmaps.append(
            (unescape_path(found["module"]), _hex(found["start"], where), _hex(found["end"], where))
        )
        return True
    found = _RESOURCE.match(line)
    if found:
        bits = int(found["id"], 16)
        if bits == 0 or bits & (bits - 1):
            raise SpRtraceError(f"{where}: resource id <{found['id']}> is not a single bit")
        flags = (found["flags"] or "").split("|")
        trace.resources.append(
            Resource(bits.bit_length(), found["type"], found["desc"], "refcount" in flags)
        )
        return True
    found = _CONTEXT.match(line)
    if found:
        trace.contexts[int(found["id"], 16)] = found["name"]
        return True
    found = _ATTACHMENT.match(line)
    if found:
        trace.attachments.append((found["name"], found["path"]))
        return True
    return False


# ---- post-processing ----------------------------------------------------------


def filter_leaks(trace: Trace) -> None:
    """Drop every deallocation and the allocation it frees, as
    sp-rtrace-postproc --filter-leaks does: an id allocated again before it
    is freed leaves the older allocation as a leak; a reference-counted
    resource's repeated allocations only count up."""
    owner: dict[tuple[str | None, int], Call] = {}  # the allocation an id is matched to
    refs: dict[tuple[str | None, int], int] = {}
    dropped: set[int] = set()
    # Matched in sp-rtrace's order: by timestamp, then by index.
    for item in sorted(trace.calls, key=lambda call: (call.timestamp_ms, call.index)):
        resource = trace.resource_of(item)
        key = (resource.name if resource else None, item.res_id)
        refcount = resource is not None and resource.refcount
        if item.is_alloc:
            if key in owner and refcount:
                refs[key] += 1
                dropped.add(id(item))
            else:
                owner[key], refs[key] = item, 1
            continue
        dropped.add(id(item))
        if key in owner:
            refs[key] -= 1
            if refs[key] == 0 or not refcount:
                dropped.add(id(owner.pop(key)))
                del refs[key]
    trace.items = [item for item in trace.items if id(item) not in dropped]
    trace.add_filter("leaks")


def leak_summary(trace: Trace) -> list[str]:
    """Per resource, what is still allocated: sp-rtrace-postproc's lines."""
    lines = []
    for resource in trace.resources:
        calls = [c for c in trace.calls if c.is_alloc and trace.resource_of(c) is resource]
        lines.append(f"# Resource - {resource.name} ({resource.desc}):")
        total = sum(c.size or 0 for c in calls)
        lines.append(f"# {len(calls)} block(s) leaked with total size of {total} bytes")
    return lines
