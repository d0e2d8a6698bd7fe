"""Several tunnels per pair on this host: the extra WireGuard devices, their peers, their routes and rules, and
the nft table that guards them and spreads flows over them (meshrun.core.tunnels says what each is for).
`FakeTunnelLink` keeps the same state in memory for tests.

`TunnelLink.delete` (and `remove`, for a host whose agent died) takes all of it away: the devices (their
wireguard-go with them, and their forward guards), the routes and rules, and the nft table.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from meshrun.core import tunnels
from meshrun.core.tunnels import TunnelPeer
from meshrun.errors import HostError, MeshrunError
from meshrun.system.kernel.device import WireGuardDevice
from meshrun.system.machine.cmd import run
from meshrun.system.sockets import probe as probe_mod

__all__ = ["FakeTunnelLink", "TunnelLink", "probe", "remove"]

log = logging.getLogger("meshrun.system.kernel.tunnellink")


def _sysctl(path: str) -> Path:
    return Path("/proc/sys") / path


def remove(overlay_interface: str, pids: Mapping[str, int] | None = None) -> None:
    """Take away every trace of the extra tunnels (what is not there is skipped); `pids`: {device: its
    wireguard-go}, waited for (tunnels.json keeps them)."""
    for i, name in enumerate(tunnels.device_names(overlay_interface), start=1):
        pid = (pids or {}).get(name)
        if Path(f"/sys/class/net/{name}").exists() or pid:
            with contextlib.suppress(MeshrunError):
                WireGuardDevice(name, Path("/dev/null"), pid if isinstance(pid, int) else None).delete()
        for pref in (tunnels.probe_pref(i), tunnels.spread_pref(i)):
            run(["ip", "-4", "rule", "del", "pref", str(pref)], check=False, quiet=True)
        run(["ip", "-4", "route", "flush", "table", str(tunnels.probe_table(i))], check=False, quiet=True)
    with contextlib.suppress(HostError):  # no nft here: no table was made either
        run(["nft", "delete", "table", "inet", tunnels.GUARD_TABLE], check=False, quiet=True)


def probe(overlay_ip: str, port: int, source: str, i: int, timeout: float = 0.5) -> float | None:
    """Seconds for one TCP handshake to `overlay_ip`:`port` through extra tunnel `i` only (its probe mark: policy
    routing takes its probe table), from `source`; None when it did not answer. A refusal answers too. The answer
    may come back on any tunnel: each end judges the tunnels it sends on."""
    return probe_mod.marked_handshake(overlay_ip, port, source, tunnels.probe_mark(i), timeout)


class TunnelLink:
    """The extra tunnels of one member: `ensure` them, `set_peers`, `set_rules` (guard and spread), `delete`.

    `pids`: the wireguard-go processes serving the devices (kernel WireGuard: none)."""

    def __init__(self, overlay_interface: str, overlay_ip: str, count: int, key_path: Path, log_dir: Path) -> None:
        self.overlay_interface = overlay_interface
        self.overlay_ip = overlay_ip
        self.names = tunnels.device_names(overlay_interface, count)
        self.key_path = key_path
        self.log_dir = log_dir
        self.pids: dict[str, int] = {}
        self.peers: dict[str, tuple[TunnelPeer, ...]] = {}  # device -> its peers, as installed
        self.made = False
        self.rules = ""  # the nft script as applied

    def ensure(self, interfaces: Sequence[str]) -> bool:
        """The devices and their rules, guarded (`interfaces`: see tunnels.ruleset); True when they were made
        (anew: one was missing, a wireguard-go that died takes its device with it), and so have no peers and
        spread nothing."""
        if self.made and all(Path(f"/sys/class/net/{n}").exists() for n in self.names):
            return False
        self.delete()
        try:
            self._make(interfaces)
        except OSError as exc:  # a sysctl the kernel does not have or refuses: the caller removes what was made
            raise HostError(
                f"could not set up the extra tunnels ({exc})",
                "run the agent as root, or `meshrun leave` and join again with --tunnels 1",
            ) from None
        return True

    def _make(self, interfaces: Sequence[str]) -> None:
        # The guard before the devices: no listener unbound from the overlay device is reachable from elsewhere.
        self.set_rules(interfaces, {})
        mtu = _mtu(self.overlay_interface) or 1420
        for i, name in enumerate(self.names, start=1):
            dev = WireGuardDevice(name, self.log_dir / f"wireguard-go-{name}.log")
            dev.create()
            if dev.pid:
                self.pids[name] = dev.pid
            dev.guard_forwarding()  # a member's packet arriving here never leaves on another interface
            run(["wg", "set", name, "listen-port", str(tunnels.port(i)), "private-key", str(self.key_path)])
            # Loose reverse-path filtering: the route back to a peer is main's, over the overlay interface, and a
            # strict filter would drop what the peer sends on this one. A loose one passes it only on a device
            # with an address (the kernel's fib_validate_source): so the overlay address, /32, which
            # net.local_addresses leaves out of the path candidates.
            run(["ip", "addr", "add", f"{self.overlay_ip}/32", "dev", name])
            _sysctl(f"net/ipv4/conf/{name}/rp_filter").write_text("2")
            v6 = _sysctl(f"net/ipv6/conf/{name}/disable_ipv6")
            if v6.exists():
                v6.write_text("1")
            run(["ip", "link", "set", name, "mtu", str(mtu), "up"])
            for pref, mark in ((tunnels.probe_pref(i), tunnels.probe_mark(i)),
                               (tunnels.spread_pref(i), tunnels.spread_mark(i))):  # fmt: skip
                run(["ip", "-4", "rule", "add", "pref", str(pref), "fwmark", hex(mark),
                     "lookup", str(tunnels.probe_table(i))])  # fmt: skip
        self.made = True

    def set_rules(self, interfaces: Sequence[str], spread: Mapping[str, Sequence[int]]) -> None:
        """The guard for `interfaces` and `spread` {peer overlay IP: its live tunnels} (tunnels.ruleset), applied
        in one nft transaction when they changed."""
        rules = tunnels.ruleset(self.overlay_ip, interfaces, spread)
        if rules != self.rules:
            run(["nft", "-f", "-"], input=rules)
            self.rules = rules

    def follow_mtu(self) -> None:
        """The devices' MTU: the overlay interface's (raised for a jumbo LAN: meshrun.mesh.node.jumbo)."""
        mtu = _mtu(self.overlay_interface)
        for name in self.names:
            if mtu and _mtu(name) != mtu:
                run(["ip", "link", "set", name, "mtu", str(mtu)])

    def set_peers(self, peers: Sequence[TunnelPeer]) -> None:
        """Exactly `peers` on the devices of their pair's tunnels (allowed only their own /32, dialled at their
        LAN address and the device's port), and each one's route through each (its table: probes and spread)."""
        for i, name in enumerate(self.names, start=1):
            want = tuple(p for p in peers if i in p.extra)
            have = self.peers.get(name, ())
            if have == want:
                continue
            args: list[str] = []
            for p in have:
                if p not in want:
                    args += ["peer", p.public_key, "remove"]
                    run(["ip", "route", "del", f"{p.overlay_ip}/32", "table", str(tunnels.probe_table(i))],
                        check=False, quiet=True)  # fmt: skip
            for p in want:
                if p not in have:
                    args += ["peer", p.public_key, "allowed-ips", f"{p.overlay_ip}/32"]
                    args += ["endpoint", f"{p.lan_ip}:{tunnels.port(i)}"]
            if args:
                run(["wg", "set", name, *args])
            for p in want:
                run(["ip", "route", "replace", f"{p.overlay_ip}/32", "dev", name, "src", self.overlay_ip,
                     "table", str(tunnels.probe_table(i))])  # fmt: skip
            self.peers[name] = want

    def delete(self) -> None:
        remove(self.overlay_interface, self.pids)
        self.pids, self.peers, self.made, self.rules = {}, {}, False, ""


def _mtu(name: str) -> int | None:
    """The MTU of interface `name` (sysfs: no process per read, follow_mtu runs every sync), None if absent."""
    try:
        return int(Path(f"/sys/class/net/{name}/mtu").read_text())
    except (OSError, ValueError):
        return None


class FakeTunnelLink:
    """TunnelLink in memory: `peers`, `interfaces` (the guard's), `spread` as the kernel would hold them; `calls`
    in order."""

    def __init__(self, overlay_interface: str, overlay_ip: str, count: int, key_path: Path, log_dir: Path) -> None:
        self.overlay_interface = overlay_interface
        self.overlay_ip = overlay_ip
        self.names = tunnels.device_names(overlay_interface, count)
        self.pids: dict[str, int] = {}
        self.peers: dict[str, tuple[TunnelPeer, ...]] = {}
        self.interfaces: tuple[str, ...] = ()
        self.spread: dict[str, tuple[int, ...]] = {}
        self.made = False
        self.fail: MeshrunError | None = None  # raised by the next ensure
        self.calls: list[tuple] = []

    def ensure(self, interfaces: Sequence[str]) -> bool:
        self.calls.append(("ensure",))
        if self.fail is not None:
            raise self.fail
        made = not self.made
        if made:
            self.peers, self.spread = {}, {}
        self.interfaces, self.made = tuple(interfaces), True
        return made

    def set_rules(self, interfaces: Sequence[str], spread: Mapping[str, Sequence[int]]) -> None:
        self.calls.append(("set_rules",))
        self.interfaces = tuple(interfaces)
        self.spread = {ip: tuple(live) for ip, live in spread.items() if live}

    def follow_mtu(self) -> None:
        self.calls.append(("follow_mtu",))

    def set_peers(self, peers: Sequence[TunnelPeer]) -> None:
        self.calls.append(("set_peers", tuple(p.name for p in peers)))
        self.peers = {name: tuple(p for p in peers if i in p.extra) for i, name in enumerate(self.names, start=1)}

    def delete(self) -> None:
        self.calls.append(("delete",))
        self.peers, self.spread, self.made, self.interfaces = {}, {}, False, ()
