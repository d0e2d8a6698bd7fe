"""The README's first screen works as written in a root shell without sudo, and on a sudo account."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
from support import REPO_ROOT

REPO = REPO_ROOT


def test_the_first_screen_gives_exactly_two_commands_without_sudo():
    first = (REPO / "README.md").read_text().split("\n## ", 1)[0]
    block = re.search(r"```sh\n(.*?)```", first, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["./dev.sh demo", "./dev.sh test"]
    assert "sudo ./dev.sh" not in first


@pytest.fixture
def fake_sudo():
    """A directory (readable by everyone) holding a `sudo` that prints how it was called."""
    d = Path(tempfile.mkdtemp(prefix="meshrun-fake-sudo-"))
    os.chmod(d, 0o755)
    (d / "sudo").write_text('#!/bin/sh\necho "sudo called as uid $(id -u): $*"\n')
    os.chmod(d / "sudo", 0o755)
    yield d
    (d / "sudo").unlink()
    d.rmdir()


def _as(user_argv: list[str], fake_sudo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": f"{fake_sudo}:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/tmp"}
    return subprocess.run(
        [*user_argv, "bash", str(REPO / "dev.sh"), *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_an_account_with_sudo_gets_dev_sh_run_again_through_sudo(fake_sudo):
    if os.geteuid() != 0:
        pytest.skip("needs root to run dev.sh as another user (setpriv)")
    assert os.stat(REPO / "dev.sh").st_mode & stat.S_IROTH, "dev.sh must be readable by other users"
    nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    res = _as(nobody, fake_sudo, "demo", "--nodes", "2")
    assert res.returncode == 0, res.stderr
    assert (
        res.stdout.strip() == f"sudo called as uid 65534: --preserve-env=PYTHON,MESHRUN_TORCH,MESHRUN_TEST_WORKERS,CI "
        f"{REPO}/dev.sh "
        "demo --nodes 2"
    )
    assert "running again through sudo" in res.stderr
    # root never goes through sudo (a fresh root shell has none): here it gets the usage line.
    res = _as([], fake_sudo)
    assert res.returncode == 2 and "sudo called" not in res.stdout and "usage: ./dev.sh" in res.stderr


def test_dev_sh_installs_git_which_the_code_sync_and_its_tests_need():
    # meshrun.system.files.archive lists a git work tree's files with git; tests/unit/system/test_archive.py builds
    # repositories and submodules (a fresh Debian 12 has no git)
    line = re.search(r"^APT_PKGS=\((.*)\)$", (REPO / "dev.sh").read_text(), re.M).group(1)
    assert "git" in line.split()
    first = (REPO / "README.md").read_text().split("\n## ", 1)[0]
    assert re.search(r"system packages with apt-get \([^)]*\bgit\b", first), "the README's list names git"


def test_dev_sh_test_installs_ethtool_which_the_relay_kernel_test_needs():
    # tests/e2e/test_relay_kernel_e2e.py turns checksum offloads off with ethtool; a fresh machine lacked it and
    # the test's setup failed in a clean-clone run of the suite (2026-11-28). The test command installs it; the
    # demo and `install` do not need it.
    text = (REPO / "dev.sh").read_text()
    assert "ethtool" in re.search(r"^TEST_APT_PKGS=\((.*)\)$", text, re.M).group(1).split()
    test_case = re.search(r"^  test\) (.*?);;", text, re.M | re.S).group(1)
    assert re.search(r'^\s*install_extra "[^"]+" 1 "\$\{TEST_APT_PKGS\[@\]\}"$', test_case, re.M), test_case
    assert text.count("TEST_APT_PKGS[@]") == 1  # neither the demo nor `install` needs it
