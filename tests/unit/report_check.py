"""The report of a record set by both analyses, held to be the same."""

from __future__ import annotations

from pathlib import Path

from mtrace_live.exporters.data.kallsyms import KernelSymbols
from mtrace_live.exporters.kmemtrace.analysis import Report, analyse, report_lines, stream_report
from mtrace_live.exporters.kmemtrace.reader import open_record_set, read_record_set


def same_report(path: Path, symbols: KernelSymbols | None = None, **stream_args: object) -> Report:
    """The streaming pass's report of ``path``, after checking that it says
    exactly what the sorting analysis says (as JSON and as the table)."""
    streaming = stream_report(open_record_set(path), symbols, **stream_args)  # type: ignore[arg-type]
    sorting = analyse(read_record_set(path), symbols)
    assert streaming.as_json() == sorting.as_json()
    for sort in ("bytes_alloc", "allocs", "fragmentation", "outstanding_bytes"):
        assert report_lines(streaming, None, sort) == report_lines(sorting, None, sort)
    return streaming
