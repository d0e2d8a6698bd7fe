"""End-to-end: `meshrun bench --json` on a real 2-node mesh (+ coordinator) in NAT'd namespaces."""

from __future__ import annotations

import json
import time

from support import hang_guard


def test_bench_json_on_two_nodes(fresh_mesh):
    mesh = fresh_mesh(3, "dc1-a")
    for n in ("dc2-a", "dc3-a"):
        mesh.join(n)
    t0 = time.monotonic()
    res = mesh.meshrun(
        "dc1-a",
        "bench",
        "--json",
        "--sizes",
        "1M,2M",
        "--duration",
        "0.5",
        "--streams",
        "2",
        "--iters",
        "3",
        check=False,
        timeout=120,
    )
    took = time.monotonic() - t0
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(res.stdout)
    assert {n["name"] for n in data["nodes"]} == {"dc2-a", "dc3-a"}
    pairs = {(p["src"], p["dst"]): p for p in data["pairs"]}
    assert set(pairs) == {("dc2-a", "dc3-a"), ("dc3-a", "dc2-a")}
    for p in pairs.values():  # path: "direct ..." or "relayed" (just after joining, probing may not be done)
        assert p["mbit_s"] > 0 and p["rtt_ms"] > 0 and isinstance(p["path"], str) and p["path"] and "error" not in p
    rows = data["allreduce"]["results"]
    assert data["allreduce"]["backend"] == "gloo" and data["world_size"] == 2
    assert [r["size"] for r in rows] == [1 << 20, 2 << 20]
    assert all(r["busbw_GBps"] > 0 and r["correct"] for r in rows)
    assert data["best_busbw_GBps"] > 0 and data["flagged"] == []
    assert took < hang_guard(20), f"meshrun bench took {took:.0f} s"  # 8-15 s here
