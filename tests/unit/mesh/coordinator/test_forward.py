"""meshrun.mesh.coordinator.forward: a follower's agents' reports reach the leader's pair driver.

The leader is a real PairDriver on a real CoordinatorDB; the follower's `send` is the leader's `take`, in
process, or one that fails as an unreachable leader does."""

from __future__ import annotations

import pytest

from meshrun.errors import CoordinatorError
from meshrun.mesh.coordinator.forward import Reports
from meshrun.mesh.coordinator.pairs import PairDriver
from meshrun.system.control.coordinatordb import CoordinatorDB


def key(i: int) -> str:
    return f"{i:042d}A="


@pytest.fixture
def leader(tmp_path):
    db = CoordinatorDB.create(tmp_path / "coordinator.db")
    db.add_coordinator("coord", key(99), "10.213.0.1")
    db.add_token("tok0000001", b"s" * 32, 3600, None)
    for i in range(3):
        db.enrol("tok0000001", b"s" * 32, f"n{i}", key(i), [], "10.213.0.0/16")
    drv = PairDriver(db)
    yield Reports(drv)  # it leads: reports go to its own driver
    db.close()


def test_a_leader_takes_reports_itself_and_a_follower_forwards_them(leader):
    sent = []

    def send(ip, batch):
        sent.append((ip, batch))
        return leader.take(batch)

    follower = Reports(leader.pairs, leading=lambda: False, leader_ip=lambda: "10.213.0.1", send=send)
    follower.pairs = None  # a follower never touches a driver of its own
    # The leader has heard nothing of n0: the follower asks the agent for a full report until the leader took one.
    assert follower.report("n0", {key(1): 100}, full=False, stale=set()) is True
    assert follower.report("n0", {key(1): 100, key(2): 0}, full=True, stale={key(2)}) is True
    follower.flush()
    assert [ip for ip, _ in sent] == ["10.213.0.1"] and len(sent[0][1]["items"]) == 2
    assert leader.pairs.reports["n0"] == {key(1): 100, key(2): -1}  # stale kept as the leader's driver keeps it
    assert follower.report("n0", {}, full=False) is False  # the leader has its full report now
    follower.report_rtt("n0", {key(1): 12.5})
    follower.flush()
    assert leader.pairs.rtt == {("n0", "n1"): 12.5}


def test_a_batch_the_leader_did_not_take_asks_every_agent_for_a_full_report_again(leader):
    up = [True]

    def send(ip, batch):
        if not up[0]:
            raise CoordinatorError("connection refused")
        return leader.take(batch)

    follower = Reports(leader.pairs, leading=lambda: False, leader_ip=lambda: "10.213.0.1", send=send)
    follower.report("n1", {key(0): 5}, full=True, stale=set())
    follower.flush()
    assert follower.report("n1", {}, full=False) is False
    up[0] = False
    follower.report("n1", {key(0): 6}, full=False, stale=set())
    follower.flush()  # lost with the leader: the next one knows nothing
    assert follower.report("n1", {}, full=False) is True


def test_a_new_leader_starts_from_nothing(leader):
    who = ["10.213.0.1"]
    follower = Reports(leader.pairs, leading=lambda: False, leader_ip=lambda: who[0], send=lambda ip, b: leader.take(b))
    follower.report("n2", {key(0): 5}, full=True, stale=set())
    follower.flush()
    assert follower.report("n2", {}, full=False) is False
    who[0] = "10.213.0.9"  # another coordinator leads now
    follower.report("n2", {key(0): 6}, full=False, stale=set())
    follower.flush()
    assert follower.report("n2", {}, full=False) is True


def test_relay_down_is_forwarded_at_once_and_counted_as_asked(leader):
    woken = []
    follower = Reports(leader.pairs, leading=lambda: False, leader_ip=lambda: "10.213.0.1", send=lambda ip, b: {})
    follower.wake.set = lambda: woken.append(1)  # type: ignore[method-assign]
    assert follower.relay_failed("n0", [key(1)], via={key(1): key(2)}) == 1
    assert woken == [1]  # not after the batching gap


@pytest.mark.parametrize(
    "batch",
    [{}, {"items": "x"}, {"items": [{"kind": "report"}]}, {"items": [{"node": "n0", "kind": "nope"}]}],
)
def test_a_malformed_batch_is_refused(leader, batch):
    with pytest.raises((ValueError, TypeError)):
        leader.take(batch)
