"""`meshrun service install`: the systemd unit meshrun renders, writes and enables (meshrun.mesh.systemd)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from support import REPO_ROOT
from typer.testing import CliRunner

from meshrun.cli import app
from meshrun.mesh import systemd
from meshrun.system.files.statedir import StateDir

REPO = REPO_ROOT


def _coordinator_state(path: Path) -> StateDir:
    sd = StateDir(path)
    sd.create()
    sd.write_json("member.json", {"role": "coordinator", "name": "coordinator"})
    return sd


def test_service_dry_run_changes_nothing(tmp_path):
    sd = _coordinator_state(tmp_path / "state")
    units = tmp_path / "units"
    res = CliRunner().invoke(
        app,
        ["service", "install", "--dry-run", "--unit-dir", str(units), "--state-dir", str(sd.path)],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    assert not units.exists()
    assert f"would write {units / 'meshrun-coordinator.service'}" in res.output
    assert f"up --foreground --state-dir {sd.path}" in res.output
    assert "systemctl daemon-reload && systemctl enable --now meshrun-coordinator.service" in res.output


def test_service_install_writes_unit_and_prints_commands_without_systemd(tmp_path):
    sd = StateDir(tmp_path / "node")
    sd.create()
    sd.write_json("member.json", {"role": "node", "name": "gpu-a"})
    units = tmp_path / "units"
    res = CliRunner().invoke(
        app, ["service", "install", "--unit-dir", str(units), "--state-dir", str(sd.path)], catch_exceptions=False
    )
    assert res.exit_code == 0, res.output
    unit = units / "meshrun-agent.service"
    text = unit.read_text()
    assert oct(unit.stat().st_mode & 0o777) == "0o644"
    exec_start = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    assert exec_start.endswith(f"up --foreground --state-dir {sd.path}")
    assert "Restart=on-failure" in text and "WantedBy=multi-user.target" in text
    assert "systemctl enable --now meshrun-agent.service" in res.output  # not run: not a systemd unit dir


def test_service_install_runs_systemctl_when_systemd_runs(tmp_path, monkeypatch):
    sd = _coordinator_state(tmp_path / "state")
    monkeypatch.setattr(systemd, "SYSTEMD_UNIT_DIRS", (tmp_path / "units",))
    monkeypatch.setattr(systemd.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(systemd.os, "geteuid", lambda: 0)
    plan = systemd.plan_install(sd, unit_dir=tmp_path / "units", command=["/usr/bin/meshrun"], systemd=True)
    ran, said = [], []
    systemd.install(
        plan,
        sd,
        said.append,
        runner=lambda argv, **kw: ran.append(argv) or subprocess.CompletedProcess(argv, 0, "", ""),
    )
    assert ran == [["systemctl", "daemon-reload"], ["systemctl", "enable", "--now", "meshrun-coordinator.service"]]
    assert (tmp_path / "units" / "meshrun-coordinator.service").read_text() == plan.text


def test_service_role_checks(tmp_path):
    sd = _coordinator_state(tmp_path / "state")
    runner = CliRunner()
    res = runner.invoke(app, ["service", "install", "--dry-run", "--role", "agent", "--state-dir", str(sd.path)])
    assert res.exit_code != 0 and "holds a coordinator, not a node" in res.output
    empty = tmp_path / "empty"
    res = runner.invoke(app, ["service", "install", "--dry-run", "--state-dir", str(empty)])
    assert res.exit_code != 0 and "--role" in res.output
    res = runner.invoke(app, ["service", "install", "--dry-run", "--role", "agent", "--state-dir", str(empty)])
    assert res.exit_code == 0 and "meshrun-agent.service" in res.output
    res = runner.invoke(app, ["service", "install", "--dry-run", "--role", "bogus", "--state-dir", str(empty)])
    assert res.exit_code != 0 and "bogus" in res.output


@pytest.mark.parametrize("role", systemd.ROLES)
def test_shipped_unit_templates_match_the_renderer(role):
    shipped = (REPO / "configs" / "systemd" / f"meshrun-{role}.service").read_text()
    assert shipped == systemd.render_unit(role, "/var/lib/meshrun", ["/usr/local/bin/meshrun"])
