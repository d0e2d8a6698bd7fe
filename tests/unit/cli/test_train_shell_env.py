"""`meshrun train` and the caller's shell: its NCCL_/GLOO_/TORCH_ variables are said before the job starts, and an
interface pin left in a shell profile (NCCL_SOCKET_IFNAME=eth0) is refused with the fix unless asked for (fake
nodes behind meshrun.jobs.submission's seams; no network)."""

from __future__ import annotations

import os

import pytest
from support import JOB_NETWORK as NET
from typer.testing import CliRunner

from meshrun.cli import app
from meshrun.core import launch
from meshrun.core.preflight import EnvReport
from meshrun.jobs import submission


class FakeShare:
    def __init__(self, name: str, ip: str) -> None:
        self.name, self.overlay_ip = name, ip


@pytest.fixture
def invoke(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / "state").mkdir()
    report = EnvReport("gpu-a", python="/p", python_version="3.11.7", torch="2.13.0+cpu", gloo=True)
    monkeypatch.setattr(submission, "check", lambda state, spec: (NET, [FakeShare("gpu-a", "10.213.0.2")]))
    monkeypatch.setattr(submission, "ask_health", lambda s: {"gpus": 0, "python": "/p"})
    monkeypatch.setattr(submission.admin, "sites", lambda state: {})
    monkeypatch.setattr(submission, "check_environments", lambda *a: ([report], None))
    for k in [k for k in os.environ if k.startswith(launch.FORWARD_ENV_PREFIXES)]:
        monkeypatch.delenv(k)

    def run(*args: str, shell: dict[str, str] | None = None):
        env = {"MESHRUN_STATE_DIR": str(tmp_path / "state"), "MESHRUN_DEBUG": "", **(shell or {})}
        return CliRunner().invoke(app, ["train", "--dry-run", "--no-sync", "--job-id", "j-1", *args], env=env)

    return run


def command_of(res) -> str:
    return next(x for x in res.stdout.splitlines() if x.startswith("cd ") and "MESHRUN_NODE_NAME=gpu-a" in x)


def test_a_shell_interface_pin_is_refused_with_the_fix_and_nothing_starts(invoke):
    res = invoke("train.py", shell={"NCCL_SOCKET_IFNAME": "eth0"})
    assert res.exit_code == 2, res.output
    err = res.stderr.strip().splitlines()
    assert "NCCL_SOCKET_IFNAME=eth0" in err[0] and "unset NCCL_SOCKET_IFNAME" in res.stderr
    assert "--env NCCL_SOCKET_IFNAME=eth0" in res.stderr and not res.stdout.strip()


@pytest.mark.parametrize("how", ["--env", "--use-shell-ifname"])
def test_asked_for_on_purpose_the_pin_passes_and_is_said(invoke, how):
    args = ["--env", "GLOO_SOCKET_IFNAME=eth0"] if how == "--env" else ["--use-shell-ifname"]
    shell = {} if how == "--env" else {"GLOO_SOCKET_IFNAME": "eth0"}
    res = invoke(*args, "train.py", shell=shell)
    assert res.exit_code == 0, res.output
    assert "GLOO_SOCKET_IFNAME=eth0" in command_of(res)
    if how == "--use-shell-ifname":
        assert "from this shell, every worker gets GLOO_SOCKET_IFNAME=eth0" in res.stderr
        assert "overriding meshrun's GLOO_SOCKET_IFNAME" in res.stderr


def test_the_shells_other_variables_are_listed_before_the_job_starts(invoke):
    res = invoke("train.py", shell={"NCCL_DEBUG": "INFO", "NCCL_NET": "IB", "OMP_NUM_THREADS": "3"})
    assert res.exit_code == 0, res.output
    line = next(x for x in res.stderr.splitlines() if "from this shell" in x)
    assert "NCCL_DEBUG=INFO" in line and "NCCL_NET=IB" in line and "OMP_NUM_THREADS" not in line
    assert "overriding meshrun's NCCL_NET" in line
    assert "NCCL_NET=IB" in command_of(res)
    quiet = invoke("train.py")
    assert quiet.exit_code == 0 and "from this shell" not in quiet.stderr


def test_shell_env_sorts_what_the_shell_passes():
    shell = {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "INFO", "PATH": "/bin", "TORCH_X": "1"}
    r = launch.shell_env(shell, {})
    assert r.forwarded == {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "INFO", "TORCH_X": "1"}
    assert r.override == ("NCCL_SOCKET_IFNAME",) and r.refused == ("NCCL_SOCKET_IFNAME",)
    given = launch.shell_env(shell, {"NCCL_SOCKET_IFNAME": "eth1"})  # the job asks for it: not the shell's doing
    assert "NCCL_SOCKET_IFNAME" not in given.forwarded and given.refused == ()
    assert launch.shell_env(shell, {}, allow_pins=True).refused == ()
    assert launch.shell_env({"PATH": "/bin"}, {}).notice() == ""
