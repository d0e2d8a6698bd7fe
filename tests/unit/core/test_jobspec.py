"""meshrun.core.jobspec: jobs as data (the spec, its launch options, states, records)."""

from __future__ import annotations

import pytest

from meshrun.core.jobspec import FINAL, JobRecord, JobSpec, JobState, ShareEnd, check_job_id
from meshrun.core.model import Network
from meshrun.errors import UsageError

NET = Network(
    name="lab",
    cidr="10.213.0.0/16",
    interface="meshrun0",
    listen_port=51820,
    mtu=1420,
    coordinator_ip="10.213.0.1",
    coordinator_public_key="c" * 43 + "=",
    endpoints=("203.0.113.1:51820",),
    fingerprint="0" * 64,
    api_port=51821,
)


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "x" * 65, "job id", "ü"])
def test_a_job_id_names_a_directory_safely(bad):
    with pytest.raises(UsageError) as exc:
        check_job_id(bad)
    assert repr(bad) in exc.value.message and "--job-id" in exc.value.fix


def test_a_spec_round_trips_and_bad_specs_are_refused():
    spec = JobSpec("exp7", "src/train.py", ["--lr", "0.1"], nnodes="2:4", project="charlm", env={"A": "1"})
    assert JobSpec.from_dict(spec.to_dict()) == spec
    assert JobSpec.from_dict({**spec.to_dict(), "from_a_newer_version": 1}) == spec  # unknown keys ignored
    bad_specs = [{"job_id": "..", "script": "t.py"}, {"job_id": "a", "script": ""}]
    for bad in [*bad_specs, {"job_id": "a", "script": "t.py", "nnodes": "x"}]:
        with pytest.raises((ValueError, UsageError)):
            JobSpec.from_dict(bad)
    with pytest.raises(ValueError, match="project"):
        JobSpec.from_dict({"job_id": "a", "script": "t.py", "project": "../etc"})
    with pytest.raises(ValueError):
        JobSpec.from_dict(["not", "an", "object"])


def test_launch_options_are_the_spec_on_this_network():
    spec = JobSpec("exp7", "src/train.py", ["--lr", "0.1"], nnodes="2", max_restarts=1, python="/opt/py/bin/python")
    shipped = spec.launch_options(NET, 29401, shipped=True)
    assert shipped.script == "train.py"  # the script's directory is the working directory
    assert (shipped.rdzv_host, shipped.rdzv_port, shipped.interface) == ("10.213.0.1", 29401, "meshrun0")
    assert (shipped.job_id, shipped.script_args, shipped.max_restarts) == ("exp7", ("--lr", "0.1"), 1)
    assert shipped.python == "/opt/py/bin/python"
    assert spec.launch_options(NET, 29401, shipped=False).script == "src/train.py"
    module = JobSpec("m", "pkg.train", module=True).launch_options(NET, 29401, shipped=True)
    assert module.script == "pkg.train" and module.module and module.python == "python3"
    assert not shipped.site_fabric
    assert JobSpec("f", "t.py", site_fabric=True).launch_options(NET, 29401, shipped=True).site_fabric


def test_bounds_and_elasticity():
    assert JobSpec("a", "t.py").bounds(5) == (5, 5)
    assert JobSpec("a", "t.py", nnodes="2:4").bounds(5) == (2, 4)
    assert JobSpec("a", "t.py", nnodes="2:4").elastic and not JobSpec("a", "t.py", nnodes="3").elastic


def test_states_records_and_share_ends():
    assert [s.final for s in JobState] == [False, False, True, True, True, True]
    assert set(FINAL) == {"succeeded", "failed", "cancelled", "lost"} and str(JobState.RUNNING) == "running"
    rec = JobRecord("exp7", state="running", started=100.0)
    assert rec.state is JobState.RUNNING and not rec.final and rec.duration(now=160.0) == 60.0
    again = JobRecord.from_dict(rec.to_dict())
    assert again == rec and rec.to_dict()["state"] == "running"
    with pytest.raises(ValueError):
        JobRecord("x", state="exploded")
    assert ShareEnd.from_dict({"code": 0}).ok
    assert not ShareEnd.from_dict({"code": 0, "cancelled": True}).ok
    assert not ShareEnd.from_dict({"code": None, "signal": "SIGKILL"}).ok


def test_a_preset_and_mixed_accelerators_reach_the_launch_options():
    from meshrun.core import presets

    choice = presets.decide("high", None, None, 3)
    spec = JobSpec("d", "t.py", compression="high", preset=choice.to_dict(), mixed_accelerators=True)
    assert JobSpec.from_dict(spec.to_dict()) == spec
    opts = spec.launch_options(NET, 29401, shipped=True)
    assert dict(opts.job_env) == presets.PRESETS["high"].env() and opts.mixed_accelerators
    plain = JobSpec("d", "t.py").launch_options(NET, 29401, shipped=True)
    assert plain.job_env == () and not plain.mixed_accelerators
    with pytest.raises(ValueError, match="compression 'max'"):
        JobSpec.from_dict({"job_id": "a", "script": "t.py", "compression": "max"})
    with pytest.raises((KeyError, TypeError, ValueError)):
        JobSpec.from_dict({"job_id": "a", "script": "t.py", "preset": {"asked": "auto", "preset": {"name": "x"}}})
