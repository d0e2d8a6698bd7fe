"""Shared fixtures. Tests marked ``netns`` build network namespaces and need root.

Not root and ``CI`` unset: those tests skip, saying why. Not root in CI: they fail, because a CI run
that silently skips the end-to-end tests proves nothing.
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest


def netns_unavailable_reason() -> str | None:
    """Why namespace tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to build network namespaces (run the tests as root)"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("netns") is None:
        return
    reason = netns_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"netns test {item.name} cannot run in CI: {reason}", pytrace=False)
    pytest.skip(reason)


def unique_prefix() -> str:
    """A short testbed prefix unique enough for concurrent runs: "t" + 4 hex digits."""
    return "t" + secrets.token_hex(2)


def _world(dcs, prefix: str, **kw):
    """World.standard(dcs) for a count, else World(dcs): a list of DatacenterSpecs."""
    from meshrun.lab.testbed import World

    return World.standard(dcs, prefix=prefix, **kw) if isinstance(dcs, int) else World(dcs, prefix=prefix, **kw)


@contextlib.contextmanager
def joined_mesh(tmp_path_factory, dcs, coordinator: str, nodes: Sequence[str]) -> Iterator:
    """A world (`dcs` as for world_factory) with meshrun init on `coordinator` and `nodes` joined, for a
    module-scoped fixture; torn down on exit. Skips where namespaces cannot be built (in CI,
    pytest_runtest_setup fails the netns tests instead)."""
    from meshrun.lab.testbed import Mesh

    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(reason)
    prefix = unique_prefix()
    world = _world(dcs, prefix, workdir=tmp_path_factory.mktemp(prefix))
    try:
        world.up()
        mesh = Mesh(world, coordinator)
        mesh.init()
        for n in nodes:
            mesh.join(n)
        yield mesh
    finally:
        world.down()


@pytest.fixture
def world_factory(tmp_path: Path) -> Callable:
    """Build testbed Worlds with a fresh prefix each; every one is torn down after the test.

    ``world_factory(3)`` is World.standard(3); ``world_factory([DatacenterSpec(...), ...])`` a custom
    world; ``up=False`` returns it unbuilt (still torn down afterwards). Extra keywords go to World.
    """
    from meshrun.lab.testbed import World

    worlds: list[World] = []

    def make(dcs, *, up: bool = True, **kw) -> World:
        prefix = kw.pop("prefix", None) or unique_prefix()
        kw.setdefault("workdir", tmp_path / prefix)
        world = _world(dcs, prefix, **kw)
        worlds.append(world)
        return world.up() if up else world

    yield make
    errors = []
    for world in reversed(worlds):
        try:
            world.down()
        except Exception as exc:  # tear down the others anyway, then report
            errors.append(exc)
    if errors:
        raise errors[0]


def json_strategy(max_text: int = 40, max_list: int = 5, max_key: int = 12, max_dict: int = 6, max_leaves: int = 20):
    """Hypothesis strategy: any JSON value (NaN, huge integers and odd text included), for fuzzing parsers."""
    from hypothesis import strategies as st

    return st.recursive(
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**70), max_value=2**70)
        | st.floats(allow_nan=True)
        | st.text(max_size=max_text),
        lambda children: st.lists(children, max_size=max_list)
        | st.dictionaries(st.text(max_size=max_key), children, max_size=max_dict),
        max_leaves=max_leaves,
    )


# --------------------------------------------------------------------------- a second Python environment

REPO = Path(__file__).resolve().parent.parent
PY310_VENV = REPO / ".venv-py310"
PY310_DEPS = ["typer>=0.9", "cryptography>=41", "wgconfig>=1.0", "numpy", "tomli>=1.1", "pytest>=7", "hypothesis>=6"]


def python310() -> str | None:
    """A working Python 3.10 (a pyenv shim on PATH may name one that is not installed)."""
    candidates = [
        p
        for pattern in (
            "/root/.pyenv/versions/3.10*/bin/python3.10",
            os.path.expanduser("~/.pyenv/versions/3.10*/bin/python3.10"),
        )
        for p in sorted(glob.glob(pattern), reverse=True)
    ]
    candidates += [p for p in (shutil.which("python3.10"), "/usr/bin/python3.10", "/usr/local/bin/python3.10") if p]
    for py in candidates:
        ok = (
            subprocess.run(
                [py, "-c", "import sys, venv; assert sys.version_info[:2] == (3, 10)"], capture_output=True
            ).returncode
            == 0
        )
        if ok:
            return py
    return None


def _venv_without_torch(py: str, where: Path) -> Path:
    """A venv of interpreter `py` at `where` with meshrun and its dependencies but torch."""
    vpy = where / "bin" / "python"
    if not vpy.exists():
        subprocess.run([py, "-m", "venv", str(where)], check=True, timeout=120)
    pip = [str(vpy), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + PY310_DEPS, check=True, timeout=600)
    subprocess.run(pip + ["--no-deps", "-e", str(REPO)], check=True, timeout=300)
    return vpy


@pytest.fixture(scope="session")
def py310_venv() -> Path:
    """A Python 3.10 venv with meshrun and its dependencies but torch (no local 3.10 torch wheel): the
    supported floor.

    Skipped, naming the reason, where no Python 3.10 exists (Debian 12 ships 3.11 only, and a fresh
    Debian 12 must pass `./dev.sh test`): the one skip allowed in CI."""
    py = python310()
    if py is None:
        pytest.skip(
            "no Python 3.10 interpreter on this machine (python3.10 on PATH or under ~/.pyenv): the "
            "supported floor is not tested here"
        )
    return _venv_without_torch(py, PY310_VENV)


@pytest.fixture(scope="session")
def torchless_venv() -> Path:
    """Another Python environment for a node, without torch: Python 3.10 where there is one, else this
    interpreter's base Python (always there)."""
    py = python310()
    if py is not None:
        return _venv_without_torch(py, PY310_VENV)
    import sys

    base = getattr(sys, "_base_executable", None) or sys.executable
    return _venv_without_torch(base, REPO / ".venv-torchless")
