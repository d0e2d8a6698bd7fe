"""The coordinator's loop and the agent's sync, end to end in one process on FakeDevices (no root).

Real CoordinatorService (SQLite state, enrolment and overlay handlers, pair driver) and real
AgentServices; only the WireGuard devices and the transport between them are stand-ins
(tests/fakemesh.py).
"""

from __future__ import annotations

import threading
import time

import pytest

from fakemesh import FakeMesh
from meshrun.core import paths
from meshrun.errors import StateError
from meshrun.system.fakedevice import FakeDevice


@pytest.fixture
def mesh(tmp_path):
    return FakeMesh(tmp_path)


def test_join_puts_the_node_on_the_coordinator_device(mesh):
    a = mesh.join("a", "198.51.100.2:40000")
    peer = mesh.peer_on_coordinator(a)
    assert peer.allowed_ips == (f"{a.ip}/32",) and peer.endpoint is None and peer.keepalive == 0
    # and the node has the coordinator, at its public endpoint, with a keepalive
    coord = next(p for p in a.device.peers() if p.public_key == mesh.network.coordinator_public_key)
    assert coord.endpoint == "203.0.113.1:51820" and coord.keepalive == 25


def test_nodes_learn_each_other_once_the_coordinator_has_seen_them(mesh):
    a, b = mesh.join("a", "198.51.100.2:40000"), mesh.join("b", "198.51.100.3:40001")
    mesh.sync()
    assert mesh.member_seen_by(a, b).endpoint is None      # not observed yet: nothing to dial
    mesh.see(a)
    mesh.see(b)
    mesh.sync()
    mesh.sync()            # the first sync reported candidates; pairs are judged once both did
    assert mesh.member_seen_by(a, b).path == paths.PUBLIC
    assert mesh.peer(a, b).endpoint == "198.51.100.3:40001"
    assert mesh.peer(b, a).endpoint == "198.51.100.2:40000"
    assert mesh.peer(a, b).allowed_ips == (f"{b.ip}/32",)


def test_nodes_behind_one_public_ip_talk_over_their_private_addresses(mesh):
    a = mesh.join("a", "198.51.100.9:40000", "172.31.40.46:51820")
    b = mesh.join("b", "198.51.100.9:40002", "172.31.40.47:51820")
    mesh.see(a)
    mesh.see(b)
    for _ in range(3):
        mesh.sync()
    assert mesh.member_seen_by(a, b).path == paths.PRIVATE
    assert mesh.peer(a, b).endpoint == "172.31.40.47:51820"
    assert mesh.peer(b, a).endpoint == "172.31.40.46:51820"


def test_a_pair_without_a_handshake_falls_back_to_relayed_through_the_coordinator(mesh):
    a, b = mesh.join("a", "198.51.100.2:40000"), mesh.join("b", "198.51.100.3:40001")
    mesh.see(a)
    mesh.see(b)
    for _ in range(3):
        mesh.sync()
    t0 = time.time()
    mesh.coord.tick(now=t0 + paths.ATTEMPT_S + 1)          # the direct attempt timed out
    for n in (a, b):
        n.agent.sync_once(wait=0)
    assert mesh.member_seen_by(a, b).path == paths.RELAYED
    assert mesh.peer(a, b).allowed_ips == ()                 # b's entry keeps trying direct, carries nothing
    coord = next(p for p in a.device.peers() if p.public_key == mesh.network.coordinator_public_key)
    assert f"{b.ip}/32" in coord.allowed_ips                 # b is reached through the coordinator


def test_a_reported_handshake_verifies_the_pair_and_it_stays_direct(mesh):
    a, b = mesh.join("a", "198.51.100.2:40000"), mesh.join("b", "198.51.100.3:40001")
    mesh.see(a)
    mesh.see(b)
    for _ in range(3):
        mesh.sync()
    mesh.handshake(a, b)
    mesh.sync()            # the agents report it, the next tick judges it
    mesh.coord.tick(now=time.time() + paths.ATTEMPT_S * 3)
    assert mesh.coord.pairs.mode("a", "b") == paths.PairState(paths.PUBLIC, mesh.coord.pairs.mode("a", "b").since,
                                                             True)


def test_an_unchanged_sync_applies_nothing(mesh):
    a, b = mesh.join("a", "198.51.100.2:40000"), mesh.join("b", "198.51.100.3:40001")
    mesh.see(a)
    mesh.see(b)
    for _ in range(3):
        mesh.sync()
    mesh.handshake(a, b)
    for _ in range(2):
        mesh.sync()
    before = len(a.device.applied)
    mesh.sync()
    assert len(a.device.applied) == before


def test_a_tick_survives_a_failed_device_read(mesh):
    a = mesh.join("a", "198.51.100.2:40000")
    mesh.coord_device.fail_reads = 1
    mesh.coord.tick()                       # logged, not raised
    mesh.see(a)
    mesh.coord.tick()
    assert mesh.coord.db.member_by_name("a").endpoint == "198.51.100.2:40000"


def test_a_removed_node_hears_410_and_takes_its_interface_down(mesh):
    a = mesh.join("a", "198.51.100.2:40000")
    mesh.sync()
    mesh.coord.db.remove_member("a")
    with pytest.raises(StateError) as exc:
        a.agent.sync_once(wait=0)
    assert getattr(exc.value, "status", None) == 410
    a.agent._cleanup_removed()
    assert not a.device.exists() and a.agent.state.read_json("member.json")["removed"] is True


# --------------------------------------------------------------------------- restarts (issue: jobs outlive the daemon)

def _meshed(mesh):
    """Two nodes with a verified direct pair, every agent in sync."""
    a, b = mesh.join("a", "198.51.100.2:40000"), mesh.join("b", "198.51.100.3:40001")
    mesh.see(a)
    mesh.see(b)
    for _ in range(3):
        mesh.sync()
    mesh.handshake(a, b)
    for _ in range(2):
        mesh.sync()
    assert mesh.coord.pairs.mode("a", "b").verified
    return a, b


def test_versions_never_repeat_across_a_restart_and_path_changes_bump_them(mesh):
    a, b = _meshed(mesh)
    before = mesh.coord.roster.version
    restarted = mesh.new_coordinator()
    assert restarted.roster.version == before            # persisted, not rebuilt from a counter at 0
    mesh.coord.tick(now=time.time() + paths.STALE_S + 60)  # nothing reported since: nothing judged
    assert mesh.coord.roster.version == before
    mesh.sync()                                           # first sync: delta, the coordinator asks for a full one
    mesh.sync()
    mesh.coord.tick(now=time.time() + paths.STALE_S + 60)  # the reported handshake is now too old: relayed
    assert mesh.coord.pairs.mode("a", "b").mode == paths.RELAYED
    assert mesh.coord.roster.version > before


def test_a_working_pair_keeps_its_path_and_its_peers_across_a_restart(mesh):
    a, b = _meshed(mesh)
    hs = {n.name: mesh.peer(n, other).latest_handshake for n, other in ((a, b), (b, a))}
    applied = {n.name: len(n.device.applied) for n in (a, b)}
    mesh.new_coordinator()
    for _ in range(4):
        mesh.sync()
    assert mesh.coord.pairs.mode("a", "b").mode == paths.PUBLIC and mesh.coord.pairs.mode("a", "b").verified
    # No peer was re-created: the handshake WireGuard has is the one it had (a re-created peer has 0).
    assert {n.name: mesh.peer(n, other).latest_handshake for n, other in ((a, b), (b, a))} == hs
    assert {n.name: len(n.device.applied) for n in (a, b)} == applied


class FlakyDevice(FakeDevice):
    """A device whose reads fail with an unexpected exception a given number of times."""

    def __init__(self, base: FakeDevice, failures: int) -> None:
        self.__dict__.update(base.__dict__)
        self.failures = failures

    def peers(self):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("simulated bug in a tick")
        return super().peers()


def test_the_loop_survives_a_failing_tick(mesh):
    svc = mesh.coord
    svc.interval = 0.05
    svc.device = FlakyDevice(mesh.coord_device, failures=2)
    t = threading.Thread(target=svc._loop, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 10
        while svc.tick_count < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert svc.tick_count >= 5 and t.is_alive() and svc.device.failures == 0
    finally:
        svc.stop_event.set()
        t.join(5)
