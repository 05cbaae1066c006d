"""The unwinders: their tables, written per process and file, and the file
server. Imports the bpf and processes rooms."""
