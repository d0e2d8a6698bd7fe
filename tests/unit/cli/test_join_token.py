"""Where `meshrun join` takes its token from (stdin, --token-file, $MESHRUN_TOKEN), and that the token in the
environment stays out of every process started after it was read (the agent daemon, and through it every job)."""

from __future__ import annotations

import os
import sys

import pytest

from meshrun.cli.node import read_token
from meshrun.errors import UsageError
from meshrun.system.machine import procs

TOKEN = "mr1.eyJ0ZXN0IjoidG9rZW4ifQ.abcd"
CHILD = """
import os, sys
from meshrun.system.machine.procs import notify_ready
with open(sys.argv[1], "w") as f:
    f.write(os.environ.get("MESHRUN_TOKEN", "<unset>"))
notify_ready()
"""


def child_sees(tmp_path) -> str:
    """$MESHRUN_TOKEN as a daemon started with procs.spawn_daemon (as `meshrun join` starts the agent) sees it."""
    script, out = tmp_path / "child.py", tmp_path / "child.env"
    script.write_text(CHILD)
    pid = procs.spawn_daemon([sys.executable, str(script), str(out)], tmp_path / "child.log", timeout=60)
    procs.wait_gone(pid, 10)
    return out.read_text()


def test_the_token_is_read_from_a_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    assert read_token(None, path) == TOKEN


def test_a_missing_token_file_is_named(tmp_path):
    with pytest.raises(UsageError, match="token file '.*nope' not found"):
        read_token(None, tmp_path / "nope")


def test_the_token_is_read_from_the_environment_and_reaches_no_child(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHRUN_TOKEN", f"  {TOKEN}\n")
    assert child_sees(tmp_path).strip() == TOKEN  # the control: a child inherits what the environment holds
    assert read_token(None, None) == TOKEN
    assert "MESHRUN_TOKEN" not in os.environ
    assert child_sees(tmp_path) == "<unset>"


@pytest.mark.parametrize("source", ["argument", "file"])
def test_the_environments_token_is_dropped_whichever_source_is_used(tmp_path, monkeypatch, source):
    monkeypatch.setenv("MESHRUN_TOKEN", "mr1.from-the-environment")
    path = tmp_path / "token"
    path.write_text(TOKEN)
    assert read_token(TOKEN if source == "argument" else None, path if source == "file" else None) == TOKEN
    assert "MESHRUN_TOKEN" not in os.environ and child_sees(tmp_path) == "<unset>"


def test_no_token_at_all_names_every_way_to_give_one(monkeypatch):
    monkeypatch.delenv("MESHRUN_TOKEN", raising=False)
    with pytest.raises(UsageError) as info:
        read_token(None, None)
    assert str(info.value) == "no join token given; meshrun join - < token, --token-file FILE, or MESHRUN_TOKEN=..."
