"""meshrun.jobs.outputs: where `meshrun pull` puts what it fetches, and what `meshrun jobs --prune` deletes
(fake shares behind `_shares`, a real state directory; no network, no root)."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshrun.core.jobspec import JobRecord, JobState
from meshrun.errors import LaunchError, UsageError
from meshrun.jobs import outputs
from meshrun.system.files import archive, joblogs
from meshrun.system.files.statedir import StateDir


class FakeShare:
    """A job's share on one node: its working directory here, pruned or not."""

    def __init__(self, name: str, work: Path, refuse: str = "") -> None:
        self.name, self.work, self.refuse = name, work, refuse
        self.pruned: list[str] = []

    def pull(self, job_id: str, path: str, max_bytes: int) -> bytes:
        return archive.pack_paths(self.work, path, max_bytes)[0]

    def prune(self, job_id: str) -> None:
        if self.refuse:
            raise LaunchError(self.refuse, "try later")
        self.pruned.append(job_id)


@pytest.fixture
def world(tmp_path, monkeypatch):
    """Two nodes whose working directories hold rank 0's checkpoint only on gpu-a; jobs given by `records`."""
    state = StateDir(tmp_path / "state")
    shares = {}
    for name in ("gpu-a", "gpu-b"):
        work = tmp_path / "nodes" / name
        (work / "checkpoints").mkdir(parents=True)
        shares[name] = FakeShare(name, work)
    (shares["gpu-a"].work / "checkpoints" / "last.pt").write_bytes(b"rank 0's weights")
    records: dict[str, JobRecord] = {}
    monkeypatch.setattr(outputs.control, "record", lambda _state, job_id: records[job_id])
    monkeypatch.setattr(outputs.control, "list_jobs", lambda _state: list(records.values()))
    monkeypatch.setattr(outputs, "_shares", lambda _state, _job, names: [shares[n] for n in names if n in shares])
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    return state, shares, records, project


def test_pull_puts_files_under_meshrun_pulled_job_node_by_default(world):
    state, _, records, project = world
    records["job-1"] = JobRecord("job-1", JobState.SUCCEEDED, nodes=["gpu-a", "gpu-b"])
    got = {r.node: r for r in outputs.pull(state, "job-1", "checkpoints/last.pt")}
    assert outputs.default_dest("job-1") == Path("meshrun-pulled/job-1")
    assert got["gpu-a"].dest == Path("meshrun-pulled/job-1/gpu-a") and got["gpu-a"].files == 1
    pulled = project / "meshrun-pulled" / "job-1" / "gpu-a" / "checkpoints" / "last.pt"
    assert pulled.read_bytes() == b"rank 0's weights"
    # rank 0 saved it on its node only: the other node says so, and nothing lands in the project itself
    assert "does not exist" in got["gpu-b"].error and got["gpu-b"].dest is None
    assert sorted(p.name for p in project.iterdir()) == ["meshrun-pulled"]
    # ... which the next job of the project does not ship
    assert archive.select_files(project, use_git=False).names == []


def test_pull_from_one_node_into_a_given_directory(world, tmp_path):
    state, _, records, _ = world
    records["job-1"] = JobRecord("job-1", JobState.SUCCEEDED, nodes=["gpu-a", "gpu-b"])
    (got,) = outputs.pull(state, "job-1", "checkpoints", tmp_path / "results", node="gpu-a")
    assert (got.node, got.files, got.error) == ("gpu-a", 1, "")
    assert (tmp_path / "results" / "gpu-a" / "checkpoints" / "last.pt").is_file()
    with pytest.raises(UsageError, match="node 'gpu-c' did not run job job-1; its nodes were: gpu-a, gpu-b"):
        outputs.pull(state, "job-1", "checkpoints", node="gpu-c")


def test_prune_deletes_finished_jobs_everywhere_and_keeps_one_a_node_could_not_prune(world):
    state, shares, records, _ = world
    records["done"] = JobRecord("done", JobState.SUCCEEDED, nodes=["gpu-a", "gpu-b"])
    records["running"] = JobRecord("running", JobState.RUNNING, nodes=["gpu-a"])
    records["stuck"] = JobRecord("stuck", JobState.FAILED, nodes=["gpu-b"])
    for job_id in records:
        joblogs.job_dir(state, job_id, create=True)
    shares["gpu-b"].refuse = "gpu-b does not answer"
    said: list[str] = []
    assert outputs.prune(state, said.append) == []  # gpu-b is down: nothing it ran is pruned
    assert said == [
        "kept done: could not prune it on gpu-b (gpu-b does not answer)",
        "kept stuck: could not prune it on gpu-b (gpu-b does not answer)",
    ]
    assert sorted(joblogs.job_ids(state)) == ["done", "running", "stuck"]
    shares["gpu-b"].refuse = ""
    assert sorted(outputs.prune(state, said.append)) == ["done", "stuck"]
    assert joblogs.job_ids(state) == ["running"]  # a running job is never pruned
    assert shares["gpu-a"].pruned == ["done", "done"] and shares["gpu-b"].pruned == ["done", "stuck"]
