"""Allocation chains of Python code, each reaching the libc's malloc or
calloc with a size of its own, for comparing a tracer's Python frames and
counts with what the program did.

    python3 py_chains.py [--repeat N] [--tracemalloc]

Standard library only; valid on CPython 3.11 to 3.13 (default build), run
with PYTHONMALLOC unset (pymalloc serves requests of up to 512 bytes, the
libc's malloc the larger ones); it refuses to run (status 2) under other
allocators, debug hooks (-X dev) included.

Protocol. After its imports and a warm-up (every chain run twice at one call
each, then let go), the program prints "ready" and waits for a line on
standard input (a tracer attaches meanwhile). On "go" it runs every chain
once, prints one line of JSON, the ledger, and waits again: on "exit" or at
the end of its input it exits with status 0. Any other line than "go" before
the chains, or the end of the input there, ends it with status 1. Everything
the chains allocated stays allocated until the process exits.

--repeat N multiplies every chain's number of calls by N. --tracemalloc runs
tracemalloc.start(1) just before the chains and adds the "tracemalloc" entry
to the ledger (below).

The chains (name: leaf function, what it calls; sizes and counts in the
constants below):

  ctypes_malloc         native_malloc: the libc's malloc through ctypes, so
                        that native frames (_ctypes, libffi) lie between the
                        Python caller and malloc.
  ctypes_calloc         native_calloc: the libc's calloc(1, size) through
                        ctypes.
  thread_bytearray      fill_in_thread: bytearray(n) in a second thread.
  recursion             descend: bytearray(n) at the bottom of a recursion
                        RECURSION_DEPTH (120) calls of descend deep.
  generator             produce_blocks: a generator whose body makes
                        bytearray(n), drained by a for loop in drain_generator.
  classmethod           BlockPool.make: bytes(n), a classmethod.
  instance_method       BlockPool.grow: bytearray(n), an instance method.
  gil_released_thread   malloc_without_gil: a second thread calling the libc's
                        malloc through ctypes (which lets go of the interpreter
                        lock for the call) again and again, while the main
                        thread spins in Python code (spin_until).
  pymalloc_bytes        small_blocks: bytes(300), which pymalloc serves
                        itself (PyObject_Calloc(1, 333)): the libc never
                        sees it; a tracer of pymalloc (--pymalloc) does.

How CPython 3.11-3.13 (default build, pymalloc) turns these into libc calls:

  bytearray(n), n > 0: bytearray.__init__ calls PyByteArray_Resize(self, n),
      which, the object having no buffer yet, asks for n + 1 bytes (the data
      and a trailing NUL) with PyObject_Realloc(NULL, n + 1); pymalloc serves
      that like PyObject_Malloc(n + 1), and above 512 bytes hands it to
      PyMem_RawMalloc: malloc(n + 1). The object itself (56 bytes) comes from
      pymalloc. So: malloc of n + 1, once per object (BYTEARRAY_EXTRA).
  bytes(n): _PyBytes_FromSize(n, use_calloc=1) calls PyObject_Calloc(1,
      PyBytesObject_SIZE + n), PyBytesObject_SIZE being 33 on a 64-bit build
      (header of 32 bytes, then the data and its NUL), which above 512 bytes
      becomes PyMem_RawCalloc(1, 33 + n): calloc(1, n + 33), one block for
      object and data (BYTES_HEADER).
  ctypes: the foreign function is the libc's own malloc or calloc, called
      with exactly the arguments given.

Every size in the libc call is odd and between 41000 and 48000, a range the
interpreter's own allocations during the chains do not reach, so that a
tracer can pick each chain's calls by (function, size) alone (but
pymalloc_bytes's, 333, in pymalloc's PyObject_Calloc).

The ledger (one line of JSON):

  {"pid": P, "python": "3.12.1", "executable": ..., "file": F, "repeat": N,
   "chains": [
     {"name": "recursion", "leaf": "descend", "file": F, "line": L,
      "fn": "malloc", "nmemb": 1, "size": 43311, "calls": 19, "bytes": 822909,
      "request": "bytearray(43310)", "thread": "MainThread", "tid": T,
      "native_frames": false, "tracemalloc": true,
      "python_stack": ["descend", ..., "descend", "recurse_chain",
                       "run_chains", "main", "<module>"]},
     ...],
   "tracemalloc": [{"file": F, "line": L, "count": C, "size": S}, ...]}

  line           the line of the statement that makes the call (the one
                 marked "# alloc: <name>" in this file).
  fn, size       the libc function and its size argument; calloc chains
                 call calloc(nmemb, size) with nmemb 1.
  calls, bytes   how many calls of that size the chain makes, and calls x size.
  python_stack   the co_qualname of every Python frame from the leaf outward,
                 recorded from the frames themselves during the warm-up: in the
                 main thread down to "<module>", in a second thread down to
                 "Thread._bootstrap". The recursion's lists "descend" 120 times.
  provider       the allocator that serves the call: "glibc" (the libc's
                 malloc or calloc), or "pymalloc" (PyObject_Calloc, never
                 reaching the libc).
  native_frames  whether native code lies between the leaf and the libc call
                 other than the interpreter's own (ctypes and libffi do).
  tracemalloc    (per chain) whether tracemalloc can see the chain's blocks:
                 it traces the interpreter's allocators, not a foreign call to
                 the libc, so not the ctypes chains.
  thread, tid    the thread that allocated: its name and native id.
  "tracemalloc"  (only with --tracemalloc) from a snapshot taken after the
                 chains: per line of this file, the number and total size of
                 the live traced blocks larger than 512 bytes whose innermost
                 frame is that line. Only those larger than 512 bytes: they are
                 the blocks the libc's malloc and calloc gave (what a tracer of
                 those sees); the smaller ones on the same lines (the 56-byte
                 bytearray objects, generator objects) come from pymalloc. A
                 chain seen by tracemalloc has count == calls and
                 size == bytes on its line.
  "gil_released_thread" also has "main_spins": how many rounds the main
  thread's loop made while the second thread allocated.
"""

import argparse
import ctypes
import json
import os
import sys
import sysconfig
import threading
import tracemalloc

LIBC = ctypes.CDLL(None)
libc_malloc = LIBC.malloc
libc_malloc.restype = ctypes.c_void_p
libc_malloc.argtypes = [ctypes.c_size_t]
libc_calloc = LIBC.calloc
libc_calloc.restype = ctypes.c_void_p
libc_calloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
libc_free = LIBC.free
libc_free.restype = None
libc_free.argtypes = [ctypes.c_void_p]

BYTEARRAY_EXTRA = 1  # bytearray(n): malloc(n + 1)
BYTES_HEADER = 33  # bytes(n): calloc(1, n + 33)
PYMALLOC_LIMIT = 512  # larger requests go to the libc
RECURSION_DEPTH = 120

# The libc call's size argument and the number of calls, per chain.
CTYPES_MALLOC = 41_011
CTYPES_CALLOC = 41_113
THREAD_BYTEARRAY = 42_211
RECURSION = 43_311
GENERATOR = 44_411
CLASSMETHOD = 45_513
INSTANCE_METHOD = 46_611
GIL_RELEASED = 47_711
# pymalloc's own: bytes(300) is PyObject_Calloc(1, 333), served by pymalloc
# (at most 512 bytes): the libc never sees it. Seen with --pymalloc alone.
SMALL_BYTES = 333

CALLS = {
    "ctypes_malloc": 31,
    "ctypes_calloc": 29,
    "thread_bytearray": 23,
    "recursion": 19,
    "generator": 17,
    "classmethod": 13,
    "instance_method": 11,
    "gil_released_thread": 41,
    "pymalloc_bytes": 37,
}

THREAD_NAMES = {
    "thread_bytearray": "py-chains-bytearray",
    "gil_released_thread": "py-chains-gil-free",
}


# --- the leaves and their callers ---------------------------------------


def native_malloc(out):
    for i in range(len(out)):
        out[i] = libc_malloc(CTYPES_MALLOC)  # alloc: ctypes_malloc


def native_calloc(out):
    for i in range(len(out)):
        out[i] = libc_calloc(1, CTYPES_CALLOC)  # alloc: ctypes_calloc


def fill_in_thread(out, tids):
    tids["thread_bytearray"] = threading.get_native_id()
    for i in range(len(out)):
        out[i] = bytearray(THREAD_BYTEARRAY - BYTEARRAY_EXTRA)  # alloc: thread_bytearray


def run_in_thread(out, tids):
    worker = threading.Thread(
        target=fill_in_thread, args=(out, tids), name=THREAD_NAMES["thread_bytearray"]
    )
    worker.start()
    worker.join()


def descend(depth):
    if depth > 1:
        return descend(depth - 1)
    return bytearray(RECURSION - BYTEARRAY_EXTRA)  # alloc: recursion


def recurse_chain(out):
    for i in range(len(out)):
        out[i] = descend(RECURSION_DEPTH)


def produce_blocks(count):
    for _ in range(count):
        yield bytearray(GENERATOR - BYTEARRAY_EXTRA)  # alloc: generator


def drain_generator(out):
    for i, block in enumerate(produce_blocks(len(out))):
        out[i] = block


class BlockPool:
    def __init__(self, out):
        self.out = out

    @classmethod
    def make(cls, out):
        for i in range(len(out)):
            out[i] = bytes(CLASSMETHOD - BYTES_HEADER)  # alloc: classmethod
        return cls(out)

    def grow(self):
        for i in range(len(self.out)):
            self.out[i] = bytearray(INSTANCE_METHOD - BYTEARRAY_EXTRA)  # alloc: instance_method


def malloc_without_gil(out, tids, done):
    tids["gil_released_thread"] = threading.get_native_id()
    for i in range(len(out)):
        out[i] = libc_malloc(GIL_RELEASED)  # alloc: gil_released_thread
    done[0] = True


def small_blocks(out):
    for i in range(len(out)):
        out[i] = bytes(SMALL_BYTES - BYTES_HEADER)  # alloc: pymalloc_bytes


def spin_until(done):
    """Python work in the main thread, without allocating above pymalloc's
    limit, until the other thread is done; the number of rounds."""
    rounds = 0
    value = 1
    while not done[0]:
        value = (value * 31 + 7) & 0xFF
        rounds += 1
    return rounds


def run_gil_released(out, tids):
    done = [False]
    worker = threading.Thread(
        target=malloc_without_gil, args=(out, tids, done), name=THREAD_NAMES["gil_released_thread"]
    )
    worker.start()
    spins = spin_until(done)
    worker.join()
    return spins


def run_chains(keep, tids):
    """Every chain once, filling its list of keep (one slot per call)."""
    native_malloc(keep["ctypes_malloc"])
    native_calloc(keep["ctypes_calloc"])
    run_in_thread(keep["thread_bytearray"], tids)
    recurse_chain(keep["recursion"])
    drain_generator(keep["generator"])
    BlockPool.make(keep["classmethod"])
    BlockPool(keep["instance_method"]).grow()
    small_blocks(keep["pymalloc_bytes"])
    return run_gil_released(keep["gil_released_thread"], tids)


# --- the ledger ---------------------------------------------------------

# name: (leaf, fn, size, Python-level request, native frames, seen by tracemalloc)
CHAINS = {
    "ctypes_malloc": ("native_malloc", "malloc", CTYPES_MALLOC,
                      f"malloc({CTYPES_MALLOC})", True, False),
    "ctypes_calloc": ("native_calloc", "calloc", CTYPES_CALLOC,
                      f"calloc(1, {CTYPES_CALLOC})", True, False),
    "thread_bytearray": ("fill_in_thread", "malloc", THREAD_BYTEARRAY,
                         f"bytearray({THREAD_BYTEARRAY - BYTEARRAY_EXTRA})", False, True),
    "recursion": ("descend", "malloc", RECURSION,
                  f"bytearray({RECURSION - BYTEARRAY_EXTRA})", False, True),
    "generator": ("produce_blocks", "malloc", GENERATOR,
                  f"bytearray({GENERATOR - BYTEARRAY_EXTRA})", False, True),
    "classmethod": ("BlockPool.make", "calloc", CLASSMETHOD,
                    f"bytes({CLASSMETHOD - BYTES_HEADER})", False, True),
    "instance_method": ("BlockPool.grow", "malloc", INSTANCE_METHOD,
                        f"bytearray({INSTANCE_METHOD - BYTEARRAY_EXTRA})", False, True),
    "gil_released_thread": ("malloc_without_gil", "malloc", GIL_RELEASED,
                            f"malloc({GIL_RELEASED})", True, False),
    "pymalloc_bytes": ("small_blocks", "calloc", SMALL_BYTES,
                       f"bytes({SMALL_BYTES - BYTES_HEADER})", False, False),
}  # fmt: skip
# the chains whose calls pymalloc serves itself (the libc sees none of them)
PYMALLOC_CHAINS = {"pymalloc_bytes"}

THIS_FILE = native_malloc.__code__.co_filename
MARK = "# alloc: "


def allocating_lines():
    """(file, line) -> chain name, from the marks in this file."""
    lines = {}
    with open(THIS_FILE, encoding="utf-8") as source:
        for number, text in enumerate(source, 1):
            code, mark, name = text.partition(MARK)
            if mark and code.strip() and name.strip() in CHAINS:
                lines[(THIS_FILE, number)] = name.strip()
    if sorted(lines.values()) != sorted(CHAINS):
        raise SystemExit(f"py_chains: marked lines {sorted(lines.values())}")
    return lines


def stack_recorder(lines, stacks):
    """A trace function that, on reaching a marked line, records the
    qualnames of the Python frames from there outward (once per chain)."""

    def on_line(frame, event, arg):
        if event == "line":
            name = lines.get((frame.f_code.co_filename, frame.f_lineno))
            if name is not None and name not in stacks:
                qualnames = []
                while frame is not None:
                    qualnames.append(frame.f_code.co_qualname)
                    frame = frame.f_back
                stacks[name] = qualnames
        return on_line

    def on_call(frame, event, arg):
        return on_line if frame.f_code.co_filename == THIS_FILE else None

    return on_call


def slots(repeat):
    return {name: [None] * (calls * repeat) for name, calls in CALLS.items()}


def start_tracing(recorder):
    threading.settrace(recorder)
    sys.settrace(recorder)


def stop_tracing():
    sys.settrace(None)
    threading.settrace(None)


def let_go(keep):
    """Frees the blocks of the ctypes chains (the others go with their
    objects)."""
    for name, (_, _, _, _, native, _) in CHAINS.items():
        if native:
            for pointer in keep[name]:
                libc_free(pointer)


def check_stacks(stacks):
    for name, (leaf, *_) in CHAINS.items():
        if stacks.get(name, [None])[0] != leaf:
            raise SystemExit(f"py_chains: {name}: stack {stacks.get(name)}")


def traced_lines(snapshot):
    """Per line of this file: the live traced blocks above pymalloc's limit."""
    per_line = {}
    for trace in snapshot.traces:
        frame = trace.traceback[0]
        if frame.filename == THIS_FILE and trace.size > PYMALLOC_LIMIT:
            count, size = per_line.get(frame.lineno, (0, 0))
            per_line[frame.lineno] = (count + 1, size + trace.size)
    return [
        {"file": THIS_FILE, "line": line, "count": count, "size": size}
        for line, (count, size) in sorted(per_line.items())
    ]


def ledger(lines, stacks, repeat, tids, spins):
    line_of = {name: line for (_, line), name in lines.items()}
    chains = []
    for name, (leaf, fn, size, request, native, seen) in CHAINS.items():
        calls = CALLS[name] * repeat
        thread = THREAD_NAMES.get(name, "MainThread")
        chain = {
            "name": name,
            "leaf": leaf,
            "file": THIS_FILE,
            "line": line_of[name],
            "fn": fn,
            "nmemb": 1,
            "size": size,
            "calls": calls,
            "bytes": calls * size,
            "request": request,
            "thread": thread,
            "tid": tids.get(name, os.getpid()),
            "native_frames": native,
            "tracemalloc": seen,
            "python_stack": stacks[name],
            "provider": "pymalloc" if name in PYMALLOC_CHAINS else "glibc",
        }
        if name == "gil_released_thread":
            chain["main_spins"] = spins
        chains.append(chain)
    return {
        "pid": os.getpid(),
        "python": ".".join(map(str, sys.version_info[:3])),
        "executable": sys.executable,
        "file": THIS_FILE,
        "repeat": repeat,
        "chains": chains,
    }


def allocators_as_described():
    """Whether the interpreter's allocators are the ones the sizes above
    assume: pymalloc over the libc, without debug hooks (PYTHONMALLOC=malloc
    would make bytearray's buffer a realloc, the debug hooks add a margin
    around every block)."""
    chosen = "" if sys.flags.ignore_environment else os.environ.get("PYTHONMALLOC", "")
    return (
        chosen in ("", "pymalloc")
        and not sys.flags.dev_mode
        and not hasattr(sys, "gettotalrefcount")  # a debug build
        and not sysconfig.get_config_var("Py_GIL_DISABLED")  # mimalloc
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1, help="multiplies every chain's calls")
    parser.add_argument(
        "--tracemalloc", action="store_true", help="trace the chains with tracemalloc"
    )
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if not allocators_as_described():
        parser.error("needs pymalloc without debug hooks: PYTHONMALLOC unset, no -X dev")

    # The warm-up: every chain twice at one call each, from here as in the
    # real run, so that its stacks are the same. First under a trace function
    # that records the stacks, then untraced (code that was traced is prepared
    # again on its first run after); the blocks are let go.
    lines = allocating_lines()
    stacks = {}
    recorder = stack_recorder(lines, stacks)
    for traced in (True, False):
        scratch = {name: [None] for name in CALLS}
        if traced:
            start_tracing(recorder)
        run_chains(scratch, {})
        if traced:
            stop_tracing()
        let_go(scratch)
        del scratch
    check_stacks(stacks)
    keep = slots(args.repeat)
    tids = {}
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1

    if args.tracemalloc:
        tracemalloc.start(1)
    spins = run_chains(keep, tids)
    entry = ledger(lines, stacks, args.repeat, tids, spins)
    if args.tracemalloc:
        snapshot = tracemalloc.take_snapshot()
        entry["tracemalloc"] = traced_lines(snapshot)
        del snapshot
    print(json.dumps(entry), flush=True)

    for line in sys.stdin:
        if line.strip() == "exit":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
