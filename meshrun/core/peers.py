"""Peer sync logic: which peers a member should have, and the minimal change to get there.

Pure (innernet's PeerDiff): `desired_*` turn the coordinator's member list into PeerSpecs,
`diff` compares them with what the interface reports, `wg_set_args` renders one
`wg set` call. Applying a diff never touches peers that did not change, so running
tunnels are not interrupted when a member joins.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from meshrun.core.model import Member, split_endpoint

KEEPALIVE = 25
# WireGuard rejects a session 180 s after its handshake (REJECT_AFTER_TIME); a peer whose
# last handshake is younger than that has a working endpoint, possibly one WireGuard
# learned by roaming, which is better than anything the coordinator can tell us.
HANDSHAKE_FRESH_S = 180
# When both ends of a pair start a handshake at the same moment (the coordinator tells everyone
# of a new endpoint together), the two initiations cross: each end answers the other's and then
# drops the answer to its own, both are left as responders waiting for data, and WireGuard tries
# again only after REKEY_TIMEOUT, 5 s (wireguard-go logs "Received invalid response message").
# So the end with the greater public key holds back this long.
HOLD_S = 1.0


@dataclass(frozen=True)
class PeerSpec:
    """A peer as we want it configured."""

    public_key: str
    allowed_ips: tuple[str, ...]
    endpoint: str | None = None
    keepalive: int = KEEPALIVE
    name: str = ""
    # The endpoint is the coordinator's word, not a hint: a relayed peer's is its relay's port for the pair,
    # set even over a live tunnel (a new relay must take over at once) and over an endpoint WireGuard roamed to.
    pinned: bool = False


@dataclass(frozen=True)
class PeerState:
    """One peer as the running interface reports it (`wg show IFACE dump`)."""

    public_key: str
    endpoint: str | None
    allowed_ips: tuple[str, ...]
    latest_handshake: int
    rx: int
    tx: int
    keepalive: int


@dataclass(frozen=True)
class PeerDiff:
    """Changes that take the interface from its current peers to the desired ones."""

    add: tuple[PeerSpec, ...] = ()
    update: tuple[PeerSpec, ...] = ()
    remove: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.add or self.update or self.remove)


@dataclass(frozen=True)
class HandshakeReport:
    """What an agent tells the coordinator about its peers' handshakes in one sync.

    `peers` {public key: latest handshake (unix s, 0 = none)} holds only the peers whose liveness the
    coordinator does not know yet; `stale` names those among them whose handshake is not fresh."""

    peers: dict[str, int]
    stale: tuple[str, ...]


def to_recreate(before: Sequence[Member], after: Sequence[Member]) -> frozenset[str]:
    """The peers (public keys) a node re-creates when its member list goes from `before` to `after`: those whose
    path really changed, so that a fresh handshake proves the new one. A first assignment ("" -> a mode) keeps a
    tunnel that already works (the coordinator counts its handshake as proof), but for the private path (a new
    endpoint to prove). A relayed pair that only changes relay keeps its session: its first datagrams latch it
    at the new relay (core/relayfwd)."""
    was = {m.public_key: m.path for m in before}
    return frozenset(
        m.public_key
        for m in after
        if m.public_key in was
        and ((was[m.public_key] and was[m.public_key] != m.path) or (was[m.public_key] == "" and m.path == "private"))
    )


def is_fresh(handshake: int, now: float) -> bool:
    """A handshake in the last HANDSHAKE_FRESH_S: the tunnel works."""
    return bool(handshake) and now - handshake < HANDSHAKE_FRESH_S


def handshake_report(
    handshakes: Mapping[str, int], told: Mapping[str, bool], full: bool, now: float
) -> HandshakeReport:
    """The peers to report, given {key: latest handshake} now and `told` {key: fresh} as last acknowledged.

    A peer is reported when the coordinator has not heard of it (a new peer, or one re-created for a
    new path, whose key the caller dropped from `told`: its next handshake proves the path) or when it
    went from fresh to stale or back (all peers when a full report is asked for). A tunnel that stays
    fresh is not reported again when WireGuard rekeys it every 120 s: in a mesh of n nodes that was
    n(n-1)/120 reports a second that changed nothing, the coordinator's whole steady-state load.
    Judged with this node's clock, the one its handshake times come from (no skew)."""
    out: dict[str, int] = {}
    stale: list[str] = []
    for key, hs in handshakes.items():
        fresh = is_fresh(hs, now)
        if full or told.get(key) != fresh:
            out[key] = hs
            if not fresh:
                stale.append(key)
    return HandshakeReport(out, tuple(stale))


def desired_for_node(
    my_key: str, members: Sequence[Member], hold: frozenset[str] | set[str] = frozenset()
) -> list[PeerSpec]:
    """Peers for a node: every other member, at the endpoint the coordinator chose for this node, each
    admitting its own overlay address and nothing else (see `check_own_addresses`).

    The coordinator's own entry carries its public endpoint from the token. A peer whose path is
    `relayed` stays a WireGuard peer of its own, end to end: only its endpoint is its relay's UDP port
    for the pair (`relayed_endpoint`), where the relay forwards the datagrams as they are, so the relay
    never decrypts them and no tunnel of the relay's admits the peer's address. Peers in `hold` (see
    `handshake_holds`) get their endpoint but no keepalive yet, so nothing starts a handshake.
    """
    out = []
    for m in members:
        if m.public_key == my_key:
            continue
        pinned = m.path == "relayed"
        endpoint = relayed_endpoint(my_key, m, members) if pinned else m.endpoint
        # No keepalive until there is an endpoint: wireguard-go would try to handshake at once,
        # fail for want of an address, and then hold off every attempt for 5 s (REKEY_TIMEOUT).
        keepalive = KEEPALIVE if endpoint and m.public_key not in hold else 0
        out.append(PeerSpec(m.public_key, (f"{m.overlay_ip}/32",), endpoint, keepalive, m.name, pinned))
    return out


def relayed_endpoint(my_key: str, peer: Member, members: Sequence[Member]) -> str | None:
    """Where this node sends a relayed `peer`'s WireGuard datagrams: its relay's host (as this node reaches
    the relay) at the port the relay forwards the pair on; None until the coordinator named a port."""
    relay = relay_of(my_key, peer, members)
    if not peer.via_port or relay is peer or not relay.endpoint:
        return None
    host = split_endpoint(relay.endpoint)[0]
    return f"[{host}]:{peer.via_port}" if ":" in host else f"{host}:{peer.via_port}"


def check_own_addresses(specs: Sequence[PeerSpec], members: Sequence[Member]) -> None:
    """The invariant every member's interface keeps: each WireGuard peer admits exactly its own overlay
    address, so no tunnel (a relay's included) ever carries another member's address; ValueError naming the
    peer otherwise. Called on every peer set before it is applied."""
    own = {m.public_key: f"{m.overlay_ip}/32" for m in members}
    for spec in specs:
        if spec.allowed_ips != (own.get(spec.public_key),):
            raise ValueError(
                f"peer {spec.name or spec.public_key} would admit {', '.join(spec.allowed_ips) or 'nothing'}, "
                f"not only its own address {own.get(spec.public_key)}"
            )


def relay_of(my_key: str, peer: Member, members: Sequence[Member]) -> Member:
    """The member whose tunnel carries this node's traffic for a relayed `peer`: the relay the coordinator
    named (`peer.via`) while this node reaches it directly, else the coordinator."""
    if peer.via and peer.via != my_key:
        relay = next((m for m in members if m.public_key == peer.via), None)
        if relay is not None and relay.path != "relayed" and relay.public_key != peer.public_key:
            return relay
    return next((m for m in members if m.is_coordinator), peer)


def handshake_holds(
    my_key: str,
    members: Sequence[Member],
    handshakes: dict[str, int],
    windows: Mapping[tuple[str, str, str], float],
    now: float,
    recreate: frozenset[str] | set[str] = frozenset(),
) -> tuple[frozenset[str], dict[tuple[str, str, str], float]]:
    """Peers this node must not start a handshake with yet (see HOLD_S), and the new hold windows.

    For a node pair with no handshake (or one being re-created for a new path), the end with the
    greater public key waits HOLD_S after it learns the other's endpoint: the other end's
    initiation normally completes the handshake first. If it does not (a NAT that lets packets in
    only after one went out), the held end starts its own when the window ends.
    `handshakes` maps peer keys to their latest handshake (0: none). `windows` maps (peer key,
    endpoint, path) to when that hold ends; the returned windows keep those still waiting and
    open one for each new endpoint or path. `windows` itself is not changed.
    """
    held = set()
    out: dict[tuple[str, str, str], float] = {}
    for m in members:
        if m.is_coordinator or not m.endpoint or not my_key > m.public_key:
            continue
        if handshakes.get(m.public_key) and m.public_key not in recreate:
            continue
        window = (m.public_key, m.endpoint, m.path)
        out[window] = windows.get(window, now + HOLD_S)
        if now < out[window]:
            held.add(m.public_key)
    return frozenset(held), out


WG_PAD = 16  # WireGuard pads each packet's plaintext to a multiple of 16 bytes (up to the interface MTU)


def route_mtus(my_key: str, my_mtu: int, members: Sequence[Member]) -> dict[str, int]:
    """{overlay IP: route MTU} for the peers whose overlay MTU is below this member's.

    A node behind a small-MTU hop lowers its own interface MTU to fit, but its peers send with
    theirs: a packet that fits their MTU arrives too big for the hop. The kernel would fragment the
    outer UDP packet, except that wireguard-go with batched I/O sends with UDP GSO, which the kernel
    refuses to fragment ("sendmmsg: message too long"): bulk traffic to that node stalls. A /32
    route with the peer's MTU makes TCP (and the kernel's PMTU for everything else) size packets for
    the peer. It is rounded down to WireGuard's 16-byte padding, because padding is capped by the
    sender's larger interface MTU, not the peer's.
    """
    out = {}
    for m in members:
        if m.public_key == my_key:
            continue
        mtu = m.mtu or my_mtu
        if m.path == "relayed":
            # The relay forwards the datagram over its own underlay: it must fit the hops to and from the relay.
            relay = relay_of(my_key, m, members)
            mtu = min(mtu, relay.mtu or my_mtu)
        if 0 < mtu < my_mtu:
            out[m.overlay_ip] = mtu - mtu % WG_PAD
    return out


def jumbo_candidates(my_key: str, members: Sequence[Member], lan_mtu: int, my_mtu: int) -> frozenset[str]:
    """Overlay IPs of the peers whose tunnel may carry this node's LAN MTU (`lan_mtu`, the LAN interface's less
    WireGuard's overhead): those on the private path (same site, dialled at their LAN address), when the LAN
    carries more than the overlay MTU. Whether it really does is the agent's probe (meshrun.mesh.node.jumbo)."""
    if lan_mtu <= my_mtu:
        return frozenset()
    return frozenset(m.overlay_ip for m in members if m.public_key != my_key and m.path == "private")


def pair_mtus(
    my_key: str, my_mtu: int, members: Sequence[Member], jumbo: Mapping[str, int], iface_mtu: int = 0
) -> tuple[int, dict[str, int]]:
    """(interface MTU, {overlay IP: route MTU}) for per-pair MTUs: the interface is raised to `iface_mtu` (a
    jumbo LAN's, while pairs on it are probed or proven), every peer gets its own MTU as a /32 route where it
    is below the interface's: `jumbo` {overlay IP: MTU} the proven jumbo pairs, the others as `route_mtus`
    (their overlay MTU, at most this node's own)."""
    base = route_mtus(my_key, my_mtu, members)
    iface = max(my_mtu, iface_mtu, *jumbo.values())
    if iface == my_mtu:
        return iface, base
    out = {}
    for m in members:
        if m.public_key == my_key:
            continue
        mtu = jumbo.get(m.overlay_ip) or base.get(m.overlay_ip, my_mtu)
        if mtu < iface:
            out[m.overlay_ip] = mtu - mtu % WG_PAD
    return iface, out


def desired_for_coordinator(members: Sequence[Member], my_key: str = "") -> list[PeerSpec]:
    """Peers for a coordinator: every node, no endpoint (nodes dial in; WireGuard roams); and every other
    coordinator at the public endpoint it advertises, with a keepalive (coordinators dial each other);
    without `my_key`, no coordinator.

    A coordinator sends nodes no keepalives: each node's own keepalive holds its NAT mapping open."""
    out = []
    for m in members:
        if m.public_key == my_key:
            continue
        if m.is_coordinator:
            if m.endpoint and my_key:  # another coordinator, known by the endpoint it advertises
                out.append(PeerSpec(m.public_key, (f"{m.overlay_ip}/32",), m.endpoint, KEEPALIVE, m.name))
            continue
        # No keepalive here (see desired_for_node): nodes keep their NAT mappings open themselves.
        out.append(PeerSpec(m.public_key, (f"{m.overlay_ip}/32",), None, 0, m.name))
    return out


def diff(
    current: Sequence[PeerState],
    desired: Sequence[PeerSpec],
    now: float,
    recreate: frozenset[str] | set[str] = frozenset(),
) -> PeerDiff:
    """Compute the minimal PeerDiff.

    An existing peer's endpoint is only replaced when the desired one differs and the
    current one is unknown or has had no handshake for HANDSHAKE_FRESH_S: a live tunnel
    is never moved to an address that might be worse; a pinned one (a relay's port) is always
    set, since the session keys outlive the move and traffic follows at once. Peers in `recreate` (their path
    changed) are removed and added again, so the next handshake proves the new path.
    """
    cur = {p.public_key: p for p in current}
    want = {p.public_key: p for p in desired}
    add, update = [], []
    recreated = []
    for key, spec in want.items():
        have = cur.get(key)
        if have is None or key in recreate:
            add.append(spec)
            if have is not None:
                recreated.append(key)
            continue
        endpoint = None
        if spec.endpoint and spec.endpoint != have.endpoint:
            fresh = have.latest_handshake and now - have.latest_handshake < HANDSHAKE_FRESH_S
            if have.endpoint is None or not fresh or spec.pinned:
                endpoint = spec.endpoint
        if (
            endpoint
            or tuple(sorted(spec.allowed_ips)) != tuple(sorted(have.allowed_ips))
            or spec.keepalive != have.keepalive
        ):
            update.append(PeerSpec(key, spec.allowed_ips, endpoint, spec.keepalive, spec.name, spec.pinned))
    remove = tuple(sorted([k for k in cur if k not in want] + recreated))
    key_order = lambda p: p.public_key  # noqa: E731 - deterministic output for tests and logs
    return PeerDiff(tuple(sorted(add, key=key_order)), tuple(sorted(update, key=key_order)), remove)


def wg_set_args(d: PeerDiff) -> list[str]:
    """Arguments after `wg set IFACE` that apply `d` in one call ([] when nothing to do)."""
    args: list[str] = []
    for key in d.remove:
        args += ["peer", key, "remove"]
    for spec in (*d.add, *d.update):
        args += ["peer", spec.public_key]
        if spec.endpoint:
            args += ["endpoint", spec.endpoint]
        args += [
            "persistent-keepalive",
            str(spec.keepalive) if spec.keepalive else "off",
            "allowed-ips",
            ",".join(spec.allowed_ips),
        ]
    return args
