"""``mtrace-live probes``: a libc's SDT probes, decoded by the catalog; and
the choice of files ``probes`` and ``doctor`` look at."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from . import options


def target_options(command: Any) -> Any:
    command = options.lib_option("Look at this file (a libc, ld.so or any ELF file).")(command)
    return options.pid_option("Look at what this process maps.")(command)


def targets(command: str, pid: int | None, lib: Path | None, with_ld_so: bool) -> list[Path]:
    from .. import target

    options.check(command, {"pid": pid, "lib": lib})
    if lib is not None:
        return [target.library_file(lib)]
    if pid is not None:
        mapped = target.mapped_glibc(pid)
        return [mapped.libc, *([mapped.ld_so] if with_ld_so and mapped.ld_so else [])]
    return [target.default_libc()]


@click.command()
@target_options
@click.option("--json", "as_json", is_flag=True, help="Print the listing as JSON.")
def probes(pid: int | None, lib: Path | None, as_json: bool) -> None:
    """List the SDT probes of a libc (and ld.so), decoded by the catalog.

    Each probe is shown with its sites and its arguments as
    name:type@location, and whether the catalog knows it. With --pid, the
    libc and ld.so the process really maps are listed; with neither option,
    the system's default libc.
    """
    from mtrace_live.exporters.data.errors import NoProbesError
    from mtrace_live.probes.catalog import load_catalog

    from ..probe_listing import list_file, render_json, render_text

    catalog = load_catalog()
    libc, *others = targets("probes", pid, lib, with_ld_so=True)
    listings = [list_file(libc, catalog)]  # a libc without probes is the error
    bare = []  # ld.so without probes is only worth a line
    for path in others:
        try:
            listings.append(list_file(path, catalog))
        except NoProbesError:
            bare.append(path)
    if as_json:
        documents = [render_json(item) for item in listings]
        documents += [{"path": str(path), "probes": [], "catalog": None} for path in bare]
        click.echo(json.dumps(documents, indent=2))
        return
    for index, item in enumerate(listings):
        if index:
            click.echo()
        for line in render_text(item):
            click.echo(line)
    for path in bare:
        click.echo(f"\n{path}: no SDT probes")
