"""Output formats, one module per format behind one interface.

Installed as ``mtrace_live.exporters``. The formats (Prometheus, kmemtrace
records, sp-rtrace text, allocinfo tables) arrive with their own modules.
"""
