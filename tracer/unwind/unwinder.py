"""The unwinders' one interface: what the trace's loop asks of each way of
walking a stack it plugs in (tracer/unwind/native.py: by the mapped files'
call-frame information).

The loop makes each unwinder while attaching, once the program is loaded
and before its gate opens; each sets its own programs in their tail-call
slots and writes its tables. Then the loop gives every unwinder the same
calls, in order, and special-cases none:

- ``load(pid)``: a process is traced from now on (at the start, or followed
  later): its tables before its first traced call;
- ``refresh()``: once a second, a look at the traced processes again (a
  library mapped meanwhile, a process gone);
- ``handle(records, kinds)``: each batch of records read, before the
  sinks get it: the asks among them (a process that wants its tables, a
  fork, an exec);
- ``fds()`` and ``pump()``: the rings of its own the loop waits on too,
  and what it reads of them at each wake-up (after the batches);
- ``settle()``: at the trace's end, before the counters are read: what is
  still owed to the names;
- ``counts()``: user space's own counts, beside the program's, for the
  outputs' table of how the stacks were walked;
- ``debug_lines()``: what its tables took (with MTRACE_LIVE_DEBUG);
- ``close(rest)``: its threads and processes ended (``rest``: the asks
  still waiting served first).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from mtrace_live.probes.elf.lazy import lazy_module

if TYPE_CHECKING:
    import numpy as np
else:
    np = lazy_module("numpy")  # (at the first use: probes/elf/lazy.py)


class Unwinder(Protocol):
    name: str

    def load(self, pid: int) -> None: ...

    def refresh(self) -> None: ...

    def handle(self, records: np.ndarray, kinds: np.ndarray) -> None: ...

    def fds(self) -> list[int]: ...

    def pump(self) -> None: ...

    def settle(self) -> None: ...

    def counts(self) -> dict[str, int]: ...

    def debug_lines(self) -> list[str]: ...

    def close(self, rest: bool = True) -> None: ...
