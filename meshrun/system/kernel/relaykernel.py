"""The relay's kernel fast path: one nftables netdev table that forwards the latched ends' transport messages
from the ingress hook of the device they arrive on (meshrun.core.relayfwd.kernel_script says what its rules
match and do).

Why: the socket path costs two system calls and a Python loop turn per datagram, and on a busy host (the
relay is a training node too) that held a relayed pair to about 0.8 of a direct one on 200 Mbit/s links; the
kernel rewrites and sends a datagram in the softirq that received it. The relay's socket still sees every
datagram the rules do not take (handshakes, an end at a new address, strangers), so the pair's binding to its
ends is decided as before, and a rule that cannot match (asymmetric routing) only leaves the work to the socket.

`KernelPath.apply` makes the table exactly what the latched pairs need, one `nft -f` transaction, only when
that changed. Where it cannot (no `nft`, a kernel without the netdev family or `fwd`), the first failure turns
the fast path off for this relay, says so once in the log and leaves the socket path forwarding everything;
`mode` tells which one is in use. `remove` deletes the table of a relay that died without closing.
`FakeKernelPath` keeps what it was asked for, for tests of the relay without root.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Mapping

from meshrun.core import netparse
from meshrun.core.relayfwd import Addr, Route, kernel_script
from meshrun.errors import CommandError, HostError
from meshrun.system.machine.cmd import run

__all__ = ["FakeKernelPath", "KernelPath", "remove", "table_name"]

log = logging.getLogger("meshrun.system.kernel.relaykernel")

KERNEL, USERSPACE = "kernel (nftables netdev fwd)", "userspace (the relay's sockets)"


def table_name(interface: str) -> str:
    """The relay table of the member whose overlay interface is `interface` (two members on one host keep apart)."""
    return "meshrun_relay_" + re.sub(r"[^A-Za-z0-9_]", "_", interface)


def remove(interface: str) -> None:
    """Delete the relay table of `interface`'s member, if there is one (its relay died without closing)."""
    _delete_table(table_name(interface))


def _delete_table(table: str) -> None:
    try:
        run(["nft", "delete", "table", "netdev", table], check=False, quiet=True)
    except HostError:  # no nft here: no table was made either
        pass


def route(ip: str) -> Route | None:
    """How this host sends to `ip` now (`ip route get`), or None (no unicast route)."""
    try:
        got = netparse.route_get(run(["ip", "-j", "-4", "route", "get", ip], check=False, quiet=True).stdout)
    except HostError:
        return None
    return Route(*got) if got else None


_PROBE = """table netdev {table} {{
  chain probe {{
    type filter hook ingress device "lo" priority filter; policy accept;
    meta mark 0x4d52ffff udp dport 9 fwd ip to 127.0.0.1 device "lo"
  }}
}}
delete chain netdev {table} probe
"""


class KernelPath:
    """The relay table of one relay; `apply(latched)` after every change, `close()` at the end."""

    def __init__(self, table: str) -> None:
        self.table = table
        self.lock = threading.Lock()
        self.routes: dict[str, Route] = {}
        self.applied: str | None = None  # the script now in the kernel
        self.error: str | None = None  # why the fast path is off (None: on, or not tried yet)

    @property
    def mode(self) -> str:
        return USERSPACE if self.error else KERNEL

    def apply(self, latched: Mapping[int, tuple[Addr, Addr]], fresh_routes: bool = False) -> None:
        """Make the table forward exactly the pairs in `latched` {port: (end, end)}; routes are looked up for new
        ends, and for every end again with `fresh_routes` (a route that moved moves its rules)."""
        with self.lock:
            if self.error:
                return
            ips = {addr[0] for ends in latched.values() for addr in ends}
            for ip in sorted(ips):
                if fresh_routes or ip not in self.routes:
                    found = route(ip)
                    if found is None:
                        self.routes.pop(ip, None)
                    else:
                        self.routes[ip] = found
            for ip in set(self.routes) - ips:
                del self.routes[ip]
            script = kernel_script(self.table, latched, self.routes)
            if script == self.applied:
                return
            # The first time, a rule with `fwd` is made and taken away again in the same transaction: a kernel
            # that cannot forward from the ingress hook says so now, not when the first pair is latched.
            probe = _PROBE.format(table=self.table) if self.applied is None else ""
            try:
                run(["nft", "-f", "-"], input=script + probe, quiet=True)
            except (CommandError, HostError) as exc:
                self.error = str(exc).splitlines()[0]
                log.warning("relay fast path off, the relay's sockets forward everything: %s", self.error)
                _delete_table(self.table)
                return
            self.applied = script

    def counters(self) -> dict[int, int]:
        """{port: datagrams the kernel forwarded for it, both directions} since its rules were last made."""
        with self.lock:
            if self.applied is None or self.error:
                return {}
            out = run(["nft", "-j", "list", "table", "netdev", self.table], check=False, quiet=True).stdout
        return kernel_counters(out)

    def close(self) -> None:
        with self.lock:
            if self.applied is not None:
                _delete_table(self.table)
            self.applied = None


def kernel_counters(text: str) -> dict[int, int]:
    """{port: packets} from `nft -j list table ...`: each rule's counter, by the `udp dport` it matches."""
    try:
        items = json.loads(text or "{}").get("nftables", [])
    except (ValueError, AttributeError):
        return {}
    out: dict[int, int] = {}
    for item in items:
        rule = item.get("rule") if isinstance(item, dict) else None
        if not rule:
            continue
        port, packets = None, 0
        for expr in rule.get("expr", []):
            match = expr.get("match") if isinstance(expr, dict) else None
            if match and match.get("left", {}).get("payload", {}) == {"protocol": "udp", "field": "dport"}:
                port = match.get("right")
            if isinstance(expr, dict) and "counter" in expr:
                packets = int(expr["counter"].get("packets", 0))
        if isinstance(port, int):
            out[port] = out.get(port, 0) + packets
    return out


class FakeKernelPath:
    """KernelPath's stand-in: remembers each `apply`, runs nothing."""

    def __init__(self, table: str = "meshrun_relay_test", error: str | None = None) -> None:
        self.table = table
        self.error = error
        self.latched: dict[int, tuple[Addr, Addr]] = {}
        self.calls = 0
        self.closed = False

    @property
    def mode(self) -> str:
        return USERSPACE if self.error else KERNEL

    def apply(self, latched: Mapping[int, tuple[Addr, Addr]], fresh_routes: bool = False) -> None:
        self.calls += 1
        self.latched = dict(latched)

    def counters(self) -> dict[int, int]:
        return {}

    def close(self) -> None:
        self.closed = True
        self.latched = {}
