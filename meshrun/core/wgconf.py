"""WireGuard configuration text: wg-quick files (through wgconfig) and `wg show dump` parsing.

Pure: rendering works on file objects (StringIO), so it is testable without a system.
"""

from __future__ import annotations

import io

import wgconfig

from meshrun.core.keys import is_public_key
from meshrun.core.peers import PeerSpec, PeerState


def render_quick(
    private_key: str, address: str, listen_port: int, mtu: int, peers: list[PeerSpec], comment: str = ""
) -> str:
    """Return a wg-quick compatible config (valid input for `wg-quick strip`).

    It holds the private key: whoever writes it must make the file 0600.
    """
    # The lines are laid out here, in wgconfig's format, and parsed once: wgconfig's add_peer and
    # add_attr re-parse the whole file on every call, which took 50 s for a node with 1000 peers.
    lines = [
        "[Interface]",
        *(f"# {line}" for line in comment.splitlines()),
        f"PrivateKey = {private_key}",
        f"Address = {address}",
        f"ListenPort = {listen_port}",
        f"MTU = {mtu}",
    ]
    for p in sorted(peers, key=lambda p: p.public_key):
        lines += [
            "",
            *([f"# {p.name}"] if p.name else []),
            "[Peer]",
            f"PublicKey = {p.public_key}",
            f"AllowedIPs = {', '.join(p.allowed_ips)}",
        ]
        if p.endpoint:
            lines.append(f"Endpoint = {p.endpoint}")
        if p.keepalive:
            lines.append(f"PersistentKeepalive = {p.keepalive}")
    cfg = wgconfig.WGConfig()
    cfg.lines = lines
    cfg.parse_lines()  # raises on a malformed section, as add_peer/add_attr would
    out = io.StringIO()
    cfg.write_to_fileobj(out)
    return out.getvalue()


def read_quick(text: str) -> tuple[dict, dict]:
    """Parse a wg-quick file into (interface attributes, {public key: peer attributes})."""
    cfg = wgconfig.WGConfig()
    cfg.read_from_fileobj(io.StringIO(text))
    return cfg.get_interface(), cfg.get_peers(keys_only=False)


def quick_peers(text: str) -> list[PeerSpec]:
    """The peers of a wg-quick file as render_quick writes them (key, allowed IPs, endpoint, keepalive, name
    unknown). ValueError when it cannot be parsed."""
    out = []
    for key, attrs in read_quick(text)[1].items():
        if not is_public_key(key):
            raise ValueError(f"a [Peer] without a valid PublicKey ({str(key)[:60]!r})")
        allowed = attrs.get("AllowedIPs", [])
        allowed = [a.strip() for a in allowed.split(",")] if isinstance(allowed, str) else [str(a) for a in allowed]
        endpoint = attrs.get("Endpoint")
        keepalive = int(attrs.get("PersistentKeepalive") or 0)
        out.append(
            PeerSpec(str(key), tuple(sorted(a for a in allowed if a)), str(endpoint) if endpoint else None, keepalive)
        )
    return out


def parse_dump(text: str) -> tuple[int, list[PeerState]]:
    """Parse `wg show IFACE dump` output with its first (interface) line already removed
    or present; returns (listen port or 0, peers). Ignores the private key column."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    port = 0
    peers = []
    for ln in lines:
        cols = ln.split("\t")
        if len(cols) == 4:  # interface line: private-key public-key listen-port fwmark
            port = int(cols[2]) if cols[2].isdigit() else 0
            continue
        if len(cols) != 8:
            raise ValueError(f"unexpected `wg show dump` line with {len(cols)} fields")
        pub, _psk, endpoint, allowed, hs, rx, tx, ka = cols
        peers.append(
            PeerState(
                public_key=pub,
                endpoint=None if endpoint == "(none)" else endpoint,
                allowed_ips=tuple(sorted(a for a in allowed.split(",") if a and a != "(none)")),
                latest_handshake=int(hs),
                rx=int(rx),
                tx=int(tx),
                keepalive=0 if ka == "off" else int(ka),
            )
        )
    return port, peers
