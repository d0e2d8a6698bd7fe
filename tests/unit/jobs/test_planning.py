"""A job's plan and shipped directory come from the job's own cwd, never the process's (no network, no root)."""

from __future__ import annotations

import pytest
from support import JOB_NETWORK as NET

from meshrun.core.jobspec import JobSpec
from meshrun.errors import UsageError
from meshrun.jobs import submission
from meshrun.jobs.planning import code_dir, plan

READY = [("n1", "10.213.0.2", {"gpus": 0, "python": "/opt/py/bin/python"})]


@pytest.fixture
def tree(tmp_path, monkeypatch):
    (tmp_path / "code" / "sub").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "code" / "sub" / "train.py").write_text("print(1)\n")
    monkeypatch.chdir(tmp_path / "elsewhere")
    return tmp_path


def test_shipped_script_runs_by_its_base_name_from_the_shipped_directory(tree):
    spec = JobSpec("j1", "sub/train.py", cwd=str(tree / "code"))
    assert code_dir(spec) == tree / "code" / "sub"
    (p,) = plan(spec, NET, READY, 29401)
    assert "train.py" in p.argv and "sub/train.py" not in p.argv
    assert p.argv[0] == "/opt/py/bin/python"  # the node agent's interpreter
    assert "--rdzv-endpoint" in p.argv and p.argv[p.argv.index("--rdzv-endpoint") + 1] == "10.213.0.1:29401"


def test_no_sync_keeps_the_path_as_given(tree):
    (p,) = plan(JobSpec("j1", "sub/train.py", cwd=str(tree / "code"), no_sync=True), NET, READY, 29401)
    assert "sub/train.py" in p.argv


def test_a_missing_script_is_named_with_the_jobs_directory(tree):
    with pytest.raises(UsageError, match=f"script 'nope.py' not found in {tree / 'code'}"):
        code_dir(JobSpec("j1", "nope.py", cwd=str(tree / "code")))
    assert code_dir(JobSpec("j1", "pkg.mod", cwd=str(tree / "code"), module=True)) == tree / "code"


@pytest.mark.parametrize(
    "site, user, expected", [("fra", {}, "fra"), ("", {}, None), ("fra", {"MESHRUN_SITE": "x"}, "x")]
)
def test_a_local_share_gets_the_site_its_node_joined_with_and_nothing_else(monkeypatch, site, user, expected):
    rec = {"name": "n1", "overlay_ip": "10.213.0.2", "site": site}
    monkeypatch.setattr(submission.member, "load", lambda state: (rec, NET))
    monkeypatch.setattr(submission.host, "visible_gpus", lambda: 0)
    p = submission.local_launch(None, JobSpec("j1", "train.py", nnodes="2", env=user))
    assert p.env.get("MESHRUN_SITE") == expected
    assert not {"MESHRUN_SITE_RANK", "MESHRUN_NUM_SITES", "MESHRUN_SITE_ADDR"} & set(p.env)
