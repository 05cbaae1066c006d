"""The plain data every output receives, below the outputs and above
probes/: decoded events and the sink interface (``sink``), the allocator
model's state (``allocator``), kernel call sites (``kmem``), kernel and
process symbols (``kallsyms``, ``symbolize``, ``processes``). Nothing here
imports the outputs or the tracer (tests/unit/test_layers.py)."""
