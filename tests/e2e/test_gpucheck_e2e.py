"""`./dev.sh gpu-check`'s check on a machine without GPUs: the same world, groups and checks on gloo, and it
says that NCCL was not exercised (on a GPU machine it runs NCCL; see the module). Its bandwidth table runs on
gloo too: the raw site LAN and meshrun0, same site and across sites, written as JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from meshrun.lab.gpucheck import gpu_count


def test_the_gpu_check_runs_every_group_and_says_when_nccl_was_not_exercised(tmp_path):
    if gpu_count() >= 1:
        pytest.skip("a GPU machine: run ./dev.sh gpu-check there and read NCCL's lines")
    table = tmp_path / "gpu_datapath.json"
    res = subprocess.run(
        [sys.executable, "-m", "meshrun.lab.gpucheck", "--out", str(table)]
        + ["--wan-rtt-ms", "60", "--wan-loss-pct", "0.1", "--wan-mib", "4", "--wan-budget-s", "0"],
        capture_output=True,
        text=True,
        timeout=500,
    )
    out = res.stdout
    assert res.returncode == 0, out[-4000:] + res.stderr[-2000:]
    assert "NCCL is NOT exercised" in out
    for group in ("world group", "site group", "cross-site groups"):
        assert out.count(f"{group}: ok") == 4, out  # two sites of two nodes: every rank says so
    assert out.count("site=s1") == 2 and out.count("site=s2") == 2
    assert out.count("cuda_at_start=False") == 4  # warm workers: torch imported before the fork, CUDA not
    assert out.rstrip().endswith("gpu-check passed")
    # The table's path: the pair on the site network with meshrun off the data path, and on meshrun0.
    data = json.loads(table.read_text())
    cells = data["cells"]
    assert set(cells) == {
        "lan same-site default",
        "meshrun0 same-site default",
        "meshrun0 cross-site default",
        "lanpath same-site default",  # site s2, trusted right after the joins: its pair on the site LAN path
        "wan cross-site default",  # then the cross-site pair again, its public path a 60 ms RTT, 0.1% loss WAN
    }, out[-3000:]
    # The WAN was there while the job ran (the overlay's round trip grew by the delay; the delay line queued the
    # pair's datagrams and dropped some), and gone after it.
    wan = data["wan"]
    assert wan["overlay_rtt_ms_with_wan"] - wan["overlay_rtt_ms_before"] >= 55, wan
    assert wan["delay_line"]["packets"] > 1000 and wan["delay_line"]["dropped"] >= 1, wan
    assert "site s2 trusted: s2-a-s2-b on the site LAN path" in out
    assert all(c["n"] >= 1 and c["min"] > 0 for c in cells.values()), cells
    for name in cells:
        assert f"\n{name} " in out
    assert "/sys/class/net/meshrun0/speed in a node:" in out
    assert "gpuchk-" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
