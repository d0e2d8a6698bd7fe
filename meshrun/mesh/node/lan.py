"""The node agent's site LAN path: planned from each member list, proven by probes, dropped when they fail.

`apply(members)` after every sync makes the device and its peers match `lanpath.plan` (or removes it all when
nothing is planned); `check()` every PROBE_EVERY_S probes each planned peer through the LAN path and moves its
route in or out of the active table (`lanpath.Health`). The pair's WireGuard peer stays configured all along,
so a pair leaving the LAN path is back on its tunnel as soon as the route is gone. What is active is written to
lan.json for `meshrun status` and `doctor`.
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
from meshrun.system.kernel import lanlink

log = logging.getLogger("meshrun.mesh.node.lan")

RETRY_S = 30.0  # a LAN path that could not be made is tried again this long after (a sync must come too)
REASSERT_EVERY = 10  # probe rounds between re-installing the active routes
LinkFactory = Callable[[str, str, str, "lanlink.HostSettings"], "lanlink.LanLink | lanlink.FakeLanLink"]


class LanPaths:
    """One member's LAN path. `probe(overlay IP, port, source)` is one try through it (seconds or None)."""

    def __init__(
        self,
        state: StateDir,
        network: Network,
        rec: dict,
        make_link: LinkFactory = lanlink.LanLink,
        probe: Callable[[str, int, str], float | None] = lanlink.probe,
    ) -> None:
        self.state = state
        self.network = network
        self.own_key = rec["public_key"]
        self.overlay_ip = rec["overlay_ip"]
        self.link = make_link(network.interface, self.overlay_ip, network.name, lanlink.host_settings(state.path))
        self.probe = probe
        self.plan = lanpath.LanPlan(None)  # what is in place
        self.wanted = lanpath.LanPlan(None)  # what the last member list asked for (tried once per change)
        self.health = lanpath.Health()
        self.lock = threading.Lock()
        self.error = ""  # why the planned LAN path could not be made ("" when it could)
        self._written: dict | None = None
        self.rounds = 0  # probe rounds so far
        self.retry_at = 0.0  # after a failure, when the next member list tries again

    def apply(self, members: list[Member]) -> None:
        """Make the LAN path what the member list plans (nothing planned: none). A host that cannot make it
        (no VXLAN) keeps every pair on WireGuard and says why in lan.json."""
        plan = lanpath.plan(self.own_key, members)
        with self.lock:
            if plan == self.wanted and not (self.error and time.monotonic() >= self.retry_at):
                return
            self.wanted = plan
            before = self.plan
            try:
                if plan.local_ip is None:
                    if self.plan.local_ip is not None:
                        self.link.delete(self.network.interface)
                        log.info("site LAN path removed (no trusted peer)")
                else:
                    self.link.ensure(plan.local_ip, plan.routed)
                    via = self.link.underlay if plan.routed else None
                    guard = lanpath.guard_script(
                        self.overlay_ip,
                        plan.peers,
                        self.network.interface,
                        routed_via=via,
                        tunnels=tunnels.device_names(self.network.interface),  # every one this member may run
                    )
                    self.link.set_peers(list(plan.peers), guard)
                    log.info(
                        "site LAN path on %s%s to %s",
                        plan.local_ip,
                        " (routed, no encapsulation)" if plan.routed else "",
                        ", ".join(p.name for p in plan.peers),
                    )
                self.error = ""
            except MeshrunError as exc:
                log.warning("no site LAN path: %s (trying again in %.0f s)", exc, RETRY_S)
                self.error = exc.message
                self.retry_at = time.monotonic() + RETRY_S
                try:
                    self.link.delete(self.network.interface)
                except MeshrunError:
                    pass
                plan = lanpath.LanPlan(None)
            self.plan = plan
            # A peer whose path was made anew (its LAN address or this member's moved: the device or its entries
            # were replaced, its active route with them) is proven again before its traffic moves to it.
            same = set(before.peers) if (before.local_ip, before.routed) == (plan.local_ip, plan.routed) else set()
            self.health.keep(p.overlay_ip for p in plan.peers if p in same)
            self._record()

    def check(self) -> None:
        """Probe every planned peer once through the LAN path (together); move the routes whose health changed."""
        with self.lock:
            peers = list(self.plan.peers)
        if not peers:
            return
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(peers))) as pool:
            answers = list(pool.map(lambda p: self.probe(p.overlay_ip, self.network.api_port, self.overlay_ip), peers))
        with self.lock:
            if list(self.plan.peers) != peers:
                return  # the plan moved while probing: the next round judges the new one
            self.rounds += 1
            for p, rtt in zip(peers, answers):
                if not self.health.record(p.overlay_ip, rtt is not None):
                    if p.overlay_ip in self.health.active and self.rounds % REASSERT_EVERY == 0:
                        self._reassert(p)
                    continue
                try:
                    if p.overlay_ip in self.health.active:
                        self.link.activate(p.overlay_ip)
                        log.info("%s on the site LAN path", p.name)
                    else:
                        self.link.deactivate(p.overlay_ip)
                        log.warning("site LAN path to %s does not answer; back on WireGuard", p.name)
                except MeshrunError as exc:
                    log.warning("could not move %s's route: %s", p.name, exc)
                    self.health.active.discard(p.overlay_ip)
            self._record()

    def _reassert(self, p: lanpath.LanPeer) -> None:
        # Someone (an operator's `ip route flush`, a network manager) may have taken the route away while the
        # record still says active: put it back now and then, else status would claim a path nobody takes.
        try:
            self.link.activate(p.overlay_ip)
        except MeshrunError as exc:
            log.warning("could not keep %s's route: %s", p.name, exc)

    def active(self) -> list[str]:
        """Names of the peers whose traffic takes the LAN path now."""
        with self.lock:
            return [p.name for p in self.plan.peers if p.overlay_ip in self.health.active]

    def _record(self) -> None:
        # What is in place, or, when it could not be made, what was asked for (doctor names the fix by it).
        routed = self.plan.routed if self.plan.local_ip else self.wanted.routed and bool(self.error)
        rec = {
            # Routed, the peers' packets come and go on the LAN interface itself.
            "device": (self.link.underlay if self.plan.routed else self.link.name) if self.plan.local_ip else None,
            "routed": routed,
            "rp_filter": list(self.link.rp_restore) if self.link.rp_restore else None,
            "local": self.plan.local_ip,
            "planned": [p.name for p in self.plan.peers],
            "active": [p.name for p in self.plan.peers if p.overlay_ip in self.health.active],
            "error": self.error,
        }
        if rec != self._written:
            try:
                self.state.write_json("lan.json", rec)
                self._written = rec
            except MeshrunError as exc:
                log.warning("could not record the LAN path: %s", exc)

    def close(self) -> None:
        """Remove the LAN path (the agent stops: no one would probe it); every pair is back on WireGuard."""
        with self.lock:
            if self.plan.local_ip is not None or self.error:
                try:
                    self.link.delete(self.network.interface)
                except MeshrunError as exc:
                    log.warning("could not remove the site LAN path: %s", exc)
            self.plan = self.wanted = lanpath.LanPlan(None)
            self.health = lanpath.Health()
            self._record()
