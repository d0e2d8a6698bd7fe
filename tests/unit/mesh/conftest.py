"""Fixtures the agent's unit tests share."""

from __future__ import annotations

import pytest

from meshrun.system.files.statedir import StateDir


@pytest.fixture
def state(tmp_path):
    """A node's state directory in tmp_path, created."""
    s = StateDir(tmp_path / "node")
    s.create()
    return s
