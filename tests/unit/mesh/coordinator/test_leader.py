"""meshrun.mesh.coordinator.leader: one coordinator leads at a time, a lost leader is replaced once its lease
runs out, and one that cannot reach etcd's majority stops leading before another may start. On FakeEtcd (held
to the real etcd's contract: tests/etcd_contract.py), its leases on a clock the test moves."""

from __future__ import annotations

from meshrun.mesh.coordinator.leader import LEASE_TTL_S, Leadership, leader_name
from meshrun.system.control.fakeetcd import FakeEtcd


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_one_leads_and_the_others_know_who():
    clock = Clock()
    store = FakeEtcd(clock=clock)
    a, b, c = (Leadership(store, n, clock=clock) for n in ("a", "b", "c"))
    assert [x.step() for x in (a, b, c)] == [True, False, False]
    assert b.leader == c.leader == "a" and leader_name(a.fence) == "a"
    clock.t += 1
    assert [x.step() for x in (a, b, c)] == [True, False, False]  # a keeps its lease alive


def test_a_lost_leader_is_replaced_once_its_lease_ran_out_and_not_before():
    clock = Clock()
    store = FakeEtcd(clock=clock)
    a, b = Leadership(store, "a", clock=clock), Leadership(store, "b", clock=clock)
    a.step(), b.step()
    clock.t += LEASE_TTL_S - 1  # a is gone (no more steps); its lease still holds
    store.expire()
    assert b.step() is False and b.leader == "a"
    clock.t += 2
    store.expire()
    assert b.step() is True and b.leader == "b"


def test_a_clean_stop_hands_over_at_once():
    clock = Clock()
    store = FakeEtcd(clock=clock)
    a, b = Leadership(store, "a", clock=clock), Leadership(store, "b", clock=clock)
    a.step(), b.step()
    a.resign()
    assert b.step() is True


def test_a_leader_cut_off_from_etcd_stops_leading_before_its_lease_may_have_run_out():
    clock = Clock()
    store = FakeEtcd(clock=clock)
    a = Leadership(store, "a", clock=clock)
    assert a.step()
    store.down = True
    clock.t += 1
    assert a.step() is True  # a moment: it still holds the key for sure
    clock.t += LEASE_TTL_S - 1
    assert a.step() is False  # it may not hold it any more: another coordinator may lead
    store.down = False
    clock.t += 1
    store.expire()
    assert a.step() is True  # back, and nobody took the lead meanwhile: it takes it again (a new lease)
