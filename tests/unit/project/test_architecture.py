"""docs/ARCHITECTURE.md lists every module under meshrun/ once, on one line of its tables, and nothing else.

The "Modules, one line each" section has one table per package, under a bold heading naming the package
(`**core/**`, `**mesh/**`, ..., `**meshrun/**` for the top level); each row's first cell is one module in
backticks, relative to that package (`coordinator/setup` under `**mesh/**`). Package `__init__.py` files are
not modules of their own here. Every package also appears in the layer diagram.

Also the errors convention: code under meshrun/ never builds a bare `MeshrunError`, only its typed subclasses.
"""

from __future__ import annotations

import ast
import re

from support import REPO_ROOT

PKG = REPO_ROOT / "meshrun"
DOC = REPO_ROOT / "docs" / "ARCHITECTURE.md"
HEADING = re.compile(r"^\*\*([\w/]+)/\*\*")
ROW = re.compile(r"^\|\s*([^|]*?)\s*\|")
ONE_MODULE = re.compile(r"^`([\w/]+)`$")


def listed_modules(text: str) -> list[str]:
    """The modules the tables list, as paths under meshrun/ without `.py`, in order (repeats kept)."""
    section = text.split("## Modules, one line each", 1)[1].split("\n## ", 1)[0]
    package = None
    out = []
    for line in section.splitlines():
        if m := HEADING.match(line):
            package = "" if m.group(1) == "meshrun" else m.group(1) + "/"
            continue
        m = ROW.match(line)
        if not m or m.group(1) in ("module", "") or set(m.group(1)) <= set("-: "):
            continue
        assert package is not None, f"a table row before any package heading: {line}"
        cell = ONE_MODULE.match(m.group(1))
        assert cell, f"a row must name one module in backticks: {line}"
        out.append(package + cell.group(1))
    return out


def actual_modules() -> set[str]:
    return {p.relative_to(PKG).with_suffix("").as_posix() for p in PKG.rglob("*.py") if p.name != "__init__.py"}


def test_every_module_is_listed_once_and_every_listed_module_exists():
    listed = listed_modules(DOC.read_text())
    repeated = sorted({m for m in listed if listed.count(m) > 1})
    missing = sorted(actual_modules() - set(listed))
    unknown = sorted(set(listed) - actual_modules())
    assert not repeated, f"listed more than once in docs/ARCHITECTURE.md: {repeated}"
    assert not missing, f"modules under meshrun/ missing from docs/ARCHITECTURE.md's tables: {missing}"
    assert not unknown, f"docs/ARCHITECTURE.md lists modules that do not exist: {unknown}"


def test_every_package_is_in_the_diagram():
    diagram = DOC.read_text().split("```", 2)[1]
    packages = sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").is_file())
    absent = [p for p in packages if f"{p}/" not in diagram]
    assert not absent, f"packages missing from docs/ARCHITECTURE.md's diagram: {absent}"


def test_the_parser_reads_rows_by_package():
    text = """## Modules, one line each

**core/** (pure)

| module | what it holds |
|---|---|
| `model` | the network |

**mesh/**

| module | what it does |
|---|---|
| `coordinator/setup` | init |

**meshrun/** (top level)

| module | what it does |
|---|---|
| `errors` | typed errors |

## Seams

| `ignored` | after the section |
"""
    assert listed_modules(text) == ["core/model", "mesh/coordinator/setup", "errors"]


def bare_meshrun_errors(source: str) -> list[int]:
    """Lines that call `MeshrunError(...)` (or `errors.MeshrunError(...)`) itself."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name == "MeshrunError":
                out.append(node.lineno)
    return out


def test_no_bare_meshrun_error_is_built():
    found = [
        f"{p.relative_to(REPO_ROOT)}:{n}"
        for p in sorted(PKG.rglob("*.py"))
        if p.name != "errors.py"
        for n in bare_meshrun_errors(p.read_text())
    ]
    assert not found, f"build a subclass from meshrun/errors.py, not a bare MeshrunError: {found}"
    assert bare_meshrun_errors("raise MeshrunError('x', 'y')\nraise errors.MeshrunError('x')") == [1, 2]
    assert bare_meshrun_errors("raise UsageError('x')\nisinstance(e, MeshrunError)") == []
