"""The member's WireGuard interface, shared by coordinator and agent: bring it up, make its peers
match a desired list, and keep the operator's wg-quick file in step.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence

from meshrun.core import peers
from meshrun.core.model import Network
from meshrun.core.wgconf import quick_peers, render_quick
from meshrun.errors import StateError
from meshrun.system.files.statedir import StateDir
from meshrun.system.kernel.device import Device, WireGuardDevice

log = logging.getLogger("meshrun.mesh.iface")


def device_for(state: StateDir, network: Network, rec: dict | None = None) -> WireGuardDevice:
    """The real device of this member (wireguard-go's PID from member.json, when recorded)."""
    pid = (rec or {}).get("wg_pid")
    return WireGuardDevice(network.interface, state / "wireguard-go.log", pid if isinstance(pid, int) else None)


def bring_up(device: Device, state: StateDir, network: Network, address: str, mtu: int | None = None) -> str:
    """Create and configure the interface from state; returns the backend. On failure it is removed.

    The forward guard comes before the interface is up, with a key or an address: whatever this host
    forwards (Docker and Kubernetes hosts turn IP forwarding on), a member's packet that arrives on the
    interface never leaves on another one."""
    device.create()
    try:
        device.guard_forwarding()
        device.configure(
            state / "private.key", network.listen_port, f"{address}/{network.prefixlen}", mtu or network.mtu
        )
    except BaseException:
        with contextlib.suppress(Exception):
            device.delete()
        raise
    return device.backend()


def restore_peers(device: Device, state: StateDir, network: Network) -> int:
    """Put the peers of the last wg-quick file written back on a device just brought up (a machine that
    rebooted): what needs the overlay before the state can be read (a coordinator's etcd member, whose state
    is that state) reaches the others with the peers it last knew. Returns how many; 0 without a readable file."""
    name = f"{network.interface}.conf"
    if not (state / name).exists():
        return 0
    try:
        last = quick_peers(state.read(name).decode(errors="replace"))
    except (StateError, ValueError) as exc:
        log.warning("cannot read the last known peers from %s: %s", state / name, exc)
        return 0
    d = peers.diff(device.peers(), last, time.time())
    if d:
        device.apply(d)
    return len(last)


def sync_peers(
    device: Device,
    state: StateDir,
    network: Network,
    desired: Sequence[peers.PeerSpec],
    *,
    address: str,
    mtu: int,
    comment: str,
    recreate: frozenset[str] = frozenset(),
    current: Sequence[peers.PeerState] | None = None,
    route_mtus: Mapping[str, int] | None = None,
    iface_mtu: int | None = None,
    quick_file: bool = True,
) -> peers.PeerDiff:
    """Make the interface's peers match `desired` with the minimal diff, and rewrite the wg-quick file.

    `current` is the device's peer list if the caller just read it. Peers in `recreate` are
    removed and added again (their path changed: a fresh handshake proves the new one). The
    wg-quick file (0600: it embeds the private key) is rewritten when peers changed or it is
    missing, unless `quick_file` is False (the caller writes it later: write_quick_file). With
    `route_mtus` ({overlay IP: MTU}, peers.route_mtus), exactly those peers get a /32 route with
    their smaller MTU; with `iface_mtu`, the interface gets that MTU (raised after the routes are in place,
    lowered before they go: no peer sees a larger MTU than its own). Returns the diff applied.
    """
    d = peers.diff(device.peers() if current is None else current, desired, time.time(), recreate)
    if d:
        log.info("peers: +%d ~%d -%d", len(d.add), len(d.update), len(d.remove))
        device.apply(d)
    now = device.link_mtu() if iface_mtu is not None else None
    if iface_mtu is not None and now is not None and iface_mtu < now:
        device.set_mtu(iface_mtu)
    if route_mtus is not None:
        device.set_route_mtus(route_mtus)
    if iface_mtu is not None and now is not None and iface_mtu > now:
        log.info("%s: MTU %d -> %d (per-pair MTUs as /32 routes)", network.interface, now, iface_mtu)
        device.set_mtu(iface_mtu)
    if quick_file and (d or not (state / f"{network.interface}.conf").exists()):
        write_quick_file(state, network, desired, address=address, mtu=mtu, comment=comment)
    return d


def write_quick_file(
    state: StateDir, network: Network, desired: Sequence[peers.PeerSpec], *, address: str, mtu: int, comment: str
) -> None:
    """The wg-quick file for these peers (0600: it embeds the private key), for an operator to read or
    `wg-quick up` by hand."""
    key = state.read("private.key").decode().strip()
    state.write(
        f"{network.interface}.conf",
        render_quick(key, f"{address}/{network.prefixlen}", network.listen_port, mtu, list(desired), comment=comment),
        secret=True,
    )
