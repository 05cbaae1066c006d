"""The BPF program loaded and attached, its maps and rings read: bcc to
compile it, the project's own system calls for the rest. The lowest room of
the tracer: it imports none of the others."""
