"""The outputs of mtrace-live, one module per output, each a ``Sink``
(``data/sink.py``) registered once in ``registry.py``: the live view
(``live_view``), event lines (``lines``), the summary (``summary``),
kmemtrace records (``kmemtrace_sink``), sp-rtrace reports (``sprtrace_writer``),
Prometheus metrics (``prometheus_sink``, served by ``web``). The formats the
offline commands read and write live here too (``kmemtrace``, ``sprtrace``,
``allocinfo``, ``kmem_table``).

Installed as ``mtrace_live.exporters``. Nothing here imports the tracer; the
plain data the outputs are built on is the subpackage ``data``
(docs/architecture.md).
"""
