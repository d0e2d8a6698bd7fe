"""meshrun.system.files.provenance and tools/build_backend.py: `meshrun --version` names the commit, run from a
checkout (its HEAD now, "+changes" when files differ) or installed from a wheel built in one (the stamp)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from support import REPO_ROOT

from meshrun.system.files import provenance


def git(where: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(where), *args], check=True, capture_output=True, text=True).stdout.strip()


def test_a_checkout_gives_its_head_and_says_when_files_differ(tmp_path):
    repo = tmp_path / "checkout"
    (repo / "meshrun").mkdir(parents=True)
    (repo / "meshrun" / "x.py").write_text("x = 1\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "one")
    head = git(repo, "rev-parse", "--short", "HEAD")
    (repo / "meshrun" / provenance.STAMP).write_text("0000000\n")  # a wheel's stamp left here: the checkout wins
    assert provenance.describe(repo / "meshrun") == head
    (repo / "meshrun" / "x.py").write_text("x = 2\n")
    assert provenance.describe(repo / "meshrun") == f"{head}+changes"


def test_an_installed_package_gives_its_stamp_or_nothing(tmp_path):
    pkg = tmp_path / "site-packages" / "meshrun"
    pkg.mkdir(parents=True)
    assert provenance.describe(pkg) is None
    (pkg / provenance.STAMP).write_text("1e21bf8+changes\n")
    assert provenance.describe(pkg) == "1e21bf8+changes"


def test_a_wheel_built_in_a_checkout_carries_its_commit(tmp_path):
    """`pip wheel` of a clone (pyproject's backend, tools/build_backend.py): the wheel holds the clone's commit."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO_ROOT), str(clone)], check=True, timeout=120)
    out = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps"]
    subprocess.run([*pip, "--no-build-isolation", "-w", str(out), str(clone)], check=True, timeout=300)
    (wheel,) = out.glob("meshrun-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert z.read(f"meshrun/{provenance.STAMP}").decode().strip() == git(clone, "rev-parse", "--short", "HEAD")
