"""An in-memory WireGuard device for tests and simulations (no root, no kernel).

It keeps peers the way WireGuard does: applying a diff adds, updates and removes peers; a peer
that is removed and added again (re-created) loses its handshake and counters, a peer that is
only updated keeps them. Tests move time on with `handshake()` and `roam()`, the way real peers
would, and read `applied` (every diff applied) and `nudged` (every nudge).
"""

from __future__ import annotations

import ipaddress
from dataclasses import replace
from pathlib import Path

from meshrun.core.peers import PeerDiff, PeerState
from meshrun.errors import NetworkError


class FakeDevice:
    """Implements meshrun.system.kernel.device.Device in memory."""

    def __init__(self, name: str = "meshrun0", backend: str = "kernel", present: bool = False) -> None:
        self.name = name
        self.pid: int | None = None
        self._backend = backend
        self.present = present
        self.config: dict = {}
        self.mtu: int | None = None
        self.route_mtus: dict[str, int] = {}
        self.guarded = False  # guard_forwarding() was called (and delete() not since)
        self.guarded_before_up: bool | None = None  # whether the guard was there when configure() ran
        self._peers: dict[str, PeerState] = {}
        self.applied: list[PeerDiff] = []
        self.nudged: list[str] = []
        self.fail_reads = 0  # the next N peers() calls raise NetworkError (a flaky `wg show`)
        self.warn: str | None = None  # what warning() says

    # the Device protocol ------------------------------------------------------
    def exists(self) -> bool:
        return self.present

    def backend(self) -> str:
        return self._backend

    def create(self) -> None:
        if self.present:
            raise NetworkError(f"network interface {self.name} already exists", "pick another --interface")
        self.present = True

    def configure(self, key_path: Path, listen_port: int, address: str, mtu: int) -> None:
        self.guarded_before_up = self.guarded
        self.config = {"key_path": Path(key_path), "listen_port": listen_port, "address": address}
        self.mtu = mtu

    def set_mtu(self, mtu: int) -> None:
        self.mtu = mtu

    def link_mtu(self) -> int | None:
        return self.mtu if self.present else None

    def current_route_mtus(self) -> dict[str, int]:
        return dict(self.route_mtus) if self.present else {}

    def set_route_mtus(self, mtus) -> None:
        self._require()
        self.route_mtus = dict(mtus)

    def peers(self) -> list[PeerState]:
        self._require()
        if self.fail_reads:
            self.fail_reads -= 1
            raise NetworkError(f"`wg show {self.name} dump` failed (simulated)", "retry")
        return [self._peers[k] for k in sorted(self._peers)]

    def apply(self, diff: PeerDiff) -> None:
        """As `wg set` does (tests/device_contract.py holds both to it): removing an unknown key is no error,
        updating one creates it, an allowed IP given to a peer is taken from whichever peer had it, an
        endpoint reads back as `wg` prints it."""
        self._require()
        self.applied.append(diff)
        for key in diff.remove:
            self._peers.pop(key, None)
        for spec in (*diff.add, *diff.update):
            ips = tuple(sorted(spec.allowed_ips))
            for other, st in list(self._peers.items()):
                if other != spec.public_key and set(st.allowed_ips) & set(ips):
                    self._peers[other] = replace(st, allowed_ips=tuple(ip for ip in st.allowed_ips if ip not in ips))
            old = self._peers.get(spec.public_key)
            endpoint = _as_wg_prints(spec.endpoint) if spec.endpoint else None
            if old is None:
                self._peers[spec.public_key] = PeerState(spec.public_key, endpoint, ips, 0, 0, 0, spec.keepalive)
            else:
                self._peers[spec.public_key] = replace(
                    old, endpoint=endpoint or old.endpoint, allowed_ips=ips, keepalive=spec.keepalive
                )

    def nudge(self, overlay_ips: list[str]) -> None:
        self.nudged.extend(overlay_ips)

    def guard_forwarding(self) -> None:
        self.guarded = True

    def warning(self) -> str | None:
        return self.warn

    def delete(self) -> None:
        self.present = False
        self.guarded = False
        self._peers.clear()

    # what a test does to it --------------------------------------------------
    def handshake(self, key: str, when: int, endpoint: str | None = None) -> None:
        """Peer `key` completed a handshake at unix time `when` (from `endpoint`, if given)."""
        old = self._peers[key]
        self._peers[key] = replace(old, latest_handshake=when, endpoint=endpoint or old.endpoint)

    def roam(self, key: str, endpoint: str) -> None:
        """WireGuard learned a new endpoint for `key` from an authenticated packet."""
        self._peers[key] = replace(self._peers[key], endpoint=endpoint)

    def _require(self) -> None:
        if not self.present:
            raise NetworkError(f"`wg show {self.name}` failed: no such device", "bring the interface up")


def _as_wg_prints(endpoint: str) -> str:
    """An endpoint as `wg show` prints it: IPv6 compressed in brackets, IPv4 as given."""
    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return endpoint
    return f"[{addr.compressed}]:{int(port)}" if addr.version == 6 else f"{addr}:{int(port)}"
