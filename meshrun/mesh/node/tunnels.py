"""The node agent's extra tunnels per pair (`meshrun join --tunnels K`): made once, peered from each member list,
each (peer, tunnel) proven by probes, a peer's flows spread over its live tunnels.

`apply(members)` after every sync makes the devices and their peers match `tunnels.plan`; `check()` every
PROBE_EVERY_S probes each (peer, tunnel) and spreads each peer's flows over the tunnels that answer
(`tunnels.ruleset`). The overlay interface carries a share of every pair's flows all along, so a pair whose
tunnels all fail is on it alone once they leave the hash. What is live is written to tunnels.json for
`meshrun status` and `doctor` (and for `meshrun leave`, which finds the wireguard-go processes there when the
agent could not remove them).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable

from meshrun.core import lanpath, tunnels
from meshrun.core.model import Member, Network
from meshrun.errors import MeshrunError
from meshrun.system.files.statedir import StateDir
from meshrun.system.kernel import tunnellink

log = logging.getLogger("meshrun.mesh.node.tunnels")

RETRY_S = 30.0  # tunnels that could not be made are tried again this long after (a sync must come too)
LinkFactory = Callable[..., "tunnellink.TunnelLink | tunnellink.FakeTunnelLink"]


class Tunnels:
    """One member's extra tunnels. `probe(overlay IP, port, source, tunnel)` is one try through a tunnel."""

    def __init__(
        self,
        state: StateDir,
        network: Network,
        rec: dict,
        make_link: LinkFactory = tunnellink.TunnelLink,
        probe: Callable[[str, int, str, int], float | None] = tunnellink.probe,
    ) -> None:
        self.state = state
        self.network = network
        self.count = int(rec.get("tunnels") or 1)
        self.own_key = rec["public_key"]
        self.overlay_ip = rec["overlay_ip"]
        self.link = make_link(network.interface, self.overlay_ip, self.count, state / "private.key", state.path)
        self.probe = probe
        self.peers: tuple[tunnels.TunnelPeer, ...] = ()  # as installed
        self.interfaces: list[str] = []  # where overlay traffic may arrive (the guard's)
        self.health = lanpath.Health()
        self.lock = threading.Lock()
        self.error = ""  # why the tunnels could not be made ("" when they could)
        self.retry_at = 0.0
        self._written: dict | None = None

    @property
    def enabled(self) -> bool:
        return self.count > 1

    def start(self) -> None:
        """Make the devices (no peers yet) before the agent's listeners start: they bind to the overlay address
        alone only when the tunnels exist (meshrun.system.kernel.lanlink.bind_device)."""
        self.apply([])

    def apply(self, members: list[Member], routed_via: str | None = None) -> None:
        """Make the tunnels' peers what the member list plans. `routed_via`: the LAN interface a routed site LAN
        path delivers the overlay on (the guard lets it through). A host that cannot make them keeps every pair
        on the overlay interface and says why in tunnels.json."""
        if not self.enabled:
            return
        plan = tunnels.plan(self.own_key, members, self.count)
        with self.lock:
            if self.error and time.monotonic() < self.retry_at:
                return
            try:
                self.interfaces = tunnels.overlay_interfaces(self.network.interface, self.count, routed_via)
                if self.link.ensure(self.interfaces):  # made (anew): no peers, nothing spread, nothing proven
                    log.info("extra tunnels: %s", ", ".join(self.link.names))
                    self.peers, self.health = (), lanpath.Health()
                self.error = ""
                self.link.follow_mtu()
                if plan != self.peers:
                    self.link.set_peers(plan)
                    self.peers = plan
                    self.health.keep(tunnels.health_key(p.overlay_ip, i) for p in plan for i in p.extra)
                    log.info("tunnels per pair: %s", ", ".join(f"{p.name} {p.count}" for p in plan) or "no peer")
                self._spread()
            except MeshrunError as exc:
                log.warning("no extra tunnels: %s (trying again in %.0f s)", exc, RETRY_S)
                self.error = exc.message
                self.retry_at = time.monotonic() + RETRY_S
                try:
                    self.link.delete()
                except MeshrunError:
                    pass
                self.peers, self.health = (), lanpath.Health()
            self._record()

    def _live(self, p: tunnels.TunnelPeer) -> list[int]:
        return [i for i in p.extra if tunnels.health_key(p.overlay_ip, i) in self.health.active]

    def _spread(self) -> None:
        self.link.set_rules(self.interfaces, {p.overlay_ip: self._live(p) for p in self.peers})

    def check(self) -> None:
        """Probe every (peer, tunnel) once (together); spread anew when a peer's live tunnels changed."""
        with self.lock:
            peers = list(self.peers)
        if not peers:
            return
        tries = [(p, i) for p in peers for i in p.extra]
        port = self.network.api_port
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(tries))) as pool:
            answers = list(pool.map(lambda t: self.probe(t[0].overlay_ip, port, self.overlay_ip, t[1]), tries))
        with self.lock:
            if list(self.peers) != peers:
                return  # planned anew while probing: the next round judges the new plan
            moved = {p for (p, i), rtt in zip(tries, answers) if self.health.record(tunnels.health_key(p.overlay_ip, i),
                                                                                     rtt is not None)}  # fmt: skip
            if not moved:
                return
            for p in sorted(moved, key=lambda p: p.name):
                log.info("%s on %d of %d tunnels", p.name, 1 + len(self._live(p)), p.count)
            try:
                self._spread()
            except MeshrunError as exc:
                log.warning("could not spread the flows anew: %s", exc)
            self._record()

    def _record(self) -> None:
        rec = {
            "count": self.count,
            "devices": list(self.link.names) if self.link.made else [],
            "ports": [tunnels.port(i) for i in range(1, self.count)],
            "pids": dict(self.link.pids),
            "peers": {p.name: {"live": self._live(p), "lan_ip": p.lan_ip, "count": p.count} for p in self.peers},
            "error": self.error,
        }
        if rec != self._written:
            try:
                self.state.write_json("tunnels.json", rec)
                self._written = rec
            except MeshrunError as exc:
                log.warning("could not record the tunnels: %s", exc)

    def close(self) -> None:
        """Remove the extra tunnels (the agent stops: no one would probe them); every pair is on the overlay
        interface alone."""
        if not self.enabled:
            return
        with self.lock:
            try:
                self.link.delete()
            except MeshrunError as exc:
                log.warning("could not remove the extra tunnels: %s", exc)
            self.peers, self.health = (), lanpath.Health()
            self._record()
