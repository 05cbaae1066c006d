# The compiled pass of report_pass.c.
from typing import Any

def report_pass(
    paths: list[str],
    cpus: list[int],
    nodes: list[int],
    big_endian: bool,
    page_size: int,
    chunk: int,
) -> dict[str, Any]: ...
