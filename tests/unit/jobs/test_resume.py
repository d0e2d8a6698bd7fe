"""`meshrun train --resume JOB` (meshrun.jobs.submission.resumed): the new job continues JOB's run, a resume of a
resume the same run; a job without --resume is a run of its own (MESHRUN_RUN_ID, meshrun.core.launch)."""

from __future__ import annotations

import pytest

from meshrun.core.jobspec import JobSpec
from meshrun.errors import UsageError
from meshrun.jobs import submission
from meshrun.system.files import joblogs
from meshrun.system.files.statedir import StateDir


def submitted(state: StateDir, job_id: str, **kw) -> JobSpec:
    spec = JobSpec(job_id=job_id, script="train.py", cwd="/home/u/proj", project="proj", **kw)
    d = StateDir(joblogs.job_dir(state, job_id).path)
    d.path.mkdir(parents=True, exist_ok=True)
    d.write_json("spec.json", spec.to_dict())
    return spec


def test_a_resume_continues_the_run_of_the_job_it_names_and_a_resume_of_a_resume_the_same_run(tmp_path):
    state = StateDir(tmp_path)
    submitted(state, "train-1")
    fields, cwd = submission.resumed(state, "train-1")
    assert fields["run_id"] == "train-1" and fields["project"] == "proj" and str(cwd) == "/home/u/proj"
    submitted(state, "train-2", run_id=fields["run_id"])
    again, _ = submission.resumed(state, "train-2")
    assert again["run_id"] == "train-1"


def test_a_run_id_must_name_a_job(tmp_path):
    with pytest.raises((UsageError, ValueError), match="job id"):
        JobSpec.from_dict({"job_id": "j-1", "script": "t.py", "run_id": "../../etc"})
    with pytest.raises(UsageError, match="no job"):
        submission.resumed(StateDir(tmp_path), "never-ran")
