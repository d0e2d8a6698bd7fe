"""End-to-end: examples/diloco_charlm.py trained with DiLoCo under `meshrun train` over the real mesh."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from meshrun.lab.testbed import Mesh

pytestmark = [pytest.mark.netns, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
FINAL = re.compile(r"^\[(dc\d-a) r0\] final val_loss=(\d+\.\d+) bytes_sent=(\d+) .*\bmode=diloco world_size=2 "
                   r"steps=20\b", re.M)


def test_diloco_charlm_trains_across_two_datacenters(world_factory):
    """Coordinator + 2 NAT'd nodes: `meshrun train` ships examples/, runs 2 DiLoCo workers, exits 0.

    rank 0's final line parses, its loss is finite and it sent pseudo-gradients (bytes_sent > 0);
    two syncs of fp16 pseudo-gradients go out, so bytes_sent is exactly 2 * 2 bytes * params.
    """
    t0 = time.monotonic()
    world = world_factory(3)
    mesh = Mesh(world, "dc1-a")
    mesh.init()
    for n in ("dc2-a", "dc3-a"):
        mesh.join(n)
    coord = mesh.coordinator
    # --state-dir goes before the script: `meshrun train` hands everything after the script to it,
    # so Mesh.meshrun (which appends --state-dir) cannot be used here.
    res = coord.run(mesh.python, "-m", "meshrun", "train", "--state-dir", str(mesh.state_dir(coord)),
                    "--timeout", "60", "diloco_charlm.py",
                    "--mode", "diloco", "--steps", "20", "--sync-every", "10", "--compression", "fp16",
                    "--hidden", "32", "--batch-size", "8", "--seq-len", "32", "--val-batches", "2",
                    "--threads", "1",
                    cwd=EXAMPLES, check=False, timeout=90)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    m = FINAL.search(res.stdout)
    assert m, f"no final line from rank 0 in:\n{res.stdout[-3000:]}"
    val_loss, sent = float(m.group(2)), int(m.group(3))
    assert 0 < val_loss < 10
    assert sent > 0
    params = int(re.search(r"\bparams=(\d+)", res.stdout).group(1))
    assert sent == 2 * 2 * params
    assert "finished on 2 node(s)" in res.stderr
    assert time.monotonic() - t0 < 90
