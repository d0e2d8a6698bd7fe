"""`meshrun status` and `meshrun ping`: what this member's interface and daemon look like.

`gather`/`ping` read state, the live interface and probe peers; `render*` are pure text formatting.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from pathlib import Path

from meshrun.core import etcdconf, lanpath, pairpaths, topology
from meshrun.core.doctor import control_warnings
from meshrun.core.doctor import removed as removed_member
from meshrun.core.model import Member
from meshrun.errors import ControlStateError, MeshrunError, StateError, UsageError
from meshrun.mesh import iface, member, process
from meshrun.mesh.coordinator import admin, ha
from meshrun.mesh.coordinator.leader import LEASE_TTL_S, leader_name
from meshrun.system.control.etcdstate import K_LEADER
from meshrun.system.files.statedir import StateDir
from meshrun.system.kernel.device import WireGuardDevice
from meshrun.system.sockets import probe


def path_label(m: Member | None, endpoint: str | None, allowed_ips: tuple[str, ...]) -> str:
    """What a peer's traffic really takes: relayed (routed via the coordinator), or direct over a
    private (same-site) or public endpoint, judged from the endpoint WireGuard is using now."""
    if m is None:
        return "unknown"
    if m.path == pairpaths.RELAYED or (not m.is_coordinator and not allowed_ips):
        return pairpaths.LABELS[pairpaths.RELAYED]
    private = pairpaths.private_candidate(m)
    if endpoint and private and pairpaths.host_of(endpoint) == pairpaths.host_of(private) and not m.is_coordinator:
        return pairpaths.LABELS[pairpaths.PRIVATE]
    return pairpaths.LABELS[pairpaths.PUBLIC]


def _members(state: StateDir, rec: dict) -> list[Member]:
    if rec.get("role") == "coordinator":
        db, _ = admin.open_db(state, readonly=True)
        try:
            return db.members()
        finally:
            db.close()
    return member.load_members(state)[1]


def coordinators(state: StateDir) -> list[dict]:
    """Every coordinator (on a coordinator): name, overlay IP, endpoint, its etcd member's health ("ok",
    "unreachable", "learner"...) and role ("leader" of meshrun's control loop, "follower"); one row for a
    lone coordinator, whose state is its SQLite file."""
    rec, network = member.load(state)
    if rec.get("role") != "coordinator":
        raise UsageError(f"{state.path} belongs to a node", "run `meshrun coordinator list` on a coordinator")
    if rec.get("removed"):  # the network's coordinators are no business of a removed one: it would list ghosts
        raise StateError(*removed_member("coordinator", str(rec["name"]), rec.get("removed_by")))
    if not ha.replicated(rec):
        return [
            {
                "name": rec["name"],
                "overlay_ip": rec["overlay_ip"],
                "endpoint": network.endpoints[0],
                "etcd": "-",
                "role": "only (state in SQLite)",
            }
        ]
    client = ha.client_for(state, timeout=2.0)
    try:
        try:
            db, _ = admin.open_db(state, readonly=True)
            coords = db.coordinators()
            db.close()
            kv = client.get(K_LEADER)
            leader = leader_name(kv.value if kv is not None else None)
        except MeshrunError:  # no majority: what this coordinator last knew of the others
            coords, leader = [], None
        if not coords:  # named by their overlay addresses (member.json keeps their etcd URLs, not their names)
            urls = (rec.get("control") or {}).get("endpoints") or []
            return [
                {
                    "name": etcdconf.url_host(u) or u,
                    "overlay_ip": etcdconf.url_host(u) or "?",
                    "endpoint": "?",
                    "etcd": _etcd_health(client, u),
                    "role": "?",
                }
                for u in urls
            ]
        rows = []
        for c in coords:
            health = _etcd_health(client, c.etcd_client)
            rows.append(
                {
                    "name": c.name,
                    "overlay_ip": c.overlay_ip,
                    "endpoint": c.endpoint,
                    "etcd": health,
                    "role": coordinator_role(c.name == leader, health),
                }
            )
        return rows
    finally:
        client.close()


def coordinator_role(holds_lead: bool, etcd_health: str) -> str:
    """A coordinator's role in `coordinator list`: the one whose name the leader key holds leads, unless its etcd
    member does not answer (its machine is gone, and the key outlives it until its lease ends: it showed as
    "leader" for about 6 s after a power-off)."""
    if not holds_lead:
        return "follower"
    if etcd_health == "unreachable":
        return f"lost leader (another takes the lead within {LEASE_TTL_S} s)"
    return "leader"


def _etcd_health(client, url: str) -> str:
    try:
        st = client.status(url)
    except ControlStateError:
        return "unreachable"
    return "ok" if st.get("leader") else "no leader"


RTT_SAMPLES = 9
RTT_FAR_SAMPLES = 3  # a peer whose first round trip exceeds RTT_FAR_MS: scheduling noise no longer matters
RTT_FAR_MS = 10.0
RTT_BUDGET_S = 10.0  # status measures peers until this is spent; the rest show no latency (meshrun ping does)
RTT_PEERS_MAX = 64  # a larger mesh shows latency for this many peers (meshrun ping measures any one)
RTT_LABEL = f"median of up to {RTT_SAMPLES} TCP connects over the overlay"


def rtt_ms(ip: str, port: int, samples: int = RTT_SAMPLES, timeout: float = 1.0) -> tuple[float | None, bool]:
    """(median round trip to ip:port in ms over up to `samples` TCP handshakes, measured one after the other,
    whether anything there accepted them): (None, False) when nothing answered; a machine whose port refuses
    answers (its time counts) without accepting (its agent or coordinator is down).

    One extra connect goes first and is not counted (it may wait for a WireGuard handshake), and
    peers are measured one at a time: measured together on a small machine, the threads' scheduling
    delays swamp a sub-millisecond round trip. A peer across a WAN (a second connect slower than
    RTT_FAR_MS) gets RTT_FAR_SAMPLES: there the noise is small against the round trip, and nine
    connects at 200 ms would make status take seconds per peer.
    """
    probe.tcp_connect(ip, port, timeout=timeout)
    first = probe.tcp_connect(ip, port, timeout=timeout)
    if first[0] is None:
        return None, False  # silent after the handshake's wait too: the rest would only wait as long again
    n = RTT_FAR_SAMPLES if first[0] * 1000 > RTT_FAR_MS else samples
    tries = [first] + [probe.tcp_connect(ip, port, timeout=timeout) for _ in range(n - 1)]
    ok = [r * 1000 for r, _ in tries if r is not None]
    return (round(statistics.median(ok), 3) if ok else None), any(accepted for _, accepted in tries)


def _tunnel_bytes(devices: list) -> dict[str, dict[str, int]]:
    """{extra tunnel device: {peer key: bytes received plus sent}} (a device gone: left out)."""
    out = {}
    for name in devices:
        if isinstance(name, str):
            with contextlib.suppress(MeshrunError):
                out[name] = {p.public_key: p.rx + p.tx for p in WireGuardDevice(name, Path("/dev/null")).peers()}
    return out


def gather(state: StateDir, measure: bool = True) -> dict:
    """Collect status as a JSON-able dict (no secrets: public keys only). A coordinator the others removed
    while it was away reads nothing of the network's state (it would wait on an etcd that left it): its
    status says it was removed, and what to do there."""
    rec, network = member.load(state)
    if rec.get("role") == "coordinator" and rec.get("removed"):
        return _removed_coordinator(state, rec, network)
    unreadable = ""
    try:
        members = _members(state, rec)
        # The coordinator knows every pair's path, so it also infers sites; a node shows what members joined with.
        sites = _sites(state, members) if rec.get("role") == "coordinator" else {m.name: m.site for m in members}
    except ControlStateError as exc:  # several coordinators, and etcd has no majority
        members, sites, unreadable = [], {}, exc.message
    by_key = {m.public_key: m for m in members}
    lan = state.read_json("lan.json") if (state / "lan.json").exists() else {}
    on_lan = set(lan.get("active") or [])
    extra = state.read_json("tunnels.json") if (state / "tunnels.json").exists() else {}
    device = iface.device_for(state, network, rec)
    up = device.exists()
    current = device.peers() if up else []
    tunnel_bytes = _tunnel_bytes(extra.get("devices") or []) if up else {}
    # Each peer's MTU: its /32 route's where it has one (a smaller peer, or a jumbo interface), else the interface's.
    link_mtu = (device.link_mtu() if up else None) or int(rec.get("mtu") or network.mtu)
    route_mtu = device.current_route_mtus() if up else {}
    now = int(time.time())
    rows = []
    for p in current:
        m = by_key.get(p.public_key)
        ip = m.overlay_ip if m else (p.allowed_ips[0].split("/")[0] if p.allowed_ips else "")
        relay = None
        live = (extra.get("peers") or {}).get(m.name, {}).get("live", []) if m is not None else []
        if m is not None and m.path == pairpaths.RELAYED:
            via = by_key.get(m.via) if m.via else None
            relay = via.name if via is not None and via.path != pairpaths.RELAYED else "coordinator"
        rows.append(
            {
                "name": m.name if m else "?",
                "coordinator": bool(m and m.is_coordinator),
                "relay": relay,
                "site": sites.get(m.name, "") if m else "",
                "overlay_ip": ip,
                "public_key": p.public_key,
                "endpoint": p.endpoint,
                # The peer's own LAN addresses: where a pair of one site dials it on the private path.
                "candidates": list(m.candidates) if m else [],
                # The site LAN path carries the pair's traffic (its WireGuard peer stays, idle, for a fallback).
                "path": lanpath.label(bool(lan.get("routed")))
                if m is not None and m.name in on_lan
                else path_label(m, p.endpoint, p.allowed_ips) + (f", {1 + len(live)} tunnels" if live else ""),
                # Tunnels carrying the pair's flows now, this interface included (`join --tunnels`, core/tunnels).
                "tunnels": 1 + len(live),
                # Bytes each extra tunnel moved with the peer, received plus sent (rx/tx_bytes: this interface's).
                "tunnel_bytes": {dev: b[p.public_key] for dev, b in tunnel_bytes.items() if p.public_key in b},
                "latest_handshake": p.latest_handshake or None,
                "handshake_age_s": now - p.latest_handshake if p.latest_handshake else None,
                "rx_bytes": p.rx,
                "tx_bytes": p.tx,
                "allowed_ips": list(p.allowed_ips),
                "mtu": route_mtu.get(ip, link_mtu),
                "latency_ms": None,
                "answered": None,  # measured: whether its API accepted a connection now (None: not measured)
            }
        )
    if measure and up:
        # Coordinators first: whether each answers is what tells a node that one is lost.
        deadline = time.monotonic() + RTT_BUDGET_S
        for r in sorted([r for r in rows if r["overlay_ip"]], key=lambda r: not r["coordinator"])[:RTT_PEERS_MAX]:
            if time.monotonic() > deadline:
                break
            r["latency_ms"], r["answered"] = rtt_ms(r["overlay_ip"], network.api_port)
    rows.sort(key=lambda r: tuple(int(x) for x in r["overlay_ip"].split(".")) if r["overlay_ip"] else (999,))
    out = {
        **_own(state, rec, network, device, up),
        "peers": rows,
        "warnings": [w for w in [device.warning() if up else None] if w],
    }
    if unreadable:
        out["warnings"].append(
            f"the replicated state cannot be read ({unreadable}); `meshrun doctor` says why and what to do"
        )
    if rec.get("role") == "coordinator":
        out["pairs"] = _pairs(state, members) if not unreadable else []
        out["coordinators"] = coordinators(state) if ha.replicated(rec) else []
    else:
        out["coordinator"] = (state.read_json("sync.json") if (state / "sync.json").exists() else {}).get("coordinator")
        relaying = state.read_json("relaying.json") if (state / "relaying.json").exists() else {}
        out["relaying"] = relaying.get("pairs", [])
        out["relay_forwarding"] = relaying.get("forwarding")
        out["lan"] = lan
        out["tunnels"] = extra
        if extra.get("error"):
            out["warnings"].append(f"no extra tunnels ({extra['error']}); every pair on {network.interface} alone")
        if lan.get("error"):
            out["warnings"].append(f"no site LAN path ({lan['error']}); this site's pairs stay on WireGuard")
        sync = state.read_json("sync.json") if (state / "sync.json").exists() else {}
        out["sync"] = sync
        if sync.get("failing_since"):
            out["warnings"].append(
                # A fresh clock: `now` was read before the peers were measured, and the agent may have written
                # sync.json since (a negative age was printed).
                f"the coordinator has not answered for {_duration(time.time() - float(sync['failing_since']))} "
                f"({sync.get('error', '?')}); tunnels, paths and relays stay as last known, retrying every "
                f"{sync.get('retry_s', '?')} s; joins, removals and path changes wait"
            )
    out["warnings"] += control_warnings(rec["role"], rows, out.get("coordinators") or [])
    return out


def _removed_coordinator(state: StateDir, rec: dict, network) -> dict:
    """`gather` on a coordinator marked removed (meshrun.mesh.coordinator.ha.refuse_removed): its own facts, no
    peers, pairs or coordinators, and the one warning of what to do."""
    device = iface.device_for(state, network, rec)
    what, fix = removed_member("coordinator", str(rec["name"]), rec.get("removed_by"))
    own = _own(state, rec, network, device, device.exists())
    return {**own, "peers": [], "warnings": [f"{what}; {fix}"], "pairs": [], "coordinators": []}


def _own(state: StateDir, rec: dict, network, device, up: bool) -> dict:
    """What `gather` says of this member itself: its network, name, address, interface and daemon."""
    return {
        "network": network.name,
        "role": rec["role"],
        "name": rec["name"],
        "overlay_ip": rec["overlay_ip"],
        "cidr": network.cidr,
        "interface": network.interface,
        "interface_up": up,
        "backend": device.backend() if up else rec.get("backend"),
        "listen_port": network.listen_port,
        "api_port": network.api_port,
        "mtu": int(rec.get("mtu") or network.mtu),
        "latency": RTT_LABEL,
        "daemon_pid": process.pid(state),
        "removed": bool(rec.get("removed")),
    }


def _sites(state: StateDir, members: list[Member]) -> dict[str, str]:
    """{member: site name} as jobs group them (meshrun.core.topology), from the coordinator's database."""
    db, _ = admin.open_db(state, readonly=True)
    try:
        return {name: site.name for name, site in topology.assign(members, db.pairs()).items()}
    finally:
        db.close()


def _pairs(state: StateDir, members: list[Member]) -> list[dict]:
    """Every pair of nodes, with its path as the coordinator decided it (its database, written by its
    daemon), or "probing" while no path is decided yet."""
    db, _ = admin.open_db(state, readonly=True)
    try:
        decided = db.pairs()
    finally:
        db.close()
    nodes = sorted(m.name for m in members if not m.is_coordinator)
    now = time.time()
    out = []
    for i, a in enumerate(nodes):
        for b in nodes[i + 1 :]:
            v = decided.get((a, b))
            out.append(
                {
                    "a": a,
                    "b": b,
                    "path": pairpaths.LABELS.get(v.mode, "?") if v else "probing",
                    "relay": (v.relay or "coordinator") if v and v.mode == pairpaths.RELAYED else None,
                    "verified": bool(v and v.verified),
                    # A relayed pair's next direct try (pairpaths.retry_delay), in seconds from now.
                    "direct_try_in_s": _next_direct_try(v, now),
                }
            )
    return out


def _next_direct_try(v: pairpaths.PairState | None, now: float) -> int | None:
    due = pairpaths.next_due(v, 0) if v is not None and v.mode == pairpaths.RELAYED else None
    return None if due is None else max(0, int(due - now))


def pair_rows(state: StateDir) -> list[dict]:
    """Every node pair as `status --json` lists it ("pairs"), read from a coordinator's state directory alone:
    no daemon asked, no peer measured."""
    return _pairs(state, _members(state, member.load(state)[0]))


def pair_labels(state: StateDir) -> dict[frozenset[str], str]:
    """{frozenset((a, b)): path label} for every node pair ("probing" while undecided)."""
    return {frozenset((p["a"], p["b"])): p["path"] for p in pair_rows(state)}


def _duration(s: float) -> str:
    """A span of seconds as status words it ("45 s", "3 min", "2 h"); never negative."""
    s = max(0, int(s))
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    return f"{s // 3600} h"


def _age(s: int | None) -> str:
    if s is None:
        return "never"
    if s < 120:
        return f"{s}s ago"
    if s < 7200:
        return f"{s // 60}m ago"
    return f"{s // 3600}h ago"


def _next_try(p: dict) -> str:
    s = p.get("direct_try_in_s")
    if s is None:
        return ""
    return f", next direct try in {s}s" if s < 120 else f", next direct try in {s // 60}m"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _table(cols: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*cols)] + [fmt.format(*r) for r in rows]


SUMMARY_AT = 20  # more peers (or pairs) than this: counts and the worst few, unless --all
WORST = 5


def _counts(values: list[str]) -> str:
    return ", ".join(f"{label} {n}" for label, n in Counter(values).most_common())


def _peer_badness(r: dict) -> tuple:
    # Never handshaken, then a stale handshake, then relayed, then the oldest handshake.
    age = r["handshake_age_s"]
    rank = 0 if age is None else 1 if age >= pairpaths.STALE_S else 2 if r.get("path") == "relayed" else 3
    return rank, -(age or 0), r["overlay_ip"]


def _pair_badness(p: dict) -> tuple:
    return (
        {"probing": 0, pairpaths.LABELS[pairpaths.RELAYED]: 1}.get(p["path"], 2 if not p["verified"] else 3),
        p["a"],
        p["b"],
    )


def render(st: dict, full: bool = False) -> str:
    """Human-readable status: a header, a table of peers, and on the coordinator the node pairs.

    With more than SUMMARY_AT peers (or pairs), each table becomes a summary (counts by path and by
    handshake state) and the WORST few rows, unless `full` (`meshrun status --all`)."""
    daemon = f"running (pid {st['daemon_pid']})" if st["daemon_pid"] else "not running"
    iface = f"{st['interface']} ({st['backend']})" if st["interface_up"] else f"{st['interface']} DOWN"
    head = [
        f"network {st['network']}  {st['role']} {st['name']}  {st['overlay_ip']} in {st['cidr']}",
        f"interface {iface}  udp/{st['listen_port']}  mtu {st['mtu']}  daemon {daemon}",
    ]
    if st.get("removed"):
        by = "by the coordinator" if st["role"] == "node" else "by the other coordinators"
        head.append(f"this {st['role']} was REMOVED from the network {by}")
    coords = [r for r in st["peers"] if r.get("coordinator")]
    if st["role"] == "node" and len(coords) > 1 and st.get("coordinator"):
        name = next((r["name"] for r in coords if r["overlay_ip"] == st["coordinator"]), st["coordinator"])
        head.append(f"{len(coords)} coordinators; this node syncs with {name} ({st['coordinator']})")
    head += [f"warning: {w}" for w in st.get("warnings", [])]
    cols = ["NAME", "SITE", "OVERLAY IP", "PATH", "ENDPOINT", "HANDSHAKE", "RTT", "RX", "TX"]
    shown = st["peers"]
    lines = head + [""]
    if not full and len(shown) > SUMMARY_AT:
        ages = [
            "never"
            if r["handshake_age_s"] is None
            else "< 3 min"
            if r["handshake_age_s"] < pairpaths.STALE_S
            else "older"
            for r in shown
        ]
        lines += [
            f"{len(shown)} peers: {_counts([r.get('path', '-') for r in shown])}; handshake {_counts(ages)}",
            f"the {WORST} worst (meshrun status --all lists every peer):",
        ]
        shown = sorted(shown, key=_peer_badness)[:WORST]
    rows = [
        [
            r["name"],
            r.get("site") or "-",
            r["overlay_ip"],
            r.get("path", "-") + (f" by {r['relay']}" if r.get("relay") else ""),
            r["endpoint"] or "-",
            _age(r["handshake_age_s"]),
            "-" if r.get("latency_ms") is None else f"{r['latency_ms']:.2f} ms",
            _bytes(r["rx_bytes"]),
            _bytes(r["tx_bytes"]),
        ]
        for r in shown
    ]
    lines += _table(cols, rows)
    if st.get("relaying"):
        shown_pairs = ", ".join(f"{a} <-> {b}" for a, b in st["relaying"][:8])
        more = f" and {len(st['relaying']) - 8} more" if len(st["relaying"]) > 8 else ""
        how = f" ({st['relay_forwarding']})" if st.get("relay_forwarding") else ""
        lines.append(f"this node relays {len(st['relaying'])} pairs{how}: {shown_pairs}{more}")
    if not rows:
        lines.append("(no peers yet)")
    elif any(r.get("latency_ms") is not None for r in shown):
        lines.append(f"RTT: {st.get('latency', RTT_LABEL)}")
    if st.get("coordinators"):
        lines += ["", "coordinators (state replicated in etcd):"]
        lines += _table(
            ["NAME", "OVERLAY IP", "ENDPOINT", "ETCD", "ROLE"],
            [[c["name"], c["overlay_ip"], c["endpoint"], c["etcd"], c["role"]] for c in st["coordinators"]],
        )
    pairs_shown = st.get("pairs") or []
    if pairs_shown:
        lines += ["", "node pairs:"]
        if not full and len(pairs_shown) > SUMMARY_AT:
            lines += [
                f"{len(pairs_shown)} pairs: {_counts([p['path'] for p in pairs_shown])}; verified "
                f"{_counts(['yes' if p['verified'] else 'no' for p in pairs_shown])}",
                f"the {WORST} worst (meshrun status --all lists every pair):",
            ]
            pairs_shown = sorted(pairs_shown, key=_pair_badness)[:WORST]
        lines += _table(
            ["A", "B", "PATH", "VERIFIED"],
            [
                [
                    p["a"],
                    p["b"],
                    p["path"] + (f" by {p['relay']}" if p.get("relay") else "") + _next_try(p),
                    "yes" if p["verified"] else "-" if p["path"] == "probing" else "no",
                ]
                for p in pairs_shown
            ],
        )
    return "\n".join(line.rstrip() for line in lines)


def ping(state: StateDir, peer: str, count: int = 5, interval: float = 0.2) -> dict:
    """TCP round trips to `peer` (name or overlay IP) over the overlay, with its path."""
    if count < 1:
        raise UsageError(f"--count {count} must be at least 1", "e.g. --count 5")
    st = gather(state, measure=False)
    row = next((r for r in st["peers"] if peer in (r["name"], r["overlay_ip"])), None)
    if row is None:
        names = ", ".join(r["name"] for r in st["peers"]) or "none"
        raise UsageError(f"{peer!r} is not a peer of this member", f"peers are: {names}")
    _, network = member.load(state)
    rtts = []
    for i in range(count):
        rtt = probe.tcp_rtt(row["overlay_ip"], network.api_port, timeout=2.0)
        if rtt is not None:
            rtts.append(rtt * 1000)
        if i + 1 < count:
            time.sleep(interval)
    return {
        "peer": row["name"],
        "overlay_ip": row["overlay_ip"],
        "path": row["path"],
        "endpoint": row["endpoint"],
        "sent": count,
        "received": len(rtts),
        "rtt_ms": {"min": min(rtts), "avg": statistics.fmean(rtts), "max": max(rtts)} if rtts else None,
    }


def render_ping(r: dict) -> str:
    via = f"{r['path']}" + (f" via {r['endpoint']}" if r["endpoint"] and r["path"] != "relayed" else "")
    if not r["rtt_ms"]:
        return f"{r['peer']} ({r['overlay_ip']}) {via}: no answer ({r['received']}/{r['sent']})"
    t = r["rtt_ms"]
    return (
        f"{r['peer']} ({r['overlay_ip']}) {via}: rtt min/avg/max {t['min']:.2f}/{t['avg']:.2f}/{t['max']:.2f} ms "
        f"({r['received']}/{r['sent']} answered)"
    )
