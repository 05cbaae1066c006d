"""serve's heap profiles (exporters/heap_profiles.py, exporters/profile_serving.py):
the queries refused, the container shapes, selection, labels and deltas of
the profile built, and the way a request travels from the serving process
to the tracing one."""

from __future__ import annotations

import base64
import contextlib
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

import bcrypt
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mtrace_live.exporters import profile_serving
from mtrace_live.exporters.data.alloc_snapshot import (
    AllocSnapshot,
    FrameNames,
    ProcessAllocs,
    StackCatalog,
    StackColumns,
    StackRow,
)
from mtrace_live.exporters.data.symbolize import Symbol
from mtrace_live.exporters.exposition import ServingProcess, SharedPages
from mtrace_live.exporters.heap_profiles import (
    MAX_SECONDS,
    HeapProfiles,
    ProfileQuery,
    QueryError,
    container_of,
    parse_query,
)
from mtrace_live.exporters.profile_serving import ProfileChannel, ProfilesApp
from mtrace_live.exporters.web import MetricsEndpoint, WebConfig
from prometheus_client import CollectorRegistry

from .profile_proto import message_class, parsed

APP, DB = 4101, 4102  # two processes of the tables below
HEX = "0123456789abcdef" * 4  # a 64-digit container id


class Names(FrameNames):
    """Addresses below 0x500000 name f<address>, in /usr/bin/app."""

    def resolve(self, tgid: int, address: int) -> Symbol | None:
        if address >= 0x500000:
            return None
        return Symbol("/usr/bin/app", f"f{address:x}", 0, None, (0x400000, 0x500000))


def stack(tgid: int, site: int, calls: int, size: int, frees: int) -> StackRow:
    return StackRow(tgid, "malloc", site, (site, 0x401000), calls, calls * size, calls * size,
                    frees, frees * size, frees * size, 0)  # fmt: skip


def numbered(catalog: StackCatalog, *rows: StackRow) -> StackColumns:
    """``rows`` as the kernel's reader gives them: numbered in its catalog,
    kept from one read to the next."""
    ids = [catalog.number((row.tgid, row.function, row.call_site, row.frames, row.provider,
                           row.provider_lib)) for row in rows]  # fmt: skip
    values = [[row.calls, row.bytes, row.sizes, row.frees, row.bytes_freed, row.sizes_freed,
               row.last_ts] for row in rows]  # fmt: skip
    return StackColumns(catalog, np.array(ids, np.int64), np.array(values, np.int64).reshape(-1, 7))


def tables(*rows: StackRow, sample_bytes: int = 0, misc: Mapping[str, int] | None = None,
           catalog: StackCatalog | None = None) -> AllocSnapshot:  # fmt: skip
    """The rows (numbered in ``catalog`` if given, else in one of their own)."""
    tgids = sorted({row.tgid for row in rows} | {APP, DB})
    return AllocSnapshot(
        stacks=rows if catalog is None else numbered(catalog, *rows),
        processes=tuple(ProcessAllocs(tgid, 1, 1, 0, 0, 0, comm="") for tgid in tgids),
        calls={}, misc=misc or {}, sample_bytes=sample_bytes, now_ns=0, started_ns=0,
    )  # fmt: skip


class Tables:
    """The kernel's tables as a reader hands them over, changed by the test."""

    def __init__(self, snapshot: AllocSnapshot | None) -> None:
        self.snapshot = snapshot
        self.names = {APP: "app", DB: "db"}

    def __call__(self, build: Callable[[AllocSnapshot, Callable[[int, str], str]], Any]) -> Any:
        if self.snapshot is None:
            return None
        return build(self.snapshot, lambda tgid, hint: self.names.get(tgid, hint or "unknown"))


CGROUPS = {APP: f"/system.slice/docker-{HEX}.scope", DB: "/system.slice/db.service"}


def profiles(snapshot: AllocSnapshot | None) -> tuple[HeapProfiles, Tables]:
    source = Tables(snapshot)
    return HeapProfiles(source, Names(), cgroup_of=lambda tgid: CGROUPS.get(tgid, "")), source


def decoded(body: bytes) -> Any:
    return parsed(body)


def samples(profile: Any) -> dict[tuple[int, str], tuple[list[int], dict[str, str]]]:
    """(pid, the leaf's function) -> (values, the string labels)."""
    strings = profile.string_table
    functions = {f.id: strings[f.name] for f in profile.function}
    leaves = {loc.id: functions[loc.line[0].function_id] for loc in profile.location}
    found = {}
    for sample in profile.sample:
        labels = {strings[label.key]: strings[label.str] for label in sample.label if label.str}
        pid = next(label.num for label in sample.label if strings[label.key] == "pid")
        found[(pid, leaves[sample.location_id[0]])] = (list(sample.value), labels)
    return found


def answer(heap: HeapProfiles, **request: Any) -> tuple[int, bytes]:
    return heap.answer({"op": "profile", "profile": "heap", **request})


# ---- queries -------------------------------------------------------------------


def test_a_query_is_read_as_go_s_pprof_handlers_read_theirs() -> None:
    assert parse_query("heap", "") == ProfileQuery("heap")
    assert parse_query("allocs", "seconds=30&gc=1&debug=0") == ProfileQuery("allocs", 30)
    assert parse_query("heap", "pid=42&comm=my%20app&cgroup=/a/b.scope") == ProfileQuery(
        "heap", 0, 42, "my app", "/a/b.scope"
    )
    assert parse_query("heap", f"seconds={MAX_SECONDS}").seconds == MAX_SECONDS


def test_a_repeated_parameter_is_read_by_its_first_value_as_go_s_form_value() -> None:
    # Parca's query for a job with params (comm) and two delta profiles: url.Values.Encode
    # of the job's params, to which each delta profile added seconds (pkg/scrape/target.go)
    parca = "comm=redis-server&seconds=15&seconds=15"
    assert parse_query("heap", parca) == ProfileQuery("heap", 15, comm="redis-server")
    assert parse_query("heap", "pid=7&pid=8&seconds=10&seconds=x") == ProfileQuery("heap", 10, 7)


@pytest.mark.parametrize(("query", "words"), [
    ("seconds=-1", "seconds must be a whole number from 1 to 300"),
    ("seconds=0", "seconds must be"), ("seconds=301", "seconds must be"),
    ("seconds=99999999999999999999", "seconds must be"), ("seconds=1.5", "seconds must be"),
    ("seconds=", "seconds must be"), ("pid=0", "pid must be"), ("pid=-3", "pid must be"),
    ("pid=4194305", "pid must be"), ("comm=%ff%fe", "not UTF-8"),
    ("comm=\xff", "not UTF-8"), ("comm=", "comm must be"), ("comm=" + "x" * 256, "comm must be"),
    ("comm=a%00b", "comm must be"), ("cgroup=/../../etc", "cgroup must be"),
    ("cgroup=/a/./b", "cgroup must be"), ("cgroup=a/b", "cgroup must be"),
    ("cgroup=/a//b", "cgroup must be"), ("cgroup=/a%00", "cgroup must be"),
    ("debug=1", "go tool pprof"),
])  # fmt: skip
def test_a_hostile_query_is_refused_in_one_line(query: str, words: str) -> None:
    with pytest.raises(QueryError) as refused:
        parse_query("heap", query)
    assert words in str(refused.value) and "\n" not in str(refused.value)


@settings(deadline=None, max_examples=300)
@given(st.text(alphabet=st.characters(max_codepoint=0xFF), max_size=80))
def test_any_query_is_read_or_refused_never_raised(query: str) -> None:
    with contextlib.suppress(QueryError):
        parse_query("allocs", query)


@pytest.mark.parametrize(("cgroup", "container"), [
    (f"/system.slice/docker-{HEX}.scope", HEX[:12]),  # Docker, systemd driver
    (f"/docker/{HEX}", HEX[:12]),  # Docker, cgroupfs driver
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1234.slice/"
     f"cri-containerd-{HEX}.scope", HEX[:12]),  # containerd under Kubernetes
    (f"/kubepods/besteffort/pod1234/{HEX}", HEX[:12]),  # Kubernetes, cgroupfs driver
    (f"/kubepods.slice/kubepods-pod1.slice/crio-{HEX}.scope", HEX[:12]),  # CRI-O
    (f"/machine.slice/libpod-{HEX}.scope", HEX[:12]),  # Podman, rootful
    (f"/user.slice/user-1000.slice/user@1000.service/user.slice/libpod-{HEX}.scope",
     HEX[:12]),  # Podman, rootless
    (f"/libpod_parent/libpod-{HEX}", HEX[:12]),  # Podman, cgroupfs
    (f"/system.slice/docker-{HEX}.scope/init.scope", HEX[:12]),  # systemd inside it
    (f"/machine.slice/libpod-conmon-{HEX}.scope", ""),  # the monitor, not the container
    ("/system.slice/nginx.service", ""), ("/", ""), ("", ""),
    (f"/docker/{HEX[:63]}", ""),  # not an id
])  # fmt: skip
def test_containers_are_named_by_the_cgroup_shapes_of_their_runtimes(
    cgroup: str, container: str
) -> None:
    assert container_of(cgroup) == container


# ---- the profile ---------------------------------------------------------------


def test_every_sample_is_labelled_with_its_process_cgroup_and_container() -> None:
    heap, _ = profiles(tables(stack(APP, 0x401100, 10, 64, 4), stack(DB, 0x401200, 3, 100, 0)))
    status, body = answer(heap)
    assert status == 200
    profile = decoded(body)
    strings = profile.string_table
    assert [strings[t.type] for t in profile.sample_type] == [
        "alloc_objects", "alloc_space", "inuse_objects", "inuse_space"]  # fmt: skip
    assert strings[profile.default_sample_type] == "inuse_space"
    assert (strings[profile.period_type.type], strings[profile.period_type.unit]) == (
        "space", "bytes")  # fmt: skip
    assert samples(profile) == {
        (APP, "f401100"): ([10, 640, 6, 384], {"allocator": "malloc", "comm": "app",
                                               "cgroup": CGROUPS[APP],
                                               "container": HEX[:12]}),
        (DB, "f401200"): ([3, 300, 3, 300], {"allocator": "malloc", "comm": "db",
                                             "cgroup": CGROUPS[DB]}),
    }  # fmt: skip


def test_allocs_defaults_to_alloc_space_and_sampling_gives_the_period() -> None:
    heap, _ = profiles(tables(stack(APP, 0x401100, 10, 64, 4), sample_bytes=524288,
                              misc={"stacks_full": 7}))  # fmt: skip
    profile = decoded(heap.answer({"op": "profile", "profile": "allocs"})[1])
    strings = profile.string_table
    assert strings[profile.default_sample_type] == "alloc_space"
    assert profile.period == 524288
    comments = [strings[c] for c in profile.comment]
    assert any("one allocation kept per 524288 bytes" in c for c in comments), comments
    assert any(c.startswith("7 allocations kept by their call site alone") for c in comments)


@pytest.mark.parametrize(("request_", "kept"), [
    ({"pid": APP}, {APP}), ({"comm": "db"}, {DB}), ({"comm": "nothing"}, set()),
    ({"cgroup": "/system.slice"}, {APP, DB}), ({"cgroup": "/system.slice/db.service"}, {DB}),
    ({"cgroup": "/system.slice/db"}, set()), ({"cgroup": "/"}, {APP, DB}),
])  # fmt: skip
def test_processes_are_selected_by_pid_comm_and_cgroup(
    request_: dict[str, Any], kept: set[int]
) -> None:
    heap, _ = profiles(tables(stack(APP, 0x401100, 10, 64, 4), stack(DB, 0x401200, 3, 100, 0)))
    status, body = answer(heap, **request_)
    assert status == 200
    assert {pid for pid, _ in samples(decoded(body))} == kept


def test_an_unknown_pid_is_a_400_and_no_allocations_a_404() -> None:
    heap, _ = profiles(tables(stack(APP, 0x401100, 10, 64, 4)))
    assert answer(heap, pid=999) == (400, b"no traced process has pid 999\n")
    untraced, _ = profiles(None)
    assert answer(untraced)[0] == 404
    assert untraced.answer({"op": "mark"})[0] == 404


@pytest.mark.parametrize("kept", [True, False], ids=["numbered-alike", "numbered-apart"])
def test_a_delta_is_what_each_stack_did_since_its_start(kept: bool) -> None:
    # GIVEN tables, and a delta begun on them; the reads numbered in one
    # catalog (as the kernel's reader does), or each in its own
    catalog = StackCatalog() if kept else None
    heap, source = profiles(tables(stack(APP, 0x401100, 10, 64, 4), stack(DB, 0x401200, 3, 8, 3),
                                   catalog=catalog))  # fmt: skip
    status, token = heap.answer({"op": "mark"})
    assert status == 200
    # WHEN APP's stack allocates 5 more and frees 6, DB's pid is a new process
    # (fewer calls than before), and a new stack appears
    source.snapshot = tables(stack(APP, 0x401100, 15, 64, 10), stack(DB, 0x401200, 2, 8, 0),
                             stack(APP, 0x401300, 1, 16, 0), catalog=catalog)  # fmt: skip
    status, body = answer(heap, since=token.decode())
    # THEN each value is the change, every value (inuse too, as Go's deltas)
    assert status == 200
    found = samples(decoded(body))
    assert {key: values for key, (values, _) in found.items()} == {
        (APP, "f401100"): [5, 320, -1, -64],
        (DB, "f401200"): [2, 16, 2, 16],
        (APP, "f401300"): [1, 16, 1, 16],
    }
    assert decoded(body).duration_nanos > 0
    # AND the start is used once
    assert answer(heap, since=token.decode())[0] == 503
    assert dict(heap.served) == {"whole": 0, "delta": 1, "delta_started": 1}


def test_a_delta_of_a_stack_that_did_nothing_has_no_sample() -> None:
    heap, _ = profiles(tables(stack(APP, 0x401100, 10, 64, 4)))
    token = heap.answer({"op": "mark"})[1].decode()
    assert len(decoded(answer(heap, since=token)[1]).sample) == 0


def test_a_profile_of_a_process_gone_is_still_valid() -> None:
    # GIVEN the rows of a process that has exited, named by real frame names
    gone = subprocess.Popen(["true"])
    assert gone.wait() == 0
    rows = (stack(gone.pid, 0x7F0000001000, 4, 32, 0),)
    source = Tables(tables(*rows))
    heap = HeapProfiles(source, FrameNames())
    # WHEN its profile is built
    status, body = answer(heap)
    # THEN it is a profile, with its sample at an unnamed address
    assert status == 200
    profile = decoded(body)
    assert [list(s.value) for s in profile.sample] == [[4, 128, 4, 128]]
    assert profile.location[0].address == 0x7F0000001000
    assert list(profile.location[0].line) == [] and list(profile.function) == []


# ---- the way a request travels -------------------------------------------------


@pytest.fixture
def channel() -> Iterator[ProfileChannel]:
    made = ProfileChannel()
    yield made
    made.close()


def answering(channel: ProfileChannel, handle: Callable[[Mapping[str, Any]], Any]) -> None:
    threading.Thread(target=channel.answer_forever, args=(handle, lambda line: None),
                     daemon=True).start()  # fmt: skip


def test_a_late_answer_is_not_taken_for_the_next_one(
    channel: ProfileChannel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GIVEN a tracing side whose first answer comes only once the asker gave
    # up on it (a short wait for that ask alone: its 503 is the event the
    # late answer waits for, whatever the machine's speed)
    monkeypatch.setattr(profile_serving, "ASK_TIMEOUT_S", 0.2)
    gave_up = threading.Event()

    def handle(request: Mapping[str, Any]) -> tuple[int, bytes]:
        if request["n"] == 1:
            assert gave_up.wait(300)
        return 200, str(request["n"]).encode()

    answering(channel, handle)
    assert channel.ask({"n": 1})[0] == 503
    monkeypatch.setattr(profile_serving, "ASK_TIMEOUT_S", 300.0)
    gave_up.set()
    # THEN the next request gets its own answer, not the late one
    assert channel.ask({"n": 2}) == (200, b"2")
    assert channel.ask({"n": 3}) == (200, b"3")


def test_a_failed_profile_is_its_request_s_500_and_the_channel_goes_on(
    channel: ProfileChannel,
) -> None:
    said: list[str] = []

    def handle(request: Mapping[str, Any]) -> tuple[int, bytes]:
        if request["n"] == 1:
            raise RuntimeError("boom")
        return 200, b"x" * 3_000_000

    threading.Thread(target=channel.answer_forever, args=(handle, said.append),
                     daemon=True).start()  # fmt: skip
    status, body = channel.ask({"n": 1})
    assert status == 500 and b"RuntimeError: boom" in body
    assert said and "\n" not in said[0]
    assert channel.ask({"n": 2}) == (200, b"x" * 3_000_000)


def test_a_closed_tracing_side_is_a_503() -> None:
    lone = ProfileChannel()  # its tracing end closed: nobody answers
    lone.serving_side()
    assert lone.ask({"op": "mark"})[0] == 503
    lone.close()


def wsgi(app: ProfilesApp, path: str, query: str = "",
         hold: Callable[[float], None] | None = None) -> tuple[str, bytes]:  # fmt: skip
    got: list[str] = []
    environ = {"PATH_INFO": path, "QUERY_STRING": query}
    if hold is not None:
        environ["mtrace.hold"] = hold  # type: ignore[assignment]
    body = b"".join(app(environ, lambda status, headers: got.append(status)))
    return got[0], body


def test_the_app_refuses_before_asking_and_asks_twice_for_a_delta() -> None:
    asked: list[dict[str, Any]] = []

    def ask(request: Mapping[str, Any]) -> tuple[int, bytes]:
        asked.append(dict(request))
        return (200, b"token") if request["op"] == "mark" else (200, b"profile")

    app = ProfilesApp(ask)
    assert wsgi(app, "/debug/pprof/")[0] == "200 OK"
    assert wsgi(app, "/debug/pprof/goroutine")[0] == "404 Not Found"
    assert wsgi(app, "/debug/pprof/heap", "pid=x")[0] == "400 Bad Request"
    assert asked == []
    held: list[float] = []
    assert wsgi(app, "/debug/pprof/allocs", "seconds=1&comm=app&max_samples=5",
                held.append) == ("200 OK", b"profile")  # fmt: skip
    assert [r["op"] for r in asked] == ["mark", "profile"]
    assert asked[1] == {"op": "profile", "profile": "allocs", "pid": None, "comm": "app",
                        "cgroup": None, "max_samples": 5, "since": "token"}  # fmt: skip
    assert held == [1 + 2 * profile_serving.ASK_TIMEOUT_S]  # the two asks, and the wait between


def fetch(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_a_forked_server_serves_the_tracing_process_s_profiles() -> None:
    # GIVEN an endpoint served by a process of its own, asking this one
    heap, _ = profiles(tables(stack(APP, 0x401100, 10, 64, 4)))
    channel = ProfileChannel()
    endpoint = MetricsEndpoint("127.0.0.1:0", CollectorRegistry(), WebConfig())
    server = ServingProcess(endpoint, SharedPages(slot_bytes=1 << 16), 0.1, channel)
    server.start(lambda: None)
    answering(channel, heap.answer)
    base = endpoint.url.removesuffix("/metrics")
    try:
        # WHEN the profile, a delta of it and a bad query are asked for
        status, body = fetch(f"{base}/debug/pprof/heap?comm=app")
        delta_status, delta = fetch(f"{base}/debug/pprof/allocs?seconds=1")
        bad = fetch(f"{base}/debug/pprof/heap?seconds=-5")
    finally:
        server.close()
        channel.close()
    # THEN each is answered from this process's tables
    assert status == 200 and samples(decoded(body))[(APP, "f401100")][0] == [10, 640, 6, 384]
    assert delta_status == 200 and len(decoded(delta).sample) == 0
    assert bad == (400, b"seconds must be a whole number from 1 to 300\n")


def test_profiles_are_not_served_where_allocations_are_not_traced() -> None:
    endpoint = MetricsEndpoint("127.0.0.1:0", CollectorRegistry(), WebConfig())
    endpoint.start()
    try:
        status, body = fetch(endpoint.url.removesuffix("/metrics") + "/debug/pprof/heap")
    finally:
        endpoint.close()
    assert status == 404 and b"not traced" in body


def test_every_error_of_the_profile_endpoints_is_marked_for_go_tool_pprof() -> None:
    # GIVEN profiles served by an endpoint with basic auth
    heap, _ = profiles(tables(stack(APP, 0x401100, 10, 64, 4)))
    hashed = bcrypt.hashpw(b"secret", bcrypt.gensalt(rounds=4))
    endpoint = MetricsEndpoint("127.0.0.1:0", CollectorRegistry(), WebConfig(users={"u": hashed}))
    endpoint.serve_profiles(ProfilesApp(heap.answer))
    endpoint.start()
    base = endpoint.url.removesuffix("/metrics")
    auth = {"Authorization": "Basic " + base64.b64encode(b"u:secret").decode()}

    def headers(path: str, given: Mapping[str, str]) -> tuple[int, str | None]:
        request = urllib.request.Request(base + path, headers=dict(given))
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.headers.get("X-Go-Pprof")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers.get("X-Go-Pprof")

    try:
        # WHEN errors of every kind are asked for, and a profile
        got = [headers("/debug/pprof/heap", {}), headers("/debug/pprof/heap?pid=x", auth),
               headers("/debug/pprof/heap?pid=99", auth), headers("/debug/pprof/goroutine", auth),
               headers("/debug/pprof/heap", auth), headers("/metrics", {})]  # fmt: skip
    finally:
        endpoint.close()
    # THEN each error carries X-Go-Pprof: 1, as Go's serveError sets it (go tool pprof
    # prints the body of those only); a profile, and a page that is not a profile's, do not
    assert got == [(401, "1"), (400, "1"), (400, "1"), (404, "1"), (200, None), (401, None)]


def test_a_delta_profile_is_dated_at_its_end_and_lasts_its_window() -> None:
    # GIVEN a delta profile's start marked, and the time read after it
    heap, _ = profiles(tables(stack(APP, 0x401100, 10, 64, 4)))
    token = heap.answer({"op": "mark"})[1].decode()
    between = time.time_ns()
    # WHEN its end is taken
    profile = decoded(answer(heap, since=token)[1])
    after = time.time_ns()
    # THEN, as Go's net/http/pprof dates a delta (TimeNanos = its second reading), its time
    # is the end of the window, and its duration the window, which began before ``between``
    assert between <= profile.time_nanos <= after
    assert profile.time_nanos - profile.duration_nanos <= between


def test_a_bounded_profile_keeps_the_largest_stacks_and_every_total() -> None:
    # GIVEN 40 stacks of app and 25 of db, each of its own size (its inuse_space known)
    rows = [stack(APP, 0x401000 + 16 * n, 1 + n % 7, 64 + 8 * n, n % 3) for n in range(40)]
    rows += [stack(DB, 0x402000 + 16 * n, 2 + n % 5, 40 + 24 * n, n % 2) for n in range(25)]
    heap, _ = profiles(tables(*rows))
    # WHEN the heap profile is asked for whole, and with at most 12 samples
    whole = decoded(answer(heap, max_samples=0)[1])
    bound = decoded(answer(heap, max_samples=12)[1])
    # THEN it holds 12 samples: one "(other)" per process, and the 10 stacks of the
    # most inuse_space, as the rows say it
    got = samples(bound)
    assert len(bound.sample) == 12 and len(whole.sample) == 65
    inuse = {(r.tgid, f"f{r.call_site:x}"): r.bytes - r.bytes_freed for r in rows}
    largest = sorted(inuse, key=lambda k: -inuse[k])[:10]
    assert set(got) == set(largest) | {(APP, "(other)"), (DB, "(other)")}
    # AND every total, of each process and each sample type, is the whole profile's
    for pid in (APP, DB):
        assert [sum(s.value[i] for s in bound.sample if s.label[0].num == pid)
                for i in range(4)] == [sum(s.value[i] for s in whole.sample
                                           if s.label[0].num == pid) for i in range(4)]  # fmt: skip
    assert got[(DB, "(other)")][1]["comm"] == "db"
    assert "stacks past the bound of 12 samples" in " ".join(
        bound.string_table[c] for c in bound.comment
    )
    # AND without a bound in the query, serve's bound (16,000) leaves these 65 whole
    assert len(decoded(answer(heap)[1]).sample) == 65


def test_a_bound_below_the_processes_keeps_one_sample_per_process() -> None:
    # GIVEN 5 processes of 3 stacks each, every stack's values known
    pids = range(5001, 5006)
    rows = [stack(pid, 0x401000 + 16 * n, 1 + n, 100 * (pid - 5000) + 8 * n, n % 2)
            for pid in pids for n in range(3)]  # fmt: skip
    heap, _ = profiles(tables(*rows))
    # WHEN the heap profile is asked for with at most 3 samples, fewer than the processes
    bound = decoded(answer(heap, max_samples=3)[1])
    # THEN no stack is kept whole: each process is one "(other)" sample (5, more than
    # the bound, as a profile of more processes than the bound must), holding the sum
    # of its stacks' four values
    totals = {pid: [0, 0, 0, 0] for pid in pids}
    for r in rows:
        for i, value in enumerate((r.calls, r.bytes, r.calls - r.frees, r.bytes - r.bytes_freed)):
            totals[r.tgid][i] += value
    assert {key: values for key, (values, _) in samples(bound).items()} == {
        (pid, "(other)"): totals[pid] for pid in pids
    }
    assert "15 stacks past the bound of 3 samples" in " ".join(
        bound.string_table[c] for c in bound.comment
    )


def test_a_bounded_delta_keeps_its_largest_changes_freed_ones_too() -> None:
    # GIVEN APP's stacks, a delta begun on them: one holds 100 blocks of 64 bytes
    heap, source = profiles(tables(stack(APP, 0x401100, 100, 64, 0),
                                   *(stack(APP, 0x401200 + 16 * n, 1, 8, 0) for n in range(4)),
                                   stack(APP, 0x401300, 7, 16, 7)))  # fmt: skip
    token = heap.answer({"op": "mark"})[1].decode()
    # WHEN the first frees 90 of its blocks (inuse_space -5,760), the next four each
    # allocate n + 2 more blocks of 8 bytes (+16 to +40), and the last does nothing
    source.snapshot = tables(stack(APP, 0x401100, 100, 64, 90),
                             *(stack(APP, 0x401200 + 16 * n, 3 + n, 8, 0) for n in range(4)),
                             stack(APP, 0x401300, 7, 16, 7))  # fmt: skip
    status, body = answer(heap, since=token, max_samples=3)
    # THEN the 3 samples are the two largest changes by inuse_space's magnitude (the
    # freed stack's -5,760 and the +40), and "(other)" sums the rest; the stack that
    # did nothing is no sample and is not counted past the bound
    assert status == 200
    delta = decoded(body)
    assert {key: values for key, (values, _) in samples(delta).items()} == {
        (APP, "f401100"): [0, 0, -90, -5760],
        (APP, "f401230"): [5, 40, 5, 40],
        (APP, "(other)"): [2 + 3 + 4, 8 * (2 + 3 + 4), 2 + 3 + 4, 8 * (2 + 3 + 4)],
    }
    assert "3 stacks past the bound of 3 samples" in " ".join(
        delta.string_table[c] for c in delta.comment
    )


def test_a_profile_s_pid_label_is_a_number_and_the_rest_strings() -> None:
    heap, _ = profiles(tables(replace(stack(APP, 0x401100, 1, 8, 0), function="calloc")))
    profile = decoded(answer(heap)[1])
    labels = {profile.string_table[label.key]: label for label in profile.sample[0].label}
    assert labels["pid"].num == APP and not labels["pid"].str
    assert profile.string_table[labels["allocator"].str] == "calloc"


# ---- the encoder kept between profiles -------------------------------------------


def contents(profile: Any) -> set[tuple[tuple[int, ...], tuple[str, ...], tuple[Any, ...]]]:
    """Each sample as (values, its frames' function names, its labels), by meaning."""
    strings = profile.string_table
    functions = {f.id: strings[f.name] for f in profile.function}
    named = {loc.id: functions[loc.line[0].function_id] if loc.line else hex(loc.address)
             for loc in profile.location}  # fmt: skip
    found = set()
    for sample in profile.sample:
        labels = tuple(sorted((strings[lb.key], strings[lb.str] if lb.str else lb.num)
                              for lb in sample.label))  # fmt: skip
        found.add((tuple(sample.value), tuple(named[i] for i in sample.location_id), labels))
    return found


def test_the_encoder_holds_each_row_and_keeps_up_with_the_tables() -> None:
    from mtrace_live.exporters.pprof import HeapEncoder

    rows = [stack(APP, 0x401100, 10, 64, 4),
            replace(stack(DB, 0x401200, 3, 100, 0), provider="jemalloc",
                    provider_lib="libjemalloc.so.2"),
            replace(stack(APP, 0x401300, 2, 8, 2), function="calloc"),
            stack(DB, 0x700000, 5, 16, 1)]  # fmt: skip
    extra = {APP: (("comm", "app"),), DB: (("comm", "db"), ("cgroup", "/x"))}
    catalog, encoder = StackCatalog(), HeapEncoder(Names())

    def encoded(rows: list[StackRow], default: str = "inuse_space") -> Any:
        body = encoder.encode(numbered(catalog, *rows), extra.__getitem__, 0, default, 0, ["c"])
        return decoded(body)

    def expected(rows: list[StackRow]) -> Any:
        """Each row as the test wrote it: its four heap values (no sampling),
        its frames named as Names names them, its process's labels."""
        found = set()
        for row in rows:
            named = (("pid", row.tgid), ("allocator", row.function),
                     *(("provider", row.provider),) * bool(row.provider),
                     *(("provider_lib", row.provider_lib),) * bool(row.provider_lib),
                     *extra[row.tgid])  # fmt: skip
            frames = tuple(f"f{a:x}" if a < 0x500000 else hex(a) for a in row.frames)
            values = (row.calls, row.bytes, row.calls - row.frees, row.bytes - row.bytes_freed)
            found.add((values, frames, tuple(sorted(named))))
        return found

    # WHEN the rows are encoded, then again with new values and DB's labels
    # changed, then with DB gone
    first = encoded(rows)
    assert contents(first) == expected(rows)
    # (the row of DB's calls through jemalloc names it, the others nothing)
    named = [{first.string_table[label.key]: first.string_table[label.str]
              for label in sample.label if label.str} for sample in first.sample]  # fmt: skip
    assert sum(labels.get("provider") == "jemalloc" for labels in named) == 1
    assert sum("provider" in labels for labels in named) == 1
    assert [first.string_table[c] for c in first.comment] == ["c"]
    grown = [replace(rows[0], calls=20, bytes=1280, sizes=1280), *rows[1:]]
    extra[DB] = (("comm", "db2"),)
    # THEN each holds its rows' values now, and the labels now
    assert contents(encoded(grown)) == expected(grown)
    encoder.retain({APP})
    third = encoded(grown[:1], "alloc_space")
    assert contents(third) == expected(grown[:1])
    assert third.string_table[third.default_sample_type] == "alloc_space"
    # AND nothing of DB's rows is kept
    kept = {catalog.keys[n][0] for n, prefix in enumerate(encoder._prefixes) if prefix}
    assert kept == {APP}


@settings(deadline=None, max_examples=200)
@given(st.lists(st.integers(-(1 << 63), (1 << 63) - 1), min_size=1, max_size=40))
def test_values_are_encoded_as_protobuf_encodes_them(values: list[int]) -> None:
    from mtrace_live.exporters.pprof import _sample_frames

    # GIVEN rows of four values each, and a prefix of one location id per row
    rows = np.array(values + [0] * (-len(values) % 4), np.int64).reshape(-1, 4)
    sample = message_class("Sample")
    prefixes = [sample(location_id=[row + 1]).SerializeToString() for row in range(len(rows))]
    # WHEN the samples are framed around their prefixes and read as a Profile
    glue, cuts = _sample_frames(np.array([len(p) for p in prefixes], np.int64), rows)
    ends = cuts.tolist()
    pieces = [glue[a:b] for a, b in zip([0, *ends], [*ends, len(glue)], strict=True)]
    body = b"".join(piece + prefix for piece, prefix in zip(pieces, [*prefixes, b""], strict=True))
    profile = message_class("Profile").FromString(body)
    # THEN each sample holds its location and its values, as protobuf reads them
    assert [list(s.location_id) for s in profile.sample] == [[i + 1] for i in range(len(rows))]
    assert [list(s.value) for s in profile.sample] == rows.tolist()


def test_past_max_marks_deltas_in_flight_the_oldest_start_is_forgotten() -> None:
    from mtrace_live.exporters.heap_profiles import MAX_MARKS

    # GIVEN one more delta begun than may be in flight at once
    heap, _ = profiles(tables(stack(APP, 0x401100, 10, 64, 4)))
    tokens = [heap.answer({"op": "mark"})[1].decode() for _ in range(MAX_MARKS + 1)]
    assert len(set(tokens)) == MAX_MARKS + 1
    # THEN the first one's start is forgotten, said in a 503, and every later
    # one is answered (the second oldest too: one start was dropped, not two)
    assert answer(heap, since=tokens[0]) == (
        503, b"the delta profile's start was forgotten (too many at once)\n")  # fmt: skip
    assert [answer(heap, since=t)[0] for t in tokens[1:]] == [200] * MAX_MARKS
    assert dict(heap.served) == {"whole": 0, "delta": MAX_MARKS, "delta_started": MAX_MARKS + 1}
