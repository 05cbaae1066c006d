"""``mtrace-live convert``: what the source is, and where the result goes."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from pathlib import Path

from mtrace_live.exporters.data.kallsyms import KernelSymbols
from mtrace_live.exporters.kmemtrace.abi import ABI_FILE, cpu_files
from mtrace_live.exporters.kmemtrace.reader import read_record_set
from mtrace_live.exporters.sprtrace import text as sprtrace
from mtrace_live.probes.errors import (
    DamagedRecordsError,
    SpRtraceError,
    TargetError,
    UsageError,
)


def _is_record_set(source: Path) -> bool:
    if source.is_dir():
        return (source / ABI_FILE).exists() or bool(cpu_files(source))
    return re.fullmatch(r"cpu\d+(\.out)?", source.name) is not None


def run_convert(
    *,
    source: Path,
    target: str,
    output: Path | None,
    leaks: bool,
    compress: bool,
    resolve: bool,
    kallsyms: Path | None,
    version: str,
) -> None:
    if not source.exists():
        raise TargetError(f"no such file or directory: {source}")
    symbols = KernelSymbols.load(kallsyms) if kallsyms is not None else None
    damage: list[str] = []
    if _is_record_set(source):
        from mtrace_live.exporters.kmemtrace.json_lines import json_lines
        from mtrace_live.exporters.sprtrace.convert import from_record_set

        records = read_record_set(source)
        damage = records.damage
        if symbols is None:
            symbols = KernelSymbols(records.kallsyms) if records.kallsyms else KernelSymbols.load()
        if target == "kmemtrace":
            raise UsageError(f"{source} is already a kmemtrace record set")
        if target == "json":
            if leaks or compress or resolve:
                raise UsageError("--leaks, --compress and --resolve apply to sp-rtrace output")
            _emit(json_lines(records, symbols), output)
            _report_damage(damage)
            return
        trace = from_record_set(records, symbols, version)
    elif _is_json_lines(source):
        if target != "kmemtrace":
            raise UsageError(f"{source} holds JSON lines: convert them --to kmemtrace -o DIR")
        if output is None:
            raise UsageError("--to kmemtrace needs -o DIR, the record set to create")
        from mtrace_live.exporters.kmemtrace.json_lines import write_record_set

        with open(source, encoding="utf-8") as stream:
            written = write_record_set(stream, output, str(source))
        print(f"mtrace-live: {written} records in {output}", file=sys.stderr)
        return
    else:
        if target != "sp-rtrace":
            raise UsageError(f"{source} is not a kmemtrace record set: --to {target} needs one")
        trace = _read_report(source)
        if resolve:
            _resolve(trace, symbols or KernelSymbols.load())
    if leaks:
        sprtrace.filter_leaks(trace)
    if compress:
        trace.add_filter("compress")
    lines = sprtrace.lines(trace, compressed=compress)
    summary = sprtrace.leak_summary(trace) if leaks else []
    _emit([*lines, *summary], output)
    _report_damage(damage)


def _is_json_lines(source: Path) -> bool:
    try:
        with open(source, "rb") as stream:
            return stream.read(4096).lstrip().startswith(b"{")
    except OSError:
        return False


def _read_report(source: Path) -> sprtrace.Trace:
    try:
        with open(source, encoding="utf-8", errors="strict") as stream:
            return sprtrace.parse(stream, str(source))
    except UnicodeDecodeError:
        raise SpRtraceError(f"{source}: not an sp-rtrace text report (not text)") from None
    except IsADirectoryError:
        raise SpRtraceError(f"{source}: a directory, but not a kmemtrace record set") from None


def _resolve(trace: sprtrace.Trace, symbols: KernelSymbols) -> None:
    for call in trace.calls:
        for frame in call.frames:
            if frame.function is None:
                found = symbols.function(frame.address)
                if found:
                    frame.function = found[0]
                    frame.module = found[2] or "[kernel.kallsyms]"
                    frame.written = None
    trace.add_filter("resolve")


def _emit(lines: Iterable[str], output: Path | None) -> None:
    stream = open(output, "w", encoding="utf-8") if output is not None else sys.stdout  # noqa: SIM115
    try:
        for line in lines:
            stream.write(line + "\n")
    finally:
        if output is not None:
            stream.close()


def _report_damage(damage: list[str]) -> None:
    if damage:
        for line in damage[:-1]:
            print(f"mtrace-live: error: {line}", file=sys.stderr)
        raise DamagedRecordsError(damage[-1])
