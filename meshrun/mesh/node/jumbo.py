"""The node agent's jumbo pairs: a same-site pair whose LAN carries jumbo frames gets them on its tunnel, once a
probe has proved it.

wireguard-go is CPU-bound per packet, so a larger MTU moves more per CPU second (benchmarks/results/
wg_ceiling*.json: 1.5-1.7x with 8920 on a 9000-byte LAN). One overlay MTU cannot serve every peer, though: the
paths across the internet carry 1500-byte packets. So while a pair on the private path (same site, dialled at
its LAN address) is probed or proven, the interface is raised to the LAN's MTU and every other peer keeps its
own MTU as a /32 route (`peers.pair_mtus`). A pair is proven by an ICMP echo of the full size, DF set, through
its tunnel (`probe.echo` ignores the kernel's cached path MTU, so a switch that drops big frames without a word
is found); until then its route keeps the overlay MTU, so no traffic depends on an unproven size. A pair whose
small echo answers and whose full-size one does not keeps the overlay MTU and is tried again after RETRY_S (the
LAN may be mended); one whose small echo fails too is not judged (the peer is away, or its tunnel not up yet).
What is proven or failed is written to jumbo.json for `meshrun status`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from meshrun.core import pairpaths, peers
from meshrun.core.model import WG_OVERHEAD, Member, Network
from meshrun.system.files.statedir import StateDir
from meshrun.system.kernel import net
from meshrun.system.sockets import probe

log = logging.getLogger("meshrun.mesh.node.jumbo")

ETHERNET_MTU = 1500  # a LAN interface above this carries jumbo frames
CHECK_S = 2.0  # pairs on trial are probed this often
RETRY_S = 600.0  # a pair whose LAN dropped the full size is tried again this long after


class JumboPairs:
    """Which private-path peers get the LAN's MTU. `plan(members)` before each apply, `check()` every CHECK_S.

    `echo(overlay IP, size)` is one DF probe through the tunnel (True, False, or None: cannot tell);
    `link_mtu(address)` the MTU of the interface holding a local address (None: none holds it)."""

    def __init__(
        self,
        state: StateDir,
        network: Network,
        rec: dict,
        echo: Callable[[str, int], bool | None] = probe.echo,
        link_mtu: Callable[[str], int | None] = net.address_mtu,
    ) -> None:
        self.state = state
        self.own_key = rec["public_key"]
        self.my_mtu = int(rec.get("mtu") or network.mtu)
        self.echo = echo
        self.link_mtu = link_mtu
        self.lock = threading.Lock()
        self.lan = 0  # this node's LAN MTU less WireGuard's overhead, as last planned (0: none larger)
        self.trial: set[str] = set()  # overlay IPs being probed
        self.ok: dict[str, int] = {}  # overlay IP -> the jumbo MTU its tunnel was proven to carry
        self.failed: dict[str, float] = {}  # overlay IP -> when it may be tried again (monotonic)
        self._written: dict | None = None

    def _lan_mtu(self, me: Member | None) -> int:
        # Only a jumbo LAN: on a 1500-byte one the 20 bytes over the overlay MTU are not worth a raised interface.
        own = pairpaths.private_candidate(me) if me is not None else None
        link = self.link_mtu(pairpaths.host_of(own) or "") if own else None
        return link - WG_OVERHEAD if link and link > ETHERNET_MTU else 0

    def plan(self, members: list[Member]) -> tuple[int, dict[str, int]]:
        """(the interface MTU to raise to, 0 for none; {overlay IP: MTU} of the proven pairs) for this member
        list: pairs that left the private path, or whose LAN MTU changed, start over."""
        private = any(m.path == pairpaths.PRIVATE for m in members if m.public_key != self.own_key)
        lan = self._lan_mtu(next((m for m in members if m.public_key == self.own_key), None)) if private else 0
        wanted = peers.jumbo_candidates(self.own_key, members, lan, self.my_mtu)
        now = time.monotonic()
        with self.lock:
            if lan != self.lan:
                self.ok, self.failed = {}, {}
            self.lan = lan
            self.ok = {ip: mtu for ip, mtu in self.ok.items() if ip in wanted}
            self.failed = {ip: t for ip, t in self.failed.items() if ip in wanted}
            self.trial = {ip for ip in wanted if ip not in self.ok and self.failed.get(ip, 0.0) <= now}
            raise_to = lan if self.trial or self.ok else 0
            out = (raise_to, dict(self.ok))
        self._write()
        return out

    def check(self) -> bool:
        """Probe each pair on trial once (its small echo first: a tunnel that is not up yet is not judged); True
        when one was proven or failed (the caller applies again)."""
        with self.lock:
            trial, lan = sorted(self.trial), self.lan
        small = self.my_mtu - self.my_mtu % peers.WG_PAD
        changed = False
        for ip in trial:
            if not self.echo(ip, small):
                continue
            full = self.echo(ip, lan)
            if full is None:
                continue  # the interface is not raised yet: the next check
            with self.lock:
                if ip not in self.trial or lan != self.lan:
                    continue  # planned anew meanwhile
                self.trial.discard(ip)
                if full:
                    self.ok[ip] = lan
                    log.info("the tunnel to %s carries %d-byte packets: it uses them", ip, lan)
                else:
                    self.failed[ip] = time.monotonic() + RETRY_S
                    log.warning(
                        "the LAN to %s dropped a %d-byte packet that this node's LAN interface allows: the pair keeps "
                        "MTU %d (tried again in %.0f min; check the switches' MTU)",
                        ip,
                        lan + WG_OVERHEAD,
                        self.my_mtu,
                        RETRY_S / 60,
                    )
            changed = True
        if changed:
            self._write()
        return changed

    def _write(self) -> None:
        with self.lock:
            now = time.monotonic()
            record = {
                "lan_mtu": self.lan,
                "proven": dict(sorted(self.ok.items())),
                "probing": sorted(self.trial),
                "failed": {ip: round(t - now) for ip, t in sorted(self.failed.items())},
            }
        if record != self._written:
            self.state.write_json("jumbo.json", record)
            self._written = record
