"""What mtrace-live attaches to: probe specifications and the BPF C programs.

The BPF programs live beside this file in ``bpf/*.bpf.c``; Python never holds
BPF C in strings. Installed as ``mtrace_live.probes``.
"""

from importlib.resources import files
from pathlib import Path


def bpf_source(name: str) -> Path:
    """Path of a bundled BPF C program, e.g. ``bpf_source("trace")``."""
    path = Path(str(files(__name__) / "bpf" / f"{name}.bpf.c"))
    if not path.is_file():
        raise FileNotFoundError(path)
    return path
