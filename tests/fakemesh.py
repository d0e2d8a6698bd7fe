"""A whole mesh in one process for unit tests: the real coordinator service and real agents, each on a
FakeDevice, talking through their API handlers directly (no sockets, no root, no kernel).

`FakeMesh(tmp_path)` runs the real `meshrun.mesh.coordinator.setup.init` (start=False) and
`meshrun.mesh.node.setup.join` (start=False); an agent's calls reach the coordinator's overlay handler
with the agent's overlay IP as the source address, as WireGuard would deliver them.
`handshake(a, b)` stands in for WireGuard: both ends record a handshake and the coordinator sees
each node's endpoint. Time is the real clock; tests that need another `now` pass it explicitly.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from meshrun.core import auth
from meshrun.mesh.coordinator.daemon import CoordinatorService
from meshrun.mesh.coordinator.setup import InitOptions, init
from meshrun.mesh.node import setup as node
from meshrun.mesh.node.daemon import AgentService
from meshrun.system.files.statedir import StateDir
from meshrun.system.kernel.fakedevice import FakeDevice
from meshrun.system.sockets.transport import Request, raise_for
from meshrun.system.sockets.udprelay import FakeRelay

COORD_ENDPOINT = "203.0.113.1"


def signed_request(method: str, path: str, client_ip: str, body: object, key: bytes | None) -> Request:
    """A request as meshrun.system.sockets.transport sends it: the JSON body's bytes and, with `key`, their MAC."""
    raw = json.dumps(body).encode() if body is not None else b""
    headers = {"Authorization": auth.sign(key, method, path, raw, time.time())} if key is not None else {}
    return Request(method, path, client_ip, body, raw=raw, headers=headers)


@dataclass
class Node:
    name: str
    state: StateDir
    device: FakeDevice
    agent: AgentService
    public: str  # the endpoint the coordinator sees it at
    private: str  # its LAN candidate

    @property
    def key(self) -> str:
        return self.agent.rec["public_key"]

    @property
    def ip(self) -> str:
        return self.agent.rec["overlay_ip"]


class FakeMesh:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.coord_state = StateDir(root / "coordinator")
        self.coord_device = FakeDevice()
        res = init(InitOptions(endpoint=COORD_ENDPOINT), self.coord_state, start=False, device=self.coord_device)
        self.token = res.token
        self.network = res.network
        self.coord = self.new_coordinator()
        self.nodes: dict[str, Node] = {}

    def new_coordinator(self) -> CoordinatorService:
        """A fresh coordinator service over the same state and device (a daemon restart)."""
        svc = CoordinatorService(self.coord_state, device=self.coord_device, make_relay=FakeRelay)
        svc.overlay.max_wait = 0.0  # long-polls answer at once in unit tests
        self.coord = svc
        return svc

    def _enrol(self, tok, name, private_key, candidates, source: str = "198.51.100.200") -> dict:
        body = node.join_request(tok, name, private_key, tok.coordinator_key, candidates)
        resp = self.coord.enrolment.handle(Request("POST", "/v1/join", source, body))
        assert resp.status == 200, resp.body
        return resp.body

    def join(self, name: str, public: str, private: str | None = None, site: str | None = None) -> Node:
        """Enrol `name` (start=False: no daemon) on its own FakeDevice, in `site` if given; returns it, not yet
        synced."""
        state = StateDir(self.root / name)
        device = FakeDevice(name=self.network.interface)
        node.join(
            self.token,
            state,
            name=name,
            start=False,
            mtu=1420,
            device=device,
            # From the node's own public address: the enrolment API limits joins per source.
            enrol_with=lambda *a: self._enrol(*a, source=public.rsplit(":", 1)[0]),
            abandon_with=lambda *a: None,
            site=site,
        )
        n = Node(name, state, device, None, public, private or "172.31.40.46:51820")  # type: ignore[arg-type]
        n.agent = AgentService(
            state,
            device=device,
            call=self._caller(n),
            addresses=lambda iface, n=n: [n.private.rsplit(":", 1)[0]],
            make_relay=FakeRelay,
        )
        self.nodes[name] = n
        return n

    def request(self, n: Node, method: str, path: str, body: object) -> Request:
        """`n`'s request as its agent sends it to the coordinator: from its overlay address, signed with its key."""
        return signed_request(method, path, n.ip, body, n.agent._key_for(self.network.coordinator_ip))

    def _caller(self, n: Node):
        def call(method: str, path: str, body: dict, timeout: float) -> dict:
            resp = self.coord.overlay.handle(self.request(n, method, path, body))
            raise_for(resp.status, resp.body, "coordinator")
            return resp.body

        return call

    def see(self, n: Node, when: int | None = None) -> None:
        """The coordinator's WireGuard hears from `n` (handshake at `when`, from its public endpoint)."""
        self.coord_device.handshake(n.key, int(time.time()) if when is None else when, n.public)

    def handshake(self, a: Node, b: Node, when: int | None = None) -> None:
        """Nodes a and b complete a direct handshake (both devices record it)."""
        when = int(time.time()) if when is None else when
        a.device.handshake(b.key, when)
        b.device.handshake(a.key, when)

    def sync(self, *nodes: Node) -> None:
        """One sync round for each node (all of them by default), with a coordinator tick first."""
        self.coord.tick()
        for n in nodes or tuple(self.nodes.values()):
            n.agent.sync_once(wait=0)

    def peer(self, n: Node, other: Node):
        return next(p for p in n.device.peers() if p.public_key == other.key)

    def peer_on_coordinator(self, n: Node):
        return next(p for p in self.coord_device.peers() if p.public_key == n.key)

    def member_seen_by(self, n: Node, other: Node):
        return next(m for m in n.agent.members if m.public_key == other.key)
