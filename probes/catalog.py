"""The probe catalog: what each probe means and how its arguments decode.

The entries live as data in ``specs/*.toml`` beside this file, written from
glibc 2.36's LIBC_PROBE calls and the kernel's kmem tracepoint definitions.
They are validated when loaded, and they are the one source for decoding,
listing and documentation.

An argument's size and signedness follow from its C type on x86_64 (LP64),
through ``TYPE_LAYOUT``; the ELF notes of a real libc are compared with them.
"""

from __future__ import annotations

import functools
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .sdt_notes import SdtSite

FIRES = ("before", "after")

ROLES = frozenset(
    {
        "address", "alignment", "arena", "attr", "bytes", "cache_name", "clock_id",
        "code_address", "condvar", "flag", "function", "futex", "heap", "jmp_buf",
        "link_map", "migratetype", "mutex", "namespace_id", "node", "order",
        "page_frame", "parameter_id", "parameter_value", "return_value", "rwlock",
        "tcache_bin", "thread", "timespec",
    }
)  # fmt: skip

# (size in bytes, signed) of the scalar types the catalog uses, x86_64 LP64.
# Every pointer type is (8, unsigned).
TYPE_LAYOUT: Mapping[str, tuple[int, bool]] = {
    "int": (4, True),
    "int32_t": (4, True),
    "clockid_t": (4, True),
    "unsigned int": (4, False),
    "long": (8, True),
    "Lmid_t": (8, True),
    "unsigned long": (8, False),
    "size_t": (8, False),
    "pthread_t": (8, False),
    "mstate": (8, False),  # struct malloc_state *
    "__data_loc char[]": (4, False),  # tracefs: offset and length of a string
}

# What a probe can change in the allocator model (tracer/loop/model.py has one
# handler per effect; "lock_wait" is counted in bulk, per futex).
EFFECTS = frozenset(
    {"sbrk_more", "sbrk_less", "heap_new", "heap_resize", "heap_free", "arena_new",
     "arena_reuse", "arena_reuse_wait", "arena_free_list", "arena_retry", "retry",
     "mallopt", "setting", "dynamic_thresholds", "double_free_check", "lock_wait"}
)  # fmt: skip
# The kmemtrace type names a probe's or tracepoint's records can have.
KMEMTRACE_TYPES = frozenset({"kmalloc", "kmem_cache", "pages", "sbrk", "heap", "arena"})

_ARG_SPEC = re.compile(r"^(?:(-?)(\d+)@)?(.+)$")


class CatalogError(Exception):
    """The catalog data is inconsistent; raised while loading it."""


def type_layout(c_type: str) -> tuple[int, bool]:
    if c_type.endswith("*"):
        return (8, False)
    try:
        return TYPE_LAYOUT[c_type]
    except KeyError:
        raise CatalogError(f"unknown C type {c_type!r}: add it to TYPE_LAYOUT") from None


@dataclass(frozen=True)
class ArgSpec:
    name: str
    c_type: str
    role: str
    size: int
    signed: bool
    note: str = ""


@dataclass(frozen=True)
class ProbeSpec:
    provider: str
    name: str
    source: str
    fires: str
    meaning: str
    args: tuple[ArgSpec, ...]
    manual: str = ""  # where glibc's manual says otherwise
    effect: str = ""  # what it changes in the allocator model, one of EFFECTS
    retry: str = ""  # effect "retry" / "arena_retry": the operation retried
    setting: str = ""  # effect "setting" / "dynamic_thresholds": the parameter
    kmemtrace: tuple[str, str] | None = None  # ("alloc" or "free", kmemtrace type)

    @property
    def qualified_name(self) -> str:
        return f"{self.provider}:{self.name}"


@dataclass(frozen=True)
class FieldSpec:
    name: str
    c_type: str
    role: str
    required: bool


@dataclass(frozen=True)
class TracepointSpec:
    category: str
    name: str
    fires: str
    meaning: str
    fields: tuple[FieldSpec, ...]
    kmemtrace: tuple[str, str] | None = None  # ("alloc" or "free", kmemtrace type)


@dataclass(frozen=True)
class Catalog:
    probes: Mapping[tuple[str, str], ProbeSpec]
    tracepoints: Mapping[str, TracepointSpec]

    def probe(self, provider: str, name: str) -> ProbeSpec | None:
        return self.probes.get((provider, name))

    def providers(self) -> set[str]:
        return {provider for provider, _ in self.probes}


@functools.cache
def load_catalog() -> Catalog:
    """The bundled catalog, loaded and validated once per process."""
    documents = {}
    for entry in sorted((Path(__file__).resolve().parent / "specs").iterdir(),
                        key=lambda e: e.name):  # fmt: skip
        if entry.name.endswith(".toml"):
            try:
                documents[entry.name] = tomllib.loads(entry.read_text(encoding="utf-8"))
            except tomllib.TOMLDecodeError as exc:
                raise CatalogError(f"{entry.name}: {exc}") from None
    return build_catalog(documents)


def build_catalog(documents: Mapping[str, Mapping[str, Any]]) -> Catalog:
    """Validate parsed catalog documents and build the catalog from them."""
    probes: dict[tuple[str, str], ProbeSpec] = {}
    tracepoints: dict[str, TracepointSpec] = {}
    for origin, document in documents.items():
        unknown = set(document) - {"probe", "tracepoint"}
        if unknown:
            raise CatalogError(f"{origin}: unknown tables {sorted(unknown)}")
        for raw in document.get("probe", []):
            spec = _probe(origin, raw)
            if (spec.provider, spec.name) in probes:
                raise CatalogError(f"{origin}: {spec.qualified_name} is listed twice")
            probes[(spec.provider, spec.name)] = spec
        for raw in document.get("tracepoint", []):
            tp = _tracepoint_spec(origin, raw)
            if tp.name in tracepoints:
                raise CatalogError(f"{origin}: tracepoint {tp.name} is listed twice")
            tracepoints[tp.name] = tp
    return Catalog(probes=probes, tracepoints=tracepoints)


def _require(
    origin: str, raw: Mapping[str, Any], keys: Iterable[str], optional: Iterable[str]
) -> None:
    what = raw.get("name", "?")
    missing = [k for k in keys if not isinstance(raw.get(k), (str, list, bool)) or raw.get(k) == ""]
    if missing:
        raise CatalogError(f"{origin}: entry {what!r} lacks {', '.join(missing)}")
    extra = set(raw) - set(keys) - set(optional)
    if extra:
        raise CatalogError(f"{origin}: entry {what!r} has unknown keys {sorted(extra)}")


def _probe(origin: str, raw: Mapping[str, Any]) -> ProbeSpec:
    _require(
        origin, raw, ("provider", "name", "source", "fires", "meaning", "args"),
        ("manual", "effect", "retry", "setting", "kmemtrace"),
    )  # fmt: skip
    where = f"{origin}: {raw['provider']}:{raw['name']}"
    if raw["fires"] not in FIRES:
        raise CatalogError(f"{where}: fires must be one of {FIRES}")
    effect = str(raw.get("effect", ""))
    if effect and effect not in EFFECTS:
        raise CatalogError(f"{where}: unknown effect {effect!r}")
    for key, effects in (("retry", ("retry", "arena_retry")),
                         ("setting", ("setting", "dynamic_thresholds"))):  # fmt: skip
        if (key in raw) != (effect in effects):
            raise CatalogError(f"{where}: {key} goes with effect {' or '.join(effects)}")
    args = []
    for arg in raw["args"]:
        _require(where, arg, ("name", "type", "role"), ("note",))
        if arg["role"] not in ROLES:
            raise CatalogError(f"{where}: argument {arg['name']} has unknown role {arg['role']!r}")
        size, signed = type_layout(arg["type"])
        args.append(
            ArgSpec(arg["name"], arg["type"], arg["role"], size, signed, arg.get("note", ""))
        )
    if len({a.name for a in args}) != len(args):
        raise CatalogError(f"{where}: argument names repeat")
    return ProbeSpec(
        provider=raw["provider"], name=raw["name"], source=raw["source"], fires=raw["fires"],
        meaning=raw["meaning"], args=tuple(args), manual=raw.get("manual", ""),
        effect=effect, retry=str(raw.get("retry", "")), setting=str(raw.get("setting", "")),
        kmemtrace=_kmemtrace(where, raw),
    )  # fmt: skip


def _kmemtrace(where: str, raw: Mapping[str, Any]) -> tuple[str, str] | None:
    if "kmemtrace" not in raw:
        return None
    record, _, type_name = str(raw["kmemtrace"]).partition(" ")
    if record not in ("alloc", "free") or type_name not in KMEMTRACE_TYPES:
        raise CatalogError(f"{where}: kmemtrace must be 'alloc TYPE' or 'free TYPE', "
                           f"TYPE one of {sorted(KMEMTRACE_TYPES)}")  # fmt: skip
    return record, type_name


def _tracepoint_spec(origin: str, raw: Mapping[str, Any]) -> TracepointSpec:
    _require(origin, raw, ("category", "name", "fires", "meaning", "fields"), ("kmemtrace",))
    where = f"{origin}: tracepoint {raw['name']}"
    if raw["fires"] not in FIRES:
        raise CatalogError(f"{where}: fires must be one of {FIRES}")
    fields = []
    for f in raw["fields"]:
        _require(where, f, ("name", "type", "role", "required"), ())
        if f["role"] not in ROLES:
            raise CatalogError(f"{where}: field {f['name']} has unknown role {f['role']!r}")
        type_layout(f["type"])
        fields.append(FieldSpec(f["name"], f["type"], f["role"], bool(f["required"])))
    return TracepointSpec(
        raw["category"], raw["name"], raw["fires"], raw["meaning"], tuple(fields),
        _kmemtrace(where, raw),
    )  # fmt: skip


# ---- comparing a binary's notes with the catalog ------------------------------


@dataclass(frozen=True)
class NoteArg:
    """One argument of an SDT note, e.g. ``-4@%esi`` or ``8@32+mp_(%rip)``."""

    size: int | None  # None when the note gives no size
    signed: bool
    location: str


def parse_note_arg(text: str) -> NoteArg:
    match = _ARG_SPEC.match(text)
    if not match:
        raise ValueError(f"not an SDT argument: {text!r}")
    sign, size, location = match.groups()
    return NoteArg(size=int(size) if size else None, signed=bool(sign), location=location)


@dataclass
class Comparison:
    """What a binary has against what the catalog expects, for some providers."""

    present: list[str] = field(default_factory=list)  # qualified names, in note order
    missing: list[str] = field(default_factory=list)  # in the catalog, not in the binary
    unknown: list[str] = field(default_factory=list)  # in the binary, not in the catalog
    mismatches: list[str] = field(default_factory=list)  # one line per disagreement

    @property
    def agrees(self) -> bool:
        return not (self.missing or self.unknown or self.mismatches)


def compare(catalog: Catalog, sites: Iterable[SdtSite], providers: Iterable[str]) -> Comparison:
    wanted = set(providers)
    result = Comparison()
    seen: dict[str, None] = {}
    for site in sites:
        if site.provider not in wanted:
            continue
        qualified = site.qualified_name
        spec = catalog.probe(site.provider, site.name)
        if spec is None:
            if qualified not in result.unknown:
                result.unknown.append(qualified)
            continue
        seen[qualified] = None
        result.mismatches.extend(_arg_mismatches(spec, site))
    result.present = list(seen)
    result.missing = [
        spec.qualified_name
        for spec in catalog.probes.values()
        if spec.provider in wanted and spec.qualified_name not in seen
    ]
    return result


def _arg_mismatches(spec: ProbeSpec, site: SdtSite) -> list[str]:
    where = f"{site.qualified_name} at {site.address:#x}"
    if len(site.arguments) != len(spec.args):
        return [
            f"{where}: the note has {len(site.arguments)} arguments, the catalog {len(spec.args)}"
        ]
    problems = []
    for arg, text in zip(spec.args, site.arguments, strict=True):
        note = parse_note_arg(text)
        if note.size is not None and (note.size, note.signed) != (arg.size, arg.signed):
            sign = "signed" if note.signed else "unsigned"
            want = f"{arg.size}-byte {'signed' if arg.signed else 'unsigned'}"
            problems.append(
                f"{where}: {arg.name} is {note.size}-byte {sign} ({text}), "
                f"the catalog's {arg.c_type} is {want}"
            )
    return problems
