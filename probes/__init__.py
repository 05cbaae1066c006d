"""What mtrace-live attaches to, and what comes out: the probe catalog
(``specs/*.toml``, ``catalog``) and what each probe means to the outputs
(``meanings``), SDT notes (``sdt_notes``, ``locations``), the BPF program
in parts (``bpf/``, joined by ``program``) and the records it writes
(``bpf/records.h``, ``records``).

Python never holds BPF C in strings. Installed as ``mtrace_live.probes``;
the bottom layer, importing nothing else of mtrace-live.
"""
