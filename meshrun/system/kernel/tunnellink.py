"""Several tunnels per pair on this host: the extra WireGuard devices, their peers, the probe and multipath
routes, the guard and the hash policy (meshrun.core.tunnels says what each is for). `FakeTunnelLink` keeps the
same state in memory for tests.

`TunnelLink.delete` (and `remove`, for a host whose agent died) takes all of it away: the devices (their
wireguard-go with them, and their forward guards), both kinds of routes and rules, the guard table, and the hash
policy put back as it was.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from meshrun.core import tunnels
from meshrun.core.tunnels import TunnelPeer
from meshrun.errors import HostError, MeshrunError
from meshrun.system.kernel import net
from meshrun.system.kernel.device import WireGuardDevice
from meshrun.system.machine.cmd import run
from meshrun.system.sockets import probe as probe_mod

__all__ = ["FakeTunnelLink", "TunnelLink", "probe", "remove"]

log = logging.getLogger("meshrun.system.kernel.tunnellink")


def _sysctl(path: str) -> Path:
    return Path("/proc/sys") / path


def remove(overlay_interface: str, hash_policy: str | None = None, pids: Mapping[str, int] | None = None) -> None:
    """Take away every trace of the extra tunnels (what is not there is skipped); `hash_policy`: the multipath
    hash policy to put back, `pids`: {device: its wireguard-go}, waited for (tunnels.json keeps both)."""
    for i, name in enumerate(tunnels.device_names(overlay_interface), start=1):
        pid = (pids or {}).get(name)
        if Path(f"/sys/class/net/{name}").exists() or pid:
            with contextlib.suppress(MeshrunError):
                WireGuardDevice(name, Path("/dev/null"), pid if isinstance(pid, int) else None).delete()
        run(["ip", "-4", "rule", "del", "pref", str(tunnels.probe_pref(i))], check=False, quiet=True)
        run(["ip", "-4", "route", "flush", "table", str(tunnels.probe_table(i))], check=False, quiet=True)
    run(["ip", "-4", "rule", "del", "pref", str(tunnels.PREF)], check=False, quiet=True)
    run(["ip", "-4", "route", "flush", "table", str(tunnels.TABLE)], check=False, quiet=True)
    with contextlib.suppress(HostError):  # no nft here: no guard was made either
        run(["nft", "delete", "table", "inet", tunnels.GUARD_TABLE], check=False, quiet=True)
    if hash_policy is not None:
        with contextlib.suppress(OSError):
            _sysctl(tunnels.HASH_SYSCTL).write_text(hash_policy)


def probe(overlay_ip: str, port: int, source: str, i: int, timeout: float = 0.5) -> float | None:
    """Seconds for one TCP handshake to `overlay_ip`:`port` through extra tunnel `i` only (its probe mark: policy
    routing takes its probe table), from `source`; None when it did not answer. A refusal answers too. The answer
    may come back on any tunnel: each end judges the tunnels it sends on."""
    return probe_mod.marked_handshake(overlay_ip, port, source, tunnels.probe_mark(i), timeout)


class TunnelLink:
    """The extra tunnels of one member: `ensure` them, `set_peers`, `route`/`unroute` a peer, `delete`.

    `hash_restore` is the multipath hash policy the host had before (None: not changed); `pids` the wireguard-go
    processes serving the devices (kernel WireGuard: none)."""

    def __init__(self, overlay_interface: str, overlay_ip: str, count: int, key_path: Path, log_dir: Path) -> None:
        self.overlay_interface = overlay_interface
        self.overlay_ip = overlay_ip
        self.names = tunnels.device_names(overlay_interface, count)
        self.key_path = key_path
        self.log_dir = log_dir
        self.hash_restore: str | None = None
        self.pids: dict[str, int] = {}
        self.peers: dict[str, tuple[TunnelPeer, ...]] = {}  # device -> its peers, as installed
        self.routes: dict[str, tuple[tuple[str, ...], int | None]] = {}  # overlay IP -> (devices, MTU) in TABLE
        self.made = False
        self.guard = ""

    def ensure(self, guard: str) -> bool:
        """The guard, the devices, the rules and the hash policy; True when they were made (anew: one was
        missing, a wireguard-go that died takes its device with it), and so have no peers."""
        if self.made and all(Path(f"/sys/class/net/{n}").exists() for n in self.names):
            if guard != self.guard:
                run(["nft", "-f", "-"], input=guard)
                self.guard = guard
            return False
        self.delete()
        try:
            self._make(guard)
        except OSError as exc:  # a sysctl the kernel does not have or refuses: the caller removes what was made
            raise HostError(
                f"could not set up the extra tunnels ({exc})",
                "run the agent as root, or `meshrun leave` and join again with --tunnels 1",
            ) from None
        return True

    def _make(self, guard: str) -> None:
        # The guard before the devices: no listener unbound from the overlay device is reachable from elsewhere.
        run(["nft", "-f", "-"], input=guard)
        self.guard = guard
        mtu = net.link(self.overlay_interface).get("mtu") or 1420
        for i, name in enumerate(self.names, start=1):
            dev = WireGuardDevice(name, self.log_dir / f"wireguard-go-{name}.log")
            dev.create()
            if dev.pid:
                self.pids[name] = dev.pid
            dev.guard_forwarding()  # a member's packet arriving here never leaves on another interface
            run(["wg", "set", name, "listen-port", str(tunnels.port(i)), "private-key", str(self.key_path)])
            # The overlay address, global scope: a multipath route prefers the next hops whose device holds the
            # flow's source address (a socket bound to it: NCCL's), and the kernel only looks at global ones.
            run(["ip", "addr", "add", f"{self.overlay_ip}/32", "dev", name])
            # Loose reverse-path filtering: a flow's answers may come back on another of the pair's tunnels.
            _sysctl(f"net/ipv4/conf/{name}/rp_filter").write_text("2")
            v6 = _sysctl(f"net/ipv6/conf/{name}/disable_ipv6")
            if v6.exists():
                v6.write_text("1")
            run(["ip", "link", "set", name, "mtu", str(mtu), "up"])
            run(["ip", "-4", "rule", "add", "pref", str(tunnels.probe_pref(i)), "fwmark",
                 hex(tunnels.probe_mark(i)), "lookup", str(tunnels.probe_table(i))])  # fmt: skip
        run(["ip", "-4", "rule", "add", "pref", str(tunnels.PREF), "lookup", str(tunnels.TABLE)])
        before = _sysctl(tunnels.HASH_SYSCTL).read_text().strip()
        if before != tunnels.HASH_POLICY:
            _sysctl(tunnels.HASH_SYSCTL).write_text(tunnels.HASH_POLICY)
            self.hash_restore = before
        self.made = True

    def follow_mtu(self) -> None:
        """The devices' MTU: the overlay interface's (raised for a jumbo LAN: meshrun.mesh.node.jumbo)."""
        mtu = net.link(self.overlay_interface).get("mtu")
        for name in self.names:
            if mtu and net.link(name).get("mtu") != mtu:
                run(["ip", "link", "set", name, "mtu", str(mtu)])

    def set_peers(self, peers: Sequence[TunnelPeer]) -> None:
        """Exactly `peers` on every device (allowed only their own /32, dialled at their LAN address and the
        device's port), and each one's probe route through each device."""
        want = tuple(peers)
        for i, name in enumerate(self.names, start=1):
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

    def route(self, overlay_ip: str, devices: Sequence[str], mtu: int | None) -> None:
        """`overlay_ip`'s traffic over `devices` (the overlay interface and live tunnels; the overlay interface
        alone: no route here, main's is used)."""
        want = (tuple(devices), mtu)
        if self.routes.get(overlay_ip) == want:
            return
        if len(devices) < 2:
            self.unroute(overlay_ip)
            return
        run(tunnels.route_argv(overlay_ip, self.overlay_ip, devices, mtu))
        self.routes[overlay_ip] = want

    def unroute(self, overlay_ip: str) -> None:
        if self.routes.pop(overlay_ip, None) is not None:
            run(["ip", "route", "del", f"{overlay_ip}/32", "table", str(tunnels.TABLE)], check=False, quiet=True)

    def route_mtus(self) -> dict[str, int]:
        """{overlay IP: MTU} of the peers with a route of their own on the overlay interface (a pair MTU: jumbo
        or smaller); the others take the devices' MTU."""
        return net.route_mtus(self.overlay_interface)

    def delete(self) -> None:
        remove(self.overlay_interface, self.hash_restore, self.pids)
        self.hash_restore, self.pids, self.peers, self.routes, self.made, self.guard = None, {}, {}, {}, False, ""


class FakeTunnelLink:
    """TunnelLink in memory: `peers`, `routes`, `guard`, `mtus` as the kernel would hold them; `calls` in order."""

    def __init__(self, overlay_interface: str, overlay_ip: str, count: int, key_path: Path, log_dir: Path) -> None:
        self.overlay_interface = overlay_interface
        self.overlay_ip = overlay_ip
        self.names = tunnels.device_names(overlay_interface, count)
        self.hash_restore: str | None = None
        self.pids: dict[str, int] = {}
        self.peers: dict[str, tuple[TunnelPeer, ...]] = {}
        self.routes: dict[str, tuple[tuple[str, ...], int | None]] = {}
        self.mtus: dict[str, int] = {}  # overlay IP -> its own MTU on the overlay interface
        self.made = False
        self.guard = ""
        self.fail: MeshrunError | None = None  # raised by the next ensure
        self.calls: list[tuple] = []

    def ensure(self, guard: str) -> bool:
        self.calls.append(("ensure",))
        if self.fail is not None:
            raise self.fail
        made = not self.made
        if made:
            self.peers, self.routes = {}, {}
        self.guard, self.made, self.hash_restore = guard, True, "0"
        return made

    def follow_mtu(self) -> None:
        self.calls.append(("follow_mtu",))

    def set_peers(self, peers: Sequence[TunnelPeer]) -> None:
        self.calls.append(("set_peers", tuple(p.name for p in peers)))
        self.peers = {name: tuple(peers) for name in self.names}

    def route(self, overlay_ip: str, devices: Sequence[str], mtu: int | None) -> None:
        self.calls.append(("route", overlay_ip, tuple(devices)))
        if len(devices) < 2:
            self.routes.pop(overlay_ip, None)
        else:
            self.routes[overlay_ip] = (tuple(devices), mtu)

    def unroute(self, overlay_ip: str) -> None:
        self.calls.append(("unroute", overlay_ip))
        self.routes.pop(overlay_ip, None)

    def route_mtus(self) -> dict[str, int]:
        return dict(self.mtus)

    def delete(self) -> None:
        self.calls.append(("delete",))
        self.peers, self.routes, self.made, self.guard, self.hash_restore = {}, {}, False, "", None
