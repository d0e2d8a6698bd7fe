"""Overlay address management: CIDR checks and allocation. Pure: routes come in as data."""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable

from meshrun.errors import NetworkError, UsageError

# Uncommon on purpose: clouds default to 10.0.0.0/16 and 172.31.0.0/16, Docker to 172.17+,
# Tailscale to 100.64.0.0/10, Kubernetes to 10.96/12 and 10.244/16.
DEFAULT_CIDR = "10.213.0.0/16"
_RFC1918 = tuple(ipaddress.IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"))


def parse_cidr(value: str) -> ipaddress.IPv4Network:
    """Parse an overlay CIDR such as 10.213.0.0/16, or raise UsageError naming the value."""
    try:
        net = ipaddress.ip_network(value.strip(), strict=True)
    except ValueError as exc:
        raise UsageError(
            f"--cidr {value!r} is not a network address ({exc})",
            f"give the network's first address and a prefix, e.g. --cidr {DEFAULT_CIDR}",
        ) from None
    if not isinstance(net, ipaddress.IPv4Network):
        raise UsageError(
            f"--cidr {value!r} is IPv6; meshrun overlays are IPv4 for now",
            f"use an IPv4 private range, e.g. --cidr {DEFAULT_CIDR}",
        )
    if net.prefixlen > 29:
        raise UsageError(
            f"--cidr {value!r} leaves room for fewer than 6 members", "use a prefix of /29 or shorter, e.g. /24 or /16"
        )
    # RFC 1918 only: `is_private` also admits 0.0.0.0/8, 240.0.0.0/4 and documentation ranges.
    if not any(net.subnet_of(r) for r in _RFC1918):
        raise UsageError(
            f"--cidr {value!r} is not a private range",
            f"pick a range from 10.0.0.0/8, 172.16.0.0/12 or 192.168.0.0/16, e.g. {DEFAULT_CIDR}",
        )
    return net


def check_overlap(net: ipaddress.IPv4Network, routes: Iterable[tuple[str, str]]) -> None:
    """Raise NetworkError if `net` overlaps a local route.

    `routes` are (destination CIDR, device) pairs, e.g. from `ip -4 route show table all`;
    default routes are ignored. An overlap would make the overlay steal (or lose) traffic
    for an existing network, e.g. a cloud VPC.
    """
    for dest, dev in routes:
        try:
            other = ipaddress.ip_network(dest, strict=False)
        except ValueError:
            continue
        if other.prefixlen == 0 or not isinstance(other, ipaddress.IPv4Network):
            continue
        if net.overlaps(other):
            raise NetworkError(
                f"overlay range {net} overlaps the local route {other} on {dev}",
                f"pick a range that no local network uses with --cidr, e.g. --cidr {DEFAULT_CIDR} or 10.231.0.0/16",
            )


def coordinator_address(net: ipaddress.IPv4Network) -> ipaddress.IPv4Address:
    """The coordinator always takes the network's first host address."""
    return net.network_address + 1


@functools.lru_cache(maxsize=1 << 17)  # an address is parsed once, not at every join (a join lists them all)
def _v4_int(address: str) -> int:
    a, b, c, d = (int(x) for x in address.split("."))
    return a << 24 | b << 16 | c << 8 | d


def allocate(net: ipaddress.IPv4Network, taken: Iterable[str]) -> ipaddress.IPv4Address:
    """Return the lowest host address of `net` not in `taken`.

    `taken` must include every address in use and every removed member's address still in its quarantine
    (meshrun.system.control.coordinatordb.ADDRESS_QUARANTINE_S), so that stale peers elsewhere no longer route an
    address by the time it is handed to another node.
    """
    used = {_v4_int(a) for a in taken}  # ints: parsing a thousand addresses was most of a join's cost
    used.add(int(coordinator_address(net)))
    first, last = int(net.network_address) + 1, int(net.broadcast_address) - 1
    for host in range(first, last + 1):
        if host not in used:
            return ipaddress.IPv4Address(host)
    raise NetworkError(
        f"overlay range {net} has no free address left ({net.num_addresses - 2} hosts)",
        "create a new network with a larger --cidr",
    )
