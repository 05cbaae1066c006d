"""The data classes' methods, compiled once and kept between runs
(probes/elf/kept_code.py): each run here is a Python process of its own, as
each start of the command is."""

from __future__ import annotations

import json
import marshal
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mtrace_live.probes.elf import facts, kept_code

# A process that installs the kept code, makes data classes of every kind
# dataclasses writes methods for, uses them, and says what it compiled.
RUN = """
import dataclasses, json, sys
from mtrace_live.probes.elf import kept_code
kept_code.install()

@dataclasses.dataclass(frozen=True)
class Point:
    x: int
    y: int = 2
    tags: tuple[str, ...] = dataclasses.field(default=(), compare=False)

@dataclasses.dataclass(order=True)
class Row:
    name: str
    values: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.values = sorted(self.values)

p = Point(1, tags=("a",))
try:
    p.x = 5
    frozen = False
except dataclasses.FrozenInstanceError:
    frozen = True
rows = sorted([Row("b", [3, 1]), Row("a")])
print(json.dumps({
    "compiled": kept_code.compiled_here(),
    "repr": repr(p), "eq": p == Point(1, 2, ("b",)), "hash": hash(p) == hash(Point(1)),
    "frozen": frozen, "rows": [repr(r) for r in rows], "lt": Row("a") < Row("b"),
    "annotations": str(Point.__init__.__annotations__),
}))
"""


def run(directory: Path, *, cache: str | None = None, keep: int | None = None,
        extra: str = "") -> dict[str, object]:  # fmt: skip
    """RUN in a process of its own (``keep``: its KEEP_TEXTS; ``extra``: more
    of its code, after the install)."""
    environment = {**os.environ, "MTRACE_LIVE_PLAN_CACHE": cache or str(directory)}
    limit = f"kept_code.KEEP_TEXTS = {keep}\n" if keep is not None else ""
    script = RUN.replace("kept_code.install()\n", f"{limit}kept_code.install()\n{extra}")
    done = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True,
                          text=True, check=True)  # fmt: skip
    assert done.stderr == ""
    result: dict[str, object] = json.loads(done.stdout)
    return result


def kept_file(directory: Path) -> Path:
    return directory / facts.FOLDER / kept_code.file_name()


def test_a_second_run_compiles_nothing_and_its_classes_behave_as_the_first_runs(
    tmp_path: Path,
) -> None:
    # GIVEN a first run, which compiles its classes' methods and keeps them
    first = run(tmp_path)
    assert isinstance(first["compiled"], int) and first["compiled"] >= 10
    assert kept_file(tmp_path).is_file()
    # WHEN a second run makes the same classes
    second = run(tmp_path)
    # THEN it compiles none of them, and every method behaves as it did
    assert second["compiled"] == 0
    assert {k: v for k, v in second.items() if k != "compiled"} == {
        k: v for k, v in first.items() if k != "compiled"
    }
    # AND as dataclasses' own methods do (what the workload knows it made)
    assert second["repr"] == "Point(x=1, y=2, tags=('a',))"
    assert second["eq"] is True and second["hash"] is True and second["frozen"] is True
    assert second["rows"] == ["Row(name='a', values=[])", "Row(name='b', values=[1, 3])"]
    assert second["lt"] is True
    # (the methods' annotations are the classes' own types, not strings: the
    # text is compiled with no __future__ flag of the compiling module)
    assert "<class 'int'>" in str(second["annotations"])


def test_a_run_with_nothing_kept_compiles_as_dataclasses_alone_would(tmp_path: Path) -> None:
    # GIVEN the plan cache turned off
    result = run(tmp_path, cache="off")
    # THEN each method is compiled in the run, and nothing is written anywhere
    assert isinstance(result["compiled"], int) and result["compiled"] >= 10
    assert result["repr"] == "Point(x=1, y=2, tags=('a',))"
    assert not (tmp_path / facts.FOLDER).exists()


@pytest.mark.parametrize("spoil", ["group-writable", "digest", "truncated", "not-marshal"])
def test_a_kept_file_that_is_not_this_users_alone_or_not_whole_is_not_run(
    tmp_path: Path, spoil: str
) -> None:
    # GIVEN code kept by a first run, then spoilt
    run(tmp_path)
    path = kept_file(tmp_path)
    data = path.read_bytes()
    if spoil == "group-writable":
        path.chmod(0o664)
    elif spoil == "digest":
        path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif spoil == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:
        body = b"\x00not marshal"
        path.write_bytes(kept_code.MAGIC + kept_code._digest(body) + body)
    # WHEN a run reads it
    assert kept_code.read(path) == {}
    result = run(tmp_path)
    # THEN it compiles its classes itself, and they behave
    assert isinstance(result["compiled"], int) and result["compiled"] >= 10
    assert result["repr"] == "Point(x=1, y=2, tags=('a',))"


def test_a_directory_another_user_could_write_is_not_read(tmp_path: Path) -> None:
    # GIVEN code kept in a directory, which is then opened to the group
    run(tmp_path)
    kept_file(tmp_path).parent.chmod(0o770)
    # THEN nothing in it is read
    assert kept_code.read(kept_file(tmp_path)) == {}


def test_texts_past_the_limit_are_dropped_but_those_the_run_used(tmp_path: Path) -> None:
    # GIVEN a kept file holding a first run's texts and 50 of code no longer made
    run(tmp_path)
    path = kept_file(tmp_path)
    ours = kept_code.read(path)
    stale = {f"def stale_{n}(): pass": compile(f"def stale_{n}(): pass", "<string>", "exec")
             for n in range(50)}  # fmt: skip
    body = marshal.dumps({**ours, **stale})
    path.write_bytes(kept_code.MAGIC + kept_code._digest(body) + body)
    # WHEN a run that compiles one text of its own (a class more) keeps what
    # it compiled, with room for fewer texts than the file holds
    more = "@dataclasses.dataclass\nclass More:\n    n: int\n"
    result = run(tmp_path, keep=len(ours) + 10, extra=more)
    # THEN the file holds the texts that run used, its new ones among them
    # (More's __init__, __repr__ and __eq__), and no stale one
    kept = kept_code.read(path)
    assert result["compiled"] == 3
    assert set(ours) < set(kept) and len(kept) == len(ours) + 3
    assert not set(stale) & set(kept)


@pytest.mark.parametrize("swapped", ["file", "directory"])
def test_a_link_put_in_the_place_of_the_file_or_its_directory_is_not_followed(
    tmp_path: Path, swapped: str
) -> None:
    # GIVEN code kept by a first run, then the file (or its directory) moved
    # away and a symbolic link to it put in its place
    run(tmp_path)
    path = kept_file(tmp_path)
    moved = path.parent if swapped == "directory" else path
    elsewhere = tmp_path / f"moved-{swapped}"
    moved.rename(elsewhere)
    moved.symlink_to(elsewhere)
    # THEN nothing is read through the link, whatever it points to
    assert kept_code.read(path) == {}
    result = run(tmp_path)
    assert isinstance(result["compiled"], int) and result["compiled"] >= 10
