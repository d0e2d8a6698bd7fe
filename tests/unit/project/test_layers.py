"""The import contract of meshrun's layers (docs/ARCHITECTURE.md), checked on the source itself.

- `meshrun.core` is pure: it imports nothing from meshrun.system, .mesh, .jobs, .cli, .lab,
  .bench or .train.
- Only `meshrun.system` runs processes, opens sockets or touches files: anywhere else, importing a
  process/socket/database/lock module or calling a file or process function is a violation.
- Every layer imports only the layers below it (system and core from everyone; mesh from jobs,
  bench, lab and cli; nothing imports cli).

The checker is a plain AST walk; `test_the_checker_catches_violations` proves it flags each rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support import REPO_ROOT

PKG = REPO_ROOT / "meshrun"

# Modules that put the system within reach; only meshrun.system may import them.
SIDE_EFFECT_MODULES = {
    "subprocess",
    "socket",
    "ssl",
    "sqlite3",
    "fcntl",
    "ctypes",
    "select",
    "selectors",
    "socketserver",
    "http.server",
    "http.client",
    "asyncio",
    "multiprocessing",
    "tarfile",
    "tempfile",
    "pty",
}
# Calls that touch files or processes: module functions and (by name) path/file methods.
SIDE_EFFECT_CALLS = {
    "open",
    "io.open",
    "os.open",
    "os.kill",
    "os.killpg",
    "os.fork",
    "os.execv",
    "os.execvp",
    "os.execvpe",
    "os.execve",
    "os.execl",
    "os.execlp",
    "os.system",
    "os.popen",
    "os.replace",
    "os.rename",
    "os.remove",
    "os.unlink",
    "os.mkdir",
    "os.makedirs",
    "os.rmdir",
    "os.chmod",
    "os.fchmod",
    "os.pipe",
    "os.setsid",
    "os.waitpid",
    "os.symlink",
    "os.link",
    "os.truncate",
    "os.posix_spawn",
    "os.posix_spawnp",
    "os.spawnv",
    "os.spawnvp",
    "os.spawnl",
    "os.spawnlp",
    "os.write",
    "os.read",
    "shutil.rmtree",
    "shutil.copy",
    "shutil.copy2",
    "shutil.copyfile",
    "shutil.copytree",
    "shutil.move",
    "torch.load",
    "torch.save",
    "importlib.import_module",
    "__import__",
}
SIDE_EFFECT_METHODS = {
    "read_text",
    "write_text",
    "read_bytes",
    "write_bytes",
    "unlink",
    "mkdir",
    "rmdir",
    "touch",
    "chmod",
    "symlink_to",
    "hardlink_to",
    "rename",
    "open",
}
# Modules whose functions above may also arrive by `from os import kill` or `import os as o`.
CALL_MODULES = {"os", "io", "shutil", "torch", "importlib"}

# Who may import whom (meshrun.errors and the package root are shared by all).
ALLOWED = {
    "core": {"core"},
    "system": {"system", "core"},
    "mesh": {"mesh", "system", "core"},
    "jobs": {"jobs", "mesh", "system", "core"},
    "train": {"train", "system", "core"},
    "bench": {"bench", "train", "jobs", "mesh", "system", "core"},
    "lab": {"lab", "system", "core"},
    "cli": {"cli", "lab", "bench", "train", "jobs", "mesh", "system", "core"},
}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "meshrun" and parts[1] in ALLOWED else None


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module of a (possibly relative) `from ... import`."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every breach of the contract in `source`, the text of meshrun module `module`."""
    layer = layer_of(module)
    tree = ast.parse(source)
    out: list[str] = []
    in_system = layer == "system"
    type_checking = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and _dotted(node.test) == "TYPE_CHECKING"
        for n in ast.walk(node)
    }
    aliases: dict[str, str] = {}  # local name -> what it is ("os", "os.kill", ...)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module in CALL_MODULES:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in type_checking:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = _absolute(node, module, is_package)
                names = [base] + [f"{base}.{a.name}" for a in node.names] if base == "meshrun" else [base]
                if not in_system and base in CALL_MODULES:
                    for a in node.names:
                        if f"{base}.{a.name}" in SIDE_EFFECT_CALLS:
                            out.append(
                                f"{module}:{node.lineno} imports {base}.{a.name} (only meshrun.system may call it)"
                            )
            for name in names:
                if not in_system and (name in SIDE_EFFECT_MODULES or name.split(".")[0] in SIDE_EFFECT_MODULES):
                    out.append(f"{module}:{node.lineno} imports {name} (only meshrun.system may)")
                target = layer_of(name)
                if layer and target and target not in ALLOWED[layer]:
                    out.append(f"{module}:{node.lineno} imports {name} (meshrun.{layer} may not use meshrun.{target})")
        elif isinstance(node, ast.Call) and not in_system:
            name = _dotted(node.func)
            head, _, rest = name.partition(".")
            if head in aliases:  # `import os as o; o.kill()`, `from os import kill; kill()`
                name = aliases[head] + (f".{rest}" if rest else "")
            if name in SIDE_EFFECT_CALLS:
                out.append(f"{module}:{node.lineno} calls {name}() (only meshrun.system may)")
            elif isinstance(node.func, ast.Attribute) and node.func.attr in SIDE_EFFECT_METHODS:
                out.append(f"{module}:{node.lineno} calls .{node.func.attr}() (only meshrun.system may)")
    return out


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        out.append((".".join(rel.parts).removesuffix(".__init__"), path))
    return out


def test_every_module_belongs_to_a_layer():
    loose = [
        m for m, _ in _modules() if layer_of(m) is None and m not in ("meshrun", "meshrun.__main__", "meshrun.errors")
    ]
    assert loose == []


@pytest.mark.parametrize("module, path", _modules(), ids=[m for m, _ in _modules()])
def test_module_keeps_the_contract(module, path):
    assert violations(path.read_text(), module, path.name == "__init__.py") == []


@pytest.mark.parametrize(
    "module, source, needle",
    [
        ("meshrun.core.x", "from meshrun.system import procs\n", "meshrun.core may not use meshrun.system"),
        ("meshrun.core.x", "from meshrun.mesh.node.daemon import AgentService\n", "may not use meshrun.mesh"),
        ("meshrun.mesh.x", "import subprocess\n", "imports subprocess (only meshrun.system may)"),
        ("meshrun.jobs.x", "from http.server import HTTPServer\n", "imports http.server"),
        ("meshrun.mesh.x", "open('/etc/passwd')\n", "calls open()"),
        ("meshrun.cli.x", "import os\nos.kill(1, 9)\n", "calls os.kill()"),
        ("meshrun.lab.x", "from pathlib import Path\nPath('x').write_text('y')\n", "calls .write_text()"),
        ("meshrun.mesh.x", "from meshrun.cli import app\n", "meshrun.mesh may not use meshrun.cli"),
        ("meshrun.system.x", "from meshrun.jobs import runner\n", "meshrun.system may not use meshrun.jobs"),
        # the side doors
        ("meshrun.core.x", "from ..system import procs\n", "meshrun.core may not use meshrun.system"),
        ("meshrun.mesh.coordinator.x", "from ...jobs import runner\n", "meshrun.mesh may not use meshrun.jobs"),
        (
            "meshrun.core.x",
            "import importlib\nimportlib.import_module('meshrun.system.machine.procs')\n",
            "calls importlib.import_module()",
        ),
        ("meshrun.core.x", "__import__('subprocess')\n", "calls __import__()"),
        ("meshrun.cli.x", "from os import kill\nkill(1, 9)\n", "calls os.kill()"),
        ("meshrun.cli.x", "from os import kill\n", "imports os.kill"),
        ("meshrun.cli.x", "import os as o\no.kill(1, 9)\n", "calls os.kill()"),
        ("meshrun.mesh.x", "import io\nio.open('x')\n", "calls io.open()"),
        ("meshrun.mesh.x", "from pathlib import Path\nPath('x').open()\n", "calls .open()"),
        ("meshrun.jobs.x", "import os\nos.posix_spawn('/bin/sh', [], {})\n", "calls os.posix_spawn()"),
        ("meshrun.train.x", "import torch\ntorch.load('snapshot.pt')\n", "calls torch.load()"),
    ],
)
def test_the_checker_catches_violations(module, source, needle):
    found = violations(source, module)
    assert any(needle in v for v in found), found


def test_the_checker_allows_what_the_layers_may_do():
    assert (
        violations("import subprocess\nopen('x')\nfrom meshrun.core import peers\n", "meshrun.system.machine.cmd") == []
    )
    assert (
        violations(
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import subprocess\n", "meshrun.lab.testbed"
        )
        == []
    )
    assert violations("from meshrun.errors import UsageError\nimport re\n", "meshrun.core.x") == []
