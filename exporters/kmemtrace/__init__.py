"""The kmemtrace record set format, in one place: its ABI (``abi``), the
writer (``writer``) and the ``--kmemtrace``/``record`` output (``sink``),
the reader (``reader``), the one walker of its records, in C (``walker.c``,
built at install as ``_walker``), ``report``'s analysis (``report``) and
the JSON lines form (``json_lines``). docs/kmemtrace-format.md describes
every byte."""
