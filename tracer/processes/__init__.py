"""The processes traced: targets, the allocators they call, their arenas,
the commands launched, the holds and the moves of one process's uprobes.
Imports the bpf room only."""
