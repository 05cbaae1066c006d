# The compiled walker of walker.c.
from typing import Any

def report_pass(
    paths: list[str],
    cpus: list[int],
    nodes: list[int],
    big_endian: bool,
    page_size: int,
    chunk: int,
) -> dict[str, Any]: ...
def scan(
    data: Any, big_endian: bool, cpu: int, out: Any, args: Any, skipped: Any
) -> tuple[int, int, int, int]: ...
def record_layout() -> dict[str, tuple[int, int]]: ...
def report_records(records: Any, nodes: list[int], page_size: int) -> dict[str, Any]: ...
def unwrap(seq: Any, prev: int | None = None) -> None: ...
