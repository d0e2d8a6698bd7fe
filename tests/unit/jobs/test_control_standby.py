"""A coordinator's job control with several coordinators: which replicated jobs get a standby supervisor here.

The standby pass runs in the daemon's watch thread while its admin socket may be starting a job: the job is in
etcd before its own supervisor holds the job's lock, and a standby started in that gap could take the lock first
(the submission then failed with "job ...'s supervisor already runs").
"""

from __future__ import annotations

import threading

import pytest

from meshrun.core.jobspec import JobRecord
from meshrun.jobs.control import JobControl
from meshrun.system.control.etcdjobs import JobReplica
from meshrun.system.control.fakeetcd import FakeEtcd
from meshrun.system.files import joblogs
from meshrun.system.files.statedir import StateDir
from meshrun.system.machine import procs


@pytest.fixture
def control(tmp_path):
    """The standby side of coordinator b's job control over an in-memory etcd (no admin socket, no thread)."""
    state = StateDir(tmp_path / "state")
    state.create()
    c = JobControl.__new__(JobControl)
    c.state, c.rec, c.client = state, {"name": "b"}, FakeEtcd()
    c.settled, c.starting, c.starting_lock = set(), set(), threading.Lock()
    return c


def submitted(control: JobControl, job_id: str) -> None:
    """What `start` does first: the job into etcd, as this coordinator's."""
    JobReplica(control.client, job_id, "b").create({"job_id": job_id}, JobRecord(job_id))


def test_a_job_this_coordinator_is_starting_gets_no_standby_here(control):
    control.starting.add("j1")
    submitted(control, "j1")
    control._stand_by()
    assert not (joblogs.job_dir(control.state, "j1") / "spec.json").exists()


def test_a_job_whose_supervisor_holds_its_lock_here_gets_no_standby(control):
    submitted(control, "j1")
    d = joblogs.job_dir(control.state, "j1", create=True)
    lock = procs.DaemonLock(d / "supervisor.lock").acquire("the test's supervisor")
    try:
        control._stand_by()
    finally:
        lock.release()
    assert not (d / "spec.json").exists()
