"""Several WireGuard tunnels per pair: a same-site pair's overlay traffic spread over K tunnels, flow by flow.

Pure: names, ports, plans, rule and route text; meshrun.system.kernel.tunnellink applies them,
meshrun.mesh.node.tunnels drives them.

Why: wireguard-go moves one tunnel's packets through one TUN device and one UDP socket, so one tunnel is
CPU-bound at a few Gbit/s however many cores the host has. K tunnels are K wireguard-go processes (or K kernel
devices) working side by side: benchmarks/results/wg_ceiling_gpu.json measured 6.0 Gbit/s with 8 streams on one
tunnel and 12.8 on four on a 16-core host; on a 2-core host there are no cores to spread to and nothing is gained
(wg_ceiling.json). So it is opt-in per node: `meshrun join --tunnels K` (1 to MAX_TUNNELS; 1, the default: the
overlay interface alone).

Tunnel 0 is the overlay interface itself. Tunnels 1..K-1 are WireGuard devices of their own (`device_name`),
with the member's own key, listening on `port(i)`, holding the member's overlay address as a /32 (a loose
reverse-path filter drops whatever arrives on a device without an address; `net.local_addresses` leaves the
tunnels out of the path candidates), and as peers only this member's private-path peers (same site,
dialled at their LAN address, where `port(i)` is reachable as it is: behind NAT only the port WireGuard punched
through is mapped), each allowed its own overlay /32 only and dialled at its LAN address and `port(i)`. Overlay
addresses do not change, so NCCL, Gloo and anything bound to the overlay address work as before: a socket's own
route is main's, over the overlay interface, and only its packets are moved.

A tunnel carries a peer's traffic only while it answers (`Health`, as the site LAN path's): every PROBE_EVERY_S
each (peer, tunnel) is tried with one TCP handshake to the peer's API port carrying `probe_mark(i)`, which policy
routing sends through tunnel i alone (`probe_table(i)`). A peer's flows are spread over the overlay interface and
its live tunnels by `ruleset`: an nft route chain on output hashes each TCP or UDP packet's addresses and ports
(jhash with the fixed HASH_SEED) onto one of them and marks it `spread_mark(i)`, which policy routing (after the
site LAN path, before main) sends through `probe_table(i)`. Both ends hash a flow's fields in the same order
(the lower overlay address and its port first), so a connection and its answers ride one tunnel, in both
directions. The kernel's own multipath route, which an earlier version used, did not do that: a connecting
socket's next hop was neither the one `ip route get` gave for its ports nor the one for port 0, while the
accepting end's was, so data and acknowledgements took different tunnels and one stream ran at 0.58 of one
tunnel (benchmarks/results/archive/tunnels_2026-11-28_multipath_route.json). One connection stays on one
tunnel (nothing is reordered) and several spread. A pair uses min(K_a, K_b) tunnels: each member reports its
K to the coordinator with every sync (`Member.tunnels`), and a peer is planned on tunnels 1..min-1 only, so
nothing is probed or dialled that the peer does not run. A tunnel whose probes fail leaves the hash, and the
peer's flows are rehashed over the rest (a TCP connection rides out the move with a retransmit).

NCCL opens one socket per peer by default: one flow, one tunnel. A job gains only with NCCL_SOCKET_NTHREADS x
NCCL_NSOCKS_PERTHREAD >= K.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from meshrun.core import pairpaths
from meshrun.core.lanpath import interface_name as lan_interface_name
from meshrun.core.model import MAX_TUNNELS, Member
from meshrun.errors import UsageError

PORT_BASE = 51810  # tunnel i listens on PORT_BASE + i: 51811-51817 (the LAN path has 51819, relays 51821-52332)
PROBE_TABLE_BASE = 51800  # tunnel i's routes to its peers: table PROBE_TABLE_BASE + i
PROBE_PREF_BASE = 5170  # a probe's rule: priority PROBE_PREF_BASE + i (before the LAN path's rules)
PROBE_MARK_BASE = 0x4D540000  # "MT" and the tunnel's number: a probe's SO_MARK
SPREAD_PREF_BASE = 5180  # a spread flow's rule: priority SPREAD_PREF_BASE + i, after the LAN path's (5180)
SPREAD_MARK_BASE = 0x4D550000  # "MU" and the tunnel's number: a flow hashed onto tunnel i (`ruleset` sets it)
# The same on every member: both ends of a pair must hash a flow alike. nft's jhash is the kernel's plain Jenkins
# hash of the fields and this seed; its symhash would be symmetric by itself but is keyed per boot, so two hosts
# would disagree.
HASH_SEED = 0x4D54
PROBE_EVERY_S = 1.0
GUARD_TABLE = "meshrun_tunnels"
LABEL = "tunnels"


def check_count(count: int) -> int:
    """`count` if it is a possible number of tunnels per pair (`--tunnels`), else UsageError."""
    if not 1 <= count <= MAX_TUNNELS:
        raise UsageError(
            f"--tunnels {count} is out of range",
            f"give 1 (the overlay interface alone) to {MAX_TUNNELS} tunnels per same-site pair, e.g. --tunnels 4",
        )
    return count


def check_listen_port(listen_port: int, count: int) -> None:
    """UsageError when the network's WireGuard port is one the extra tunnels would take."""
    if count > 1 and PORT_BASE < listen_port < PORT_BASE + count:
        raise UsageError(
            f"--tunnels {count}: the network's WireGuard port {listen_port} is one of the extra tunnels' ports "
            f"({PORT_BASE + 1}-{PORT_BASE + count - 1})",
            f"join with --tunnels {listen_port - PORT_BASE}, or fewer",
        )


def device_name(overlay_interface: str, i: int) -> str:
    """Extra tunnel `i` (1..MAX_TUNNELS-1) beside overlay interface `overlay_interface` (at most 15 characters)."""
    return f"{overlay_interface[:11]}-t{i}"


def device_names(overlay_interface: str, count: int = MAX_TUNNELS) -> list[str]:
    """The extra tunnels' devices of a member running `count` tunnels per pair (none for 1)."""
    return [device_name(overlay_interface, i) for i in range(1, count)]


def port(i: int) -> int:
    """The UDP port extra tunnel `i` listens on (the same on every member: a peer dials it at its LAN address)."""
    return PORT_BASE + i


def probe_mark(i: int) -> int:
    return PROBE_MARK_BASE + i


def probe_table(i: int) -> int:
    return PROBE_TABLE_BASE + i


def probe_pref(i: int) -> int:
    return PROBE_PREF_BASE + i


def spread_mark(i: int) -> int:
    return SPREAD_MARK_BASE + i


def spread_pref(i: int) -> int:
    return SPREAD_PREF_BASE + i


@dataclass(frozen=True)
class TunnelPeer:
    """A peer the extra tunnels reach: its name, key, overlay address, the LAN address they dial, and the
    tunnels the pair uses (`count`, at least 2: the overlay interface and tunnels 1..count-1)."""

    name: str
    public_key: str
    overlay_ip: str
    lan_ip: str
    count: int

    @property
    def extra(self) -> range:
        """The pair's extra tunnels' numbers: 1..count-1."""
        return range(1, self.count)


def plan(own_key: str, members: Sequence[Member], count: int) -> tuple[TunnelPeer, ...]:
    """The peers of the extra tunnels: every peer this member reaches on the private path (the coordinator's
    `path` for the pair) at an IPv4 LAN address that runs extra tunnels too, each with min(`count`, its own);
    none when this member runs one tunnel per pair."""
    if count < 2:
        return ()
    out = []
    for m in members:
        pair = min(count, m.tunnels)
        if m.public_key == own_key or m.path != pairpaths.PRIVATE or pair < 2:
            continue
        host = pairpaths.host_of(pairpaths.private_candidate(m))
        try:
            if not host or ipaddress.ip_address(host).version != 4:
                continue
        except ValueError:
            continue
        out.append(TunnelPeer(m.name, m.public_key, m.overlay_ip, host, pair))
    return tuple(sorted(out, key=lambda p: p.name))


def health_key(overlay_ip: str, i: int) -> str:
    """The key of (peer, tunnel) in the probes' `lanpath.Health` record."""
    return f"{overlay_ip}#{i}"


def _hash_expr(own_ip: ipaddress.IPv4Address, peer_ip: ipaddress.IPv4Address) -> str:
    # The lower overlay address and its port first, on both ends: the two ends of a flow hash the same fields.
    if own_ip < peer_ip:
        return "ip saddr . ip daddr . th sport . th dport"
    return "ip daddr . ip saddr . th dport . th sport"


def ruleset(own_overlay_ip: str, interfaces: Iterable[str], spread: Mapping[str, Sequence[int]]) -> str:
    """The nft script that (re)creates table inet GUARD_TABLE, the tunnels' guard and spread.

    Guard: whatever reaches this member's overlay address on an interface not in `interfaces` (the overlay's, its
    tunnels', the site LAN path's device or LAN interface) or loopback is dropped. The overlay's listeners, bound
    to the WireGuard device alone otherwise (SO_BINDTODEVICE), are bound to the address while tunnels exist (they
    must answer on every tunnel, meshrun.system.kernel.lanlink.bind_device); this keeps the host's other
    interfaces away from them.

    Spread: `spread` {peer overlay IP: its live tunnels (1..K-1)}; each TCP or UDP packet this member sends to
    such a peer, unmarked, is hashed onto the overlay interface (no mark) or one of the live tunnels
    (`spread_mark(i)`), the same way on both ends (module docstring). A peer with no live tunnel is left out."""
    own = ipaddress.IPv4Address(own_overlay_ip)
    names = sorted({*interfaces, "lo"})
    ifaces = "{ " + ", ".join(f'"{n}"' for n in names) + " }"
    peers = sorted((ipaddress.IPv4Address(ip), sorted(set(live))) for ip, live in spread.items() if live)
    lines = [
        f"table inet {GUARD_TABLE} {{}}",
        f"delete table inet {GUARD_TABLE}",
        f"table inet {GUARD_TABLE} {{",
        '  comment "meshrun tunnels: the overlay address only from the overlay\'s own interfaces; flows spread"',
        "  chain input {",
        "    type filter hook input priority filter - 2; policy accept;",
        f"    ip daddr {own} iifname != {ifaces} drop",
        "  }",
        "  chain spread {",
        "    type route hook output priority mangle; policy accept;",
    ]
    if peers:
        vmap = ", ".join(f"{ip} : goto peer{n}" for n, (ip, _) in enumerate(peers))
        lines.append(f"    meta mark 0 meta l4proto {{ tcp, udp }} ip daddr vmap {{ {vmap} }}")
    lines.append("  }")
    for n, (ip, live) in enumerate(peers):
        marks = ", ".join(f"{k} : {hex(spread_mark(i) if i else 0)}" for k, i in enumerate([0, *live]))
        lines += [
            f"  chain peer{n} {{",
            f"    meta mark set jhash {_hash_expr(own, ip)} mod {1 + len(live)} seed {hex(HASH_SEED)}"
            f" map {{ {marks} }}",
            "  }",
        ]
    return "\n".join([*lines, "}", ""])


def overlay_interfaces(overlay_interface: str, count: int, routed_via: str | None = None) -> list[str]:
    """Every interface overlay traffic may arrive on: the overlay's, the site LAN path's device (or, routed, the
    LAN interface `routed_via`), and the extra tunnels'."""
    names = [overlay_interface, lan_interface_name(overlay_interface), *device_names(overlay_interface, count)]
    return names + ([routed_via] if routed_via else [])
