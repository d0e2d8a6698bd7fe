"""WireGuard configuration text: wg-quick files (through wgconfig) and `wg show dump` parsing.

Pure: rendering works on file objects (StringIO), so it is testable without a system.
"""

from __future__ import annotations

import io
import wgconfig

from meshrun.core.peers import PeerSpec, PeerState


def render_quick(private_key: str, address: str, listen_port: int, mtu: int,
                 peers: list[PeerSpec], comment: str = "") -> str:
    """Return a wg-quick compatible config (valid input for `wg-quick strip`).

    It holds the private key: whoever writes it must make the file 0600.
    """
    cfg = wgconfig.WGConfig()
    if comment:
        cfg.lines.extend(f"# {line}" for line in comment.splitlines())
    cfg.add_attr(None, "PrivateKey", private_key)
    cfg.add_attr(None, "Address", address)
    cfg.add_attr(None, "ListenPort", listen_port)
    cfg.add_attr(None, "MTU", mtu)
    for p in sorted(peers, key=lambda p: p.public_key):
        cfg.add_peer(p.public_key, f"# {p.name}" if p.name else None)
        cfg.add_attr(p.public_key, "AllowedIPs", ", ".join(p.allowed_ips))
        if p.endpoint:
            cfg.add_attr(p.public_key, "Endpoint", p.endpoint)
        if p.keepalive:
            cfg.add_attr(p.public_key, "PersistentKeepalive", p.keepalive)
    out = io.StringIO()
    cfg.write_to_fileobj(out)
    return out.getvalue()


def read_quick(text: str) -> tuple[dict, dict]:
    """Parse a wg-quick file into (interface attributes, {public key: peer attributes})."""
    cfg = wgconfig.WGConfig()
    cfg.read_from_fileobj(io.StringIO(text))
    return cfg.get_interface(), cfg.get_peers(keys_only=False)


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
        peers.append(PeerState(
            public_key=pub, endpoint=None if endpoint == "(none)" else endpoint,
            allowed_ips=tuple(sorted(a for a in allowed.split(",") if a and a != "(none)")),
            latest_handshake=int(hs), rx=int(rx), tx=int(tx), keepalive=0 if ka == "off" else int(ka)))
    return port, peers
