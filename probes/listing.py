"""What can be traced in a file: its SDT probes and their sites, decoded by
the catalog (``mtrace-live probes`` lists them; exporters/probe_list.py
writes them out)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import sdt_notes
from .catalog import Catalog, Comparison, compare, parse_note_arg
from .errors import NoProbesError
from .sdt_notes import read_sites


@dataclass(frozen=True)
class ListedArg:
    name: str
    c_type: str
    location: str
    size: int | None
    signed: bool
    note: str

    def __str__(self) -> str:
        return f"{self.name}:{self.c_type}@{self.location}"


@dataclass(frozen=True)
class ListedSite:
    address: int
    file_offset: int
    semaphore: int
    base: int
    args: tuple[ListedArg, ...]


@dataclass(frozen=True)
class ListedProbe:
    provider: str
    name: str
    known: bool
    fires: str
    meaning: str
    manual: str
    sites: tuple[ListedSite, ...]

    @property
    def qualified_name(self) -> str:
        return f"{self.provider}:{self.name}"


@dataclass(frozen=True)
class FileListing:
    path: Path
    probes: tuple[ListedProbe, ...]
    comparison: Comparison

    @property
    def site_count(self) -> int:
        return sum(len(p.sites) for p in self.probes)


def no_probes_error(path: Path) -> NoProbesError:
    return NoProbesError(
        f"{path} has no SDT probes: its glibc was built without --enable-systemtap "
        "(Debian's is); build one with 'make sdt-glibc' and run the target under it "
        "(scripts/with-sdt-glibc CMD, or mtrace-live count --sdt-glibc -- CMD)"
    )


def list_file(path: Path, catalog: Catalog) -> FileListing:
    sites = read_sites(path)
    if not sites:
        raise no_probes_error(path)
    grouped: dict[tuple[str, str], list[sdt_notes.SdtSite]] = {}
    for site in sites:
        grouped.setdefault((site.provider, site.name), []).append(site)
    probes = []
    for (provider, name), its_sites in grouped.items():
        spec = catalog.probe(provider, name)
        listed_sites = []
        for site in its_sites:
            args = []
            for index, text in enumerate(site.arguments):
                note = parse_note_arg(text)
                if spec is not None and index < len(spec.args):
                    a = spec.args[index]
                    args.append(
                        ListedArg(a.name, a.c_type, note.location, note.size, note.signed, a.note)
                    )
                else:
                    args.append(
                        ListedArg(f"arg{index + 1}", _type_of(note.size, note.signed),
                                  note.location, note.size, note.signed, "")
                    )  # fmt: skip
            listed_sites.append(
                ListedSite(site.address, site.file_offset, site.semaphore, site.base, tuple(args))
            )
        probes.append(
            ListedProbe(
                provider=provider,
                name=name,
                known=spec is not None,
                fires=spec.fires if spec else "",
                meaning=spec.meaning if spec else "",
                manual=spec.manual if spec else "",
                sites=tuple(listed_sites),
            )
        )
    providers = {p for p, _ in grouped} & catalog.providers()
    return FileListing(path, tuple(probes), compare(catalog, sites, providers))


def _type_of(size: int | None, signed: bool) -> str:
    if size is None:
        return "?"
    return f"{'' if signed else 'u'}int{size * 8}_t"
