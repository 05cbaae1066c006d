"""What mtrace-live attaches to, and what comes out: the probe catalog
(``specs/*.toml``, ``catalog``) and what each probe means to the outputs
(``meanings``), SDT notes (``sdt_notes``, ``locations``), the BPF program
(``bpf/trace.bpf.c``) and the records it writes (``bpf/records.h``,
``records``).

Python never holds BPF C in strings. Installed as ``mtrace_live.probes``;
the bottom layer, importing nothing else of mtrace-live.
"""

from importlib.resources import files
from pathlib import Path


def bpf_source(name: str) -> Path:
    """Path of a bundled BPF C program, e.g. ``bpf_source("trace")``."""
    path = Path(str(files(__name__) / "bpf" / f"{name}.bpf.c"))
    if not path.is_file():
        raise FileNotFoundError(path)
    return path
