"""Job files (`meshrun train --config`): parsing, errors naming the bad key, command line precedence."""

from __future__ import annotations

import pytest
from support import REPO_ROOT

from meshrun.core import jobconfig
from meshrun.core.jobspec import JobSpec
from meshrun.errors import UsageError
from meshrun.jobs.submission import job_spec
from meshrun.system.files.statedir import read_user_file

EXAMPLE = REPO_ROOT / "configs" / "job.example.toml"
NOTHING = {
    "script": None,
    "script_args": None,
    "nnodes": None,
    "nproc_per_node": None,
    "max_restarts": None,
    "nodes": None,
    "wait_timeout": None,
    "rdzv_timeout": None,
    "module": False,
    "no_sync": False,
    "sync_limit_mb": None,
    "dry_run": False,
    "env": {},
    "job_id": None,
    "python": None,
}


def test_the_shipped_example_loads_into_a_job_spec(tmp_path):
    (tmp_path / "examples").mkdir()
    req = job_spec(jobconfig.merge(jobconfig.parse(EXAMPLE.read_text()), NOTHING), tmp_path)
    assert req.script == "examples/ddp_train.py"
    assert req.script_args == ["--epochs", "5", "--steps-per-epoch", "50"]
    assert (req.nnodes, req.nproc_per_node, req.max_restarts, req.rdzv_timeout) == ("2", 1, 1, 900)
    assert req.env == {"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "4"}
    assert req.module is False and req.python is None  # the agent's own interpreter


def test_every_key_maps_to_a_job_spec_field():
    fields = set(JobSpec.__dataclass_fields__)
    assert {field for field, *_ in jobconfig.KEYS.values()} <= fields


def test_command_line_wins_and_env_merges():
    got = jobconfig.merge(
        jobconfig.parse('script = "a.py"\nargs = ["--x"]\nnnodes = 3\nmax_restarts = 2\n[env]\nA = "1"\nB = 2\n'),
        dict(NOTHING, nnodes="2:4", env={"B": "9"}, no_sync=True),
    )
    assert got["nnodes"] == "2:4" and got["max_restarts"] == 2
    assert got["env"] == {"A": "1", "B": "9"}
    assert got["script"] == "a.py" and got["script_args"] == ["--x"] and got["no_sync"] is True


def test_site_fabric_from_the_job_file_or_the_command_line_reaches_the_launch_options(tmp_path):
    from_file = jobconfig.merge(jobconfig.parse('script = "a.py"\nsite_fabric = true\n'), NOTHING)
    from_cli = jobconfig.merge(jobconfig.parse('script = "a.py"\n'), dict(NOTHING, site_fabric=True))
    neither = jobconfig.merge(jobconfig.parse('script = "a.py"\n'), dict(NOTHING, site_fabric=False))
    assert from_file["site_fabric"] is True and from_cli["site_fabric"] is True and neither["site_fabric"] is False
    spec = job_spec(from_file, tmp_path)
    assert spec.site_fabric and JobSpec.from_dict(spec.to_dict()).site_fabric
    with pytest.raises(UsageError, match="site_fabric = 'yes' must be true or false"):
        jobconfig.parse('site_fabric = "yes"')


def test_a_script_on_the_command_line_brings_its_own_args():
    got = jobconfig.merge(
        jobconfig.parse('script = "a.py"\nargs = ["--x"]\n'), dict(NOTHING, script="b.py", script_args=[])
    )
    assert got["script"] == "b.py" and got["script_args"] == []


@pytest.mark.parametrize(
    "text, words",
    [
        ("epochs = 3", ["unknown key 'epochs'", "use one of"]),
        ("nnodes = true", ["nnodes = true must be", 'nnodes = "2:4"']),
        ('max_restarts = "1"', ["max_restarts = '1' must be an integer"]),
        ('args = "--epochs 3"', ["args = '--epochs 3' must be a list of strings"]),
        ("timeout = 0", ["timeout = 0 must be a positive number"]),
        ("[env]\nA = true", ["env = {'A': True} must be a table"]),
        ('script = "a', ["is not valid TOML", "fix the syntax"]),
    ],
)
def test_bad_job_files_name_the_key_and_the_fix(text, words):
    with pytest.raises(UsageError) as exc:
        jobconfig.parse(text)
    msg = f"{exc.value.message}; {exc.value.fix}"
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_missing_file_and_missing_script(tmp_path):
    with pytest.raises(UsageError, match="job file '.*nope.toml' not found; check the path given to --config"):
        read_user_file(tmp_path / "nope.toml", "job file", "--config")
    with pytest.raises(UsageError, match="no training script given"):
        jobconfig.merge({}, NOTHING)
    with pytest.raises(UsageError, match="unknown option '--bogus'"):
        jobconfig.merge({}, dict(NOTHING, script="--bogus"))


def test_compression_model_size_and_mixed_accelerators_from_the_job_file(tmp_path):
    text = 'script = "a.py"\ncompression = "auto"\nmodel_size = "1.3B"\nstep_time = 0.8\nmixed_accelerators = true\n'
    got = jobconfig.merge(jobconfig.parse(text), NOTHING)
    assert (got["compression"], got["model_size"], got["step_time"]) == ("auto", 1_300_000_000, 0.8)
    spec = job_spec(got, tmp_path)
    assert spec.mixed_accelerators and spec.model_size == 1_300_000_000
    assert JobSpec.from_dict(spec.to_dict()) == spec
    cli = jobconfig.merge(jobconfig.parse(text), dict(NOTHING, compression="low", model_size="350M"))
    assert job_spec(cli, tmp_path).compression == "low" and job_spec(cli, tmp_path).model_size == 350_000_000


@pytest.mark.parametrize(
    "text, words",
    [
        ('compression = "max"', "compression = 'max' must be one of 'auto', 'none', 'low', 'medium', 'high'"),
        ("model_size = -3", "model_size = -3 must be a parameter count"),
        ('model_size = "lots"', "--model-size 'lots' is not a parameter count"),
        ("step_time = 0", "step_time = 0 must be a positive number"),
        ('mixed_accelerators = "yes"', "mixed_accelerators = 'yes' must be true or false"),
    ],
)
def test_bad_compression_keys_name_the_value(text, words):
    with pytest.raises(UsageError) as exc:
        jobconfig.parse(text)
    assert words in exc.value.message and exc.value.fix


def test_a_bad_compression_on_the_command_line_is_refused(tmp_path):
    with pytest.raises(UsageError, match="--compression 'max' is not a preset"):
        job_spec(dict(NOTHING, script="a.py", compression="max"), tmp_path)
    with pytest.raises(UsageError, match="--step-time -1"):
        job_spec(dict(NOTHING, script="a.py", step_time=-1), tmp_path)


def test_the_worker_kind_from_the_job_file_or_the_command_line_reaches_the_launch_options(tmp_path):
    """`workers` (`--workers`): warm unless asked; cold travels through the spec to every agent's command."""
    default = job_spec(jobconfig.merge(jobconfig.parse('script = "a.py"\n'), NOTHING), tmp_path)
    assert default.workers == "warm"
    spec = job_spec(jobconfig.merge(jobconfig.parse('script = "a.py"\nworkers = "cold"\n'), NOTHING), tmp_path)
    assert spec.workers == "cold" and JobSpec.from_dict(spec.to_dict()) == spec
    assert job_spec(jobconfig.merge({}, dict(NOTHING, script="a.py", workers="cold")), tmp_path).workers == "cold"
    with pytest.raises(UsageError, match="workers = 'lukewarm' must be one of 'warm', 'cold'"):
        jobconfig.parse('workers = "lukewarm"')
    with pytest.raises(UsageError, match="--workers 'lukewarm' is not one of warm, cold"):
        job_spec(dict(NOTHING, script="a.py", workers="lukewarm"), tmp_path)
    with pytest.raises(ValueError, match="workers 'lukewarm' is not one of warm, cold"):
        JobSpec.from_dict({**spec.to_dict(), "workers": "lukewarm"})
