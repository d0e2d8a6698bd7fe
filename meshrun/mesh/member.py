"""What every member (coordinator or node) has: its record in member.json, and taking it down."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from meshrun.core import auth, keys
from meshrun.core.model import Member, Network
from meshrun.errors import MeshrunError, StateError
from meshrun.mesh import iface, process
from meshrun.system.files.statedir import StateDir
from meshrun.system.kernel import lanlink, net, relaykernel, tunnellink


def load(state: StateDir) -> tuple[dict, Network]:
    """(member.json as a dict, the network); StateError if there is no member here or it is corrupt."""
    if not state.exists:
        raise StateError(f"no meshrun state in {state.path}", "run `meshrun init` or `meshrun join` first")
    rec = state.read_json("member.json")
    try:
        return rec, Network.from_dict(rec["network"])
    except (KeyError, ValueError, TypeError) as exc:
        raise StateError(
            f"{state / 'member.json'} is corrupt ({exc})", "restore it, or `meshrun leave --purge` and join again"
        ) from None


@dataclass(frozen=True)
class TakenDown:
    """What `take_down` found and did: the interface's name, whether a daemon was running (and was stopped),
    whether the interface existed (and was removed), whether the state was deleted."""

    interface: str
    stopped: bool
    removed: bool
    purged: bool

    def summary(self) -> str:
        """One line for the user that says only what happened ("stopped the daemon; removed meshrun0")."""
        parts = [
            "stopped the daemon" if self.stopped else "no daemon was running",
            f"removed {self.interface}" if self.removed else f"{self.interface} was not there",
        ]
        return "; ".join(parts + (["state deleted"] if self.purged else []))


def take_down(state: StateDir, role: str, purge: bool = False) -> TakenDown:
    """Stop the daemon and remove the interface; delete the state with `purge`. Returns what it found and did.

    `role` is what the command expects ("coordinator" for `down`, "node" for `leave`).
    """
    if not state.exists:
        raise StateError(f"no meshrun state in {state.path}", "nothing to do; pass --state-dir if it lives elsewhere")
    rec, network = load(state)
    if rec.get("role") != role:
        other = {"coordinator": "`meshrun down`", "node": "`meshrun leave`"}.get(rec.get("role"), "another command")
        raise StateError(f"{state.path} holds a meshrun {rec.get('role')}, not a {role}", f"use {other} there")
    net.require_admin()
    stopped = process.stop(state)
    device = iface.device_for(state, network, rec)
    existed = device.exists()
    device.delete()  # and its forward guard (every member has one)
    # The site LAN path, if the agent did not get to it (and the LAN interface's filter as meshrun found it).
    lanlink.remove(network.interface, lanlink.host_settings(state.path))
    state.remove("lan.json")  # what it recorded is gone (a stale filter value there would be adopted again)
    relaykernel.remove(network.interface)  # and the relay's fast path
    # The extra tunnels per pair, and their wireguard-go processes as the agent recorded them.
    extra = state.read_json("tunnels.json") if (state / "tunnels.json").exists() else {}
    pids = extra.get("pids") if isinstance(extra, dict) else None
    tunnellink.remove(network.interface, pids if isinstance(pids, dict) else None)
    if purge:
        state.delete()
    return TakenDown(network.interface, stopped, existed, purge)


def save_members(state: StateDir, version: int, members: list[Member]) -> None:
    state.write_json("peers.json", {"version": version, "members": [m.to_dict() for m in members]})


def load_members(state: StateDir) -> tuple[int, list[Member]]:
    """The last member list the coordinator sent (version 0 and none before the first)."""
    if not (state / "peers.json").exists():
        return 0, []
    try:
        data = state.read_json("peers.json")
        return int(data.get("version", 0)), [Member.from_dict(m) for m in data.get("members", [])]
    except (ValueError, TypeError) as exc:
        raise StateError(
            f"{state / 'peers.json'} is corrupt ({exc})", "remove it; the agent fetches it again"
        ) from None


def job_key(state: StateDir, peer_public_key: str) -> bytes:
    """The job key this member shares with `peer_public_key` (meshrun.core.auth.job_key): on the
    coordinator a node's key, on a node the coordinator's. Computed from this member's private key;
    never stored, never sent."""
    rec, network = load(state)
    private = state.read("private.key").decode().strip()
    own = keys.public_key(private)
    shared = keys.shared_secret(private, peer_public_key)
    if rec.get("role") == "coordinator":
        return auth.job_key(shared, own, peer_public_key)
    return auth.job_key(shared, peer_public_key, own)


class OverlayKeys:
    """The overlay-request keys (meshrun.core.auth.overlay_key) this member shares with others, by their public
    keys: computed from the private key on first use, kept in memory, never stored or sent; `at` and `by_ip`
    find a member's by its overlay address."""

    def __init__(self, state: StateDir) -> None:
        self.state = state
        self._keys: dict[str, bytes] = {}
        self._by_ip: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def __call__(self, peer_public_key: str) -> bytes:
        with self._lock:
            if peer_public_key not in self._keys:
                private = self.state.read("private.key").decode().strip()
                shared = keys.shared_secret(private, peer_public_key)
                self._keys[peer_public_key] = auth.overlay_key(shared, keys.public_key(private), peer_public_key)
            return self._keys[peer_public_key]

    def at(self, overlay_ip: str, members: Sequence[Member], network: Network) -> bytes | None:
        """The key shared with the member at `overlay_ip` in `members` (the network's first coordinator before
        there is a list); None for an address it does not know."""
        pub = next((m.public_key for m in members if m.overlay_ip == overlay_ip), None)
        if pub is None and overlay_ip == network.coordinator_ip:
            pub = network.coordinator_public_key
        return self(pub) if pub else None

    def by_ip(self, overlay_ip: str) -> bytes | None:
        """`at` with the member list this member last saved (read once per address: a process without an agent's
        list in memory, such as torchrun's agent)."""
        if overlay_ip not in self._by_ip:
            try:
                _, network = load(self.state)
                _, members = load_members(self.state)
            except (MeshrunError, OSError):
                return None
            key = self.at(overlay_ip, members, network)
            if key is None:
                return None
            self._by_ip[overlay_ip] = key
        return self._by_ip[overlay_ip]
