"""benchmarks/diloco_wan.py --smoke: DDP, no communication, SparseLoCo gathered and summed (sparse-shared) through
both phases of the fixed protocol, tuning on loopback and a measured round over meshrun, at a tiny size.

The numbers mean nothing at this size; what is checked is that the benchmark still runs against the current
meshrun and example script (the stdlib corpus, the transformer), that its result has what the generated tables
read (tuning records with their seeds and no test loss, held-out loss, blocked time, the baseline's noise
verdict), that the measured round used a seed no tuning run used, and that every DiLoCo variant's workers end on
the same model. The result goes to a temporary file, never to benchmarks/results/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support import REPO_ROOT


def test_diloco_wan_smoke_runs_every_variant_and_its_result_renders(tmp_path):
    out = tmp_path / "diloco.json"
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "benchmarks" / "diloco_wan.py"), "--smoke", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    report = json.loads(out.read_text())
    assert report["format"] == 3 and report["summary"] in proc.stdout and report["protocol"]["smoke"]
    assert report["environment"]["wireguard"]["sha256"], report["environment"]
    results = report["results"]
    expected = {"ddp", "local", "sparse_int2", "sparse_shared"}
    assert set(results) == expected and not [v for v, r in results.items() if "error" in r]
    # phase 1 chose every tuned variant's schedule on the tuning split, with the tuning seed, and kept no test loss
    tuning = report["tuning"]
    assert set(tuning["runs"]) == {"ddp", "sparse_int2", "sparse_shared"}
    for variant, runs in tuning["runs"].items():
        assert len(runs) == 2 and all("tune_loss" in r and "test_loss" not in r for r in runs)
        assert {r["seed"] for r in runs} == set(report["config"]["tune_seeds"])
        assert results[variant]["params"] == tuning["chosen"][variant]
    final = {r["seed"] for v in results.values() for r in v["rounds"]}
    assert final == set(report["config"]["final_seeds"]) and not final & set(report["config"]["tune_seeds"])
    for variant in ("sparse_int2", "sparse_shared"):
        r = results[variant]
        assert len(r["param_checksums"]) == 1, (variant, r["param_checksums"])  # both workers, one model
        assert r["blocked_share"] is not None and 0 <= r["blocked_share"] < 1 and r["test_loss"] > 0
        assert r["payload_bytes_per_worker"] < results["ddp"]["payload_bytes_per_worker"] / 20
    # one round: the baseline's spread is unknown, so no wall verdict, and the report says so
    assert report["baseline_noise"]["refused"] and "one round" in report["baseline_noise"]["why"]
    assert "NO WALL VERDICT" in proc.stdout
    comps = report["comparison"]
    assert set(comps) == expected - {"ddp", "local"}
    assert all(c["targets"]["wall"]["met"] is None and c["targets"]["bytes"]["met"] is not None for c in comps.values())
    # the generated tables read it
    sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    try:
        import readme_figures
    finally:
        sys.path.remove(str(REPO_ROOT / "benchmarks"))
    table = readme_figures.diloco_table(report)
    assert all(f"| {v} |" in table for v in comps) and "held-out loss vs DDP" in table
