"""`meshrun demo` (the README's first command) runs green: the whole product in one command."""

from __future__ import annotations

import re
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


def test_demo_with_sites_runs_green():
    """`meshrun demo --sites`: two datacenters of two nodes, DDP inside each, DiLoCo across them."""
    res = subprocess.run(
        [sys.executable, "-m", "meshrun", "demo", "--sites"], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    out = res.stdout
    assert "meshrun join on dc1-a, dc1-b, dc2-a, dc2-b" in out
    assert len(set(re.findall(r"site=(dc\d) site_rank=\d/2 local=\d/2", out))) == 2, out[-4000:]
    assert "all 4 ranks ended with identical parameters" in out
    moved = {dc: float(mib) for dc, mib in re.findall(r"(dc\d): ([\d.]+) MiB left the datacenter", out)}
    assert set(moved) == {"dc1", "dc2"} and all(v > 0 for v in moved.values()), out[-3000:]
    assert "demo-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
