"""Train's launch planning (pure: no network, no root)."""

from __future__ import annotations

from pathlib import Path

from meshrun.core.model import Member, Network
from meshrun.jobs.runner import Console, Train, TrainRequest

NET = Network(name="t", cidr="10.213.0.0/16", interface="meshrun0", listen_port=51820, mtu=1420,
              coordinator_ip="10.213.0.1", coordinator_public_key="A" * 43 + "=", endpoints=("192.0.2.1:51820",),
              fingerprint="0" * 64)
MEMBERS = [Member("coord", "C" * 43 + "=", "10.213.0.1", is_coordinator=True),
           Member("n1", "B" * 43 + "=", "10.213.0.2")]


def plan_script(tmp_path: Path, monkeypatch, script: str, **kw) -> list[str]:
    monkeypatch.chdir(tmp_path / "elsewhere")
    train = Train(NET, MEMBERS, TrainRequest(script=script, **kw), Console(), cwd=tmp_path / "code")
    (plan,) = train.plan([(MEMBERS[1], {"gpus": 0, "python": "python3"})])
    return list(plan.argv)


def test_shipped_script_is_resolved_against_the_job_cwd_not_the_process_cwd(tmp_path, monkeypatch):
    (tmp_path / "code" / "sub").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "code" / "sub" / "train.py").write_text("print(1)\n")
    argv = plan_script(tmp_path, monkeypatch, "sub/train.py")
    # The code directory is shipped as the job's working directory: the script runs by its base name.
    assert "train.py" in argv and "sub/train.py" not in argv


def test_no_sync_keeps_the_path_as_given(tmp_path, monkeypatch):
    (tmp_path / "code" / "sub").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "code" / "sub" / "train.py").write_text("print(1)\n")
    assert "sub/train.py" in plan_script(tmp_path, monkeypatch, "sub/train.py", no_sync=True)
