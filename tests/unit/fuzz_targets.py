"""The readers of untrusted input, as fuzz targets: bytes in, and either a
clean error (the reader's MtraceError) or a result that passes its checks.

Any other exception is a finding. The same targets run under hypothesis in
the unit tests (a bounded number of examples, in CI) and under atheris with
``make fuzz`` (coverage-guided, a million inputs and more, with libFuzzer's
time and memory limits: see docs/fuzzing.md). Each target also has seeds,
valid inputs for the fuzzers to start from.
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from mtrace_live.exporters.data.kallsyms import KernelSymbols
from mtrace_live.exporters.kmemtrace.analysis import analyse, report_lines, stream_report
from mtrace_live.exporters.kmemtrace.json_lines import json_lines, write_record_set
from mtrace_live.exporters.kmemtrace.reader import cpu_files, open_record_set, read_record_set
from mtrace_live.exporters.sprtrace import text as sprtrace
from mtrace_live.exporters.sprtrace.convert import from_record_set
from mtrace_live.exporters.web import load_web_config, parse_address
from mtrace_live.probes.errors import (
    ListenError,
    RecordSetError,
    SpRtraceError,
    WebConfigError,
)

# Files are written under /dev/shm where there is one: a target writes a
# record set or a config for each input.
SCRATCH = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def _scratch() -> Path:
    return Path(tempfile.mkdtemp(prefix="mtrace-live-fuzz-", dir=SCRATCH))


# ---- sp-rtrace text ---------------------------------------------------------------


def sprtrace_text(data: bytes) -> None:
    """Read a report, post-process it; what is written must read back the same."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return  # convert refuses it as not text, before parsing
    try:
        trace = sprtrace.parse(io.StringIO(text), "fuzz")
    except SpRtraceError:
        return
    written = list(sprtrace.lines(trace))
    again = sprtrace.parse(written, "again")
    assert again.calls == trace.calls, "a report does not read back as it was written"
    assert again.mmaps == trace.mmaps and again.resources == trace.resources
    list(sprtrace.lines(trace, compressed=True))
    sprtrace.filter_leaks(trace)
    summary = sprtrace.leak_summary(trace)
    assert all(not line.split()[1].startswith("-") for line in summary[1::2])


SPRTRACE_SEED = """version=1.0,arch=x86_64,timestamp=2026.11.21 08:30:00,process=app,pid=42
@ 1 : pid 42 (app)
<1> : memory (user memory)
<2> : arena (arenas) [refcount]
: /usr/lib/x86_64-linux-gnu/libc.so.6 => 0x7f0000000000-0x7f0000200000
: /memfd:jit\\040(deleted) => 0x7f1000000000-0x7f1000001000
1. @1 [00:00:01.250] malloc<memory>(192) = 0x5555aaaa0000
\t$1 = 256
\t0x7f0000001234 in malloc() from /usr/lib/x86_64-linux-gnu/libc.so.6
\t0x7f0000005678 sysmalloc() at malloc.c:2724
\t0x400100 in ??

2. [00:00:02.000] free<memory>(0x5555aaaa0000)

3. memory_arena_new<arena>(2048) = 0x7f0000100000
4. free(0x99)
## a permanent comment
# a temporary one
"""


# ---- JSON lines -------------------------------------------------------------------


def json_records(data: bytes) -> None:
    """JSON lines into a record set; what reads back must be what went in."""
    text = data.decode("utf-8", errors="replace")
    directory = _scratch()
    try:
        try:
            written = write_record_set(text.splitlines(), directory / "set", "fuzz.jsonl")
        except RecordSetError:
            assert not (directory / "set").exists(), "a refused input left a record set"
            return
        records = read_record_set(directory / "set")
        assert len(records.records) == written
        docs = [json.loads(line) for line in json_lines(records, KernelSymbols(""))]
        given = [json.loads(line) for line in text.splitlines() if line.strip()]
        given.sort(key=lambda doc: doc["seq"])
        for doc, source in zip(docs, given, strict=True):
            for key in ("ts_ns", "cpu", "pid", "tid", "event", "call_site", "ptr"):
                if key in doc and key in source:
                    assert doc[key] == source[key], f"{key} did not survive"
    finally:
        shutil.rmtree(directory)


JSON_SEED = "\n".join(
    json.dumps(doc)
    for doc in (
        {"seq": 0, "ts_ns": 100, "cpu": 0, "pid": 42, "tid": 42, "event": "alloc",
         "type": "kmalloc", "call_site": 0xFFFFFFFF81000010, "ptr": 0xFFFF888000001000,
         "bytes_req": 100, "bytes_alloc": 128, "gfp_flags": 0xCC0, "node": -1},
        {"seq": 1, "ts_ns": 200, "cpu": 1, "pid": 42, "tid": 43, "event": "free",
         "type": "kmalloc", "call_site": 0xFFFFFFFF81000020, "ptr": 0xFFFF888000001000},
        {"seq": 2, "ts_ns": 300, "cpu": 0, "pid": 42, "tid": 42, "event": "alloc",
         "type": "pages", "call_site": 0, "ptr": 0x1234000, "bytes_req": 4096,
         "bytes_alloc": 4096, "gfp_flags": 0, "node": 0},
        {"seq": 3, "ts_ns": 400, "cpu": 0, "pid": 42, "tid": 42, "event": "probe",
         "probe": "memory_mallopt", "call_site": 0x7F0000001000, "args": [1, 64]},
        {"seq": 4, "ts_ns": 500, "cpu": 0, "pid": 42, "tid": 42, "event": "alloc",
         "type": "sbrk", "call_site": 0x7F0000002000, "ptr": 0x555555560000,
         "bytes_req": 135168, "bytes_alloc": 135168, "gfp_flags": 0, "node": -1},
    )
)  # fmt: skip


# ---- kmemtrace record sets --------------------------------------------------------

# A record set as one byte string: a byte of flags saying which header files
# are present, then the files' contents separated by SEPARATOR: the present
# header files in HEADER_FILES order, then cpu0, cpu1, ... (at most MAX_CPU_FILES;
# with flag 0x80, named cpu0, cpu1000, cpu2000, ...).
HEADER_FILES = ("abi_version", "cpus", "total_overruns", "libc_probes", "cpu_nodes", "kallsyms")
SEPARATOR = b"\n--mtrace-live--\n"
MAX_CPU_FILES = 8


def record_set_bytes(files: dict[str, bytes], cpus: list[bytes]) -> bytes:
    flags = sum(1 << n for n, name in enumerate(HEADER_FILES) if name in files)
    parts = [files[name] for name in HEADER_FILES if name in files] + cpus
    return bytes([flags]) + SEPARATOR.join(parts)


def record_set(data: bytes) -> None:
    """A record set's files; reading, reporting and converting it either
    refuse it cleanly or give consistent numbers."""
    if not data:
        return
    flags, parts = data[0], data[1:].split(SEPARATOR)
    present = [name for n, name in enumerate(HEADER_FILES) if flags & (1 << n)]
    directory = _scratch()
    try:
        for name, part in zip(present, parts, strict=False):
            (directory / name).write_bytes(part)
        for n, part in enumerate(parts[len(present) :][:MAX_CPU_FILES]):
            (directory / f"cpu{n * 1000 if flags & 0x80 else n}").write_bytes(part)
        try:
            records = read_record_set(directory)
        except RecordSetError:
            return
        total = sum(path.stat().st_size for path in cpu_files(directory).values())
        assert len(records.unordered) <= total // 24
        symbols = KernelSymbols(records.kallsyms or "")
        report = analyse(records, symbols)
        # the streaming pass reads the same hostile bytes to the same answer
        assert stream_report(open_record_set(directory), symbols).as_json() == report.as_json()
        report_lines(report, None, "bytes_alloc")
        allocs = int(np.count_nonzero(records.unordered["event_id"] == 0))
        assert sum(site.allocs for site in report.kernel.sites) <= allocs
        for site in report.kernel.sites:
            assert min(site.allocs, site.bytes_req, site.bytes_alloc, site.frees) >= 0
        assert sum(1 for _ in json_lines(records, symbols)) == len(records.records)
        list(sprtrace.lines(from_record_set(records, symbols, "fuzz")))
    finally:
        shutil.rmtree(directory)


def record_set_seed() -> bytes:
    """A small valid record set, written by the tracer's own encoder."""
    directory = _scratch()
    try:
        write_record_set(JSON_SEED.splitlines(), directory / "set", "seed")
        files = {
            name: (directory / "set" / name).read_bytes()
            for name in HEADER_FILES
            if (directory / "set" / name).exists()
        }
        files["kallsyms"] = b"ffffffff81000000 T start_kernel\nffffffff81000100 t helper [mod]\n"
        files["cpu_nodes"] = b"0 0\n1 0\n"
        cpus = cpu_files(directory / "set")
        return record_set_bytes(files, [cpus[n].read_bytes() for n in sorted(cpus)])
    finally:
        shutil.rmtree(directory)


# ---- the web config and the listen address ---------------------------------------


def web_config(data: bytes) -> None:
    """A --web.config.file: loaded, or one WebConfigError."""
    directory = _scratch()
    try:
        path = directory / "web-config.yml"
        path.write_bytes(data)
        try:
            config = load_web_config(path)
        except WebConfigError:
            return
        assert all(isinstance(value, bytes) and len(value) == 60 for value in config.users.values())
    finally:
        shutil.rmtree(directory)


WEB_CONFIG_SEED = """tls_server_config:
  cert_file: server.crt
  key_file: server.key
  client_auth_type: RequireAndVerifyClientCert
  client_ca_file: clients.crt
  min_version: TLS12
http_server_config:
  headers: {X-Frame-Options: deny}
basic_auth_users:
  alice: $2b$04$abcdefghijklmnopqrstuu0123456789ABCDEFGHIJKLMNOPQRSTU
"""


WEB_CONFIG_SEEDS = [
    WEB_CONFIG_SEED.encode(),
    b"basic_auth_users:\n  bob: $2y$10$abcdefghijklmnopqrstuu0123456789ABCDEFGHIJKLMNOPQRSTU\n",
    b"http_server_config:\n  headers:\n    Strict-Transport-Security: max-age=3600\n",
    b"tls_server_config:\n  cert_file: /dev/null\n  key_file: /etc/hostname\n",
    b"a: &x [1, 2]\nb: [*x, *x, *x]\nbasic_auth_users: {c: *x}\n",
]


def listen_address(data: bytes) -> None:
    """--web.listen-address: host and port, or one ListenError; what is
    accepted reads back the same when written back."""
    text = data.decode("utf-8", errors="replace")
    try:
        host, port = parse_address(text)
    except ListenError:
        return
    assert 0 <= port <= 65535
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    assert parse_address(shown) == (host, port)


CFI_FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "elf" / "no_notes.so"


def cfi_rows(data: bytes) -> None:
    """A library's bytes (its .eh_frame, or anything) as unwind rows: rows
    sorted by address, one per address, kinds within their enums; or none,
    with why. Never an exception."""
    from mtrace_live.probes.elf.cfi import Cfa, Rbp, read_cfi

    directory = _scratch()
    try:
        path = directory / "cfi.so"
        path.write_bytes(data)
        table = read_cfi(path)
    finally:
        shutil.rmtree(directory)
    rows = table.rows
    assert (rows["pc"][1:] > rows["pc"][:-1]).all()
    assert set(rows["cfa"].tolist()) <= {int(k) for k in Cfa}
    assert set(rows["rbp"].tolist()) <= {int(k) for k in Rbp}


# ---- the table of targets ---------------------------------------------------------

TARGETS: dict[str, tuple[Callable[[bytes], None], Callable[[], list[bytes]]]] = {
    "sprtrace": (sprtrace_text, lambda: [SPRTRACE_SEED.encode()]),
    "json": (json_records, lambda: [JSON_SEED.encode()]),
    "recordset": (record_set, lambda: [record_set_seed()]),
    "webconfig": (web_config, lambda: WEB_CONFIG_SEEDS),
    "listen": (listen_address, lambda: [b"127.0.0.1:9477", b"[::1]:9477", b":9477"]),
    "cfi": (cfi_rows, lambda: [CFI_FIXTURE.read_bytes()]),
}
