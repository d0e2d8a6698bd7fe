"""What `meshrun train --dry-run` and `meshrun pull` print of what nodes said: nothing that could rewrite the
operator's terminal (fake nodes behind meshrun.jobs.submission's and meshrun.jobs.outputs' seams; no network)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import JOB_NETWORK as NET
from typer.testing import CliRunner

from meshrun.cli import app
from meshrun.core.preflight import EnvReport
from meshrun.jobs import outputs, submission

# A node that clears the screen, sets the window title and moves the cursor to forge a line of its own.
EVIL = "\x1b[2J\x1b]0;pwned\x07\x1b[1A\rforged"


class FakeShare:
    name, overlay_ip = "gpu-a", "10.213.0.2"


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print(1)\n")

    def invoke(*args: str):
        env = {"MESHRUN_STATE_DIR": str(tmp_path / "state"), "MESHRUN_DEBUG": ""}
        return CliRunner().invoke(app, list(args), env=env, catch_exceptions=False)

    return invoke


def test_the_dry_run_cleans_what_nodes_report(run, monkeypatch):
    report = EnvReport(
        "gpu-a",
        python=f"/opt/py{EVIL}/bin/python",
        python_version=f"3.11.7{EVIL}",
        torch=f"2.12.0+cpu{EVIL}",
        gloo=True,
        gpus=1,
        gpu_names=[f"NVIDIA H100{EVIL}"],
        code_hash="c0de",
        code_files={f"train{EVIL}.py": "aa" * 32},
    )
    monkeypatch.setattr(submission, "check", lambda state, spec: (NET, [FakeShare()]))
    monkeypatch.setattr(submission, "ask_health", lambda s: {"gpus": 1, "python": f"/opt/py{EVIL}/bin/python"})
    monkeypatch.setattr(submission.admin, "sites", lambda state: {})
    monkeypatch.setattr(
        submission,
        "check_environments",
        lambda spec, shares, healths, job_id, project: ([report], {"train.py": "bb" * 32}),
    )
    res = run("train", "--dry-run", "--no-sync", "--job-id", "j-1", "train.py")
    assert res.exit_code == 0, res.output
    assert "\x1b" not in res.stdout and "\x07" not in res.stdout and "\r" not in res.stdout
    assert "pwned" not in res.stdout and "forged" in res.stdout  # the sequences go, with an OSC's payload
    assert (
        "BLOCK gpu-a: its copy of the code differs from the coordinator's: trainforged.py (extra), train.py (missing)"
        in res.stdout
    )
    assert "#   gpu-a  3.11.7forged  2.12.0+cpuforged  CPU    -     1 NVIDIA H100forged  ?     c0de  ?" in res.stdout
    assert "/opt/pyforged/bin/python" in res.stdout  # the interpreter a node reported, cleaned


def test_pull_cleans_a_node_s_error_and_puts_files_under_meshrun_pulled(run, monkeypatch):
    asked = {}

    def pull(state, job, path, dest, node=None, max_mb=1024):
        asked["dest"] = dest
        return [
            outputs.Pulled("gpu-a", outputs.default_dest(job) / "gpu-a", 2),
            outputs.Pulled("gpu-b", error=f"checkpoints does not exist{EVIL}"),
        ]

    monkeypatch.setattr(outputs, "pull", pull)
    res = run("pull", "j-1", "checkpoints")
    assert res.exit_code == 1
    assert asked["dest"] is None  # outputs.default_dest decides: ./meshrun-pulled/JOB
    assert res.stdout == f"gpu-a: 2 file(s) in {Path('meshrun-pulled/j-1/gpu-a')}\n"
    assert res.stderr == "gpu-b: checkpoints does not existforged\n"
