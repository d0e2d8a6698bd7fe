"""`meshrun demo` (the README's first command) runs green: the whole product in one command."""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import time

from support import hang_guard

from meshrun.lab.demo import DEMO_RUNS

OURS = re.compile(r"^demo[0-9a-f]{4}-", re.M)


def test_demo_runs_green():
    """And it first removes what a killed demo left (a namespace and the record of a pid that is gone)."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = "demo" + secrets.token_hex(2)
    DEMO_RUNS.mkdir(parents=True, exist_ok=True)
    (DEMO_RUNS / f"{stale}.json").write_text(json.dumps({"prefix": stale, "pid": dead.pid}))
    subprocess.run(["ip", "netns", "add", f"{stale}-inet"], check=True)
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "meshrun", "demo", "--nodes", "3"], capture_output=True, text=True, timeout=300
    )
    took = time.monotonic() - t0
    subprocess.run(["ip", "netns", "del", f"{stale}-inet"], capture_output=True)  # in case the demo did not
    assert f"removed what a killed demo (pid {dead.pid}) left behind: 1 namespaces {stale}-*" in res.stdout
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    out = res.stdout
    for step in range(1, 7):
        assert f"==> [{step}/6]" in out
    assert "Gloo's full-mesh connect failed" in out or "failed after" in out
    assert "all 3 ranks ended with identical parameters" in out
    assert out.rstrip().endswith("demo finished: one job trained across every datacenter")
    assert took < hang_guard(80)  # a hang, not a speed target (about 55 s here)
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not OURS.search(listing), listing
    assert not (DEMO_RUNS / f"{stale}.json").exists()


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
    assert not OURS.search(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout)
