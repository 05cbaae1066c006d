"""The shape the code keeps (docs/architecture.md): no BPF file over 700
lines, no function over 60 lines (Python, C and BPF C), and no two
functions of the package with one name."""

from __future__ import annotations

import ast
import re
import subprocess
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_BPF_LINES = 700
MAX_FUNCTION_LINES = 60
PACKAGE = ("probes", "tracer", "exporters")
C_SOURCES = ("probes/bpf/*.c", "probes/bpf/*.h", "exporters/**/*.c", "tracer/*.c")


def tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--", *patterns], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return [ROOT / name for name in out.split()]


def python_functions(path: Path) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every function and method, from its
    ``def`` to its last line."""
    tree = ast.parse(path.read_text())
    return [(node.name, node.lineno, node.end_lineno - node.lineno + 1)  # type: ignore[operator]
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]  # fmt: skip


_C_HEAD = re.compile(r"^(?!#|\s|/|\*|typedef|struct|enum|union)[^;=]*\([^;]*$")


def c_functions(text: str) -> list[tuple[str, int, int]]:
    """(head, first line, lines) of every function defined at file level:
    from the line that names it to its closing brace."""
    lines = text.split("\n")
    found = []
    index = 0
    while index < len(lines):
        if not _C_HEAD.match(lines[index]):
            index += 1
            continue
        start = index
        # the body's brace on the line that names it, or within the next two
        brace = next((i for i in range(start, min(start + 3, len(lines))) if "{" in lines[i]), None)
        if brace is None or any(lines[i].rstrip().endswith(";") for i in range(start, brace)):
            index += 1
            continue
        index = brace
        depth = 0
        for end in range(index, len(lines)):
            depth += lines[end].count("{") - lines[end].count("}")
            if depth == 0:
                break
        found.append((lines[start].strip(), start + 1, end - start + 1))
        index = end + 1
    return found


def test_no_bpf_file_is_over_700_lines() -> None:
    sizes = {path.name: len(path.read_text().splitlines()) for path in tracked("probes/bpf/*")}
    assert "common.bpf.h" in sizes
    assert {name: n for name, n in sizes.items() if n > MAX_BPF_LINES} == {}


def test_no_python_function_is_over_60_lines() -> None:
    paths = tracked(*(f"{top}/*.py" for top in (*PACKAGE, "bench", "tests")))
    long = [f"{path.relative_to(ROOT)}:{line} {name} ({n} lines)"
            for path in paths for name, line, n in python_functions(path)
            if n > MAX_FUNCTION_LINES]  # fmt: skip
    assert long == []


def test_no_c_function_is_over_60_lines() -> None:
    paths = tracked(*C_SOURCES)
    assert any(path.name == "walker.c" for path in paths)
    long = [f"{path.relative_to(ROOT)}:{line} {head} ({n} lines)"
            for path in paths for head, line, n in c_functions(path.read_text())
            if n > MAX_FUNCTION_LINES]  # fmt: skip
    assert long == []


def test_no_two_functions_of_the_package_share_a_name() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for path in tracked(*(f"{top}/*.py" for top in PACKAGE)):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef):
                where[node.name].append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}


def test_the_measures_see_a_long_function(tmp_path: Path) -> None:
    # GIVEN a C function of 62 lines, a BPF handler macro, and Python ones of
    # 61 lines and of 3 (a method)
    body = "\n".join(f"    x += {i};" for i in range(58))
    c = f"static int f(int x)\n{{\n{body}\n    return x;\n}}\nTRACEPOINT_PROBE(a, b)\n{{\n}}\n"
    (head, line, n), (macro, _, m) = c_functions(c)
    assert (head, line, n, macro, m) == ("static int f(int x)", 1, 62, "TRACEPOINT_PROBE(a, b)", 3)
    source = tmp_path / "long.py"
    method = "\n\n\nclass K:\n    def h(self):\n        pass\n\n        return 1\n"
    source.write_text("def g():\n" + "\n".join(f"    y = {i}" for i in range(60)) + method)
    # THEN the measures the tests use give each its lines
    assert sorted(python_functions(source)) == [("g", 1, 61), ("h", 65, 4)]
