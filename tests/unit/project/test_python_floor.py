"""meshrun on the oldest Python it claims (pyproject: requires-python >= 3.10): the pure and loopback tests
run again under a Python 3.10 interpreter, in a venv of its own with meshrun's dependencies but torch
(there is no local CPU torch wheel for 3.10; nothing these tests load needs it).

Skipped, naming the reason, where no Python 3.10 is found (a fresh Debian 12 has none): the one skip
allowed in CI (see the `py310_venv` fixture).
"""

from __future__ import annotations

import os
import subprocess

from support import REPO_ROOT, TESTS

# The tests, without torch, root or namespaces, of what 3.10 changes: tarfile's extraction filters
# (system/files/archive), asyncio and TLS (system/sockets: transport, frontdoor, longpoll), tomli for tomllib
# (core/jobconfig), cryptography's key and certificate APIs (core: keys, keys_pki, token), click and typer
# (cli errors), the interpreter's own exit sequence that a worker replays (jobs/worker: threading._shutdown,
# sys.last_*). Everything else is pure logic on top of those: it is imported here (IMPORT_ALL), which is where a
# syntax or typing construct newer than the floor fails, and runs in full on the main interpreter.
FLOOR = [
    TESTS / "unit" / "system" / "test_archive.py",
    TESTS / "unit" / "system" / "test_transport.py",
    TESTS / "unit" / "system" / "test_frontdoor.py",
    TESTS / "unit" / "system" / "test_longpoll.py",
    TESTS / "unit" / "core" / "test_jobconfig.py",
    TESTS / "unit" / "core" / "test_keys.py",
    TESTS / "unit" / "core" / "test_keys_pki.py",
    TESTS / "unit" / "core" / "test_token.py",
    TESTS / "unit" / "cli" / "test_cli_errors.py",
    TESTS / "unit" / "jobs" / "test_worker.py",
    TESTS / "unit" / "project" / "test_layers.py",
    TESTS / "unit" / "project" / "test_devsh.py",
]
# Every meshrun module imports on 3.10 (a syntax or typing construct newer than the floor fails here), but
# those that need torch, which the floor's venv lacks.
IMPORT_ALL = """
import importlib, pkgutil
import meshrun as package
bad = []
for m in pkgutil.walk_packages(package.__path__, "meshrun."):
    if m.name.endswith("__main__"):  # the CLI itself: importing it runs it
        continue
    try:
        importlib.import_module(m.name)
    except ModuleNotFoundError as exc:
        if exc.name != "torch" and not (exc.name or "").startswith("torch."):
            bad.append(f"{m.name}: {exc}")
    except Exception as exc:
        bad.append(f"{m.name}: {exc!r}")
print("\\n".join(bad))
raise SystemExit(1 if bad else 0)
"""


def test_the_supported_floor_runs_the_pure_tests(py310_venv):
    vpy = py310_venv
    version = subprocess.run(
        [str(vpy), "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert version == "(3, 10)", version
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run(
        [
            str(vpy),
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "-m",
            "not netns",
            *[str(t) for t in FLOOR],
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    imported = subprocess.run([str(vpy), "-c", IMPORT_ALL], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    assert imported.returncode == 0, imported.stdout[-3000:] + imported.stderr[-3000:]
