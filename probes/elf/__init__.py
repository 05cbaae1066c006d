"""The bottom layer: ELF files, and the project's one error hierarchy.

``errors`` holds every error class mtrace-live raises, with its exit code;
it sits here so that every layer, from reading a file up, raises the same
classes and none translates another's. ``file`` opens an ELF file and reads
its build-id, loadable segments, file offsets and code; ``symbols`` its
symbol tables; ``debug`` finds a separate debug file the way gdb does.
Installed as ``mtrace_live.probes.elf``; it imports nothing else of
mtrace-live.
"""
