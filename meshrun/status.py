"""`meshrun status`: what this member's interface and daemon look like, per peer.

`gather` reads state and the live interface; `render` is pure text formatting.
"""

from __future__ import annotations

import time

from meshrun import agent, wg
from meshrun.errors import MeshrunError
from meshrun.store import CoordinatorDB, StateDir


def gather(state: StateDir) -> dict:
    """Collect status as a JSON-able dict (no secrets: public keys only)."""
    rec, network = agent.load_node(state)
    if rec.get("role") == "coordinator":
        members = CoordinatorDB(state / "coordinator.db").members()
    else:
        members = agent.load_members(state)[1] if (state / "peers.json").exists() else []
    by_key = {m.public_key: m for m in members}
    up = wg.interface_exists(network.interface)
    current = wg.show(network.interface)[1] if up else []
    now = int(time.time())
    rows = []
    for p in current:
        m = by_key.get(p.public_key)
        rows.append({
            "name": m.name if m else "?", "overlay_ip": m.overlay_ip if m else p.allowed_ips[0].split("/")[0]
            if p.allowed_ips else "", "public_key": p.public_key, "endpoint": p.endpoint,
            "latest_handshake": p.latest_handshake or None,
            "handshake_age_s": now - p.latest_handshake if p.latest_handshake else None,
            "rx_bytes": p.rx, "tx_bytes": p.tx, "allowed_ips": list(p.allowed_ips)})
    rows.sort(key=lambda r: tuple(int(x) for x in r["overlay_ip"].split(".")) if r["overlay_ip"] else (999,))
    return {"network": network.name, "role": rec["role"], "name": rec["name"], "overlay_ip": rec["overlay_ip"],
            "cidr": network.cidr, "interface": network.interface, "interface_up": up,
            "backend": wg.backend_of(network.interface) if up else rec.get("backend"),
            "listen_port": network.listen_port, "mtu": network.mtu, "daemon_pid": state.read_pid(),
            "removed": bool(rec.get("removed")), "peers": rows}


def _age(s: int | None) -> str:
    if s is None:
        return "never"
    if s < 120:
        return f"{s}s ago"
    if s < 7200:
        return f"{s // 60}m ago"
    return f"{s // 3600}h ago"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def render(st: dict) -> str:
    """Human-readable status: a header and a table of peers."""
    daemon = f"running (pid {st['daemon_pid']})" if st["daemon_pid"] else "not running"
    iface = f"{st['interface']} ({st['backend']})" if st["interface_up"] else f"{st['interface']} DOWN"
    head = [f"network {st['network']}  {st['role']} {st['name']}  {st['overlay_ip']} in {st['cidr']}",
            f"interface {iface}  udp/{st['listen_port']}  mtu {st['mtu']}  daemon {daemon}"]
    if st.get("removed"):
        head.append("this node was REMOVED from the network by the coordinator")
    cols = ["NAME", "OVERLAY IP", "ENDPOINT", "HANDSHAKE", "RX", "TX"]
    rows = [[r["name"], r["overlay_ip"], r["endpoint"] or "-", _age(r["handshake_age_s"]), _bytes(r["rx_bytes"]),
             _bytes(r["tx_bytes"])] for r in st["peers"]]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = head + ["", fmt.format(*cols)] + [fmt.format(*r) for r in rows]
    if not rows:
        lines.append("(no peers yet)")
    return "\n".join(line.rstrip() for line in lines)
