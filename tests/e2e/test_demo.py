"""`meshrun demo` (the README's first command) runs green: the whole product in one command."""

from __future__ import annotations

import subprocess
import sys
import time


def test_demo_runs_green():
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "meshrun", "demo", "--nodes", "3"], capture_output=True, text=True, timeout=300
    )
    took = time.monotonic() - t0
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    out = res.stdout
    for step in range(1, 7):
        assert f"==> [{step}/6]" in out
    assert "Gloo's full-mesh connect failed" in out or "failed after" in out
    assert "all 3 ranks ended with identical parameters" in out
    assert out.rstrip().endswith("demo finished: one job trained across every datacenter")
    assert took < 180
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "demo-" not in listing
