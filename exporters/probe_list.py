"""A file's probes as text or JSON: ``mtrace-live probes``'s listing of
its SDT probes (probes/listing.py) and of the derived ones
(probes/derived.py)."""

from __future__ import annotations

from typing import Any

from mtrace_live.probes.derived import UNAVAILABLE, DerivedPlan
from mtrace_live.probes.listing import FileListing


def render_text(listing: FileListing) -> list[str]:
    c = listing.comparison
    lines = [
        f"{listing.path}: {len(listing.probes)} probes at {listing.site_count} sites; "
        f"catalog: {len(c.present)} known, {len(c.missing)} missing, {len(c.unknown)} unknown, "
        f"{len(c.mismatches)} mismatches"
    ]
    for probe in listing.probes:
        if probe.known:
            lines.append(f"{probe.qualified_name}  ({probe.fires}) {probe.meaning}")
        else:
            lines.append(f"{probe.qualified_name}  [not in the catalog]")
        for site in probe.sites:
            args = "  ".join(str(a) for a in site.args) or "(no arguments)"
            semaphore = f"  semaphore {site.semaphore:#x}" if site.semaphore else ""
            lines.append(f"    {site.address:#x}  {args}{semaphore}")
    lines += [f"missing: {name}" for name in c.missing]
    lines += [f"mismatch: {line}" for line in c.mismatches]
    return lines


def render_derived_text(plan: DerivedPlan) -> list[str]:
    """Each memory_* probe (and lll_lock_wait_private) as derived: its
    status, what it is derived from, and each uprobe site with the anchor
    found, the instruction chosen and where each argument is."""
    debug = plan.debug_file or plan.debug_problem
    lines = [f"{plan.libc}: memory_* probes derived (docs/derived-probes.md); debug file: {debug}"]
    for probe in plan.probes.values():
        head = f"{probe.name}  {probe.status}"
        if probe.status == UNAVAILABLE:
            lines.append(f"{head}: {probe.differs}")
            continue
        lines.append(f"{head}, from {probe.source}: {probe.derived_from}")
        if probe.differs:
            lines.append(f"    differs: {probe.differs}")
        for site in probe.sites:
            how = "emulated" if site.emulated else "single-stepped"
            lines.append(f"    {site.address:#x}  {site.instruction}  ({how}; {site.anchor})")
            lines.append("      " + "  ".join(f"{a.name}={a.text}" for a in site.args))
        for arg in probe.syscall_args:
            lines.append(f"      {arg.name}: {arg.text}")
    return lines


def render_derived_json(plan: DerivedPlan) -> dict[str, Any]:
    return {
        "debug_file": str(plan.debug_file) if plan.debug_file else None,
        "debug_problem": plan.debug_problem or None,
        "probes": [
            {
                "name": p.name,
                "status": p.status,
                "source": p.source or None,
                "derived_from": p.derived_from or None,
                "differs": p.differs or None,
                "sites": [
                    {
                        "address": s.address,
                        "file_offset": s.file_offset,
                        "function": s.function,
                        "anchor": s.anchor,
                        "instruction": s.instruction,
                        "emulated": s.emulated,
                        "arguments": [{"name": a.name, "location": a.text} for a in s.args],
                    }
                    for s in p.sites
                ],
                "arguments": [{"name": a.name, "from": a.text} for a in p.syscall_args],
            }
            for p in plan.probes.values()
        ],
    }


def render_json(listing: FileListing) -> dict[str, Any]:
    c = listing.comparison
    return {
        "path": str(listing.path),
        "probes": [
            {
                "provider": p.provider,
                "name": p.name,
                "known": p.known,
                "fires": p.fires or None,
                "meaning": p.meaning or None,
                "manual_disagrees": p.manual or None,
                "sites": [
                    {
                        "address": s.address,
                        "file_offset": s.file_offset,
                        "semaphore": s.semaphore,
                        "base": s.base,
                        "arguments": [
                            {
                                "name": a.name,
                                "type": a.c_type,
                                "location": a.location,
                                "size": a.size,
                                "signed": a.signed,
                            }
                            for a in s.args
                        ],
                    }
                    for s in p.sites
                ],
            }
            for p in listing.probes
        ],
        "catalog": {
            "present": c.present,
            "missing": c.missing,
            "unknown": c.unknown,
            "mismatches": c.mismatches,
        },
    }
