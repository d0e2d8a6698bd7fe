"""Peer relays in the coordinator: the pair driver names a relay for every relayed pair, moves the pair when
the relay fails or can no longer reach an end, and the roster tells both ends and the relay.

PairDriver runs on a real CoordinatorDB; the last tests run the real service and agents on FakeDevices
(tests/fakemesh.py), so what reaches each device is checked."""

from __future__ import annotations

import time

import pytest
from fakemesh import FakeMesh

from meshrun.core import pairpaths, relays
from meshrun.core.model import Member
from meshrun.mesh.coordinator.pairs import AVOID_S, PairDriver
from meshrun.mesh.node import daemon
from meshrun.system.control.coordinatordb import CoordinatorDB

T0 = 1_700_000_000.0


def key(i: int) -> str:
    return f"{i:042d}A="


def node(i: int, relay: bool = True) -> Member:
    return Member(
        f"n{i}", key(i), f"10.213.0.{i + 2}", f"198.51.100.{100 + i}:{40000 + i}", ("172.31.40.46:51820",), relay=relay
    )


@pytest.fixture
def db(tmp_path):
    d = CoordinatorDB.create(tmp_path / "coordinator.db")
    yield d
    d.close()


def synced_twice(drv: PairDriver, members: list[Member], since: float) -> None:
    """Each agent's next two syncs after `since`, reporting nothing new: it has applied the paths chosen then."""
    for t in (since + 0.5, since + 0.6):
        for m in members:
            drv.report(m.name, {}, full=False, stale=set(), now=t)


def world(db, n: int = 5, cut: tuple[int, int] = (0, 1), relay=lambda i: True):
    """n nodes, every pair with a fresh handshake except `cut` (two nodes behind symmetric NAT)."""
    drv = PairDriver(db)
    members = [node(i, relay(i)) for i in range(n)]
    for m in members:
        seen = {o.public_key: int(T0) for o in members if o is not m}
        for x in cut:
            if m.name == f"n{x}":
                seen[key(cut[1] if x == cut[0] else cut[0])] = 0
        drv.report(m.name, seen, full=True, stale={k for k, v in seen.items() if not v})
    drv.update(members, T0)
    synced_twice(drv, members, T0)
    drv.update(None, T0 + 1)
    drv.update(None, T0 + pairpaths.ATTEMPT_S + 1)  # the cut pair's attempt window closed: relayed
    return drv, members


def failed_twice(drv: PairDriver, members: list[Member]) -> float:
    """`world`'s cut pair tries direct again (RETRY_MIN_S after it was relayed) and fails again: relayed, its next
    try RETRY_S away. Returns when it was relayed the second time."""
    retry = T0 + pairpaths.ATTEMPT_S + 1 + pairpaths.RETRY_MIN_S
    drv.update(None, retry)
    assert drv.mode("n0", "n1").mode == pairpaths.PUBLIC
    synced_twice(drv, members, retry)
    relayed = retry + pairpaths.ATTEMPT_S + 1
    drv.update(None, relayed)
    assert (drv.mode("n0", "n1").mode, drv.mode("n0", "n1").tries) == (pairpaths.RELAYED, 2)
    return relayed


def test_a_relayed_pair_gets_a_member_relay_that_reaches_both_ends(db):
    drv, _ = world(db)
    st = drv.mode("n0", "n1")
    assert st.mode == pairpaths.RELAYED and st.relay == "n2"  # unmeasured: the first name of n2..n4
    assert drv.relaying("n2") == [("n0", "n1")] and drv.take_relay_changes() == {"n2"}
    assert db.pairs()[("n0", "n1")].relay == "n2"  # stored: a restarted coordinator keeps it
    assert PairDriver(db).relaying("n2") == [("n0", "n1")]


def test_the_relay_with_the_shortest_measured_round_trips_wins(db, monkeypatch):
    drv, _ = world(db)
    drv.reroute.add(("n0", "n1"))  # choose again with what the agents measured
    drv.report_rtt("n0", {key(2): 80.0, key(3): 9.0, key(4): 30.0})
    drv.report_rtt("n1", {key(2): 80.0, key(3): 12.0, key(4): 30.0})
    drv.update(None, T0 + 20)
    assert drv.mode("n0", "n1").relay == "n3"


def test_a_member_that_claims_0_ms_to_everyone_is_not_chosen(db):
    """The ends' own measurements decide: n4 says it is 0 ms from n0 and n1 (and from everyone), which before
    overwrote the ends' own legs; the ends measured n3 closest, and n3 relays. Negative control: the same
    claim made by the ends themselves does win."""
    drv, _ = world(db)
    drv.reroute.add(("n0", "n1"))
    drv.report_rtt("n0", {key(2): 80.0, key(3): 9.0, key(4): 60.0})
    drv.report_rtt("n1", {key(2): 80.0, key(3): 12.0, key(4): 60.0})
    drv.report_rtt("n4", {key(i): 0.0 for i in range(4)})  # the liar, after the ends
    drv.update(None, T0 + 20)
    assert drv.mode("n0", "n1").relay == "n3"
    assert drv._rtt("n0", "n4") == 60.0 and drv._rtt("n4", "n0") == 0.0  # its claim is only its own leg
    drv.reroute.add(("n0", "n1"))
    drv.report_rtt("n0", {key(4): 0.0})
    drv.report_rtt("n1", {key(4): 0.0})
    drv.update(None, T0 + 21)
    assert drv.mode("n0", "n1").relay == "n4"


def test_relays_give_each_pair_its_own_port_and_keep_it(db):
    """Two pairs on one relay get two ports; a pair that stays on its relay keeps its port (the ends' WireGuard
    keeps its endpoint); ports are stored with the pair."""
    drv, members = world(db, n=6)
    drv.report("n2", {key(3): 0}, full=False, stale={key(3)})
    drv.report("n3", {key(2): 0}, full=False, stale={key(2)})
    for t in (T0 + 20, T0 + 21, T0 + 20 + pairpaths.ATTEMPT_S + 2):
        drv.update(None, t)
    first, second = drv.mode("n0", "n1"), drv.mode("n2", "n3")
    assert first.mode == second.mode == pairpaths.RELAYED
    if first.relay == second.relay:
        assert first.port != second.port
    assert {first.port, second.port} <= set(relays.RELAY_PORTS)
    assert db.pairs()[("n0", "n1")].port == first.port and PairDriver(db).mode("n0", "n1").port == first.port
    drv.update(None, T0 + 60)
    assert drv.mode("n0", "n1").port == first.port


def test_a_member_that_opted_out_is_never_chosen_and_with_none_left_the_coordinator_relays(db):
    drv, _ = world(db, relay=lambda i: i == 4)
    assert drv.mode("n0", "n1").relay == "n4"
    drv, _ = world(CoordinatorDB.create(db.path.parent / "b.db"), relay=lambda i: False)
    assert drv.mode("n0", "n1").relay == ""  # the coordinator


def test_a_failed_relay_hands_the_pair_to_another_and_is_avoided_for_it(db):
    drv, _ = world(db)
    drv.take_relay_changes()
    assert drv.relay_failed("n0", [key(1)], now=T0 + 20) == 1
    assert drv.update(None, T0 + 20)  # the ends must hear of it
    assert drv.mode("n0", "n1").relay == "n3"
    assert drv.take_relay_changes() == {"n2", "n3"} and ("n0", "n1") in drv.take_changes()
    drv.relay_failed("n1", [key(0)], now=T0 + 21)
    drv.update(None, T0 + 21)
    assert drv.mode("n0", "n1").relay == "n4"
    drv.relay_failed("n1", [key(0)], now=T0 + 22)
    drv.update(None, T0 + 22)
    assert drv.mode("n0", "n1").relay == ""  # every member failed it: the coordinator
    # A report about a pair that is not relayed changes nothing.
    assert drv.relay_failed("n2", [key(3)], now=T0 + 23) == 0


def test_a_pair_the_coordinator_took_over_goes_back_to_a_member_once_one_may_relay_it_again(db):
    """Every member relay failed the pair, so the coordinator carries it; when the first of them may relay it
    again (AVOID_S after it failed) the pair moves back to a member, with no report needed to wake it."""
    drv, members = world(db)
    t0 = failed_twice(drv, members)  # its next direct try is RETRY_S away: it stays relayed meanwhile
    for t, end, other in ((t0 + 9, "n0", 1), (t0 + 10, "n1", 0), (t0 + 11, "n1", 0)):
        drv.relay_failed(end, [key(other)], now=t)
        drv.update(None, t)
    assert drv.mode("n0", "n1").relay == ""
    drv.take_changes()
    drv.update(None, t0 + 9 + AVOID_S - 1)  # every member still avoided: the coordinator keeps it
    assert drv.mode("n0", "n1").relay == "" and drv.take_changes() == set()
    assert drv.update(None, t0 + 9 + AVOID_S + 0.5)  # n2's avoidance over: the ends must hear of it
    assert drv.mode("n0", "n1").relay == "n2" and ("n0", "n1") in drv.take_changes()
    assert drv.relaying("") == [] and db.pairs()[("n0", "n1")].relay == "n2"


def test_a_relay_that_loses_its_tunnel_to_an_end_or_leaves_hands_its_pairs_on(db):
    drv, members = world(db)
    failed_twice(drv, members)  # its next direct try is RETRY_S away: it stays relayed meanwhile
    assert drv.mode("n0", "n1").relay == "n2"
    # n2's tunnel with n1 goes stale (both ends say so): n2 no longer reaches n1 directly.
    drv.report("n2", {key(1): int(T0)}, full=False, stale={key(1)})
    drv.report("n1", {key(2): int(T0)}, full=False, stale={key(2)})
    for m in members:  # every agent is still heard from
        drv.report(m.name, {}, full=False, stale=set(), now=T0 + 199)
    drv.update(None, T0 + 200)
    # That pair is relayed now (by n3), and n0 <-> n1 moves on, to the relay with no pair yet (n4).
    assert drv.mode("n1", "n2").mode == pairpaths.RELAYED and drv.mode("n1", "n2").relay == "n3"
    assert drv.mode("n0", "n1").relay == "n4"
    # n4 is removed from the network: its pair moves in the same update, to the one relay left.
    drv.update([m for m in members if m.name != "n4"], T0 + 201)
    assert drv.mode("n0", "n1").relay == "n3"
    assert not drv.by_relay.get("n4")


def test_a_handshake_through_the_relay_verifies_the_pair_and_keeps_its_relay_and_port(db):
    """The ends' handshakes cross the relay now: they prove the relayed path, and the pair stays where it is."""
    drv, _ = world(db)
    before = drv.mode("n0", "n1")
    drv.take_relay_changes()
    drv.report("n0", {key(1): int(T0 + 30)}, full=False, stale=set())
    drv.update(None, T0 + 31)
    after = drv.mode("n0", "n1")
    assert (after.mode, after.relay, after.port, after.verified) == (pairpaths.RELAYED, "n2", before.port, True)
    assert drv.relaying("n2") == [("n0", "n1")] and drv.take_relay_changes() == set()


# ------------------------------------------------------------------------------------- the whole mesh
def _nodes(mesh: FakeMesh, names: str):
    nodes = [mesh.join(x, f"198.51.100.{i + 2}:40000") for i, x in enumerate(names)]
    for n in nodes:
        mesh.see(n)
    for _ in range(3):
        mesh.sync()
    return nodes


def _ports(relay) -> list[tuple[int, tuple[str, str]]]:
    """What a relay forwards: [(port, the ends' keys)], none before it was first asked."""
    return [] if relay is None else [(p.port, p.keys) for p in relay.pairs]


def test_both_ends_reach_each_other_at_the_relays_port_and_only_the_relay_forwards_the_pair(tmp_path, monkeypatch):
    mesh = FakeMesh(tmp_path)
    a, b, c = _nodes(mesh, "abc")
    t = int(time.time())
    mesh.handshake(a, c, when=t)
    mesh.handshake(b, c, when=t)
    mesh.sync()
    mesh.sync()
    mesh.coord.tick(now=time.time() + pairpaths.ATTEMPT_S + 1)  # a <-> b never handshook: relayed
    mesh.sync()
    st = mesh.coord.pairs.mode("a", "b")
    assert (st.mode, st.relay) == (pairpaths.RELAYED, "c") and st.port in relays.RELAY_PORTS
    # Each end keeps the other as its own peer, its own address only, at c's host and the pair's port: c's
    # tunnels carry nothing of the pair's.
    c_host = mesh.member_seen_by(a, c).endpoint.rsplit(":", 1)[0]
    assert mesh.peer(a, b).allowed_ips == (f"{b.ip}/32",) and mesh.peer(a, b).endpoint == f"{c_host}:{st.port}"
    assert mesh.peer(b, a).allowed_ips == (f"{a.ip}/32",) and mesh.peer(b, a).endpoint.endswith(f":{st.port}")
    assert mesh.peer(a, c).allowed_ips == (f"{c.ip}/32",) and mesh.peer(b, c).allowed_ips == (f"{c.ip}/32",)
    assert mesh.member_seen_by(a, b).via == c.key and mesh.member_seen_by(a, b).via_port == st.port
    # c forwards exactly that pair, on that port, between those keys; nobody else forwards anything.
    assert _ports(c.agent.relaying.relay) == [(st.port, (a.key, b.key))]
    assert a.agent.relaying.relay is None and b.agent.relaying.relay is None and mesh.coord.relaying.relay is None

    # c's agent stops forwarding (its machine is gone, say): a notices through its probe and reports it, once
    # the relay's grace for a first handshake through it is over.
    a.agent.probe = lambda ip: None if ip == b.ip else 0.001
    for _ in range(3):
        assert a.agent.check_relays() == []
    monkeypatch.setattr(daemon, "RELAY_GRACE_S", 0.0)
    for _ in range(3):
        a.agent.check_relays()
    mesh.sync()
    st = mesh.coord.pairs.mode("a", "b")
    assert st.relay == "" and st.port in relays.RELAY_PORTS  # only the coordinator is left
    coord_host = mesh.network.endpoints[0].rsplit(":", 1)[0]
    assert mesh.peer(a, b).endpoint == f"{coord_host}:{st.port}" and mesh.peer(a, b).allowed_ips == (f"{b.ip}/32",)
    assert [p for p, _ in _ports(mesh.coord.relaying.relay)] == [st.port]
    mesh.sync()
    assert _ports(c.agent.relaying.relay) == []  # told it relays nothing any more


def test_a_node_that_joined_with_no_relay_refuses_to_forward(tmp_path):
    mesh = FakeMesh(tmp_path)
    a, b, c = _nodes(mesh, "abc")
    c.agent.rec["relay"] = False
    c.agent.sync_once(wait=0)
    c.agent._relay([[a.ip, b.ip, relays.RELAY_PORTS[0]]])  # as if a coordinator asked anyway
    assert _ports(c.agent.relaying.relay) == []


def test_a_relay_is_told_only_well_formed_pairs_of_members(tmp_path):
    """Ports outside the relay range, a port given twice and addresses of non-members are left out."""
    mesh = FakeMesh(tmp_path)
    a, b, c = _nodes(mesh, "abc")
    c.agent.sync_once(wait=0)
    first = relays.RELAY_PORTS[0]
    c.agent._relay([[a.ip, b.ip, first], [a.ip, "10.213.9.9", first + 1], [b.ip, a.ip, first], [a.ip, b.ip, 22]])
    assert [p for p, _ in _ports(c.agent.relaying.relay)] == [first]


def test_a_report_about_a_relay_the_pair_already_left_changes_nothing(db):
    drv, _ = world(db)
    assert drv.relay_failed("n0", [key(1)], now=T0 + 20, via={key(1): key(2)}) == 1  # n0 tried n2
    drv.update(None, T0 + 20)
    assert drv.mode("n0", "n1").relay == "n3"
    # n1's report about n2 arrives late: n3 is not blamed for it.
    assert drv.relay_failed("n1", [key(0)], now=T0 + 21, via={key(0): key(2)}) == 0
    drv.update(None, T0 + 21)
    assert drv.mode("n0", "n1").relay == "n3"
