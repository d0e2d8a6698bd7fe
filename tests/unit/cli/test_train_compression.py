"""`meshrun train --compression` and `--mixed-accelerators` on the command line: the choice is printed with its
reason, reaches every node's environment, and `auto` reads the latest `meshrun bench` result the coordinator kept
(fake nodes behind meshrun.jobs.submission's seams; no network)."""

from __future__ import annotations

import json

import pytest
from support import JOB_NETWORK as NET
from typer.testing import CliRunner

from meshrun.cli import app
from meshrun.core import presets
from meshrun.core.jobspec import JobSpec
from meshrun.core.preflight import EnvReport
from meshrun.jobs import submission
from meshrun.system.files.statedir import StateDir


class FakeShare:
    def __init__(self, name: str, ip: str) -> None:
        self.name, self.overlay_ip = name, ip


SHARES = [FakeShare("gpu-a", "10.213.0.2"), FakeShare("cpu-b", "10.213.0.3")]
BENCH = {
    "sites": {"eu": ["gpu-a"], "us": ["cpu-b"]},
    "pairs": [{"src": "gpu-a", "dst": "cpu-b", "mbit_s": 200.0}, {"src": "cpu-b", "dst": "gpu-a", "mbit_s": 190.0}],
    "best_busbw_GBps": None,
    "measured_at": 1_700_000_000.0,
}


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / "state").mkdir()
    reports = [
        EnvReport("gpu-a", python="/p", python_version="3.11.7", torch="2.13.0+cu128", cuda="12.8", gloo=True),
        EnvReport("cpu-b", python="/p", python_version="3.11.7", torch="2.13.0+cpu", gloo=True),
    ]
    monkeypatch.setattr(submission, "check", lambda state, spec: (NET, SHARES))
    monkeypatch.setattr(submission, "ask_health", lambda s: {"gpus": 0, "python": "/p"})
    monkeypatch.setattr(submission.admin, "sites", lambda state: {})
    monkeypatch.setattr(submission, "check_environments", lambda *a: (reports, None))

    def invoke(*args: str):
        env = {"MESHRUN_STATE_DIR": str(tmp_path / "state"), "MESHRUN_DEBUG": ""}
        return CliRunner().invoke(app, ["train", "--dry-run", "--no-sync", "--job-id", "j-1", *args], env=env)

    return invoke, StateDir(tmp_path / "state")


def test_auto_without_a_bench_result_says_so_and_takes_medium(run):
    invoke, _ = run
    res = invoke("--compression", "auto", "--model-size", "350M", "train.py")
    assert res.exit_code == 0, res.output
    assert "# compression auto -> medium: DiLoCo H=50, 2 fragments, fp4 (no `meshrun bench` result" in res.stdout
    for node in ("gpu-a", "cpu-b"):  # every node's command carries the preset
        line = next(x for x in res.stdout.splitlines() if x.startswith("cd ") and f"MESHRUN_NODE_NAME={node}" in x)
        assert "MESHRUN_DILOCO_COMPRESSION=fp4" in line and "MESHRUN_DILOCO_SYNC_EVERY=50" in line


def test_auto_chooses_from_the_latest_bench_result_and_the_model_size(run):
    invoke, state = run
    state.write_json(submission.BENCH_RESULT, BENCH)
    small = invoke("--compression", "auto", "--model-size", "10M", "train.py")
    assert small.exit_code == 0, small.output
    assert "# compression auto -> low: DiLoCo H=50, bf16 (slowest cross-site pair cpu-b -> gpu-a 190 Mbit/s" in (
        small.stdout
    )
    assert "10M parameters, 2 workers" in small.stdout and "MESHRUN_DILOCO_COMPRESSION=bf16" in small.stdout
    big = invoke("--compression", "auto", "--model-size", "1.3B", "train.py")
    assert "# compression auto -> high: DiLoCo H=20, sparse-int2" in big.stdout
    assert "MESHRUN_DILOCO_DENSITY=0.015625" in big.stdout


def test_a_level_by_name_and_the_user_s_env_over_it(run):
    invoke, _ = run
    res = invoke("--compression", "low", "--env", "MESHRUN_DILOCO_SYNC_EVERY=10", "train.py")
    assert "# compression low: DiLoCo H=50, bf16 (asked for;" in res.stdout
    assert "MESHRUN_DILOCO_SYNC_EVERY=10" in res.stdout and "MESHRUN_DILOCO_SYNC_EVERY=50" not in res.stdout
    bad = invoke("--compression", "max", "train.py")
    assert bad.exit_code == 2 and "--compression 'max' is not a preset" in bad.output


def test_the_pre_flight_blocks_a_mixed_job_unless_it_is_declared(run):
    invoke, _ = run
    plain = invoke("train.py")
    # two nodes: the first one's build is taken as the usual one
    assert "#   BLOCK cpu-b: a CPU build of torch where the others have CUDA" in plain.stdout
    assert "declare it with --mixed-accelerators" in plain.stdout
    assert "MESHRUN_MIXED_ACCELERATORS" not in plain.stdout
    mixed = invoke("--mixed-accelerators", "train.py")
    assert "BLOCK" not in mixed.stdout and "#   warn  cpu-b: a CPU build of torch where the others" in mixed.stdout
    assert mixed.stdout.count("MESHRUN_MIXED_ACCELERATORS=1") == 2


def test_an_unreadable_bench_result_counts_as_none(tmp_path):
    state = StateDir(tmp_path)
    (tmp_path / submission.BENCH_RESULT).write_text("{not json")
    spec = JobSpec("j", "t.py", compression="auto", model_size=10**9)
    choice = submission.choose_compression(state, spec, 3)
    assert choice is not None and choice.preset == presets.PRESETS["medium"] and "no `meshrun bench`" in choice.reason
    assert spec.preset == choice.to_dict()
    (tmp_path / submission.BENCH_RESULT).write_text(json.dumps(BENCH))
    assert submission.choose_compression(state, spec, 3).preset == presets.PRESETS["high"]
    spec.compression = None
    assert submission.choose_compression(state, spec, 3) is None and spec.preset is None
