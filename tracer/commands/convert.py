"""``mtrace-live convert``: record sets and sp-rtrace reports, converted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click


@click.command()
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--to", "target", type=click.Choice(["sp-rtrace", "json", "kmemtrace"]),
              default="sp-rtrace", show_default=True,
              help="sp-rtrace: the sp-rtrace text protocol; json: JSON lines of a record set; "
              "kmemtrace: a record set again, from JSON lines (needs -o DIR).")  # fmt: skip
@click.option("--output", "-o", type=click.Path(path_type=Path),
              help="Write here instead of standard output "
              "(a new directory for kmemtrace).")  # fmt: skip
@click.option("--leaks", is_flag=True, help="Drop allocations that were freed, and the frees.")
@click.option("--compress", is_flag=True, help="Group the calls by backtrace.")
@click.option("--resolve", is_flag=True, help="Name unnamed kernel frames from kallsyms.")
@click.option("--kallsyms", type=click.Path(dir_okay=False, path_type=Path),
              help="Symbols to use instead of the ones saved with the records.")  # fmt: skip
def convert(**params: Any) -> None:
    """Convert a kmemtrace record set, or an sp-rtrace report, to an
    sp-rtrace text report; a record set to JSON lines, and JSON lines back
    into a record set.

    An sp-rtrace report can be read back and post-processed again: --leaks,
    --compress and --resolve are applied in that order and recorded in the
    header's filter key, and temporary ('# ') comments are dropped.

    \b
      mtrace-live convert out.d --to sp-rtrace --leaks -o leaks.txt
      mtrace-live convert leaks.txt --compress
      mtrace-live convert out.d --to json > out.jsonl
      mtrace-live convert out.jsonl --to kmemtrace -o again.d
    """
    from mtrace_live.exporters.conversions import run_convert
    from mtrace_live.tracer.loop import package_version

    run_convert(version=package_version(), **params)
