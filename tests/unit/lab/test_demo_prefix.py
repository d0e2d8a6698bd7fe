"""`meshrun demo` beside another demo and after a killed one: each takes a prefix of its own, and what a dead
demo left is torn down (meshrun.lab.demo.claim_prefix, with the teardown replaced: no namespaces here)."""

from __future__ import annotations

import json
import os
import re
import subprocess

from meshrun.lab import demo


def test_a_demo_takes_its_own_prefix_leaves_a_live_one_alone_and_cleans_up_a_dead_one(tmp_path, monkeypatch):
    torn: list[str] = []
    monkeypatch.setattr(demo, "remove_stale", lambda prefix: torn.append(prefix) or [f"{prefix}-inet"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / "demoaaaa.json").write_text(json.dumps({"prefix": "demoaaaa", "pid": os.getpid()}))
    (tmp_path / "demobbbb.json").write_text(json.dumps({"prefix": "demobbbb", "pid": dead.pid}))
    (tmp_path / "democccc.json").write_text(json.dumps({"prefix": "../etc", "pid": dead.pid}))  # not ours: skipped
    said: list[str] = []
    prefix = demo.claim_prefix(said.append, tmp_path)
    assert re.fullmatch(r"demo[0-9a-f]{4}", prefix) and prefix not in ("demoaaaa", "demobbbb")
    assert torn == ["demobbbb"]
    assert any(f"pid {os.getpid()}" in line and "left alone" in line for line in said), said
    assert any(f"killed demo (pid {dead.pid})" in line and "1 namespaces demobbbb-*" in line for line in said)
    assert json.loads((tmp_path / f"{prefix}.json").read_text()) == {"prefix": prefix, "pid": os.getpid()}
    assert not (tmp_path / "demobbbb.json").exists() and (tmp_path / "demoaaaa.json").exists()
