"""``mtrace-live probes``: a libc's SDT probes, decoded by the catalog; and
the choice of files ``probes`` and ``doctor`` look at."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from mtrace_live.tracer.commands import options


def target_options(command: Any) -> Any:
    command = options.lib_option("Look at this file (a libc, ld.so or any ELF file).")(command)
    return options.pid_option("Look at what this process maps.")(command)


def targets(command: str, pid: int | None, lib: Path | None, with_ld_so: bool) -> list[Path]:
    from mtrace_live.tracer.processes import target

    options.check(command, {"pid": pid, "lib": lib})
    if lib is not None:
        return [target.library_file(lib)]
    if pid is not None:
        mapped = target.mapped_glibc(pid)
        return [mapped.libc, *([mapped.ld_so] if with_ld_so and mapped.ld_so else [])]
    return [target.default_libc()]


@click.command()
@target_options
@options.derived_options
@click.option("--json", "as_json", is_flag=True, help="Print the listing as JSON.")
def probes(
    pid: int | None, lib: Path | None, derived: bool, debug_file: Path | None, as_json: bool
) -> None:
    """List the SDT probes of a libc (and ld.so), decoded by the catalog,
    and where each allocation function (malloc, free, ...) is probed.

    Each probe is shown with its sites and its arguments as
    name:type@location, and whether the catalog knows it. With --pid, the
    libc and ld.so the process really maps are listed; with neither option,
    the system's default libc.

    For a libc without SDT notes, or with --derived, each memory_* probe is
    shown as derived: from a system call, an exported symbol or the debug
    file (each site, the instruction chosen, where each argument is), or
    unavailable and why.

        mtrace-live probes --pid 1234
    """
    from mtrace_live.probes.catalog import load_catalog
    from mtrace_live.probes.errors import NoProbesError
    from mtrace_live.probes.listing import list_file

    catalog = load_catalog()
    libc, *others = targets("probes", pid, lib, with_ld_so=True)
    sites = _alloc_sites(libc)
    listings = []
    bare = []  # files without probes are worth a line
    for path in (libc, *others):
        try:
            listings.append(list_file(path, catalog))
        except NoProbesError as exc:
            if path == libc and not sites:
                raise  # neither probes nor allocation functions: nothing to trace
            bare.append((path, str(exc)))
    plan = _derived_plan(libc, debug_file) if derived or libc in (p for p, _ in bare) else None
    if as_json:
        _print_json(libc, listings, bare, plan, sites, debug_file)
    else:
        _print_text(libc, listings, bare, plan, sites, debug_file)


def _print_json(libc: Path, listings: list[Any], bare: list[tuple[Path, str]], plan: Any,
                sites: list[dict[str, Any]], debug_file: Path | None) -> None:  # fmt: skip
    from mtrace_live.exporters.probe_list import render_derived_json, render_json
    from mtrace_live.tracer.loop.lock_waits import timing_report

    documents = [render_json(item) for item in listings]
    documents += [{"path": str(path), "probes": [], "catalog": None} for path, _ in bare]
    for document in documents:
        if document["path"] == str(libc):
            document["allocation_functions"] = sites
            document["source"] = "derived" if plan is not None else "SDT notes"
            if plan is not None:
                document["derived"] = render_derived_json(plan)
            document["lock_wait_times"] = timing_report(libc, debug_file).as_json()
    click.echo(json.dumps(documents, indent=2))


def _print_text(libc: Path, listings: list[Any], bare: list[tuple[Path, str]], plan: Any,
                sites: list[dict[str, Any]], debug_file: Path | None) -> None:  # fmt: skip
    from mtrace_live.exporters.probe_list import render_derived_text, render_text
    from mtrace_live.tracer.loop.lock_waits import timing_report

    for index, item in enumerate(listings):
        if index:
            click.echo()
        for line in render_text(item):
            click.echo(line)
    for path, why in bare:
        click.echo(f"\n{path}: no SDT probes" + (f" ({why})" if path == libc else ""))
    if plan is not None:
        click.echo()
        for line in render_derived_text(plan):
            click.echo(line)
    click.echo(f"\n{libc}: lock wait times: {timing_report(libc, debug_file).text}")
    if sites:
        click.echo(f"\n{libc}: allocation functions, each probe at the first instruction the "
                   "kernel emulates (docs/allocations.md):")  # fmt: skip
        for site in sites:
            where = site["seen_as"] and f"seen as {site['seen_as']}"
            where = where or (f"{site['entry']}+{site['offset']}  {site['instruction']}  "
                              f"({'emulated' if site['emulated'] else 'stepped'})")  # fmt: skip
            click.echo(f"  {site['function']:<15} {where}")


def _derived_plan(libc: Path, debug_file: Path | None) -> Any:
    from mtrace_live.probes.derived import plan
    from mtrace_live.probes.errors import DebugInfoError, NotGlibcError, TargetError

    try:
        return plan(libc, debug_file)
    except (DebugInfoError, NotGlibcError) as exc:
        raise TargetError(str(exc)) from None


def _alloc_sites(libc: Path) -> list[dict[str, Any]]:
    """Each allocation function the libc exports, and where its probe sits."""
    from mtrace_live.probes.errors import MtraceError
    from mtrace_live.tracer.loop.alloc_probes import plan_sites

    try:
        chosen = plan_sites(libc)
    except (OSError, MtraceError):
        return []  # the SDT listing says what is wrong with the file
    out: list[dict[str, Any]] = []
    for name, site in chosen.sites.items():
        out.append({"function": name, "entry": hex(site.entry), "offset": site.offset,
                    "instruction": site.instruction, "emulated": site.emulated,
                    "file_offset": site.file_offset, "seen_as": None})  # fmt: skip
    for name, other in chosen.seen_as.items():
        out.append({"function": name, "seen_as": other})
    return out
