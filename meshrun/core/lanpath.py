"""The site LAN path: overlay traffic between members of a trusted site, on the site network, without WireGuard.

Pure: names, numbers, plans and rule text; meshrun.system.kernel.lanlink applies them, meshrun.mesh.node.lan
drives them.

The operator marks a site's network trusted (`meshrun site trust NAME`); the coordinator then tells both ends of
every pair of nodes in that site (both joined with ``--site NAME``) that the pair may use the LAN path
(`Member.lan`), whatever path their WireGuard pair takes; each end's probes decide whether it does. The site's
encapsulation (`ENCAPSULATIONS`, chosen with the trust) says how the overlay packet, addresses unchanged, crosses
the site network, so NCCL, Gloo or anything bound to the overlay address works as before either way:

- "vxlan" (the default): each such member keeps one VXLAN device (`interface_name`) on its LAN address, and the
  packet goes out inside a UDP datagram from this member's LAN address to the peer's, so a cloud VPC's
  source/destination check passes. Nothing is learned from the wire: each end derives the other's device MAC
  from its overlay address (`mac_for`) and installs the forwarding and neighbour entries itself.
- "none" (`LanPlan.routed`): the packet goes out as it is, routed to the peer's LAN address as its next hop on
  the LAN interface (Flannel's host-gw, Kilo's `--encapsulate=never`): no header, no device, the LAN's MTU
  (benchmarks/results/datapath.json measures it beside VXLAN). It needs the pair on one layer-2 segment that
  passes packets with addresses it never assigned: bare metal and on-premises switches, not a cloud VPC. Where
  the network drops them the probes fail and the pair stays on WireGuard.

The path is used only while it answers: every peer is probed through it (a TCP handshake to the peer's API port
with PROBE_MARK, which policy routing sends through PROBE_TABLE, the LAN routes of every planned peer);
after PROBE_OKS answers the peer's route goes into ACTIVE_TABLE, which every packet consults before the main
table; after PROBE_FAILS misses it leaves it again and the pair's traffic is back on WireGuard (whose peer
and tunnel stay configured throughout, so nothing has to be rebuilt).

What the LAN path admits (`guard_script`): datagrams on LAN_PORT from a planned peer's LAN address only, each
carrying an IPv4 packet from that peer's own overlay address to this member's; routed, packets to this member's
overlay address on the LAN interface only from the planned peers' overlay addresses, and nothing from the LAN
interface is forwarded into WireGuard. A member of the site cannot
speak as another member; a host on the site network that forges the outer addresses can (that is what trusting
the site network means, SECURITY.md).
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from meshrun.core.model import SITE_RE, Member
from meshrun.core.pairpaths import host_of, private_candidate

LAN_PORT = 51819  # UDP port of the VXLAN datagrams (below the WireGuard port; relays use 51821-52332)
ACTIVE_TABLE = 51819  # routing table of the peers whose LAN path answers; consulted before main
PROBE_TABLE = 51818  # routing table of every planned peer's LAN route; only PROBE_MARK packets use it
ACTIVE_PREF = 5180  # `ip rule` priorities (main is 32766)
PROBE_PREF = 5179
PROBE_MARK = 0x4D52  # "MR"
PROBE_EVERY_S = 1.0
PROBE_FAILS = 3  # misses in a row before a pair goes back to WireGuard
PROBE_OKS = 2  # answers in a row before a pair (back) on the LAN path
OVERHEAD = 50  # outer IPv4 20 + UDP 8 + VXLAN 8 + Ethernet 14
GUARD_TABLE = "meshrun_lan"
TRUST_META = "trusted_sites"  # the coordinator's metadata key: a JSON list of site names
ROUTED_META = "routed_sites"  # of those, the ones trusted with encapsulation "none" (a JSON list)
ENCAPSULATIONS = ("vxlan", "none")  # how a trusted site's LAN path carries the overlay (the module docstring)
LABEL = "site LAN, unencrypted"
ROUTED_LABEL = LABEL + ", routed"
# The LAN path's device carries one link-scope address: Linux's reverse-path filter (loose, as meshrun sets it)
# drops everything arriving on a device without any IPv4 address. Link scope: never a candidate, never routed.
DEVICE_ADDRESS = "169.254.81.19/32"


def trusted_from_meta(value: str | None) -> frozenset[str]:
    """The trusted sites as the coordinator's metadata holds them (None or unreadable: none)."""
    try:
        names = json.loads(value or "[]")
    except ValueError:
        return frozenset()
    return (
        frozenset(n for n in names if isinstance(n, str) and SITE_RE.match(n))
        if isinstance(names, list)
        else frozenset()
    )


def trusted_to_meta(names: Iterable[str]) -> str:
    return json.dumps(sorted(set(names)))


def trust_from_meta(meta: Callable[[str], str | None]) -> dict[str, str]:
    """{trusted site: its encapsulation} from the coordinator's metadata (`meta(key)` reads one key)."""
    routed = trusted_from_meta(meta(ROUTED_META))
    return {s: "none" if s in routed else "vxlan" for s in trusted_from_meta(meta(TRUST_META))}


def trust_to_meta(trust: dict[str, str]) -> dict[str, str]:
    """The metadata keys that hold `trust` ({site: encapsulation}), for the database's `set_meta(**...)`."""
    return {
        TRUST_META: trusted_to_meta(trust),
        ROUTED_META: trusted_to_meta(s for s, e in trust.items() if e == "none"),
    }


def label(routed: bool) -> str:
    """How `meshrun status` names a pair on the LAN path."""
    return ROUTED_LABEL if routed else LABEL


def interface_name(overlay_interface: str) -> str:
    """The LAN path's device beside overlay interface `overlay_interface` (at most 15 characters)."""
    return overlay_interface[:11] + "-lan"


def vni(network_name: str) -> int:
    """The VXLAN network identifier of network `network_name` (the same on every member, 24 bits, never 0)."""
    return int.from_bytes(hashlib.sha256(network_name.encode()).digest()[:3], "big") or 1


def mac_for(overlay_ip: str) -> str:
    """The LAN device MAC of the member at `overlay_ip`: locally administered, unicast, from its address."""
    b = ipaddress.IPv4Address(overlay_ip).packed
    return "02:4d:" + ":".join(f"{x:02x}" for x in b)


@dataclass(frozen=True)
class LanPeer:
    """A peer this member may reach on the site network: its overlay address and its LAN address."""

    name: str
    overlay_ip: str
    lan_ip: str


@dataclass(frozen=True)
class LanPlan:
    """What the LAN path of one member looks like: its own LAN address (None: no LAN path), its peers, and
    whether they are reached with no encapsulation (`routed`: the site's encapsulation is "none")."""

    local_ip: str | None
    peers: tuple[LanPeer, ...] = ()
    routed: bool = False


def _lan_address(m: Member) -> str | None:
    """The member's LAN address: the host of its private candidate when that is IPv4 (the LAN path and its
    guard are IPv4 only; a [v6] candidate, which a sync may report, plans no LAN path)."""
    host = host_of(private_candidate(m))
    try:
        return host if host and ipaddress.ip_address(host).version == 4 else None
    except ValueError:
        return None


def plan(own_key: str, members: Sequence[Member]) -> LanPlan:
    """The LAN path the coordinator's member list asks for: every peer marked `lan` that has a LAN address,
    from this member's own LAN address (its private candidate as the coordinator lists it). No peers when
    this member has no LAN address; peers sharing a LAN address with another (not a LAN) are left out.
    Routed when every planned peer is marked `lan_routed` (one site, so one encapsulation; a list caught
    between two trust changes takes VXLAN until the next)."""
    me = next((m for m in members if m.public_key == own_key), None)
    local = _lan_address(me) if me is not None else None
    if not local:
        return LanPlan(None)
    out: list[LanPeer] = []
    for m in members:
        if m.public_key == own_key or not m.lan:
            continue
        lan = _lan_address(m)
        if lan and lan != local:
            out.append(LanPeer(m.name, m.overlay_ip, lan))
    counts: dict[str, int] = {}
    for p in out:
        counts[p.lan_ip] = counts.get(p.lan_ip, 0) + 1
    peers = tuple(sorted((p for p in out if counts[p.lan_ip] == 1), key=lambda p: p.name))
    routed_names = {m.name for m in members if m.lan and m.lan_routed}
    routed = all(p.name in routed_names for p in peers)
    return LanPlan(local, peers, routed) if peers else LanPlan(None)


def _hex(ip: str) -> str:
    return "0x" + ipaddress.IPv4Address(ip).packed.hex()


def guard_script(
    own_overlay_ip: str,
    peers: Iterable[LanPeer],
    overlay_interface: str = "meshrun0",
    port: int = LAN_PORT,
    routed_via: str | None = None,
    tunnels: Iterable[str] = (),
) -> str:
    """The nft script that (re)creates the LAN path's guard, table inet GUARD_TABLE.

    On LAN_PORT it drops every datagram that is not from a planned peer's LAN address, or whose VXLAN payload
    is not an IPv4 packet from that peer's overlay address to `own_overlay_ip` (offsets from the UDP header:
    8 UDP + 8 VXLAN, then the inner Ethernet header, its type at bit 224; after its 14 bytes the IPv4 header:
    source at bit 336, destination at 368). No peers: every datagram on the port is dropped.

    Routed (`routed_via`: the LAN interface the peers' packets arrive on, unencapsulated) it drops what reaches
    `own_overlay_ip` on that interface from anything but a planned peer's overlay address, and forwards nothing
    from it into the overlay's interface (a host on the LAN must not use this member as a door into WireGuard).

    It also drops whatever reaches `own_overlay_ip` on an interface other than the overlay's, the LAN path's
    device (or `routed_via`), the extra `tunnels` (core/tunnels) and loopback: the overlay's listeners that
    meshrun binds to the WireGuard device (SO_BINDTODEVICE) are bound to the address alone while a LAN path
    exists (they must answer on its device too, meshrun.system.kernel.lanlink.bind_device), and this rule keeps
    the host's other interfaces away from them."""
    peers = sorted(peers, key=lambda p: ipaddress.IPv4Address(p.lan_ip))
    own = ipaddress.IPv4Address(own_overlay_ip)
    lans = ", ".join(p.lan_ip for p in peers)
    rules = [f"    udp dport {port} ip saddr != {{ {lans} }} drop" if peers else f"    udp dport {port} drop"]
    rules += [
        f"    udp dport {port} @th,224,16 != 0x0800 drop",
        f"    udp dport {port} @th,368,32 != {_hex(own_overlay_ip)} drop",
    ]
    rules += [f"    udp dport {port} ip saddr {p.lan_ip} @th,336,32 != {_hex(p.overlay_ip)} drop" for p in peers]
    names = [overlay_interface, interface_name(overlay_interface), "lo", *tunnels]
    forward = []
    if routed_via:
        overlays = ", ".join(p.overlay_ip for p in peers)
        rules.append(
            f'    ip daddr {own} iifname "{routed_via}" ip saddr != {{ {overlays} }} drop'
            if peers
            else f'    ip daddr {own} iifname "{routed_via}" drop'
        )
        names.append(routed_via)
        forward = [
            "  chain forward {",
            "    type filter hook forward priority filter - 2; policy accept;",
            f'    iifname "{routed_via}" oifname "{overlay_interface}" drop',
            "  }",
        ]
    ifaces = "{ " + ", ".join(f'"{n}"' for n in sorted(names)) + " }"
    rules.append(f"    ip daddr {own} iifname != {ifaces} drop")
    return "\n".join(
        [
            f"table inet {GUARD_TABLE} {{}}",
            f"delete table inet {GUARD_TABLE}",
            f"table inet {GUARD_TABLE} {{",
            '  comment "meshrun site LAN path: only planned peers, only their own overlay addresses"',
            "  chain input {",
            "    type filter hook input priority filter - 2; policy accept;",
            *rules,
            "  }",
            *forward,
            "}",
            "",
        ]
    )


@dataclass
class Health:
    """Each LAN peer's probe record: whether its route is active, and the answers or misses in a row.

    `record(ip, ok)` returns True when the peer's activity changed (the caller moves its route)."""

    active: set[str] = field(default_factory=set)
    streak: dict[str, int] = field(default_factory=dict)  # > 0: answers in a row, < 0: misses in a row

    def record(self, ip: str, ok: bool) -> bool:
        s = self.streak.get(ip, 0)
        s = max(s, 0) + 1 if ok else min(s, 0) - 1
        self.streak[ip] = s
        if ip not in self.active and s >= PROBE_OKS:
            self.active.add(ip)
            return True
        if ip in self.active and s <= -PROBE_FAILS:
            self.active.discard(ip)
            return True
        return False

    def keep(self, ips: Iterable[str]) -> None:
        """Forget every peer not in `ips` (no longer planned)."""
        keep = set(ips)
        self.active &= keep
        self.streak = {ip: s for ip, s in self.streak.items() if ip in keep}
