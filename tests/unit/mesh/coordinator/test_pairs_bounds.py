"""PairDriver.report under a member that invents keys: what the coordinator keeps per node stays bounded
(the members' keys and UNKNOWN_SLACK others), whatever the reports say and however many arrive."""

from __future__ import annotations

import pytest

from meshrun.core.model import Member
from meshrun.mesh.coordinator.pairs import UNKNOWN_SLACK, PairDriver
from meshrun.system.control.coordinatordb import CoordinatorDB

T0 = 1_700_000_000


def key(i: int) -> str:
    return f"{i:042d}A="


def node(i: int) -> Member:
    return Member(f"n{i}", key(i), f"10.213.0.{i + 2}", f"198.51.100.{i + 1}:{40000 + i}", (f"172.31.40.{i}:51820",))


@pytest.fixture
def driver(tmp_path):
    db = CoordinatorDB.create(tmp_path / "coordinator.db")
    drv = PairDriver(db)
    members = [node(i) for i in range(5)]
    drv.update(members, T0)
    yield drv, members
    db.close()


def invented(batch: int, n: int = 5000) -> dict[str, int]:
    return {f"{batch:04d}{j:06d}": T0 for j in range(n)}


def bound(members: list[Member]) -> int:
    return len(members) + UNKNOWN_SLACK


@pytest.mark.parametrize("stale", [None, "all"])  # an older agent's reports, and one that says what is stale
def test_partial_reports_of_invented_keys_keep_memory_bounded(driver, stale):
    drv, members = driver
    attacker = members[0].name
    honest = {m.public_key: T0 for m in members[1:]}
    drv.report(attacker, honest, full=True, stale=None if stale is None else set())
    for batch in range(40):
        delta = invented(batch)
        delta[members[1].public_key] = T0 + batch + 1  # a real handshake among the junk
        drv.report(attacker, delta, full=False, stale=None if stale is None else set(delta))
        assert len(drv.reports[attacker]) <= bound(members), batch
    kept = drv.reports[attacker]
    # What a member reports about real members still counts.
    assert abs(kept[members[1].public_key]) in (T0 + 40, T0 + 41) and members[2].public_key in kept
    assert sum(1 for k in kept if k not in drv.names) <= UNKNOWN_SLACK


def test_a_full_report_of_invented_keys_keeps_at_most_the_slack(driver):
    drv, members = driver
    for batch in range(5):
        drv.report(members[0].name, {**invented(batch), members[1].public_key: T0}, full=True)
        assert len(drv.reports[members[0].name]) <= 1 + UNKNOWN_SLACK
        assert members[1].public_key in drv.reports[members[0].name]


def test_partial_reports_before_any_full_one_are_not_kept(driver):
    drv, members = driver
    for batch in range(5):
        assert drv.report(members[0].name, invented(batch), full=False)  # a full report is still owed
    assert members[0].name not in drv.reports


def test_every_member_reporting_junk_grows_memory_linearly_in_members_only(driver):
    drv, members = driver
    for m in members:
        drv.report(m.name, {}, full=True)
        for batch in range(10):
            drv.report(m.name, invented(batch, 2000), full=False)
    assert sum(len(r) for r in drv.reports.values()) <= len(members) * bound(members)
