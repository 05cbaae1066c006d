"""Every test the docs cite exists: each ``tests/...`` path named in
docs/*.md and the README is a file or folder of the repository, and each
``tests/FILE.py::name`` is a function (or class, or ``Class::method``)
defined in that file, read with ast. A parametrize id (``name[id]``) is
not part of the name, but its text must be in the file (an id given, or a
parameter's value); ``...::name`` is the file of the citation before it in
the same table cell (or line)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]

NAME = r"[A-Za-z_]\w*(?:::[A-Za-z_]\w*)*(?:\[[^\]\n]*\])?"
CITATION = re.compile(rf"(?P<path>tests/[\w/.-]*)(?:::(?P<name>{NAME}))?|\.\.\.::(?P<same>{NAME})")


@dataclass(frozen=True)
class Citation:
    line: int
    path: str
    name: str | None  # None: the path alone

    def where(self, doc: Path) -> str:
        cited = f"{self.path}::{self.name}" if self.name else self.path
        return f"{doc.relative_to(REPO)}:{self.line}: {cited}"


def citations(text: str) -> Iterator[Citation]:
    """The citations in a document, in order; ``...::name`` without a file
    before it in its cell gives the path ``...``, which exists nowhere."""
    for number, line in enumerate(text.splitlines(), 1):
        cells = line.split("|") if line.lstrip().startswith("|") else [line]
        for cell in cells:
            path = "..."
            for match in CITATION.finditer(cell):
                if match["same"] is not None:
                    yield Citation(number, path, match["same"])
                    continue
                path = match["path"].rstrip(".")
                yield Citation(number, path, match["name"])


@cache
def defined(path: Path) -> frozenset[str]:
    """The module's functions and classes, and its classes' methods as
    ``Class::method``."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            names.update(
                f"{node.name}::{member.name}"
                for member in node.body
                if isinstance(member, ast.FunctionDef | ast.AsyncFunctionDef)
            )
    return frozenset(names)


def broken(doc: Path, text: str) -> list[str]:
    """Each citation of ``text`` (the document ``doc``) that names nothing."""
    found = []
    for citation in citations(text):
        path = REPO / citation.path
        if not path.exists():
            found.append(f"{citation.where(doc)}: no such file")
        elif citation.name is not None:
            name, _, id_ = citation.name.partition("[")
            if path.suffix != ".py" or name not in defined(path):
                found.append(f"{citation.where(doc)}: no {name} in {citation.path}")
            elif id_ and id_[:-1] not in path.read_text():
                found.append(f"{citation.where(doc)}: no id {id_[:-1]} in {citation.path}")
    return found


@pytest.mark.parametrize("doc", DOCS, ids=[str(doc.relative_to(REPO)) for doc in DOCS])
def test_every_test_a_document_cites_exists(doc: Path) -> None:
    found = broken(doc, doc.read_text())
    assert not found, "\n".join(found)


def test_the_docs_cite_tests_by_name() -> None:
    # the check above reads something: the docs' table of failures alone
    # cites tests by name and by the shorthand
    cited = [c for doc in DOCS for c in citations(doc.read_text()) if c.name is not None]
    assert len(cited) >= 20, cited
    assert any(c.path.endswith(".py") for c in cited)


def test_a_citation_is_read_with_its_shorthand_and_parametrize_id() -> None:
    text = (
        "| case | `tests/unit/test_cfi.py::test_x[a b]`, `...::test_y` |"
        " `...::test_z` |\n"
        "see `tests/unit/` and tests/unit/test_sinks.py::Sinks::test_w.\n"
    )
    assert list(citations(text)) == [
        Citation(1, "tests/unit/test_cfi.py", "test_x[a b]"),
        Citation(1, "tests/unit/test_cfi.py", "test_y"),
        Citation(1, "...", "test_z"),  # another cell: no file before it there
        Citation(2, "tests/unit/", None),
        Citation(2, "tests/unit/test_sinks.py", "Sinks::test_w"),
    ]


def test_a_citation_of_a_name_or_file_that_is_gone_is_found() -> None:
    here = Path(__file__).relative_to(REPO)
    doc = REPO / "docs" / "x.md"
    missing = "-".join(["no", "such", "id"])  # a text this file does not hold
    text = (
        f"`{here}::test_a_citation_of_a_name_or_file_that_is_gone_is_found[gone.py]`,"
        f" `...::test_gone`, `...::broken[{missing}]`, `{here}::Gone::test_x`,"
        " `tests/unit/gone.py`, `tests/unit/gone.py::test_x`\n"
    )
    assert broken(doc, text) == [
        f"docs/x.md:1: {here}::test_gone: no test_gone in {here}",
        f"docs/x.md:1: {here}::broken[{missing}]: no id {missing} in {here}",
        f"docs/x.md:1: {here}::Gone::test_x: no Gone::test_x in {here}",
        "docs/x.md:1: tests/unit/gone.py: no such file",
        "docs/x.md:1: tests/unit/gone.py::test_x: no such file",
    ]
