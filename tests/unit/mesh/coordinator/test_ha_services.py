"""Two coordinator services on one replicated state (a FakeEtcd, held to the real etcd's contract): one leads,
the other answers its agents' syncs and joins, forwards their reports to the leader, and takes the lead once
the leader's lease ran out. Real services and agents on FakeDevices (tests/fakemesh.py), in one process."""

from __future__ import annotations

import time

import pytest
from fakemesh import FakeMesh, signed_request

from meshrun.core import keys
from meshrun.core.token import parse_token
from meshrun.mesh.coordinator.daemon import CoordinatorService
from meshrun.mesh.coordinator.leader import LEASE_TTL_S
from meshrun.mesh.node import setup as node
from meshrun.system.control.coordinatordb import CoordinatorDB, CoordinatorInfo
from meshrun.system.control.etcdstate import EtcdCoordinatorDB
from meshrun.system.control.fakeetcd import FakeEtcd
from meshrun.system.sockets.transport import Request, raise_for
from meshrun.system.sockets.udprelay import FakeRelay


class Clock:
    def __init__(self) -> None:
        self.t = time.monotonic()

    def __call__(self) -> float:
        return self.t


def settle(db: EtcdCoordinatorDB, version: int) -> None:
    deadline = time.monotonic() + 5
    while db.version() < version and time.monotonic() < deadline:
        time.sleep(0.01)


def public_key(svc: CoordinatorService) -> str:
    return keys.public_key(svc.state.read("private.key").decode().strip())


@pytest.fixture
def two(tmp_path):
    """Coordinator A (made by init, its state moved into etcd) and node b, made coordinator B; nodes n1, n2."""
    mesh = FakeMesh(tmp_path)
    n1 = mesh.join("n1", "198.51.100.11:40001")
    b = mesh.join("b", "198.51.100.20:51820")
    mesh.sync()
    clock = Clock()
    store = FakeEtcd(clock=clock)
    sqlite = CoordinatorDB(mesh.coord_state / "coordinator.db")
    dump = sqlite.dump()
    sqlite.close()
    first = EtcdCoordinatorDB(store)
    first.load(dump)
    net = mesh.network
    first.add_coordinator("coordinator", net.coordinator_public_key, net.coordinator_ip, net.endpoints[0])
    first.add_coordinator("b", b.key, b.ip, "198.51.100.20:51820")
    for name, key, ip, ep in (("coordinator", net.coordinator_public_key, net.coordinator_ip, net.endpoints[0]),
                              ("b", b.key, b.ip, "198.51.100.20:51820")):  # fmt: skip
        first.put_coordinator(CoordinatorInfo(name, key, ip, ep, net.fingerprint))
    for state in (mesh.coord_state, b.state):
        rec = state.read_json("member.json")
        state.write_json("member.json", dict(rec, role="coordinator", control={"kind": "etcd", "endpoints": ["x"]}))
    services = {}

    def forward(ip, batch):
        leader = next(s for s in services.values() if s.ip == ip)
        sender = services["other"]
        key = sender.overlay_keys(public_key(leader))  # as the follower signs it (with its own private key)
        resp = leader.overlay.handle(signed_request("POST", "/v1/forward", sender.ip, batch, key))
        raise_for(resp.status, resp.body, "leader")
        return resp.body

    def service(state, device):
        svc = CoordinatorService(
            state, device=device, db=EtcdCoordinatorDB(store, follow=True), forward_with=forward,
            guard_etcd=lambda *a: None, etcd_member=False, make_relay=FakeRelay,
        )  # fmt: skip
        svc.overlay.max_wait = 0.0
        return svc

    services["a"] = service(mesh.coord_state, mesh.coord_device)
    services["b"] = services["other"] = service(b.state, b.device)
    services["a"].tick()
    services["b"].tick()
    yield mesh, services, store, clock, n1
    for svc in services.values():
        svc.db.close()


def test_one_leads_and_the_other_follows_answering_syncs_from_the_replicated_state(two):
    mesh, svc, store, clock, n1 = two
    a, b = svc["a"], svc["b"]
    assert (a.leading, b.leading) == (True, False)

    # n1 syncs with B: the member list comes from B's mirror of the store, the report goes to A's pair driver.
    def sync() -> dict:
        body = dict(n1.agent.heartbeat(n1.device.peers()), wait=0)
        resp = b.overlay.handle(signed_request("POST", "/v1/sync", n1.ip, body, n1.agent.overlay_keys(public_key(b))))
        assert resp.status == 200, resp.body
        n1.agent.full_report = resp.body.get("report") == "full"
        return resp.body

    answer = sync()
    assert {m["name"] for m in answer["members"]} == {"coordinator", "n1", "b"}
    assert answer["report"] == "full"  # the leader has no full report from n1 yet: B asks for one
    assert sync()["report"] == "full"  # sent, not yet taken by the leader
    b.reports.flush()
    assert "n1" in a.pairs.reports  # the leader's pair driver has it
    assert "report" not in sync()


def test_a_node_joins_through_the_follower_and_the_leader_puts_it_on_its_interface(two):
    mesh, svc, store, clock, n1 = two
    a, b = svc["a"], svc["b"]
    tok = parse_token(mesh.token)
    from meshrun.core import keys

    private = keys.generate_private_key()
    body = node.join_request(tok, "n9", private, b.public_key, [])
    resp = b.enrolment.handle(Request("POST", "/v1/join", "198.51.100.99", body))
    assert resp.status == 200, resp.body
    pub = keys.public_key(private)
    assert pub in {p.public_key for p in b.device.peers()}  # at once, on the one it joined through
    settle(a.db, b.db.version())
    a.tick()
    assert pub in {p.public_key for p in a.device.peers()}
    assert a.roster.version == b.db.version()


def test_the_follower_takes_the_lead_once_the_leaders_lease_ran_out(two):
    mesh, svc, store, clock, n1 = two
    a, b = svc["a"], svc["b"]
    v = a.db.version()
    clock.t += LEASE_TTL_S + 1  # A's machine is gone: nothing keeps its lease alive
    store.expire()
    b.tick()
    assert b.leading and b.db.fence is not None
    b.db.bump_version()  # a leader's write, fenced by its own key
    assert b.db.version() == v + 1
    a.tick()  # A comes back: it follows now
    assert not a.leading and a.leadership.leader == "b"
