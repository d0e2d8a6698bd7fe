"""The coordinator's pair driver: work proportional to change, same decisions as stepping every pair.

PairDriver runs on a real CoordinatorDB (SQLite in tmp_path); `steps` counts its calls of
pairpaths.initial/step, the per-pair work. The last tests run the real coordinator service and agents on
FakeDevices (tests/fakemesh.py).
"""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
from fakemesh import FakeMesh

from meshrun.core import pairpaths
from meshrun.core.model import Member
from meshrun.errors import StateError
from meshrun.mesh.coordinator.pairs import PairDriver
from meshrun.system.control.coordinatordb import CoordinatorDB
from meshrun.system.files.statedir import StateDir

T0 = 1_700_000_000.0


def key(i: int) -> str:
    return f"{i:042d}A="


def node(i: int, site: int | None = None) -> Member:
    """Node i; nodes given the same `site` sit behind one public IP (same VPC)."""
    host = f"198.51.100.{site if site is not None else 100 + i}"
    return Member(f"n{i}", key(i), f"10.213.0.{i + 2}", f"{host}:{40000 + i}", (f"172.31.40.{i + 10}:51820",))


@pytest.fixture
def db(tmp_path):
    d = CoordinatorDB.create(tmp_path / "coordinator.db")
    yield d
    d.close()


def report_all(drv: PairDriver, members: list[Member], hs: int, full: bool = True) -> None:
    for m in members:
        drv.report(m.name, {o.public_key: hs for o in members if o is not m}, full=full)


def applied(drv: PairDriver, members: list[Member], since: float) -> None:
    """Every node syncs twice just after `since` (it has applied what changed then), reporting nothing new."""
    for t in (since + 0.001, since + 0.002):
        for m in members:
            drv.report(m.name, {}, full=False, stale=set(), now=t)


def meshed(db, n: int = 6, hs: int = int(T0)) -> tuple[PairDriver, list[Member]]:
    drv = PairDriver(db)
    members = [node(i) for i in range(n)]
    report_all(drv, members, hs)
    assert drv.update(members, T0)  # every pair created
    assert len(drv.pairs) == n * (n - 1) // 2 and all(st.verified for st in drv.pairs.values())
    drv.update(None, T0 + 1)  # a new state is looked at once more, the tick after
    return drv, members


def test_a_tick_with_no_input_change_steps_no_pair(db):
    drv, members = meshed(db)
    before = drv.steps
    for t in (T0 + 1, T0 + 5, T0 + 60, T0 + pairpaths.STALE_S - 1):
        assert not drv.update(None, t)
        assert not drv.update(members, t)  # the same member list again: nothing changed either
    assert drv.steps == before


def test_a_handshake_report_advances_only_its_own_pair(db, monkeypatch):
    drv, members = meshed(db)
    stepped = recording_steps(monkeypatch)
    drv.report("n1", {key(4): int(T0) + 30}, full=False)
    drv.report("n2", {key(3): int(T0)}, full=False)  # the same handshake as before: no news
    drv.update(None, T0 + 31)
    assert stepped == [("n1", "n4")]
    # The newer handshake moved only that pair's stale time on.
    drv.update(None, T0 + pairpaths.STALE_S)
    relayed = {k for k, st in drv.pairs.items() if st.mode == pairpaths.RELAYED}
    assert relayed == set(drv.pairs) - {("n1", "n4")}
    assert drv.pairs[("n1", "n4")] == pairpaths.PairState(pairpaths.PUBLIC, T0, True)


def test_due_timers_step_each_pair_once_when_its_time_comes(db):
    drv = PairDriver(db)
    members = [node(i) for i in range(5)]
    report_all(drv, members, 0)  # no handshakes at all: every pair is tried, unproven
    drv.update(members, T0)
    applied(drv, members, T0)
    drv.update(None, T0 + 1)
    assert drv.steps == 20  # created, then looked at once more
    closes = T0 + 0.002 + pairpaths.ATTEMPT_S  # the window opened at the ends' second sync
    drv.update(None, closes - 0.5)
    assert drv.steps == 20  # nothing due yet
    assert drv.update(None, closes)
    assert drv.steps == 30 and {st.mode for st in drv.pairs.values()} == {pairpaths.RELAYED}
    drv.update(None, closes + 1)
    drv.update(None, closes + pairpaths.RETRY_MIN_S - 1)  # relayed pairs wait for a handshake or their next try
    assert drv.steps == 40
    assert drv.update(None, closes + pairpaths.RETRY_MIN_S)
    assert drv.steps == 50 and {(st.mode, st.tries) for st in drv.pairs.values()} == {(pairpaths.PUBLIC, 1)}


def test_a_window_waits_for_both_ends_to_have_applied_the_path(db, monkeypatch):
    """An end that does not sync (stopped, overloaded, offline) fails no path: the pair waits for its reports,
    without a timer, and its window opens at its second report; a handshake still verifies it meanwhile."""
    drv = PairDriver(db)
    members = [node(i) for i in range(3)]
    report_all(drv, members, 0)
    drv.update(members, T0)
    applied(drv, members[:2], T0)  # n2 is stopped
    drv.update(None, T0 + 1)
    drv.update(None, T0 + 3600)
    assert {k: st.mode for k, st in drv.pairs.items()} == {
        ("n0", "n1"): pairpaths.RELAYED,
        ("n0", "n2"): pairpaths.PUBLIC,
        ("n1", "n2"): pairpaths.PUBLIC,
    }
    stepped = recording_steps(monkeypatch)
    drv.update(None, T0 + 7200)
    assert stepped == [("n0", "n1")]  # its next direct try; the waiting pairs have no timer
    drv.report("n2", {}, full=False, now=T0 + 7200.5)
    drv.report("n2", {key(1): int(T0) + 7201}, full=False, now=T0 + 7201)  # n2 runs again, n1 answers
    drv.update(None, T0 + 7201.5)
    assert drv.mode("n1", "n2") == pairpaths.PairState(pairpaths.PUBLIC, T0, True)
    assert drv.mode("n0", "n2") == pairpaths.PairState(pairpaths.PUBLIC, T0)  # its window opened at 7201
    drv.update(None, T0 + 7201 + pairpaths.ATTEMPT_S - 0.1)
    assert drv.mode("n0", "n2").mode == pairpaths.PUBLIC
    drv.update(None, T0 + 7201 + pairpaths.ATTEMPT_S)
    assert drv.mode("n0", "n2").mode == pairpaths.RELAYED


def test_a_relayed_pair_whose_end_moved_tries_direct_again_at_once(db):
    """An end's address changes (it moved, its NAT rebooted): its relayed pairs forget their failed attempts
    and try direct within RETRY_MIN_S of being relayed, not RETRY_S later; other relayed pairs keep waiting."""
    drv = PairDriver(db)
    members = [node(i) for i in range(3)]
    report_all(drv, members, 0)
    drv.update(members, T0)
    applied(drv, members, T0)
    for t in (T0 + 1, T0 + 11, T0 + 12):
        drv.update(None, t)
    assert {(st.mode, st.tries) for st in drv.pairs.values()} == {(pairpaths.RELAYED, 1)}
    retry = T0 + 11 + pairpaths.RETRY_MIN_S  # the first retry, within a minute: it fails too
    drv.update(None, retry)
    applied(drv, members, retry)
    for t in (retry + 1, retry + 11, retry + 12):
        drv.update(None, t)
    assert {(st.mode, st.tries) for st in drv.pairs.values()} == {(pairpaths.RELAYED, 2)}
    moved = [dataclasses.replace(m, endpoint="203.0.113.7:41000") if m.name == "n2" else m for m in members]
    drv.update(moved, retry + 100)
    assert {k: (st.mode, st.tries) for k, st in drv.pairs.items()} == {
        ("n0", "n1"): (pairpaths.RELAYED, 2),
        ("n0", "n2"): (pairpaths.PUBLIC, 0),
        ("n1", "n2"): (pairpaths.PUBLIC, 0),
    }
    assert db.pairs() == drv.pairs


def test_same_site_pairs_start_private_and_fall_back_one_step_at_a_time(db):
    drv = PairDriver(db)
    members = [node(0, site=9), node(1, site=9), node(2)]
    report_all(drv, members, 0)
    drv.update(members, T0)
    assert drv.mode("n0", "n1").mode == pairpaths.PRIVATE and drv.mode("n0", "n2").mode == pairpaths.PUBLIC
    applied(drv, members, T0)
    drv.update(None, T0 + pairpaths.ATTEMPT_S + 0.01)
    assert drv.mode("n0", "n1") == pairpaths.PairState(pairpaths.PUBLIC, T0 + pairpaths.ATTEMPT_S + 0.01)
    assert drv.take_changes() == {("n0", "n1"), ("n0", "n2"), ("n1", "n2")}
    assert drv.take_changes() == set()


def reference(pairs, reports, members, now, times):
    """The old driver: every pair of judgeable, reported nodes stepped on every tick. `times`: each node's
    report times, oldest first (an unproven pair's window opens at both ends' second report after its change)."""

    def hs(a, b):
        return max(reports.get(a.name, {}).get(b.public_key, 0), reports.get(b.name, {}).get(a.public_key, 0))

    def started(k, st):
        after = [[t for t in times.get(n, []) if t > st.since] for n in k]
        if any(len(ts) < 2 for ts in after):
            return None
        return max(ts[1] for ts in after)

    nodes = [m for m in members if not m.is_coordinator and m.endpoint and m.candidates and m.name in reports]
    live = {m.name for m in members}
    new = {k: st for k, st in pairs.items() if k[0] in live and k[1] in live}
    for i, a in enumerate(nodes):
        for b in nodes[i + 1 :]:
            k = pairpaths.pair_key(a.name, b.name)
            old = pairs.get(k)
            if old is None:
                new[k] = pairpaths.initial(a, b, hs(a, b), now)
            else:
                new[k] = pairpaths.step(old, a, b, hs(a, b), now, None, started(k, old))
    return new


@pytest.mark.parametrize("seed", range(6))
def test_same_decisions_as_stepping_every_pair_every_tick(db, seed):
    """Random joins, removals, endpoint arrivals, full and partial reports and clock jumps: after every
    tick the pair states equal those of the old stepping-everything driver."""
    rng = random.Random(seed)
    drv = PairDriver(db)
    ref: dict = {}
    reports: dict[str, dict[str, int]] = {}
    members = [node(i, site=rng.choice([1, 2, None])) for i in range(5)]
    members[4] = Member(members[4].name, members[4].public_key, members[4].overlay_ip, None, ())  # not seen yet
    next_id, now = 5, T0
    times: dict[str, list[float]] = {}
    for step in range(120):
        now += rng.choice([0.5, 1, 1, 3, 9.5, 10, 40, 170, 200])
        op = rng.random()
        if op < 0.1:
            members = members + [node(next_id, site=rng.choice([1, 2, None]))]
            next_id += 1
        elif op < 0.15 and len(members) > 2:
            gone = rng.choice(members)
            members = [m for m in members if m is not gone]
            reports.pop(gone.name, None)
            times.pop(gone.name, None)
        elif op < 0.2:
            members = [node(int(m.name[1:])) if not m.endpoint else m for m in members]  # observed now
        for m in rng.sample(members, k=min(len(members), rng.randrange(0, 4))):
            full = m.name not in reports or rng.random() < 0.1
            delta = {
                o.public_key: int(now) - rng.choice([0, 1, 5, 200])
                for o in members
                if o is not m and (full or rng.random() < 0.4)
            }
            if full:
                reports[m.name] = dict(delta)
            else:
                reports[m.name].update(delta)
            drv.report(m.name, delta, full, now=now)
            times.setdefault(m.name, []).append(now)
        ref = reference(ref, reports, members, now, times)
        # As the service does: the member list on the first tick and whenever it changed; sometimes
        # the same list again (another change the driver does not care about).
        drv.update(list(members) if step == 0 or rng.random() < 0.5 or op < 0.2 else None, now)
        # The same paths (which member relays a relayed pair, and on which port, is the relay choice's, tested
        # on its own).
        assert {k: dataclasses.replace(st, relay="", port=0) for k, st in drv.pairs.items()} == ref
    assert drv.pairs == db.pairs()  # every change was written


def test_pairs_survive_a_restart_and_a_removed_member_takes_only_its_own_rows(db):
    drv, members = meshed(db, n=4)
    again = PairDriver(db)
    assert again.pairs == drv.pairs and len(db.pairs()) == 6
    # Before the nodes report again, their pairs are kept as they were, whatever the clock says.
    again.update(members, T0 + 10_000)
    assert again.pairs == drv.pairs and again.steps == 0
    again.update([m for m in members if m.name != "n2"], T0 + 10_001)
    assert set(db.pairs()) == {("n0", "n1"), ("n0", "n3"), ("n1", "n3")} == set(again.pairs)


def test_rows_of_members_removed_while_the_coordinator_was_down_are_dropped(db):
    drv, members = meshed(db, n=4)
    again = PairDriver(db)
    again.update(members[:3], T0)
    assert set(db.pairs()) == {("n0", "n1"), ("n0", "n2"), ("n1", "n2")}


def test_an_old_paths_json_is_imported_once_and_removed(db, tmp_path):
    state = StateDir(tmp_path)
    state.write_json("pairpaths.json", {"pairs": {"n0|n1": {"mode": "relayed", "since": T0, "verified": False}}})
    drv = PairDriver(db, state)
    assert drv.pairs == {("n0", "n1"): pairpaths.PairState(pairpaths.RELAYED, T0)} == db.pairs()
    assert not (tmp_path / "pairpaths.json").exists()
    state.write("pairpaths.json", "{not json")
    assert PairDriver(db, state).pairs == db.pairs()  # the database wins; the stale file goes
    assert not (tmp_path / "pairpaths.json").exists()


def test_an_unreadable_paths_json_is_ignored(tmp_path):
    db = CoordinatorDB.create(tmp_path / "c.db")
    state = StateDir(tmp_path)
    state.write("pairpaths.json", "[1, 2")
    assert PairDriver(db, state).pairs == {} and not (tmp_path / "pairpaths.json").exists()
    db.close()


def test_observe_writes_only_what_changed(db):
    db.add_coordinator("c", key(99), "10.213.0.1")
    db.set_meta(network="{}")
    db.conn.execute(
        "INSERT INTO members(name, public_key, overlay_ip, joined_at) VALUES('n0', ?, '10.213.0.2', 0)", (key(0),)
    )
    v = db.version()
    assert db.observe({key(0): ("198.51.100.1:1", 5), key(99): (None, 0)}) is True and db.version() == v + 1
    assert db.observe({key(0): ("198.51.100.1:1", 5)}) is False and db.version() == v + 1
    assert db.observe({key(0): (None, 7)}) is False and db.member_by_name("n0").last_handshake == 7


# --------------------------------------------------------------------------- the real service on fakes


def seen_nodes(mesh: FakeMesh, count: int) -> list:
    """`count` nodes joined, each heard from by the coordinator's WireGuard at its own public address."""
    nodes = [mesh.join(f"n{i}", f"198.51.100.{i + 2}:40000") for i in range(count)]
    for n in nodes:
        mesh.see(n)
    return nodes


def test_the_coordinator_loop_steps_no_pair_for_rekeys_and_one_for_a_tunnel_gone_stale(tmp_path, monkeypatch):
    mesh = FakeMesh(tmp_path)
    nodes = seen_nodes(mesh, 4)
    for _ in range(3):
        mesh.sync()
    t = int(time.time())
    for i, a in enumerate(nodes):
        for b in nodes[i + 1 :]:
            mesh.handshake(a, b, when=t)
    for _ in range(3):
        mesh.sync()  # reported, judged (verified), looked at once more the tick after
    assert len(mesh.coord.pairs.pairs) == 6 and all(st.verified for st in mesh.coord.pairs.pairs.values())
    before = mesh.coord.pairs.steps
    for _ in range(3):
        mesh.sync()  # agents report nothing new, the coordinator ticks
    assert mesh.coord.pairs.steps == before
    stepped = recording_steps(monkeypatch)
    for i, a in enumerate(nodes):  # WireGuard rekeys every tunnel (every 120 s): nothing to report
        for b in nodes[i + 1 :]:
            mesh.handshake(a, b, when=t + 120)
    mesh.sync()
    mesh.coord.tick()
    assert stepped == []
    # One tunnel's last handshake ages past STALE_S: both ends say so, and only that pair is stepped.
    mesh.handshake(nodes[1], nodes[3], when=int(time.time() - pairpaths.STALE_S - 1))
    mesh.sync()
    mesh.coord.tick()
    assert stepped == [("n1", "n3")]
    assert mesh.coord.pairs.mode("n1", "n3").mode == pairpaths.RELAYED


def steps_per_update(drv: PairDriver, members: list[Member] | None, t0: float, limit: int = 100) -> list[int]:
    """Update `drv` once a second from t0 (the first with `members`) until nothing waits; the pairs stepped by each."""
    sizes = []
    for t in range(limit):
        before = drv.steps
        drv.update(members if t == 0 else None, t0 + t)
        sizes.append(drv.steps - before)
        if not drv.behind:
            return sizes
    raise AssertionError(f"still behind after {limit} updates: {sizes}")


def recording_steps(monkeypatch) -> list[tuple[str, str]]:
    """Every pair stepped from now on (pairpaths.step calls), in order."""
    stepped: list[tuple[str, str]] = []
    real = pairpaths.step

    def step(st, a, b, hs, now, *rest):
        stepped.append((a.name, b.name))
        return real(st, a, b, hs, now, *rest)

    monkeypatch.setattr(pairpaths, "step", step)
    return stepped


def test_a_mass_start_is_judged_within_the_budget_and_an_urgent_pair_goes_first(db, monkeypatch):
    """60 nodes judged at once (1769 new pairs) with a budget of 500: no update looks at more than 500
    pairs, the one pair with news (n0-n1) is stepped in the first, and every pair ends created and verified."""
    drv = PairDriver(db)
    drv.budget = 500
    members = [node(i) for i in range(60)]
    report_all(drv, members[:2], int(T0))
    drv.update(members[:2], T0)  # one pair, created and verified
    drv.update(None, T0 + 1)
    assert len(drv.pairs) == 1
    stepped = recording_steps(monkeypatch)
    report_all(drv, members, int(T0) + 2)  # everyone's first report at once; n0-n1 has news
    sizes = steps_per_update(drv, members, T0 + 2)
    assert stepped[0] == ("n0", "n1")
    assert len(sizes) > 4 and max(sizes) == 500 and sum(sizes) >= 1769, sizes
    assert len(drv.pairs) == 60 * 59 // 2 and all(st.verified for st in drv.pairs.values())
    assert drv.pairs == db.pairs()


def test_a_storm_of_handshake_changes_is_carried_over_in_order(db, monkeypatch):
    """Every one of 780 pairs has news at once, the budget is 100: each update steps at most 100, the
    pairs left over go first in the next update (oldest first), so a later change waits its turn."""
    drv, members = meshed(db, 40)
    drv.budget = 100
    stepped = recording_steps(monkeypatch)
    report_all(drv, members, int(T0) + 10, full=False)
    drv.update(None, T0 + 10)
    assert len(stepped) == 100 and drv.behind
    first = stepped[0]
    drv.report(first[0], {members[int(first[1][1:])].public_key: int(T0) + 11}, full=False)  # news again
    sizes = [100] + steps_per_update(drv, None, T0 + 11)
    assert max(sizes) == 100 and sum(sizes) == 781, sizes
    assert sorted(stepped[:780]) == sorted(drv.pairs) and stepped[780] == first  # the newer change came last
    assert not drv.behind and drv.pairs == db.pairs()


def test_a_restart_with_every_member_reporting_at_once_stays_within_the_budget(db):
    """A coordinator restart: 60 members, 1770 stored pairs, every agent's full report arriving together.
    Each update looks at no more than its budget, and every pair comes back as it was."""
    drv, members = meshed(db, 60)
    before = dict(drv.pairs)
    again = PairDriver(db)
    again.budget = 200
    report_all(again, members, int(T0) + 20)
    sizes = steps_per_update(again, members, T0 + 20)
    assert max(sizes) == 200 and sum(sizes) >= 1770, sizes
    assert {k: st.mode for k, st in again.pairs.items()} == {k: st.mode for k, st in before.items()}
    assert all(st.verified for st in again.pairs.values())


def test_a_sliced_backlog_is_announced_once_per_interval_and_no_path_is_lost(tmp_path):
    """While a backlog is sliced (the loop ticking every BACKLOG_PAUSE), a new version (which wakes
    every agent's long-poll) goes out at most once per interval; the pair paths held back meanwhile
    all reach the agents with the version that finally announces them."""
    mesh = FakeMesh(tmp_path)
    coord = mesh.coord
    coord.pairs.budget = 5
    nodes = seen_nodes(mesh, 8)
    mesh.sync()  # the coordinator sees endpoints; agents' first reports
    coord.interval = 3600  # from here on "within one interval"
    coord.published_at = time.monotonic()
    versions = []
    while coord.pairs.behind or not versions:
        coord.tick()
        versions.append(coord.roster.version)
    assert len(versions) >= 4 and len(set(versions[:-1])) == 1, versions  # held back while slicing
    assert versions[-1] > versions[0]  # announced once it emptied
    assert len(coord.pairs.pairs) == 28
    for n in nodes:
        n.agent.sync_once(wait=0)
    for a in nodes:
        for b in nodes:
            if a is not b:
                assert mesh.member_seen_by(a, b).path == coord.pairs.mode(a.name, b.name).mode, (a.name, b.name)


def test_a_steady_sync_reads_nothing_from_the_database_and_a_removal_still_bites_at_once(tmp_path, monkeypatch):
    """With 1000 long-polls the database lock was the bottleneck (every sync took it four times and the
    loop starved): an agent's sync with nothing new is answered from memory; a removal is still
    refused at the next request, before the loop has published it."""
    mesh = FakeMesh(tmp_path)
    nodes = seen_nodes(mesh, 3)
    for _ in range(3):
        mesh.sync()
    db, calls = mesh.coord.db, []
    for name in ("member_by_ip", "heartbeat", "version", "members", "is_removed_ip"):
        real = getattr(db, name)
        monkeypatch.setattr(db, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    for _ in range(3):
        for n in nodes:
            n.agent.sync_once(wait=0)
    assert calls == []
    db.remove_member("n0")  # no tick, no publish yet
    with pytest.raises(StateError) as exc:
        nodes[0].agent.sync_once(wait=0)
    assert exc.value.status == 410


def test_a_join_recorded_while_a_tick_applies_peers_is_applied_by_the_next_tick(tmp_path):
    """A race seen in CI (a join's daemon never ready: the coordinator never added its peer): a join
    landing between a tick's peer apply and its publish was announced by that publish (which took the
    database's newer version), so the next tick saw nothing new and never applied the peer."""
    mesh = FakeMesh(tmp_path)
    seen_nodes(mesh, 1)
    mesh.sync()
    coord, real_apply, late = mesh.coord, mesh.coord.apply_peers, []

    def apply_then_a_join_lands(current=None):
        real_apply(current)
        if not late:  # the enrolment thread records it; the daemon's loop is only woken (not here)
            late.append(mesh.join("late", "198.51.100.50:40000"))

    coord.apply_peers = apply_then_a_join_lands
    coord.enrolment.on_enrolled = lambda member: None
    mesh.see(mesh.nodes["n0"], when=int(time.time()) + 5)  # something for this tick to do
    coord.tick()
    coord.apply_peers = real_apply
    coord.tick()
    assert any(p.public_key == late[0].key for p in mesh.coord_device.peers())


def test_no_coordinator_tick_exceeds_its_budget_in_a_mass_join_or_after_a_restart(tmp_path):
    """The real coordinator service and agents on FakeDevices, the pair budget set to 20: 16 nodes
    joining together (120 pairs), then a coordinator restart with every agent reporting again. No tick
    looks at more than 20 pairs, the loop is told to come back at once while pairs wait, and in the end
    every node sees every other on the path the coordinator decided."""
    mesh = FakeMesh(tmp_path)
    mesh.coord.pairs.budget = 20
    nodes = seen_nodes(mesh, 16)

    def until_steady(coord) -> list[int]:
        sizes = []
        for _ in range(60):
            before = coord.pairs.steps
            mesh.sync()
            sizes.append(coord.pairs.steps - before)
            if len(sizes) > 2 and not coord.pairs.behind and sizes[-1] == 0:
                return sizes
        raise AssertionError(f"not steady after 60 ticks: {sizes}")

    sizes = until_steady(mesh.coord)
    assert max(sizes) == 20 and len(mesh.coord.pairs.pairs) == 120, sizes
    before = {k: st.mode for k, st in mesh.coord.pairs.pairs.items()}
    coord = mesh.new_coordinator()
    coord.pairs.budget = 20
    for n in nodes:
        mesh.see(n)
    sizes = until_steady(coord)
    assert max(sizes) == 20, sizes
    assert {k: st.mode for k, st in coord.pairs.pairs.items()} == before
    for a in nodes:
        for b in nodes:
            if a is not b:
                assert mesh.member_seen_by(a, b).path == coord.pairs.mode(a.name, b.name).mode, (a.name, b.name)


def test_a_fresh_tunnel_needs_no_reports_and_no_timer_while_its_nodes_are_heard(db, monkeypatch):
    """Agents that say what is stale: a verified pair has no timer; it stays fresh without any new
    handshake report for as long as its nodes are heard from, and falls back once both ends call it
    stale, or once one end calls it stale while the other has gone silent."""
    clock = [T0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    drv = PairDriver(db)
    members = [node(i) for i in range(4)]
    for m in members:
        drv.report(m.name, {o.public_key: int(T0) for o in members if o is not m}, full=True, stale=set())
    drv.update(members, T0)
    drv.update(None, T0 + 1)
    assert all(st.verified for st in drv.pairs.values()) and not drv.booked  # no timer per pair
    for t in range(60, 3600, 60):  # an hour of syncs that report nothing new
        clock[0] = T0 + t
        for m in members:
            drv.report(m.name, {}, full=False, stale=set())
        drv.update(None, T0 + t)
    before = drv.steps
    assert all(st.verified for st in drv.pairs.values()) and not drv.booked
    # n0 says n1 is stale; n1 last said fresh and is still heard: the pair waits for n1's word.
    now = T0 + 3600
    clock[0] = now
    drv.report("n0", {key(1): int(T0)}, full=False, stale={key(1)})
    drv.update(None, now)
    assert drv.mode("n0", "n1").mode == pairpaths.PUBLIC and drv.steps == before + 1
    drv.report("n1", {key(0): int(T0)}, full=False, stale={key(0)})
    drv.update(None, now)
    assert drv.mode("n0", "n1").mode == pairpaths.RELAYED
    # n2 calls n3 stale while n3 has not been heard for longer than STALE_S (its machine is gone).
    clock[0] = now + pairpaths.STALE_S + 20
    drv.report("n2", {key(3): int(T0)}, full=False, stale={key(3)})
    drv.update(None, clock[0])
    assert drv.mode("n2", "n3").mode == pairpaths.RELAYED
    # No other pair was stepped: n0-n1 at each end's report and once more after it changed, n2-n3 once.
    assert drv.steps == before + 4
