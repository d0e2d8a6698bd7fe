"""Shared data shapes: the network description and members, as they travel between members.

`from_dict` functions validate input from the wire (it may be hostile or garbled) and raise
ValueError; callers turn that into their own typed error.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field, fields

from meshrun.core.keys import is_public_key

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}\Z")  # \Z: `$` would accept a trailing newline
SITE_RE = NAME_RE  # `meshrun join --site`: a name like a member's
MAX_TUNNELS = 8  # `meshrun join --tunnels`: WireGuard tunnels per same-site pair, at most (meshrun.core.tunnels)
IFACE_RE = re.compile(r"^[A-Za-z0-9_=+.-]{1,15}\Z")
DEFAULT_PORT = 51820
DEFAULT_MTU = 1420
DEFAULT_IFACE = "meshrun0"
DEFAULT_RDZV_PORT = 29400
STORE_PORTS = 100  # a job's rendezvous store takes a port from rdzv_port + 1 up to rdzv_port + STORE_PORTS - 1


class _Wire:
    """A data shape that travels as JSON."""

    def to_dict(self) -> dict:
        # Shallow (the fields are scalars and tuples of strings): dataclasses.asdict deep-copies, and the
        # coordinator builds a thousand of these per member-list version.
        out = {}
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out


@dataclass(frozen=True)
class Network(_Wire):
    """What every member knows about the network (nothing secret)."""

    name: str
    cidr: str
    interface: str
    listen_port: int
    mtu: int
    coordinator_ip: str
    coordinator_public_key: str
    endpoints: tuple[str, ...]  # the coordinator's public host:port (from init --endpoint)
    fingerprint: str  # SHA-256 of the coordinator's TLS certificate
    api_port: int = DEFAULT_PORT + 1  # overlay API (coordinator) and job API (agents), overlay IPs only
    rdzv_port: int = DEFAULT_RDZV_PORT  # torch c10d store hosted by the coordinator on its overlay IP

    @property
    def prefixlen(self) -> int:
        return ipaddress.ip_network(self.cidr).prefixlen

    @classmethod
    def from_dict(cls, d: dict) -> Network:
        _object(d, "network")
        net = cls(
            name=_str(d, "name", NAME_RE),
            cidr=str(ipaddress.ip_network(_str(d, "cidr"))),
            interface=_str(d, "interface", IFACE_RE),
            listen_port=_port(d, "listen_port"),
            mtu=_int(d, "mtu", 1280, 9000),
            coordinator_ip=str(ipaddress.IPv4Address(_str(d, "coordinator_ip"))),
            coordinator_public_key=_key(d, "coordinator_public_key"),
            endpoints=tuple(_strlist(d, "endpoints")),
            fingerprint=_str(d, "fingerprint", re.compile(r"^[0-9a-f]{64}\Z")),
            api_port=_port(d, "api_port"),
            rdzv_port=_port(d, "rdzv_port"),
        )
        return net


@dataclass(frozen=True)
class Member(_Wire):
    """A member as the coordinator describes it to others."""

    name: str
    public_key: str
    overlay_ip: str
    endpoint: str | None = None  # public endpoint as the coordinator's WireGuard observed it
    candidates: tuple[str, ...] = field(default=())  # the member's own local ip:port addresses
    is_coordinator: bool = False
    last_handshake: int = 0  # with the coordinator, unix seconds (0 = never)
    path: str = ""  # for the receiving node: private | public | relayed | ""
    mtu: int = 0  # the member's overlay MTU as it reported it (0 = unknown)
    site: str = ""  # the site it joined with (`meshrun join --site`), "" if none
    relay: bool = True  # may relay other members' pairs (`meshrun join --no-relay`: not)
    via: str = ""  # for the receiving node, a relayed peer's relay: its public key ("" = the coordinator)
    via_port: int = 0  # for the receiving node, the UDP port its relay forwards this pair's datagrams on (0: none yet)
    lan: bool = False  # for the receiving node: the pair may use its trusted site's LAN path (core/lanpath)
    lan_routed: bool = False  # ... with no encapsulation (the site was trusted with `--encapsulation none`)
    tunnels: int = 1  # WireGuard tunnels per same-site pair it runs (`meshrun join --tunnels`), as it reports it

    @classmethod
    def from_dict(cls, d: dict) -> Member:
        _object(d, "member")
        endpoint = d.get("endpoint")
        if endpoint is not None:
            endpoint = parse_endpoint(str(endpoint))
        return cls(
            name=_str(d, "name", NAME_RE),
            public_key=_key(d, "public_key"),
            overlay_ip=str(ipaddress.IPv4Address(_str(d, "overlay_ip"))),
            endpoint=endpoint,
            candidates=tuple(parse_endpoint(c) for c in _strlist(d, "candidates", required=False)),
            is_coordinator=bool(d.get("is_coordinator", False)),
            last_handshake=_int(d, "last_handshake", 0, 2**40, required=False),
            path=_choice(d, "path", ("", "private", "public", "relayed")),
            mtu=_int(d, "mtu", 0, 9000, required=False),
            site=_str(d, "site", SITE_RE) if d.get("site") else "",
            relay=bool(d.get("relay", True)),
            via=_key(d, "via") if d.get("via") else "",
            via_port=_int(d, "via_port", 0, 65535, required=False),
            lan=bool(d.get("lan", False)),
            lan_routed=bool(d.get("lan_routed", False)),
            tunnels=_int(d, "tunnels", 1, MAX_TUNNELS, required=False),
        )


def parse_endpoint(value: str, default_port: int | None = None) -> str:
    """Normalise 'host:port' (IPv4, [IPv6] or DNS name) and return it; ValueError if malformed."""
    value = value.strip()
    host, sep, port = value.rpartition(":")
    if not sep or host.endswith("]") is False and ":" in host:
        if default_port is None:
            raise ValueError(f"endpoint {value!r} has no port")
        host, port = value, str(default_port)
    if host.startswith("[") and host.endswith("]"):
        ipaddress.IPv6Address(host[1:-1])
    elif not re.match(r"^[A-Za-z0-9.-]{1,253}$", host):
        raise ValueError(f"endpoint host {host!r} is not an address or DNS name")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint port {port!r} is not a port number")
    return f"{host}:{int(port)}"


_NOT_PUBLIC = (
    ("loopback", ipaddress.IPv4Network("127.0.0.0/8")),
    ("private (RFC 1918)", ipaddress.IPv4Network("10.0.0.0/8")),
    ("private (RFC 1918)", ipaddress.IPv4Network("172.16.0.0/12")),
    ("private (RFC 1918)", ipaddress.IPv4Network("192.168.0.0/16")),
    ("carrier-grade NAT (RFC 6598)", ipaddress.IPv4Network("100.64.0.0/10")),
    ("link-local", ipaddress.IPv4Network("169.254.0.0/16")),
    ("unspecified", ipaddress.IPv4Network("0.0.0.0/8")),
    ("multicast", ipaddress.IPv4Network("224.0.0.0/4")),
    ("reserved", ipaddress.IPv4Network("240.0.0.0/4")),
)


def not_public(ip: str) -> str | None:
    """What kind of address `ip` (IPv4) is when nodes in other networks cannot reach it ("private (RFC 1918)",
    "loopback", ...), or None. The documentation ranges count as public: the testbed's internet uses them."""
    addr = ipaddress.IPv4Address(ip)
    return next((kind for kind, net in _NOT_PUBLIC if addr in net), None)


def refuse_ipv6(value: str) -> None:
    """UsageError when `value` (HOST, HOST:PORT or [V6]:PORT, as given to --endpoint) is an IPv6
    address: enrolment, NAT traversal and the MTU probes are IPv4 only, and a half-working IPv6
    underlay would fail later, on another machine, with a worse message."""
    from meshrun.errors import UsageError

    host = value.strip()
    if host.startswith("["):
        host = host[1:].split("]", 1)[0]
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return
    raise UsageError(
        f"--endpoint {value!r} is an IPv6 address; meshrun's underlay is IPv4 only",
        "give this machine's public IPv4 address, or a DNS name with an A record",
    )


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' (as parse_endpoint returns it) -> (host without brackets, port)."""
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def _object(d: object, what: str) -> None:
    if not isinstance(d, dict):
        raise ValueError(f"{what} must be an object")


def _str(d: dict, key: str, pattern: re.Pattern | None = None) -> str:
    v = d.get(key)
    if not isinstance(v, str) or (pattern is not None and not pattern.match(v)):
        raise ValueError(f"{key} is missing or malformed")
    return v


def _int(d: dict, key: str, lo: int, hi: int, required: bool = True) -> int:
    v = d.get(key, None if required else lo)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"{key} must be an integer in {lo}..{hi}")
    return v


def _choice(d: dict, key: str, allowed: tuple[str, ...]) -> str:
    v = d.get(key, allowed[0])
    if v not in allowed:
        raise ValueError(f"{key} must be one of {', '.join(allowed)}")
    return v


def _port(d: dict, key: str) -> int:
    return _int(d, key, 1, 65535)


def _key(d: dict, key: str) -> str:
    v = d.get(key)
    if not is_public_key(v):
        raise ValueError(f"{key} is not a WireGuard public key")
    return v


def _strlist(d: dict, key: str, required: bool = True) -> list[str]:
    v = d.get(key, None if required else [])
    if not isinstance(v, list) or len(v) > 64 or not all(isinstance(x, str) for x in v):
        raise ValueError(f"{key} must be a list of strings")
    return v


# --------------------------------------------------------------------------- option checks
# Each raises UsageError naming the option, the bad value and an example of a good one.


def check_interface(value: str) -> str:
    from meshrun.errors import UsageError

    if not IFACE_RE.match(value) or value in (".", ".."):
        raise UsageError(
            f"--interface {value!r} is not a valid interface name",
            "use 1-15 letters, digits or -_.=+, e.g. --interface meshrun0",
        )
    return value


def check_port(value: int, option: str = "--port") -> int:
    from meshrun.errors import UsageError

    if not 1 <= value <= 65534:
        raise UsageError(f"{option} {value} is not a usable port", f"pick 1-65534, e.g. {option} {DEFAULT_PORT}")
    return value


def check_mtu(value: int) -> int:
    from meshrun.errors import UsageError

    if not 1280 <= value <= 9000:
        raise UsageError(
            f"--mtu {value} is outside 1280..9000",
            f"use {DEFAULT_MTU} for a 1500-byte underlay, 1280 for the smallest paths",
        )
    return value


def check_name(value: str, option: str = "--name") -> str:
    from meshrun.errors import UsageError

    if not NAME_RE.match(value):
        raise UsageError(
            f"{option} {value!r} is not a valid name",
            f"use 1-32 lower-case letters, digits and '-', starting with a letter or digit, e.g. {option} gpu-a",
        )
    return value


WG_OVERHEAD = 60  # outer IPv4 20 + UDP 8 + WireGuard 32 (IPv6 underlays would need 80)
MIN_MTU = 576  # smallest IPv4 MTU every host must accept


def overlay_mtu(configured: int, underlay: int | None) -> int:
    """The interface MTU: the configured one, lowered to fit the probed underlay path MTU."""
    if underlay is None:
        return configured
    return max(MIN_MTU, min(configured, underlay - WG_OVERHEAD))


def default_node_name(hostname: str) -> str:
    """A valid member name derived from a hostname ('GPU_Box.local' -> 'gpu-box')."""
    name = re.sub(r"[^a-z0-9-]+", "-", hostname.split(".")[0].lower()).strip("-")[:32].strip("-")
    return name or "node"
