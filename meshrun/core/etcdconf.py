"""etcd's command line for a coordinator's member of the replicated control state.

A member listens on its overlay address only (clients on `client_port`, peers on `peer_port`), over TLS
both ways with certificates from the coordinators' CA (meshrun.core.keys.new_ca / sign_csr) required of
every client and peer. The TLS files live in one directory: `ca.crt`, `etcd.crt`, `etcd.key`. etcd reads
the certificate and key again on every new handshake (a renewal needs no restart) but `ca.crt` only when it
starts; during a CA rotation `ca.crt` holds two CAs (meshrun.mesh.coordinator.ha.CaRecord).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from meshrun.core.model import NAME_RE
from meshrun.errors import UsageError

CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "etcd.crt", "etcd.key"
QUOTA_BYTES = 1 << 30  # the control state is small; a runaway writer hits this long before the disk fills
MAX_TXN_OPS = 10000  # one transaction may rewrite a whole member list
COMPACTION_RETENTION = 10000  # revisions kept for watchers that fall behind (a coordinator resuming its watch)
# Members talk across the WAN, not a LAN: etcd advises a heartbeat near the members' round trip and an
# election timeout of at least ten heartbeats. 100/1000 ms fit overlay round trips up to about 100 ms and
# elect a new leader within about a second; longer paths need both raised together, so both are explicit.
HEARTBEAT_MS = 100
ELECTION_MS = 1000
# An idle watch hears from the server this often, so a watcher notices a dead stream (etcd's default: 10 min).
PROGRESS_NOTIFY = "5s"
# Said wherever two coordinators are seen (add, remove, status, doctor): two are weaker than one.
TWO_COORDINATORS = (
    "two coordinators: etcd needs both to write, so losing either stops joins, path changes and job starts "
    "(add a third: `meshrun coordinator add`)"
)


def _ip(ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        raise UsageError(f"{ip!r} is not an IP address", "pass the member's overlay address, e.g. 10.7.0.2") from None
    if addr.is_unspecified or addr.is_multicast:
        raise UsageError(
            f"etcd may not listen on {ip}", "pass the member's own overlay address: etcd answers on the overlay only"
        )
    return addr


def _port(port: int, what: str) -> int:
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise UsageError(f"the etcd {what} port {port!r} is not a port (1-65535)", f"pass another {what} port")
    return port


def _url(ip: str, port: int, what: str) -> str:
    addr = _ip(ip)
    host = f"[{addr}]" if addr.version == 6 else str(addr)
    return f"https://{host}:{_port(port, what)}"


def client_url(ip: str, port: int) -> str:
    """The URL etcd's clients use for the member at `ip`:`port` (https; IPv6 in brackets)."""
    return _url(ip, port, "client")


def peer_url(ip: str, port: int) -> str:
    """The URL etcd's peers use for the member at `ip`:`port` (https; IPv6 in brackets)."""
    return _url(ip, port, "peer")


def url_host(url: str) -> str:
    """The address a member URL (client_url/peer_url) names; "" for a URL without one."""
    return urlsplit(str(url)).hostname or ""


def _name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise UsageError(
            f"{name!r} is not an etcd member name", "use a member's name (lower-case letters, digits, '-', 1-32)"
        )
    return name


def _check_peer_url(url: str, who: str) -> str:
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "https" or parts.hostname is None or port is None or parts.path not in ("", "/"):
        raise UsageError(f"the peer URL {url!r} of {who} is not https://IP:PORT", "use etcdconf.peer_url(ip, port)")
    _ip(parts.hostname)
    return url


def server_argv(
    name: str,
    data_dir: Path,
    overlay_ip: str,
    client_port: int,
    peer_port: int,
    initial_cluster: Mapping[str, str],
    cluster_state: str,
    tls_dir: Path,
) -> list[str]:
    """etcd's argv (without the binary) for member `name` of the cluster `initial_cluster` (name -> peer URL,
    this member included, as `peer_url` writes them).

    `cluster_state` is "new" when every member in `initial_cluster` starts the cluster together, "existing"
    when this member joins a running cluster that already added it (member add). UsageError for a bad name,
    address, port or URL, or an `initial_cluster` that gives this member another peer URL than its own.
    """
    _name(name)
    if cluster_state not in ("new", "existing"):
        raise UsageError(f"the etcd cluster state {cluster_state!r} is not 'new' or 'existing'", "pass one of those")
    if _port(client_port, "client") == _port(peer_port, "peer"):
        raise UsageError(f"etcd's client and peer ports are both {client_port}", "pass two different ports")
    clients, peers = client_url(overlay_ip, client_port), peer_url(overlay_ip, peer_port)
    if not initial_cluster:
        raise UsageError("the initial etcd cluster is empty", "list at least this member")
    for member, url in initial_cluster.items():
        _check_peer_url(url, _name(member))
    if initial_cluster.get(name) != peers:
        raise UsageError(
            f"the initial etcd cluster gives {name} the peer URL {initial_cluster.get(name)!r}, not {peers}",
            "list this member with its own overlay address and peer port",
        )
    members = sorted(initial_cluster)
    tls = Path(tls_dir)
    ca, cert, key = str(tls / CA_FILE), str(tls / CERT_FILE), str(tls / KEY_FILE)
    return [
        "--name", name,
        "--data-dir", str(data_dir),
        "--listen-client-urls", clients,
        "--advertise-client-urls", clients,
        "--listen-peer-urls", peers,
        "--initial-advertise-peer-urls", peers,
        "--initial-cluster", ",".join(f"{m}={initial_cluster[m]}" for m in members),
        "--initial-cluster-state", cluster_state,
        # The same token on every member whenever they start (stable: it comes from the names, not a clock),
        # and different for clusters started from different first members, so two never merge by mistake.
        "--initial-cluster-token", f"meshrun-{members[0]}",
        "--client-cert-auth",
        "--trusted-ca-file", ca,
        "--cert-file", cert,
        "--key-file", key,
        "--peer-client-cert-auth",
        "--peer-trusted-ca-file", ca,
        "--peer-cert-file", cert,
        "--peer-key-file", key,
        "--enable-grpc-gateway=true",  # meshrun.system.control.etcd speaks JSON to /v3/...
        "--enable-v2=false",
        "--max-txn-ops", str(MAX_TXN_OPS),
        "--quota-backend-bytes", str(QUOTA_BYTES),
        "--auto-compaction-mode", "revision",
        "--auto-compaction-retention", str(COMPACTION_RETENTION),
        "--heartbeat-interval", str(HEARTBEAT_MS),
        "--election-timeout", str(ELECTION_MS),
        "--experimental-watch-progress-notify-interval", PROGRESS_NOTIFY,
        "--logger", "zap",
        "--log-outputs", "stderr",
    ]  # fmt: skip
