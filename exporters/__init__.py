"""The outputs of mtrace-live, one module per output, each a ``Sink``
(``data/sink.py``) registered once in ``registry.py``: the live view
(``live_view``), event lines (``lines``), the summary (``summary``),
kmemtrace records (``kmemtrace.sink``), sp-rtrace reports (``sprtrace.sink``),
Prometheus metrics (``prometheus_sink``, served by ``web``). Each file format
is one package, with its reader, writer and output (``kmemtrace``,
``sprtrace``); ``convert`` converts between them, and ``allocinfo`` and
``kmem_table`` are the other formats.

Installed as ``mtrace_live.exporters``. Nothing here imports the tracer; the
plain data the outputs are built on is the subpackage ``data``
(docs/architecture.md).
"""
