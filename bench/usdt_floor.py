"""The floors of section 1: on the SDT libc's sites of the named probes, in
every process mapping it (as bpftrace attaches to the library), either a
handler that does nothing (the uprobe trap alone) or one that writes a ring
record of RECORD_BYTES a hit and nothing else (bench/bpf/ring_floor.bpf.c).

The least an event stream can pay: the records are read, on another CPU, by
a thread that copies everything committed every millisecond (mtrace-live's
own bulk reader, tracer/bpf/ringbuf.py) and does nothing else; the ring (1 MiB)
fits in the CPU's L2; a commit wakes no one. Prints "ready" once attached;
at SIGINT or SIGTERM, how many records the ring refused, then exits.

    python bench/usdt_floor.py empty|record RECORD_BYTES PROBE...
"""

from __future__ import annotations

import mmap
import signal
import sys
import threading

import numpy as np
from common import floor_source
from mtrace_live.probes.sdt_notes import read_sites
from mtrace_live.tracer.bpf.bpf_backend import BpfProgram
from mtrace_live.tracer.bpf.ringbuf import RingReader
from mtrace_live.tracer.processes import sdt_glibc

RING_PAGES = 256  # 1 MiB: 5 ms of jmp_loop's 96-byte records
PERIOD_S = 0.001


def read(reader: RingReader, stop: threading.Event) -> None:
    while not stop.wait(PERIOD_S):
        reader.read()


def main(handler: str, record_bytes: int, probes: list[str]) -> None:
    libc = sdt_glibc.locate().libc
    sites = [s for s in read_sites(libc) if s.provider == "libc" and s.name in probes]
    program = BpfProgram(
        floor_source("ring_floor", {"RECORD_BYTES": record_bytes, "RING_PAGES": RING_PAGES})
    )
    record = np.dtype([("words", "<u8", (record_bytes // 8,))])
    reader = RingReader(program.map_fd("records"), RING_PAGES * mmap.PAGESIZE, record)
    stop = threading.Event()
    reading = threading.Thread(target=read, args=(reader, stop))
    try:
        reading.start()
        for site in sites:
            program.attach_uprobe(libc, site.file_offset, handler)
        print("ready", flush=True)
        signal.sigwait([signal.SIGINT, signal.SIGTERM])
        print(f"refused {program.percpu_array_totals('refused')[0]}", flush=True)
    finally:
        stop.set()
        if reading.is_alive():
            reading.join()
        reader.close()
        program.close()


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT, signal.SIGTERM])
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
