"""The host's network as meshrun reads and changes it: privileges, tools, routes, addresses, forwarding.

Commands go through meshrun.system.machine.cmd; their output is parsed by meshrun.core.netparse.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from meshrun.core import netparse, tunnels
from meshrun.errors import HostError
from meshrun.system.machine.cmd import PACKAGES, run

CAP_NET_ADMIN = 12


def require_admin() -> None:
    """Raise HostError unless this process holds CAP_NET_ADMIN.

    Root normally does, but root in a container started without NET_ADMIN does not: checking the
    capability, not the uid, turns that case into a clear error instead of a failed `ip link add`.
    """
    try:
        status = Path("/proc/self/status").read_text().splitlines()
        caps = next(int(line.split()[1], 16) for line in status if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError, IndexError):
        caps = None  # cannot tell: trust the uid
    if caps is None and os.geteuid() == 0 or caps is not None and caps >> CAP_NET_ADMIN & 1:
        return
    if os.geteuid() == 0:
        raise HostError(
            "this process runs as root but without CAP_NET_ADMIN, which WireGuard interfaces need (a container?)",
            "start the container with --cap-add NET_ADMIN --device /dev/net/tun, or run meshrun on the host",
        )
    raise HostError(
        "meshrun needs root (or CAP_NET_ADMIN) to manage WireGuard interfaces", "run it as root (e.g. with sudo)"
    )


def require_tools(*tools: str) -> None:
    """Raise HostError naming the apt package of the first missing tool."""
    for t in tools:
        if shutil.which(t) is None:
            raise HostError(f"`{t}` is not installed", f"install it: apt-get install {PACKAGES.get(t, t)}")


def local_routes() -> list[tuple[str, str]]:
    """(destination, device) for every IPv4 route in every table, defaults excluded."""
    return netparse.routes(run(["ip", "-4", "-o", "route", "show", "table", "all"], quiet=True).stdout)


def local_addresses(exclude: str | None = None) -> list[str]:
    """This machine's global-scope IPv4 addresses (candidates for same-site paths), but those of the overlay
    interface `exclude` and of its extra tunnels, which hold its address too (core/tunnels)."""
    out = run(["ip", "-4", "-o", "addr", "show", "scope", "global"], quiet=True).stdout
    skip = set(tunnels.device_names(exclude)) if exclude else set()
    return [addr for dev, addr in netparse.addresses(out, exclude) if dev not in skip]


def interface_of(address: str) -> str | None:
    """The interface that holds IPv4 `address` on this machine, or None."""
    out = run(["ip", "-4", "-o", "addr", "show"], check=False, quiet=True).stdout
    return next((dev for dev, addr in netparse.addresses(out) if addr == address), None)


def address_mtu(address: str) -> int | None:
    """The MTU of the interface that holds IPv4 `address` on this machine, or None."""
    dev = interface_of(address) if address else None
    return link(dev).get("mtu") if dev else None


def default_route_address() -> str | None:
    """The primary address of the default route's device, if there is one."""
    dev = netparse.default_device(run(["ip", "-4", "-o", "route", "show", "default"], check=False, quiet=True).stdout)
    if dev is None:
        return None
    out = run(["ip", "-4", "-o", "addr", "show", "dev", dev, "scope", "global"], check=False, quiet=True).stdout
    found = netparse.addresses(out)
    return found[0][1] if found else None


def resolve(host: str) -> str:
    """The IPv4 address of `host` (a name or an address); OSError if it has none."""
    return socket.gethostbyname(host)


def link(name: str) -> dict:
    """{"exists", "up", "mtu"} of the network interface `name`."""
    return netparse.link(run(["ip", "-j", "link", "show", "dev", name], check=False, quiet=True).stdout)


def route_mtus(dev: str) -> dict[str, int]:
    """{IP: MTU} of the /32 routes with an MTU on `dev` ({} when it has none, or is not there)."""
    return netparse.route_mtus(run(["ip", "-j", "-4", "route", "show", "dev", dev], check=False, quiet=True).stdout)


def set_route_mtus(dev: str, want: Mapping[str, int]) -> bool:
    """Make the /32 routes with an MTU on `dev` exactly `want` {IP: mtu}; True if anything changed.

    Routes for other addresses, and `dev`'s own prefix route, are left alone.
    """
    have = route_mtus(dev)
    for ip, mtu in sorted(want.items()):
        if have.get(ip) != mtu:
            run(["ip", "-4", "route", "replace", f"{ip}/32", "dev", dev, "mtu", str(mtu)])
    for ip in sorted(set(have) - set(want)):
        run(["ip", "-4", "route", "del", f"{ip}/32", "dev", dev], check=False)
    return any(have.get(ip) != mtu for ip, mtu in want.items()) or bool(set(have) - set(want))


@contextlib.contextmanager
def udp_arrivals(source: str, port: int) -> Iterator[Callable[[], int]]:
    """Count UDP datagrams from `source` to local `port` that do not come from `port` itself.

    A counting rule (no verdict: packets go on as before) in the raw table's PREROUTING, removed on
    exit; yields a function returning the count so far. HostError without iptables.
    """
    require_tools("iptables")
    tag = f"meshrun-doctor-{secrets.token_hex(4)}"
    rule = [
        "PREROUTING",
        "-p",
        "udp",
        "-s",
        source,
        "--dport",
        str(port),
        "!",
        "--sport",
        str(port),
        "-m",
        "comment",
        "--comment",
        tag,
    ]
    run(["iptables", "-w", "5", "-t", "raw", "-I", *rule])
    try:
        yield lambda: netparse.rule_packets(
            run(["iptables", "-w", "5", "-t", "raw", "-L", "PREROUTING", "-v", "-x", "-n"], quiet=True).stdout, tag
        )
    finally:
        run(["iptables", "-w", "5", "-t", "raw", "-D", *rule], check=False)
