"""meshrun.system.control.etcdjobs: a job replicated across coordinators (on FakeEtcd, the real etcd's contract)."""

from __future__ import annotations

import pytest

from meshrun.core.jobspec import JobRecord, JobState
from meshrun.errors import ControlStateError, UsageError
from meshrun.mesh.coordinator.rendezvous import RendezvousService
from meshrun.system.control import etcdjobs
from meshrun.system.control.etcdjobs import CODE_SLICE, EtcdKV, JobReplica
from meshrun.system.control.fakeetcd import FakeEtcd


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def store():
    clock = Clock()
    s = FakeEtcd(clock=clock)
    s.test_clock = clock
    return s


def test_a_job_id_is_unique_across_coordinators(store):
    JobReplica(store, "j1", "a").create({"job_id": "j1"}, JobRecord("j1"))
    with pytest.raises(UsageError, match="job 'j1' exists already"):
        JobReplica(store, "j1", "b").create({"job_id": "j1"}, JobRecord("j1"))
    assert etcdjobs.job_ids(store) == ["j1"]


def test_one_supervisor_owns_a_job_and_a_standby_takes_it_when_the_owners_lease_runs_out(store):
    a, b = JobReplica(store, "j1", "a"), JobReplica(store, "j1", "b")
    a.create({}, JobRecord("j1"))
    assert a.own() and not b.own()
    assert b.owner() == "a"
    a.save(JobRecord("j1", state=JobState.RUNNING, nodes=["n1"]))
    with pytest.raises(ControlStateError, match="no longer owns"):
        b.save(JobRecord("j1", state=JobState.FAILED))  # a standby cannot write the record
    assert b.record().state is JobState.RUNNING
    a.stop.set()  # a's machine is gone: nothing keeps its lease alive
    store.test_clock.t += etcdjobs.OWNER_TTL_S + 1
    store.expire()
    assert b.owner() is None and b.own() and b.owner() == "b"
    b.save(JobRecord("j1", state=JobState.SUCCEEDED))
    with pytest.raises(ControlStateError):
        a.save(JobRecord("j1", state=JobState.FAILED))  # the old owner, back, writes nothing
    assert a.record().state is JobState.SUCCEEDED
    b.release()


def test_a_job_is_owned_from_its_creation_so_no_standby_takes_it_while_its_supervisor_starts(store):
    submitted = JobReplica(store, "j1", "a")  # job control on coordinator a
    submitted.create({}, JobRecord("j1"))
    standby = JobReplica(store, "j1", "b")
    assert standby.owner() == "a" and not standby.own()
    supervisor = JobReplica(store, "j1", "a")  # the supervisor process job control spawns
    assert supervisor.adopt(submitted.handover())
    submitted.detach()  # job control lets go; the ownership stays
    assert standby.owner() == "a" and not standby.own()
    supervisor.save(JobRecord("j1", state=JobState.RUNNING))  # the fence it adopted writes the record
    assert standby.record().state is JobState.RUNNING
    assert not JobReplica(store, "j1", "a").adopt({"fence": "a/forged", "lease": supervisor.lease})
    supervisor.release()
    assert standby.own()


def test_a_submission_whose_supervisor_never_adopts_the_job_loses_it_when_the_lease_runs_out(store):
    submitted = JobReplica(store, "j1", "a")
    submitted.create({}, JobRecord("j1"))
    submitted.detach()  # nothing keeps it alive: job control's machine went away mid-submission
    store.test_clock.t += etcdjobs.OWNER_TTL_S + 1
    store.expire()
    assert JobReplica(store, "j1", "b").own()


def test_the_owners_lines_code_and_cancel_reach_every_coordinator(store):
    a, b = JobReplica(store, "j1", "a"), JobReplica(store, "j1", "b")
    a.create({}, JobRecord("j1"))
    a.own()
    a.event("100 meshrun: one")
    a.event("101 meshrun: two")
    lines = b.events()
    assert [line for _, line in lines] == ["100 meshrun: one", "101 meshrun: two"]
    a.event("102 meshrun: three")
    assert [line for _, line in b.events(lines[-1][0])] == ["102 meshrun: three"]
    blob = bytes(range(256)) * (3 * CODE_SLICE // 256 + 7)
    assert a.put_code(blob) and b.code() == blob
    assert not a.put_code(b"x" * (etcdjobs.CODE_LIMIT + 1)) and b.code() == blob
    assert not a.cancel_requested()
    b.request_cancel()
    assert a.cancel_requested()
    a.release()


def test_only_a_running_jobs_nodes_may_use_its_rendezvous_in_etcd(store):
    a = JobReplica(store, "j1", "a")
    a.create({}, JobRecord("j1", state=JobState.RUNNING))
    a.own()
    a.allow(["10.0.0.5", "10.0.0.6"])
    svc = RendezvousService(EtcdKV(store), lambda job: etcdjobs.job_allowed(store, job))
    assert svc.handle("10.0.0.5", "j1", {"op": "set_state", "state": "AA==", "token": None})["ok"] is True
    other = svc.handle("10.0.0.6", "j1", {"op": "set_state", "state": "AQ==", "token": None})
    assert other["ok"] is False and other["state"] == "AA=="  # compare-and-swap: the first write stays
    from meshrun.errors import AuthError, StateError

    with pytest.raises(AuthError):
        svc.handle("10.0.0.9", "j1", {"op": "get_state"})
    a.save(JobRecord("j1", state=JobState.SUCCEEDED))
    with pytest.raises(StateError):  # an ended job has no rendezvous
        svc.handle("10.0.0.5", "j1", {"op": "get_state"})
    etcdjobs.forget_rendezvous(store, "j1")
    assert EtcdKV(store).keys("rdzv/j1/") == []
    a.release()
