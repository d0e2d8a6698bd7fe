"""setuptools' build backend (pyproject.toml's [build-system]), and the commit a wheel is built from.

A wheel built in a git checkout (`pip install /path/to/checkout`, `pip wheel .`) carries the checkout's commit
in meshrun/_commit, which `meshrun --version` prints (meshrun.system.files.provenance: an editable install reads
the checkout itself). Built from files outside a checkout (tools/offline_bundle.sh copies them elsewhere and
writes the stamp itself), it leaves whatever stamp is there.
"""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403 -- every hook setuptools has, build_wheel replaced below

ROOT = Path(__file__).resolve().parent.parent


def _stamp() -> None:
    if not (ROOT / ".git").exists():
        return
    sys.path.insert(0, str(ROOT))  # stdlib only: nothing of meshrun's dependencies is needed for this
    try:
        from meshrun.system.files.provenance import STAMP, checkout_commit

        commit = checkout_commit(ROOT)
    finally:
        sys.path.remove(str(ROOT))
    if commit:
        (ROOT / "meshrun" / STAMP).write_text(commit + "\n")


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _stamp()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
