"""The import graph keeps the layers one-way (docs/architecture.md).

From the top: ``mtrace_live.tracer`` (the commands, then its rooms:
``loop`` -> ``unwind`` -> ``processes`` -> ``bpf``) ->
``mtrace_live.exporters`` (one module per output) ->
``mtrace_live.exporters.data`` (the plain data every output receives) ->
``mtrace_live.probes`` (catalog, ELF notes, BPF C, record layouts) ->
``mtrace_live.probes.elf`` (ELF files) -> ``mtrace_live.probes.errors``
(the error hierarchy, a module of its own). A module
may import its own layer and the layers below, never one above; no two
modules may import each other, however indirectly; and bcc is imported in
one module only. Modules are known by their dotted names, and files in
docs/architecture.md's map by their paths: three names (sink.py, convert.py,
lock_waits.py) are seven files.
"""

from __future__ import annotations

import graphlib
import re
from pathlib import Path

import grimp
import pytest

LAYERS = (
    "mtrace_live.tracer",  # the commands
    "mtrace_live.tracer.loop",  # the tracer's rooms (tracer/__init__.py)
    "mtrace_live.tracer.unwind",
    "mtrace_live.tracer.processes",
    "mtrace_live.tracer.bpf",
    "mtrace_live.exporters",
    "mtrace_live.exporters.data",
    "mtrace_live.probes",
    "mtrace_live.probes.elf",
    "mtrace_live.probes.errors",
)
PACKAGES = ("mtrace_live.probes", "mtrace_live.exporters", "mtrace_live.tracer")
BCC_IMPORTER = "mtrace_live.tracer.bpf.bpf_backend"


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, include_external_packages=True)


def layer(module: str) -> int:
    """Index in LAYERS of the most specific layer holding ``module`` (0 = top)."""
    held = [i for i, name in enumerate(LAYERS) if module == name or module.startswith(name + ".")]
    return max(held, key=lambda i: len(LAYERS[i]), default=-1)


def project_modules(graph: grimp.ImportGraph) -> set[str]:
    return {m for m in graph.modules if m.split(".")[0] == "mtrace_live" and layer(m) >= 0}


def test_every_module_of_the_package_is_in_a_layer(graph: grimp.ImportGraph) -> None:
    # GIVEN the graph of the installed package
    modules = project_modules(graph)
    # THEN it holds every layer, with the modules the layers are known by
    for name in LAYERS:
        assert name in modules
    assert {"mtrace_live.tracer.loop.live", "mtrace_live.exporters.kmemtrace",
            "mtrace_live.exporters.data.sink", "mtrace_live.probes.records"} <= modules  # fmt: skip


def test_no_import_goes_up_a_layer(graph: grimp.ImportGraph) -> None:
    upward = []
    for module in sorted(project_modules(graph)):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if layer(imported) < 0:
                continue  # outside the project
            if layer(imported) < layer(module):
                upward.append(f"{module} -> {imported}")
    assert upward == []


def test_no_modules_import_each_other(graph: grimp.ImportGraph) -> None:
    modules = project_modules(graph)
    sorter = graphlib.TopologicalSorter(
        {m: graph.find_modules_directly_imported_by(m) & modules for m in modules}
    )
    try:
        sorter.prepare()
    except graphlib.CycleError as cycle:
        pytest.fail(f"import cycle: {' -> '.join(cycle.args[1])}")


def test_bcc_is_imported_in_one_place(graph: grimp.ImportGraph) -> None:
    importers = graph.find_modules_that_directly_import("bcc")
    assert importers == {BCC_IMPORTER}


def test_the_checks_see_a_violation() -> None:
    # GIVEN a graph where an output imports the tracer and the tracer the output
    toy = grimp.ImportGraph()
    toy.add_import(importer="mtrace_live.exporters.toy", imported="mtrace_live.tracer.loop.live")
    toy.add_import(importer="mtrace_live.tracer.loop.live", imported="mtrace_live.exporters.toy")
    # THEN the import from exporters up into tracer is the one found going up
    upward = [
        f"{a} -> {b}"
        for a in sorted(toy.modules)
        for b in sorted(toy.find_modules_directly_imported_by(a))
        if layer(b) < layer(a)
    ]
    assert upward == ["mtrace_live.exporters.toy -> mtrace_live.tracer.loop.live"]
    # AND the two modules form a cycle
    sorter = graphlib.TopologicalSorter(
        {m: toy.find_modules_directly_imported_by(m) for m in toy.modules}
    )
    with pytest.raises(graphlib.CycleError):
        sorter.prepare()


ROOT = Path(__file__).resolve().parents[2]
# a file's name in the map, and its path where the map gives one
FILE = re.compile(r"(?<![\w/.*])(\w[\w.]*\.(?:py|c|h))(?![\w])")


def module_map(doc: str) -> set[str]:
    """The paths (from the repository's root) of the files the module map of
    ``doc`` places: a folder line (``elf/``) holds the lines indented below
    it, and the files its own description names; a file is also where a
    description names it beside its own (``plan_cache.py`` beside usdt.py)."""
    block = doc.split("## The folders, module by module", 1)[1].split("```")[1]
    named: set[str] = set()
    folders: list[tuple[int, str]] = []  # (indent, path) of the folders above
    here = ""  # the folder the current entry's description is in
    for line in block.splitlines()[1:]:
        indent = len(line) - len(line.lstrip(" "))
        first, _, description = line.strip().partition("  ")
        if indent > 24:  # the description of the entry above, continued
            description = line.strip()
        else:
            while folders and folders[-1][0] >= indent:
                folders.pop()
            here = parent = folders[-1][1] if folders else ""
            for name in first.split(", "):
                if name.endswith("/"):
                    here = parent + name
                    folders.append((indent, here))
                elif FILE.fullmatch(name):
                    named.add(parent + name)
        named.update(here + name for name in FILE.findall(description))
    return named


def parts_table(doc: str) -> set[str]:
    """The paths of the BPF program's parts and headers its section names."""
    section = doc.split("## The BPF program in parts", 1)[1].split("\n## ", 1)[0]
    return {f"probes/bpf/{name}" for name in re.findall(r"`(\w[\w.]*\.(?:c|h))`", section)}


def test_the_map_is_read_by_path() -> None:
    # GIVEN a map that places sink.py in exporters/data/ and kmemtrace/ with
    # its reader, and plan_cache.py beside usdt.py
    doc = """## The folders, module by module

```
exporters/data/                the plain-data layer
  sink.py                      Sink, EventBatch
exporters/                     the outputs layer
  kmemtrace/                   the kmemtrace format: reader.py,
                               walker.c (the walker)
  conversions.py               `convert`
tracer/                        the tracer layer
  usdt.py                      the SDT sites; plan_cache.py keeps
  cli.py, commands/            the command line
    run.py, convert.py         the commands
```

## The BPF program in parts

| `unwind.bpf.c` | the unwinder, with `tracer/loop/live.py`'s tables | `WITH_UNWIND` |
"""
    # THEN each file is named by its folder's path, and a name in one folder
    # places no file of the same name in another (exporters/kmemtrace/sink.py)
    assert module_map(doc) | parts_table(doc) == {
        "exporters/data/sink.py", "exporters/kmemtrace/reader.py", "exporters/kmemtrace/walker.c",
        "exporters/conversions.py", "tracer/usdt.py", "tracer/plan_cache.py", "tracer/cli.py",
        "tracer/commands/run.py", "tracer/commands/convert.py", "probes/bpf/unwind.bpf.c",
    }  # fmt: skip


def test_every_file_of_the_package_is_in_the_architecture_map() -> None:
    # GIVEN every module, C file and BPF part the package installs
    doc = (ROOT / "docs" / "architecture.md").read_text()
    files = {str(path.relative_to(ROOT)) for top in ("probes", "tracer", "exporters")
             for path in (ROOT / top).rglob("*")
             if path.suffix in (".py", ".c", ".h") and path.name != "__init__.py"
             and "__pycache__" not in path.parts}  # fmt: skip
    assert len(files) > 100
    # THEN docs/architecture.md places each by its path (its module map, or
    # its parts' table), and places no file the package does not have
    mapped = module_map(doc) | parts_table(doc)
    assert sorted(files - mapped) == [], "not in docs/architecture.md"
    assert sorted(mapped - files) == [], "in docs/architecture.md, not in the package"
