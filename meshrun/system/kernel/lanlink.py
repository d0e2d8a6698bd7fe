"""The site LAN path on this host: the VXLAN device, its forwarding and neighbour entries (or, routed, none:
plain routes through the LAN interface), the policy routes, the guard (meshrun.core.lanpath says what each is
for). `FakeLanLink` keeps the same state in memory for tests.

Every change is one `ip`, `bridge` or `nft` call; `LanLink.delete` (and `remove`, for a host whose agent died)
takes all of it away: the device (its entries go with it), the routes of both tables, the two `ip rule`s, the
guard table, and a LAN interface's reverse-path filter put back as it was (meshrun.system.kernel.hostsettings
records it before the change, so an agent that crashed with it loosened still puts back what it found).
"""

from __future__ import annotations

import json
from pathlib import Path

from meshrun.core import lanpath, tunnels
from meshrun.core.lanpath import LanPeer
from meshrun.errors import CommandError, HostError
from meshrun.system.kernel import net
from meshrun.system.kernel.hostsettings import RECORD, HostSettings
from meshrun.system.machine.cmd import run
from meshrun.system.sockets import probe as probe_mod

__all__ = ["FakeLanLink", "LanLink", "bind_device", "host_settings", "probe", "remove", "rp_filter_setting"]


def bind_device(device: str | None) -> str | None:
    """The device an overlay listener should bind to (SO_BINDTODEVICE): `device`, unless this host has a site
    LAN path beside it, whose traffic arrives on the LAN path's device (or, routed, on the LAN interface), or
    extra tunnels per pair (core/tunnels); then None (the address alone), and the LAN path's or the tunnels'
    guard drops what reaches the overlay address on any other interface (core/lanpath, core/tunnels)."""
    if not device:
        return device
    if Path(f"/sys/class/net/{lanpath.interface_name(device)}").exists():
        return None
    # Extra tunnels per pair deliver the overlay on their own devices; their guard does what the LAN path's does.
    if Path(f"/sys/class/net/{tunnels.device_name(device, 1)}").exists():
        return None
    # Routed, there is no device: the LAN path's rule tells (one per host, made before any peer is reachable).
    rules = run(["ip", "-4", "rule", "show", "pref", str(lanpath.ACTIVE_PREF)], check=False, quiet=True).stdout
    return None if rules.strip() else device


def _rules() -> list[list[str]]:
    return [
        ["pref", str(lanpath.PROBE_PREF), "fwmark", hex(lanpath.PROBE_MARK), "lookup", str(lanpath.PROBE_TABLE)],
        ["pref", str(lanpath.ACTIVE_PREF), "lookup", str(lanpath.ACTIVE_TABLE)],
    ]


def remove(overlay_interface: str, settings: HostSettings | None = None) -> None:
    """Take away every trace of the LAN path (device, routes, rules, guard); what is not there is skipped.
    `settings`: the member's record of host settings, whose reverse-path filters (a routed LAN path loosens
    its LAN interface's) are put back."""
    name = lanpath.interface_name(overlay_interface)
    calls = [["ip", "link", "del", name]] + [["ip", "-4", "rule", "del", *rule[:2]] for rule in _rules()]
    calls += [["ip", "-4", "route", "flush", "table", str(t)] for t in (lanpath.PROBE_TABLE, lanpath.ACTIVE_TABLE)]
    for argv in calls + [["nft", "delete", "table", "inet", lanpath.GUARD_TABLE]]:
        try:
            run(argv, check=False, quiet=True)
        except HostError:  # no nft here: no guard was made either
            pass
    if settings:
        settings.restore(RP_FILTER_PREFIX)


RP_FILTER_PREFIX = "net/ipv4/conf/"  # the settings remove() puts back: only reverse-path filters are recorded


def host_settings(state_dir: Path) -> HostSettings:
    """The record of host settings of the member whose state is in `state_dir`. A LAN interface's filter that an
    older meshrun noted only in lan.json ("rp_filter": [interface, value before]) is moved into it."""
    settings = HostSettings(state_dir / RECORD)
    try:
        old = json.loads((state_dir / "lan.json").read_text()).get("rp_filter")
    except (OSError, ValueError, AttributeError):
        old = None
    if isinstance(old, list) and len(old) == 2 and all(isinstance(x, str) for x in old):
        settings.adopt(rp_filter_setting(old[0]), old[1])
    return settings


def rp_filter_setting(dev: str) -> str:
    """The name (path under /proc/sys) of `dev`'s IPv4 reverse-path filter."""
    return f"{RP_FILTER_PREFIX}{dev}/rp_filter"


def probe(overlay_ip: str, port: int, source: str, timeout: float = 0.5) -> float | None:
    """Seconds for one TCP handshake to `overlay_ip`:`port` through the LAN path only (PROBE_MARK: policy routing
    takes PROBE_TABLE), from `source`; None when it did not answer. A refusal answers too."""
    return probe_mod.marked_handshake(overlay_ip, port, source, lanpath.PROBE_MARK, timeout)


class LanLink:
    """The LAN path of one member: `ensure` it, `set_peers`, `activate`/`deactivate` peers, `delete`.

    `underlay` is the LAN interface (routed: where the peers' packets come in); `rp_restore` is (that interface,
    its reverse-path filter before meshrun first loosened it, as `settings` records it) while a routed LAN path
    has loosened it."""

    def __init__(self, overlay_interface: str, overlay_ip: str, network_name: str, settings: HostSettings) -> None:
        self.name = lanpath.interface_name(overlay_interface)
        self.overlay_interface = overlay_interface
        self.overlay_ip = overlay_ip
        self.vni = lanpath.vni(network_name)
        self.local_ip: str | None = None
        self.routed = False
        self.underlay: str | None = None
        self.rp_restore: tuple[str, str] | None = None
        self.settings = settings
        self.peers: dict[str, LanPeer] = {}  # overlay IP -> peer, as installed

    def ensure(self, local_ip: str, routed: bool = False) -> None:
        """The LAN path on LAN address `local_ip`: the VXLAN device (made anew when missing or on another
        address) or, `routed`, the LAN interface's reverse-path filter; the rules. HostError when the kernel
        has no VXLAN, or (routed) no interface holds `local_ip`."""
        made = routed or Path(f"/sys/class/net/{self.name}").exists()
        if self.local_ip == local_ip and self.routed == routed and made:
            return
        self._clear()
        underlay = net.interface_of(local_ip)
        if routed:
            self._ensure_routed(local_ip, underlay)
            return
        # The guard before the device: until set_peers names the peers, every datagram on the port is dropped.
        run(["nft", "-f", "-"], input=lanpath.guard_script(self.overlay_ip, [], self.overlay_interface))
        add = ["ip", "link", "add", self.name, "type", "vxlan", "id", str(self.vni), "dstport", str(lanpath.LAN_PORT)]
        # No outer UDP checksum (optional for IPv4; the inner packet has its own): 5-10% faster here.
        add += ["local", local_ip, "nolearning", "noudpcsum"] + (["dev", underlay] if underlay else [])
        try:
            run(add, quiet=True)
        except CommandError as exc:
            if "unknown device type" in str(exc).lower():
                raise HostError(
                    "this kernel has no VXLAN, which the site LAN path needs",
                    "load it (`modprobe vxlan`), or leave the site untrusted (`meshrun site untrust NAME`)",
                ) from None
            raise
        self.local_ip = local_ip
        mtu = (net.link(underlay).get("mtu") or 1500) - lanpath.OVERHEAD if underlay else 1500 - lanpath.OVERHEAD
        run(["ip", "link", "set", self.name, "address", lanpath.mac_for(self.overlay_ip), "mtu", str(mtu), "up"])
        run(["ip", "addr", "add", lanpath.DEVICE_ADDRESS, "dev", self.name, "scope", "link"])
        # Loose reverse-path filtering: a peer may send on the LAN path while this end still answers on WireGuard.
        Path(f"/proc/sys/net/ipv4/conf/{self.name}/rp_filter").write_text("2")
        v6 = Path(f"/proc/sys/net/ipv6/conf/{self.name}/disable_ipv6")
        if v6.exists():
            v6.write_text("1")
        self.underlay = underlay
        self._ensure_rules()

    def _ensure_routed(self, local_ip: str, underlay: str | None) -> None:
        if not underlay:
            raise HostError(
                f"no interface holds the LAN address {local_ip}, which the routed site LAN path leaves from",
                "check the node's address (`ip -4 addr`), or trust the site with `--encapsulation vxlan`",
            )
        run(
            ["nft", "-f", "-"],
            input=lanpath.guard_script(self.overlay_ip, [], self.overlay_interface, routed_via=underlay),
        )
        # A strict reverse-path filter drops a peer's packet from its overlay address on the LAN interface
        # while this end still routes that address through WireGuard (probing starts on both ends at once):
        # loose, as the VXLAN device is; put back by delete/remove. The value found is recorded before the
        # change and kept over later ones: a restarted agent finds its own 2 here, not what to put back.
        settings = self.settings
        setting = rp_filter_setting(underlay)
        if max(int(settings.read(rp_filter_setting("all"))), int(settings.read(setting))) == 1:
            settings.change(setting, "2")
        original = settings.originals().get(setting)
        self.rp_restore = (underlay, original) if original is not None else None
        self.local_ip, self.routed, self.underlay = local_ip, True, underlay
        self._ensure_rules()

    def _ensure_rules(self) -> None:
        have = run(["ip", "-4", "rule", "show"], quiet=True).stdout
        for rule in _rules():
            if not any(line.startswith(f"{rule[1]}:") for line in have.splitlines()):
                run(["ip", "-4", "rule", "add", *rule])

    def set_peers(self, peers: list[LanPeer], guard: str) -> None:
        """Exactly `peers` on the device (forwarding entry, neighbour, probe route each) and the guard script."""
        want = {p.overlay_ip: p for p in peers}
        for ip, p in list(self.peers.items()):
            if want.get(ip) != p:
                self._forget(p)
        for ip, p in want.items():
            if self.peers.get(ip) != p:
                self.peers[ip] = p
                if not self.routed:
                    mac = lanpath.mac_for(p.overlay_ip)
                    run(["bridge", "fdb", "replace", mac, "dev", self.name, "dst", p.lan_ip, "self", "permanent"])
                    run(["ip", "neigh", "replace", ip, "lladdr", mac, "dev", self.name, "nud", "permanent"])
                self._route("replace", ip, lanpath.PROBE_TABLE)
        run(["nft", "-f", "-"], input=guard)

    def _route(self, verb: str, ip: str, table: int) -> None:
        if self.routed:  # the peer's own LAN address is the next hop; onlink: no route to it needs to say so
            via = ["via", self.peers[ip].lan_ip, "dev", str(self.underlay), "onlink"]
        else:
            via = ["dev", self.name]
        run(["ip", "route", verb, f"{ip}/32", *via, "src", self.overlay_ip, "table", str(table)])

    def _forget(self, p: LanPeer) -> None:
        for table in (lanpath.ACTIVE_TABLE, lanpath.PROBE_TABLE):
            run(["ip", "route", "del", f"{p.overlay_ip}/32", "table", str(table)], check=False, quiet=True)
        if not self.routed:
            run(["ip", "neigh", "del", p.overlay_ip, "dev", self.name], check=False, quiet=True)
            run(["bridge", "fdb", "del", lanpath.mac_for(p.overlay_ip), "dev", self.name], check=False, quiet=True)
        self.peers.pop(p.overlay_ip, None)

    def activate(self, overlay_ip: str) -> None:
        """Send `overlay_ip`'s traffic on the LAN path (ACTIVE_TABLE is consulted before main)."""
        self._route("replace", overlay_ip, lanpath.ACTIVE_TABLE)

    def deactivate(self, overlay_ip: str) -> None:
        """`overlay_ip`'s traffic back on WireGuard."""
        run(["ip", "route", "del", f"{overlay_ip}/32", "table", str(lanpath.ACTIVE_TABLE)], check=False, quiet=True)

    def _clear(self) -> None:
        remove(self.overlay_interface, self.settings)
        self.local_ip, self.routed, self.underlay, self.rp_restore, self.peers = None, False, None, None, {}

    def delete(self, overlay_interface: str) -> None:
        self._clear()


class FakeLanLink:
    """LanLink in memory: `local_ip`, `peers`, `active`, `guard` as the kernel would hold them; `calls` in order."""

    def __init__(
        self, overlay_interface: str, overlay_ip: str, network_name: str, settings: HostSettings | None = None
    ) -> None:
        self.name = lanpath.interface_name(overlay_interface)
        self.overlay_ip = overlay_ip
        self.local_ip: str | None = None
        self.routed = False
        self.underlay: str | None = None
        self.rp_restore: tuple[str, str] | None = None
        self.peers: dict[str, LanPeer] = {}
        self.active: set[str] = set()
        self.guard = ""
        self.calls: list[tuple] = []

    def ensure(self, local_ip: str, routed: bool = False) -> None:
        self.calls.append(("ensure", local_ip) + (("routed",) if routed else ()))
        if self.local_ip != local_ip or self.routed != routed:
            self.peers, self.active = {}, set()
        self.local_ip, self.routed, self.underlay = local_ip, routed, "eth0"

    def set_peers(self, peers: list[LanPeer], guard: str) -> None:
        self.calls.append(("set_peers", tuple(p.name for p in peers)))
        old, self.peers = self.peers, {p.overlay_ip: p for p in peers}
        # Like LanLink: a peer whose entry changed is forgotten (its active route too) and installed anew.
        self.active = {ip for ip in self.active if ip in self.peers and old.get(ip) == self.peers[ip]}
        self.guard = guard

    def activate(self, overlay_ip: str) -> None:
        self.calls.append(("activate", overlay_ip))
        self.active.add(overlay_ip)

    def deactivate(self, overlay_ip: str) -> None:
        self.calls.append(("deactivate", overlay_ip))
        self.active.discard(overlay_ip)

    def delete(self, overlay_interface: str) -> None:
        self.calls.append(("delete",))
        self.local_ip, self.peers, self.active, self.guard = None, {}, set(), ""
        self.routed, self.underlay = False, None
