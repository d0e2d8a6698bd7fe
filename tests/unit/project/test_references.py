"""Every module, attribute or file the code, tests and docs name exists, so a rename cannot leave stale text.

Three kinds of reference are checked in every text file of the project (code, tests, docs, README.md,
SECURITY.md, benchmarks, examples):

- dotted names, `meshrun.mesh.node.setup.join`: the longest prefix that is a module, then a name defined
  at its top level, then (for a class) a name in the class body;
- repository paths, `tests/e2e/test_diloco_e2e.py`, `meshrun/system/machine/procs.py`;
- a layer's module as ARCHITECTURE.md writes it, `mesh/coordinator/daemon.CoordinatorService.tick`,
  resolved as `meshrun.mesh.coordinator.daemon.CoordinatorService.tick`.

Names are read from the source (ast), nothing is imported.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest
from support import REPO_ROOT

TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".yml", ".yaml", ".cfg", ".txt"}
SCANNED = ["meshrun", "tests", "benchmarks", "docs", "examples", "configs", "README.md", "SECURITY.md", "dev.sh"]
SKIPPED_DIRS = {"__pycache__", ".venv", ".git"}

# A dotted name not followed by "/" (format tags such as "meshrun.train.diloco/1" are not references).
DOTTED = re.compile(r"(?<![\w./-])meshrun(?:\.[A-Za-z_]\w*)+(?![\w/])")
PATH = re.compile(r"(?<![\w./-])((?:meshrun|tests|benchmarks|examples|docs|configs)/[\w/.-]*\.(?:py|md|json|toml|sh))")
LAYER = re.compile(r"(?<![\w./-])((?:core|system|mesh|jobs|train|bench|lab|cli)/[\w/]*\w(?:\.[A-Za-z_]\w*)*)")

# Names made up on purpose, by file: the layer checker's synthetic sources, gitignore patterns, and this
# file's own stale examples. A reference the pattern matches (from its start) is not checked.
NOT_REFERENCES = {
    "tests/unit/project/test_layers.py": re.compile(r"meshrun(\.\w+)*\.x$"),
    "tests/unit/core/test_ignore.py": re.compile(r"docs/"),
    "tests/unit/project/test_references.py": re.compile(""),
    "tests/unit/project/test_docs.py": re.compile(r"(meshrun\.x|docs/x\.md|examples/x\.py)$"),
}
PLACEHOLDER = re.compile(r"[A-Z]{3,}")  # benchmarks/results/NAME.json


def text_files() -> list[Path]:
    out = []
    for name in SCANNED:
        top = REPO_ROOT / name
        if top.is_file():
            out.append(top)
            continue
        for p in sorted(top.rglob("*")):
            if p.is_file() and p.suffix in TEXT_SUFFIXES and not SKIPPED_DIRS.intersection(p.parts):
                out.append(p)
    return out


def _module_file(mod: str) -> Path | None:
    base = REPO_ROOT / mod.replace(".", "/")
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def _assigned(targets) -> set[str]:
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


@cache
def top_level_names(mod: str) -> dict[str, frozenset[str] | None]:
    """{name defined at the module's top level: the names in its body if it is a class, else None}."""
    tree = ast.parse(_module_file(mod).read_text())
    out: dict[str, frozenset[str] | None] = {}
    for node in _top_statements(tree.body):
        if isinstance(node, ast.ClassDef):
            body: set[str] = set()
            for b in node.body:
                if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    body.add(b.name)
                elif isinstance(b, ast.Assign):
                    body |= _assigned(b.targets)
                elif isinstance(b, ast.AnnAssign):
                    body |= _assigned([b.target])
            out[node.name] = frozenset(body)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = None
        elif isinstance(node, ast.Assign):
            out.update(dict.fromkeys(_assigned(node.targets)))
        elif isinstance(node, ast.AnnAssign):
            out.update(dict.fromkeys(_assigned([node.target])))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update(dict.fromkeys((a.asname or a.name).split(".")[0] for a in node.names))
    return out


def _top_statements(body: list[ast.stmt]):
    """The module's statements, and those inside its top-level `if` and `try` blocks."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            for block in (
                node.body,
                node.orelse,
                getattr(node, "finalbody", []),
                *(h.body for h in getattr(node, "handlers", [])),
            ):
                yield from _top_statements(block)


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    i = len(parts)
    while i > 0 and _module_file(".".join(parts[:i])) is None:
        i -= 1
    if i == 0:
        return False
    rest = parts[i:]
    if not rest:
        return True
    names = top_level_names(".".join(parts[:i]))
    if rest[0] not in names:
        return False
    members = names[rest[0]]
    return len(rest) == 1 or members is None or rest[1] in members  # deeper than a class member: not checked


def stale_references(path: Path, text: str) -> list[str]:
    rel = path.relative_to(REPO_ROOT).as_posix()
    skip = NOT_REFERENCES.get(rel)
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        found = [(m.group(0), m.group(0)) for m in DOTTED.finditer(line)]
        found += [(m.group(1), None) for m in PATH.finditer(line)]
        for m in LAYER.finditer(line):
            ref = m.group(1)
            stem = ref.rsplit(".", 1)[0] if ref.endswith((".py", ".md", ".json")) else ref
            found.append((ref, "meshrun." + stem.replace("/", ".")))
        for ref, dotted in found:
            if skip is not None and skip.match(ref):
                continue
            if dotted is not None:
                ok = resolves(dotted)
            else:
                ok = "*" in ref or PLACEHOLDER.search(ref) is not None or (REPO_ROOT / ref).exists()
            if not ok:
                out.append(f"{rel}:{n}: {ref}")
    return out


def test_every_named_module_and_path_exists():
    stale = [s for p in text_files() for s in stale_references(p, p.read_text(errors="replace"))]
    assert not stale, "references to modules, names or files that do not exist:\n" + "\n".join(stale)


@pytest.mark.parametrize(
    "text",
    [
        "see `meshrun.status.render`",  # a module that moved
        "meshrun.core.launch.no_such_function",  # a name the module does not define
        "meshrun.mesh.node.daemon.AgentService.no_such_method",  # a name the class does not define
        "tests/test_diloco_e2e.py",  # a file that moved
        "(`mesh/daemon.tick`)",  # ARCHITECTURE.md's form
    ],
)
def test_the_check_catches_a_stale_reference(text):
    assert stale_references(REPO_ROOT / "docs" / "x.md", text)


@pytest.mark.parametrize(
    "text",
    [
        "meshrun.mesh.node.setup.join",
        "meshrun.mesh.node.daemon.AgentService.sync_once",
        "tests/e2e/test_diloco_e2e.py and benchmarks/results/*.json and benchmarks/results/NAME.json",
        "`mesh/coordinator/daemon.CoordinatorService.tick`, `core/token`",
        '"meshrun.train.diloco.snapshot/1"',
    ],
)
def test_the_check_accepts_what_exists(text):
    assert stale_references(REPO_ROOT / "docs" / "x.md", text) == []
