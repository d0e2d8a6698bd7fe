"""What a relay does with one WireGuard datagram of a pair it relays: forward it to the other end, or drop it.

Pure (no sockets: meshrun.system.sockets.udprelay feeds it). A relay forwards a pair's WireGuard datagrams as they are,
on a UDP port of its own for that pair (core/relays.RELAY_PORTS), as Tailscale's peer relays and DERP do: it
holds no key of the pair, so it reads nothing and can forge nothing; what it learns is sizes and timing.

Each end's NAT may give its datagrams to the relay a port nobody can predict (symmetric NAT: that is why the
pair is relayed), so the relay learns each end's address from what arrives, and the port is bound to the
pair in two ways, so it is useless to anyone else:

- **by address**: a datagram counts as an end's only when it comes from one of that end's underlay hosts
  (where the relay's own WireGuard sees that member, its observed endpoint and its candidates: LAN addresses
  only from a relay on the end's own LAN), as TURN binds a relay allocation to its peers' IP addresses;
- **by key**: a handshake message (initiation or response) is forwarded only if its mac1 is the one made with
  the receiving end's public key (WireGuard's mac1 = MAC(HASH("mac1----" || receiver's public key), message)),
  so it was sent to that end by someone who knows its key; anything that is not a WireGuard message is dropped.

Both ends' addresses are learned (latched) from what they first send from one of their hosts (a pair that
moves to this relay goes on with its WireGuard session, so transport datagrams come first). A latched end moves
to a new address only with a handshake message whose mac1 was made for the other end's key (what its WireGuard
sends within seconds when its NAT gives it a new port and its data gets no answer), at most once per
LATCH_MIN_S: a stranger that holds an end's host (one NAT, or private ranges that repeat across datacenters)
takes a running pair over with nothing it sends, and a flood of handshakes costs at most one kernel rewrite a
second. Until the other end is known, the last
datagram from one end is kept (one per end) and delivered as soon as the other end is heard from, so the
first handshake through a new relay does not wait for WireGuard's 5 s retry (unless the other end's first
datagram is a handshake initiation too: then only that one goes on, since two would cross). When both ends
sit behind one address (one NAT) the end is told by its latched port, or by mac1 for a handshake.

Once both ends are latched, the kernel can take the hot path over (`kernel_script`): a transport message from
one latched end, which the relay forwards unread to the other, is rewritten and sent on in the receiving
device's ingress hook (nftables netdev `fwd`), never reaching the relay's socket. The same decision, made
without a system call per datagram; everything else (handshakes, an end at a new address, strangers) still
reaches the socket and this module's rules.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from meshrun.core import pairpaths
from meshrun.core.model import Member, not_public, split_endpoint
from meshrun.core.relays import RELAY_PORTS

__all__ = [
    "MAC1_LABEL",
    "RelayedPair",
    "PairForwarder",
    "Route",
    "end_hosts",
    "kernel_script",
    "mac1",
    "mac1_ok",
    "message_type",
    "relayed_pairs",
]

MAC1_LABEL = b"mac1----"
# WireGuard's message types and their sizes (handshake messages have a fixed size; a transport message is
# at least its 16-byte header plus the 16-byte tag of an empty keepalive).
INITIATION, RESPONSE, COOKIE, TRANSPORT = 1, 2, 3, 4
SIZES = {INITIATION: 148, RESPONSE: 92, COOKIE: 64}
MIN_TRANSPORT = 32
LATCH_MIN_S = 1.0  # an end latched at one address moves to another at most this often
Addr = tuple[str, int]


def message_type(data: bytes) -> int:
    """The WireGuard message type of `data` (1-4), or 0 when it is not a well-formed WireGuard message."""
    if len(data) < 4 or data[1:4] != b"\0\0\0":
        return 0
    kind = data[0]
    if kind in SIZES:
        return kind if len(data) == SIZES[kind] else 0
    # No check of the length's multiple: WireGuard pads to 16 bytes only up to the sender's interface MTU.
    return TRANSPORT if kind == TRANSPORT and len(data) >= MIN_TRANSPORT else 0


def _mac1_key(public_key: bytes) -> bytes:
    return hashlib.blake2s(MAC1_LABEL + public_key, digest_size=32).digest()


def mac1(message: bytes, public_key: bytes) -> bytes:
    """WireGuard's mac1 of a handshake message's first part (everything before its two MACs) for the receiver
    with `public_key` (32 raw bytes)."""
    return hashlib.blake2s(message, key=_mac1_key(public_key), digest_size=16).digest()


def mac1_ok(data: bytes, public_key: bytes) -> bool:
    """A handshake message (initiation or response) whose mac1 was made for the receiver with `public_key`."""
    kind = message_type(data)
    if kind not in (INITIATION, RESPONSE):
        return False
    end = SIZES[kind] - 32  # mac1 then mac2, 16 bytes each, close the message
    return mac1(data[:end], public_key) == data[end : end + 16]


@dataclass(frozen=True)
class RelayedPair:
    """One pair a relay forwards: its port, and for each end its public key (WireGuard's base64) and the
    underlay hosts its datagrams may come from."""

    port: int
    keys: tuple[str, str]
    hosts: tuple[frozenset[str], frozenset[str]]


@dataclass
class PairForwarder:
    """One relayed pair's forwarding state: each end's latched address and the datagram kept for it.

    `route(data, source)` returns the datagrams to send now, as [(data, address)]: usually the one given, to
    the other end; nothing when it is dropped or the other end is not known yet."""

    pair: RelayedPair
    addrs: list[Addr | None] = field(default_factory=lambda: [None, None])
    kept: list[bytes | None] = field(default_factory=lambda: [None, None])  # the last datagram from each end
    latched_at: list[float] = field(default_factory=lambda: [0.0, 0.0])  # monotonic time each end last moved
    forwarded: int = 0
    dropped: int = 0

    def __post_init__(self) -> None:
        self._raw = tuple(base64.b64decode(k) for k in self.pair.keys)

    def update(self, pair: RelayedPair) -> None:
        """The same port's pair with new hosts (a member's NAT changed its address): latched ends stay as
        long as their addresses are still allowed."""
        same_ends = pair.keys == self.pair.keys
        self.pair = pair
        self._raw = tuple(base64.b64decode(k) for k in pair.keys)
        for i in (0, 1):
            addr = self.addrs[i]
            if not same_ends or (addr is not None and addr[0] not in pair.hosts[i]):
                self.addrs[i], self.kept[i] = None, None

    def _end_of(self, data: bytes, kind: int, source: Addr) -> int | None:
        """Which end sent `data` (0 or 1), or None when it is from neither."""
        for i in (0, 1):
            if self.addrs[i] == source:
                return i
        ends = [i for i in (0, 1) if source[0] in self.pair.hosts[i]]
        if len(ends) == 1:
            return ends[0]
        if len(ends) == 2 and kind in (INITIATION, RESPONSE):
            # Both ends behind one address: a handshake says whom it is for, so who sent it.
            for i in (0, 1):
                if mac1_ok(data, self._raw[1 - i]):
                    return i
        return None

    def route(self, data: bytes, source: Addr, now: float | None = None) -> list[tuple[bytes, Addr]]:
        now = time.monotonic() if now is None else now
        kind = message_type(data)
        end = self._end_of(data, kind, source) if kind else None
        handshake = kind in (INITIATION, RESPONSE)
        if end is None or (handshake and not mac1_ok(data, self._raw[1 - end])):
            self.dropped += 1
            return []
        other = 1 - end
        out: list[tuple[bytes, Addr]] = []
        if self.addrs[end] != source:
            # An end is first latched by what it sends from one of its hosts (a pair moved to this relay goes on
            # with its session: transport datagrams come first). Once latched it moves to another address only
            # on a handshake made for the other end's key, and not too often.
            if self.addrs[end] is not None and (not handshake or now - self.latched_at[end] < LATCH_MIN_S):
                self.dropped += 1
                return []
            self.addrs[end], self.latched_at[end] = source, now
            waiting = self.kept[other]  # the other end spoke first: its datagram goes out now
            self.kept[other] = None
            if waiting is not None and kind == INITIATION and message_type(waiting) == INITIATION:
                # Both ends started a handshake: delivering both would cross them, each end answering the other's
                # and dropping the answer to its own, and WireGuard tries again only after 5 s (REKEY_TIMEOUT).
                # This one goes on alone; its answer completes the handshake.
                self.dropped += 1
            elif waiting is not None:
                out.append((waiting, source))
        dest = self.addrs[other]
        if dest is None:
            self.kept[end] = data
        else:
            out.append((data, dest))
        self.forwarded += len(out)
        return out


def _lan_address(host: str) -> bool:
    """An address that only its own network can reach (RFC 1918, CGNAT, link-local, loopback; IPv6 not global)."""
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    return bool(not_public(host)) if isinstance(addr, ipaddress.IPv4Address) else not addr.is_global


def end_hosts(end: Member, observed: str | None, me: Member | None) -> frozenset[str]:
    """The underlay hosts an end's datagrams may reach this relay from: where its own WireGuard sees the end,
    the endpoint the coordinator observed, and the end's reported candidates, its LAN ones only when this relay
    shares its LAN (private ranges repeat across datacenters: a stranger on this relay's LAN may hold the same
    address as an end's LAN address elsewhere)."""
    hosts = {split_endpoint(e)[0] for e in (observed, end.endpoint) if e}
    lan = me is not None and pairpaths.shares_lan(end, me)
    hosts |= {h for h in (split_endpoint(c)[0] for c in end.candidates if c) if lan or not _lan_address(h)}
    return frozenset(hosts)


def relayed_pairs(
    relaying: list[list], members: list[Member], observed: dict[str, str | None], me: str = ""
) -> list[RelayedPair]:
    """The pairs to forward, from the coordinator's `relaying` ([[overlay IP, overlay IP, port], ...]) and what
    this relay (public key `me`) knows of each end (end_hosts): where its own WireGuard sees it (`observed`
    {public key: endpoint}), the endpoint in its member entry and the candidates the member reported. Pairs with
    an unknown end, a port outside RELAY_PORTS or a port given twice are left out (the ends then report the
    relay down)."""
    by_ip = {m.overlay_ip: m for m in members}
    mine = next((m for m in members if me and m.public_key == me), None)
    out, ports = [], set()
    for item in relaying:
        if len(item) != 3:
            continue
        a, b, port = by_ip.get(str(item[0])), by_ip.get(str(item[1])), item[2]
        if a is None or b is None or not isinstance(port, int) or port not in RELAY_PORTS or port in ports:
            continue
        ports.add(port)
        hosts = tuple(end_hosts(m, observed.get(m.public_key), mine) for m in (a, b))
        out.append(RelayedPair(port, (a.public_key, b.public_key), hosts))  # type: ignore[arg-type]
    return out


@dataclass(frozen=True)
class Route:
    """How this host sends to an address: the device, the next hop (the address itself when on-link) and the
    source address it would use (`ip route get`)."""

    dev: str
    via: str
    src: str


def _ipv4(addr: Addr | None) -> bool:
    if addr is None:
        return False
    try:
        return isinstance(ipaddress.ip_address(addr[0]), ipaddress.IPv4Address)
    except ValueError:
        return False


def kernel_script(table: str, latched: Mapping[int, tuple[Addr, Addr]], routes: Mapping[str, Route]) -> str:
    """The nft script that (re)creates table netdev `table`: for each port's pair with both ends `latched`, a
    transport message from one end is rewritten to come from this host's address and the pair's port and go to
    the other end, and sent on at once from the ingress hook of the device it arrives on (`fwd`).

    What it matches is exactly what the socket path forwards unread: UDP to the port, from the end's latched
    address and port, not fragmented, at least a WireGuard keepalive long, whose first four bytes are a transport
    message's type (4, then three zero bytes). An end is known to arrive on the device its route goes out of;
    where routing is asymmetric the rule just never matches and the socket path goes on forwarding. Pairs with
    an IPv6 end, or an end without a route in `routes`, are left to the socket. No pairs: an empty table."""
    chains: dict[str, list[str]] = {}
    for port in sorted(latched):
        ends = latched[port]
        if not all(_ipv4(e) for e in ends) or not all(e[0] in routes for e in ends):
            continue
        for i in (0, 1):
            (src_ip, src_port), (dst_ip, dst_port) = ends[i], ends[1 - i]
            inbound, out = routes[src_ip], routes[dst_ip]
            chains.setdefault(inbound.dev, []).append(
                f"    ip saddr {src_ip} udp sport {src_port} udp dport {port} ip frag-off & 0x3fff == 0"
                f" udp length >= {8 + MIN_TRANSPORT} @th,64,32 0x{TRANSPORT:02x}000000 counter"
                f" ip saddr set {out.src} udp sport set {port} ip daddr set {dst_ip} udp dport set {dst_port}"
                f" fwd ip to {out.via} device {json.dumps(out.dev)}"
            )
    body = []
    for n, dev in enumerate(sorted(chains)):
        body += [
            f"  chain in{n} {{",
            f"    type filter hook ingress device {json.dumps(dev)} priority filter - 10; policy accept;",
            *chains[dev],
            "  }",
        ]
    return "\n".join(
        [
            f"table netdev {table} {{}}",
            f"delete table netdev {table}",
            f"table netdev {table} {{",
            '  comment "meshrun relay: WireGuard transport messages between the latched ends of each relayed pair"',
            *body,
            "}",
            "",
        ]
    )
