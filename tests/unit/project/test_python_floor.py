"""meshrun on the oldest Python it claims (pyproject: requires-python >= 3.10): the pure and loopback tests
run again under a Python 3.10 interpreter, in a venv of its own with meshrun's dependencies but torch
(there is no local CPU torch wheel for 3.10; nothing these tests load needs it).

Skipped, naming the reason, where no Python 3.10 is found (a fresh Debian 12 has none): the one skip
allowed in CI (see the `py310_venv` fixture).
"""

from __future__ import annotations

import os
import subprocess
import sys

from support import REPO_ROOT, TESTS

# Everything that runs without torch, root or namespaces: what 3.10 changes (tarfile filters, asyncio TLS,
# typing, tomli for tomllib) is exercised here.
FLOOR = [TESTS / "unit" / d for d in ("core", "system", "mesh", "jobs", "cli")] + [
    TESTS / "unit" / "project" / "test_layers.py",
    TESTS / "unit" / "project" / "test_devsh.py",
]


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
    assert sys.version_info >= (3, 10)
