"""What each probe means to the outputs, as the catalog's specs say it
(``effect``, ``retry``, ``setting`` and ``kmemtrace`` in specs/*.toml): the
one place the model, the Prometheus metrics and the kmemtrace records learn
which probes retry, change a setting, check for double frees or become
allocation records."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from .catalog import Catalog, load_catalog


@dataclass(frozen=True)
class Meanings:
    effects: Mapping[str, str]  # libc probe -> its effect on the allocator model
    retries: Mapping[str, str]  # retry probe -> the operation retried
    settings: Mapping[str, str]  # setting probe -> the parameter it changes
    kmemtrace: Mapping[str, tuple[str, str]]  # probe or tracepoint -> ("alloc"/"free", type)

    def with_effect(self, effect: str) -> tuple[str, ...]:
        return tuple(probe for probe, its in self.effects.items() if its == effect)

    @property
    def stateful(self) -> frozenset[str]:
        """The probes the model decodes one event at a time (lock waits are
        counted in bulk)."""
        return frozenset(p for p, effect in self.effects.items() if effect != "lock_wait")

    def kmemtrace_probes(self, record: str) -> dict[str, str]:
        """Libc probes whose events become ``record`` ("alloc" or "free")
        records -> the kmemtrace type name."""
        return {
            probe: type_name
            for probe, (kind, type_name) in self.kmemtrace.items()
            if kind == record and probe in self.effects
        }


def from_catalog(catalog: Catalog) -> Meanings:
    libc = [spec for spec in catalog.probes.values() if spec.provider == "libc"]
    kmemtrace = {spec.name: spec.kmemtrace for spec in libc if spec.kmemtrace}
    kmemtrace.update({tp.name: tp.kmemtrace for tp in catalog.tracepoints.values() if tp.kmemtrace})
    return Meanings(
        effects={spec.name: spec.effect for spec in libc if spec.effect},
        retries={spec.name: spec.retry for spec in libc if spec.retry},
        settings={spec.name: spec.setting for spec in libc if spec.setting},
        kmemtrace=kmemtrace,
    )


@functools.cache
def meanings() -> Meanings:
    """The bundled catalog's meanings, read once per process."""
    return from_catalog(load_catalog())
