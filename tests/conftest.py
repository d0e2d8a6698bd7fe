"""Shared fixtures, and the markers every test gets from where it lives.

tests/unit/<layer>/test_<module>.py mirror the package and need neither root nor namespaces; every test
under tests/e2e/ is marked ``netns`` and ``slow`` (run the fast set with ``pytest tests/unit`` or
``-m "not slow"``). Not root and ``CI`` unset: the netns tests skip, saying why. Not root in CI: they
fail, because a CI run that silently skips the end-to-end tests proves nothing.
"""

from __future__ import annotations

import fcntl
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import (
    PY310_DEPS,
    PY310_VENV,
    REPO_ROOT,
    TESTS,
    _world,
    cannot_run,
    netns_unavailable_reason,
    python310,
    unique_prefix,
)

E2E = TESTS / "e2e"
# The collection order, which is the order the workers taking one file at a time start them in with
# `--dist loadfile --no-loadscope-reorder` (./dev.sh test; without the second option xdist sorts the files by
# their number of tests, and the one-test VM file started 42 minutes in, beside the heaviest end-to-end tests,
# and took 16 minutes instead of 7). The VM test goes first, beside the unit tests: under TCG the guest needs
# a core to itself, and the end-to-end tests' namespaces, daemons and trainers took it (a guest join ran past
# its 45 s beside them). Then the longest files (minutes each on the 2-core CI machines, from a CI run's
# --durations): one of them starting last would stretch the run by its whole length.
FIRST = "test_vm_e2e.py"
LONGEST_FIRST = (  # from a clean-clone run's junit file (tests/DURATIONS.md), longest first
    "test_benchmarks_smoke.py",
    "test_nat_e2e.py",
    "test_ha_e2e.py",
    "test_corpus_e2e.py",
    "test_lanpath_e2e.py",
    "test_reliability_e2e.py",
    "test_jobs_e2e.py",
    "test_diloco_e2e.py",
    "test_member_attacks_e2e.py",
    "test_rdzv_flood_e2e.py",
    "test_demo_e2e.py",
    "test_train_e2e.py",
    "test_gpucheck_e2e.py",
    "test_diloco_wan_smoke.py",
    "test_relay_attacks_e2e.py",
    "test_doctor_e2e.py",
    "test_sites_e2e.py",
    "test_python_floor.py",
)
HEAVY = {"test_python_floor.py"}  # a unit test by what it checks, run among the end-to-end ones for its minutes


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def order(item: pytest.Item) -> tuple[int, int]:
        path = Path(str(item.fspath)).resolve()
        if path.name == FIRST:
            return (0, 0)
        return (2 if E2E in path.parents or path.name in HEAVY else 1, rank.get(path.name, len(rank)))

    for item in items:
        if E2E in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.netns)
            item.add_marker(pytest.mark.slow)
    # A stable sort: the order inside a file, and of the other files, stays as collected.
    items.sort(key=order)


# Tests marked `timing` compare what they measure against a reference taken beside it, or a rate window: they
# take this lock alone, so they never run beside a test marked `load` (a flood, iperf3 at a link's ceiling, busy
# loops, the TCG VM), which take it shared among themselves. A file in /tmp: the two xdist workers share it.
LOAD_LOCK = Path(tempfile.gettempdir()) / "meshrun-tests-load.lock"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Setup, call and teardown of a `timing` test hold LOAD_LOCK exclusively, of a `load` test shared."""
    kind = (
        fcntl.LOCK_EX
        if item.get_closest_marker("timing")
        else fcntl.LOCK_SH
        if item.get_closest_marker("load")
        else None
    )
    if kind is None:
        yield
        return
    with open(LOAD_LOCK, "a") as lock:
        fcntl.flock(lock, kind)
        yield


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("netns") is None:
        return
    reason = netns_unavailable_reason()
    if reason is None:
        return
    cannot_run(f"netns test {item.name}", reason)


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


@pytest.fixture
def fresh_mesh(world_factory) -> Callable:
    """``fresh_mesh(dcs, coordinator="dc1-a", nodes=())``: a world (as world_factory builds it) with
    `meshrun init` on the coordinator and `nodes` joined, for one test; torn down after it."""
    from meshrun.lab.mesh import Mesh

    def make(dcs, coordinator: str = "dc1-a", nodes=(), **kw) -> Mesh:
        mesh = Mesh(world_factory(dcs, **kw), coordinator)
        mesh.init()
        for n in nodes:
            mesh.join(n)
        return mesh

    return make


def _venv_without_torch(py: str, where: Path) -> Path:
    """A venv of interpreter `py` at `where` with meshrun and its dependencies but torch (made once: test
    processes running side by side (pytest-xdist) take turns through a lock file beside it)."""
    import fcntl

    where.parent.mkdir(parents=True, exist_ok=True)
    with open(where.parent / f".{where.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _make_venv(py, where)


def _make_venv(py: str, where: Path) -> Path:
    vpy = where / "bin" / "python"
    if not vpy.exists():
        subprocess.run([py, "-m", "venv", str(where)], check=True, timeout=120)
    pip = [str(vpy), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + PY310_DEPS, check=True, timeout=600)
    subprocess.run(pip + ["--no-deps", "-e", str(REPO_ROOT)], check=True, timeout=300)
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
    return _venv_without_torch(base, REPO_ROOT / ".venv-torchless")
