"""meshrun on the oldest Python it claims (pyproject: requires-python >= 3.10): the pure and loopback tests
run again under a Python 3.10 interpreter, in a venv of its own with meshrun's dependencies but torch
(there is no local CPU torch wheel for 3.10; nothing these tests load needs it).

Skipped outside CI when no Python 3.10 is found; in CI that is a failure.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv-py310"
DEPS = ["typer>=0.9", "cryptography>=41", "wgconfig>=1.0", "numpy", "tomli>=1.1", "pytest>=7", "hypothesis>=6"]
# Everything that runs without torch, root or namespaces: what 3.10 changes (tarfile filters, asyncio TLS,
# typing, tomli for tomllib) is exercised here.
TESTS = ["test_auth.py", "test_token.py", "test_keys.py", "test_model.py", "test_ipam.py", "test_peers.py",
         "test_paths.py", "test_netparse.py", "test_wgconf.py", "test_jobfile.py", "test_jobs_core.py",
         "test_store.py", "test_transport.py", "test_frontdoor.py", "test_mesh_loop.py", "test_layers.py",
         "test_procs.py", "test_api_fuzz.py", "test_fuzz.py", "test_status.py", "test_runner.py", "test_worker.py",
         "test_archive.py", "test_devsh.py"]


def python310() -> str | None:
    """A working Python 3.10 (a pyenv shim on PATH may name one that is not installed)."""
    candidates = [p for pattern in ("/root/.pyenv/versions/3.10*/bin/python3.10",
                                    os.path.expanduser("~/.pyenv/versions/3.10*/bin/python3.10"))
                  for p in sorted(glob.glob(pattern), reverse=True)]
    candidates += [p for p in (shutil.which("python3.10"), "/usr/bin/python3.10", "/usr/local/bin/python3.10") if p]
    for py in candidates:
        ok = subprocess.run([py, "-c", "import sys, venv; assert sys.version_info[:2] == (3, 10)"],
                            capture_output=True).returncode == 0
        if ok:
            return py
    return None


def test_the_supported_floor_runs_the_pure_tests():
    py = python310()
    if py is None:
        if os.environ.get("CI"):
            pytest.fail("no Python 3.10 interpreter to test the supported floor with", pytrace=False)
        pytest.skip("no Python 3.10 interpreter here (python3.10 on PATH or under ~/.pyenv)")
    vpy = VENV / "bin" / "python"
    if not vpy.exists():
        subprocess.run([py, "-m", "venv", str(VENV)], check=True, timeout=120)
    pip = [str(vpy), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run(pip + DEPS, check=True, timeout=600)
    subprocess.run(pip + ["--no-deps", "-e", str(REPO)], check=True, timeout=300)
    version = subprocess.run([str(vpy), "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                             text=True, check=True).stdout.strip()
    assert version == "(3, 10)", version
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([str(vpy), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not netns",
                          *[str(REPO / "tests" / t) for t in TESTS]], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    assert sys.version_info >= (3, 10)
