"""A node's life: `meshrun join` (enrol, bring up the interface, start the agent), resume, leave.

Enrolment talks TLS to the coordinator's public port, pinned by the fingerprint in the token;
the private key is made here and never leaves the machine. On failure nothing is left behind:
no interface, no daemon, no state files.
"""

from __future__ import annotations

import base64
import contextlib
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

from meshrun.core import auth, keys
from meshrun.core import tunnels as tunnel_mod
from meshrun.core.model import (
    Member,
    Network,
    check_mtu,
    check_name,
    default_node_name,
    overlay_mtu,
    parse_endpoint,
    refuse_ipv6,
    split_endpoint,
)
from meshrun.core.token import JoinToken, parse_token
from meshrun.errors import CoordinatorError, NetworkError, StateError, TokenError, UsageError
from meshrun.mesh import iface, member, process
from meshrun.mesh.node.daemon import apply_members
from meshrun.system.files.statedir import StateDir
from meshrun.system.kernel import net
from meshrun.system.kernel.device import Device
from meshrun.system.sockets import probe, transport

READY_TIMEOUT = 45.0  # `meshrun join --wait`: the agent's first sync with the coordinator
MAX_READY_TIMEOUT = 3600.0
NODE_FILES = ("private.key", "member.json", "peers.json", "wireguard-go.log", *process.FILES)


@dataclass(frozen=True)
class JoinResult:
    name: str
    overlay_ip: str
    network: Network
    backend: str
    resumed: bool
    daemon_pid: int | None
    mtu: int
    warning: str | None = None  # what the interface costs (an old wireguard-go), with the fix


def join_request(
    tok: JoinToken, name: str, private_key: str, coordinator_public_key: str, candidates: list[str]
) -> dict:
    """The body of POST /v1/join (it carries the token secret: send it only over pinned TLS), with the
    proof that this node holds its private key (made with the X25519 secret it shares with the coordinator)."""
    public_key = keys.public_key(private_key)
    proof = auth.enrol_proof(
        keys.shared_secret(private_key, coordinator_public_key),
        tok.network,
        name,
        public_key,
        tok.token_id,
        time.time(),
    )
    return {
        "token_id": tok.token_id,
        "secret": base64.urlsafe_b64encode(tok.secret).decode().rstrip("="),
        "name": name,
        "public_key": public_key,
        "candidates": candidates,
        "network": tok.network,
        "possession": proof,
    }


def enrol(tok: JoinToken, name: str, private_key: str, candidates: list[str], timeout: float = 15) -> dict:
    """POST /v1/join to each coordinator in the token until one answers; TLS pinned by that coordinator's
    fingerprint, the proof of the key made with that coordinator's key (a coordinator that is gone is
    skipped; one that answers decides)."""
    if not tok.coordinator_key:
        raise TokenError(
            "this join token was made by an older meshrun and lacks the coordinator's key",
            "create a new token on the coordinator (`meshrun token create`)",
        )
    tried = []
    for ep, fingerprint, ckey in tok.coordinators():
        host, port = split_endpoint(ep)
        body = join_request(tok, name, private_key, ckey, candidates)
        try:
            return transport.call(host, port, "POST", "/v1/join", body, fingerprint=fingerprint, timeout=timeout)
        except CoordinatorError as exc:
            if exc.status:  # the coordinator answered: its verdict is final
                raise
            tried.append(exc)
    if len(tried) == 1:
        raise tried[0]
    raise CoordinatorError(
        "cannot reach any coordinator at " + ", ".join(ep for ep, _, _ in tok.coordinators()),
        "check the addresses and that TCP port is open on the coordinators",
    )


def abandon(tok: JoinToken, name: str, private_key: str, timeout: float = 5) -> None:
    """Tell the coordinator that this enrolment's join failed here, so the name is free again (best effort)."""
    public_key = keys.public_key(private_key)
    for ep, fingerprint, ckey in tok.coordinators():
        body = {
            "name": name,
            "public_key": public_key,
            "token_id": tok.token_id,
            "possession": auth.enrol_proof(
                keys.shared_secret(private_key, ckey),
                tok.network,
                name,
                public_key,
                f"abandon:{tok.token_id}",
                time.time(),
            ),
        }
        host, port = split_endpoint(ep)
        try:
            transport.call(host, port, "POST", "/v1/join/abandon", body, fingerprint=fingerprint, timeout=timeout)
            return
        except CoordinatorError:
            continue


Enrol = Callable[[JoinToken, str, str, list[str]], dict]
Abandon = Callable[[JoinToken, str, str], None]


def join(
    token: str,
    state: StateDir,
    name: str | None = None,
    endpoint: str | None = None,
    start: bool = True,
    mtu: int | None = None,
    device: Device | None = None,
    enrol_with: Enrol = enrol,
    abandon_with: Abandon = abandon,
    site: str | None = None,
    relay: bool | None = None,
    wait: float = READY_TIMEOUT,
    tunnels: int | None = None,
) -> JoinResult:
    """Enrol this machine and bring up its interface; start the agent unless start=False.

    `site`: the site this node is in (its agent reports it; jobs group their ranks by it, see
    meshrun.core.topology). `relay` False: this node never relays other members' pairs (`--no-relay`;
    by default any member with direct tunnels to both ends of a pair may, see meshrun.core.relays).
    `tunnels`: WireGuard tunnels per same-site pair (`--tunnels`, meshrun.core.tunnels; None: 1, or as before).
    `wait`: seconds the agent has for its first sync with the coordinator (`--wait`) before the join
    is undone.
    Run again on an enrolled node, it resumes with the same key and address. On failure
    nothing is left: no interface, no daemon, no state files (the coordinator keeps a
    reservation it frees for the same name on the next try). Tests pass a FakeDevice (whose
    caller needs no privileges) and an in-process `enrol_with`.
    """
    tok = parse_token(token)
    check_wait(wait)
    if site is not None:
        check_name(site, "--site")
    if tunnels is not None:
        tunnel_mod.check_count(tunnels)
    if state.exists:
        return resume(state, tok, start, site=site, relay=relay, wait=wait, tunnels=tunnels)
    name = check_name(name) if name else default_node_name(platform.node())
    if mtu is not None:
        check_mtu(mtu)
    advertised = []
    if endpoint:
        refuse_ipv6(endpoint)
        try:
            advertised = [parse_endpoint(endpoint, default_port=split_endpoint(tok.endpoints[0])[1])]
        except ValueError as exc:
            raise UsageError(
                f"--endpoint {endpoint!r} is not HOST or HOST:PORT ({exc})",
                "give this node's public address, e.g. --endpoint 198.51.100.7",
            ) from None
    if device is None:
        net.require_admin()
        net.require_tools("ip", "wg")
    private_key = keys.generate_private_key()
    answer = enrol_with(tok, name, private_key, advertised)
    try:
        return _install(
            answer,
            state,
            private_key,
            advertised,
            mtu,
            device,
            start,
            site or "",
            relay is not False,
            wait,
            tunnels or 1,
        )
    except BaseException:
        with contextlib.suppress(Exception):  # the name is free again at once, not after the grace
            abandon_with(tok, name, private_key)
        raise


WAIT_FIX = "on a slow host or link give the agent longer, e.g. `meshrun join --wait 180`"


def check_wait(wait: float) -> None:
    """UsageError unless `wait` (seconds, `--wait`) is positive and at most an hour."""
    if not 0 < wait <= MAX_READY_TIMEOUT:
        raise UsageError(
            f"--wait {wait:g} is out of range", f"give the seconds to wait for the agent, 1 to {MAX_READY_TIMEOUT:.0f}"
        )


def _install(
    answer: dict,
    state: StateDir,
    private_key: str,
    advertised: list[str],
    mtu: int | None,
    device: Device | None,
    start: bool,
    site: str = "",
    relay: bool = True,
    wait: float = READY_TIMEOUT,
    tunnels: int = 1,
) -> JoinResult:
    """After enrolment: write the state, bring up the interface, apply the peers, start the agent; on
    failure nothing is left here (the caller gives the enrolment back)."""
    try:
        network = Network.from_dict(answer["network"])
        me = Member.from_dict(answer["member"])
        members = [Member.from_dict(m) for m in answer["members"]]
    except (KeyError, ValueError, TypeError) as exc:
        raise CoordinatorError(
            f"the coordinator's join answer is malformed ({exc})",
            "use the same meshrun version on the node and the coordinator",
        ) from None
    tunnel_mod.check_listen_port(network.listen_port, tunnels)
    device = device or iface.device_for(state, network)
    if device.exists():
        raise NetworkError(
            f"network interface {network.interface} already exists on this machine",
            "run `meshrun leave` if it is a leftover of meshrun, or remove it with `ip link del`",
        )

    underlay = None
    if mtu is None:
        underlay = probe.path_mtu(*split_endpoint(network.endpoints[0]))
        mtu = overlay_mtu(network.mtu, underlay)

    created_dir = state.create()
    try:
        state.write("private.key", private_key + "\n", secret=True)
        record = {
            "role": "node",
            "name": me.name,
            "network": network.to_dict(),
            "overlay_ip": me.overlay_ip,
            "public_key": me.public_key,
            "advertised": advertised,
            "mtu": mtu,
            "underlay_mtu": underlay,
            "site": site,
            "relay": relay,
            "tunnels": tunnels,
        }
        sync_with = answer.get("coordinator_ip")
        if isinstance(sync_with, str) and any(m.overlay_ip == sync_with and m.is_coordinator for m in members):
            record["sync_with"] = sync_with  # the coordinator that enrolled it: its first sync goes there
        backend = iface.bring_up(device, state, network, me.overlay_ip, mtu)
        record.update(backend=backend, wg_pid=device.pid)
        state.write_json("member.json", record)
        member.save_members(state, 0, members)
        apply_members(device, state, record, network, members)
        daemon_pid = process.spawn(state, timeout=wait, fix=WAIT_FIX) if start else None
    except BaseException:
        with contextlib.suppress(Exception):
            process.stop(state)
        with contextlib.suppress(Exception):
            device.delete()
        if created_dir:
            state.delete()
        else:
            state.remove(f"{network.interface}.conf", *NODE_FILES)
        raise
    return JoinResult(me.name, me.overlay_ip, network, backend, False, daemon_pid, mtu, device.warning())


def resume(
    state: StateDir,
    tok: JoinToken | None,
    start: bool = True,
    site: str | None = None,
    relay: bool | None = None,
    wait: float = READY_TIMEOUT,
    tunnels: int | None = None,
) -> JoinResult:
    """Bring an enrolled node back (same key, same address): interface and agent; `site`, `relay` and
    `tunnels` (if given) take effect from the agent's next start (UsageError while the agent runs with others)."""
    rec, network = member.load(state)
    if rec.get("role") != "node":
        raise StateError(
            f"{state.path} holds a coordinator, not a node", "use another --state-dir to join from this machine"
        )
    if tok is not None and (tok.network != network.name or tok.fingerprint != network.fingerprint):
        raise StateError(
            f"this node is already a member of network {network.name!r} (another network's token given)",
            "run `meshrun leave --purge` first to switch networks",
        )
    net.require_admin()
    pid = process.pid(state)
    if site is not None and site != rec.get("site", ""):
        if pid is not None:
            raise UsageError(
                f"--site {site!r}: this node's agent is running with site {rec.get('site', '')!r}",
                "run `meshrun leave` (the node keeps its keys and address), then this `meshrun join` again",
            )
        rec["site"] = site
        state.write_json("member.json", rec)
    if relay is not None and relay != rec.get("relay", True):
        if pid is not None:
            raise UsageError(
                f"--{'' if relay else 'no-'}relay: this node's agent is running with the other setting",
                "run `meshrun leave` (the node keeps its keys and address), then this `meshrun join` again",
            )
        rec["relay"] = relay
        state.write_json("member.json", rec)
    if tunnels is not None and tunnels != int(rec.get("tunnels") or 1):
        if pid is not None:
            raise UsageError(
                f"--tunnels {tunnels}: this node's agent is running with {int(rec.get('tunnels') or 1)}",
                "run `meshrun leave` (the node keeps its keys and address), then this `meshrun join` again",
            )
        tunnel_mod.check_listen_port(network.listen_port, tunnels)
        rec["tunnels"] = tunnels
        state.write_json("member.json", rec)
    if pid is None and start:
        pid = process.spawn(state, timeout=wait, fix=WAIT_FIX)
    device = iface.device_for(state, network, rec)
    return JoinResult(
        rec["name"],
        rec["overlay_ip"],
        network,
        device.backend(),
        True,
        pid,
        int(rec.get("mtu") or network.mtu),
        device.warning(),
    )


def leave(state: StateDir, purge: bool = False) -> member.TakenDown:
    """Stop the agent and remove the interface; state stays unless `purge`. Returns what was found and done."""
    return member.take_down(state, "node", purge)
