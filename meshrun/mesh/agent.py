"""The node side: `join` (enrol, bring up the interface) and the agent daemon that keeps the
node's peers in sync with the coordinator.

The agent long-polls POST /v1/sync on the coordinator's overlay IP: the coordinator answers
at once when the member list changed since the version the agent holds, else after up to
25 s. Each request carries the node's heartbeat (its candidate addresses and its view of
its peers). When the coordinator is unreachable the agent keeps the tunnels it has and
retries with backoff; the data path never depends on the coordinator being up.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import shutil
import signal
import socket
import threading
import time
from dataclasses import dataclass

from meshrun.mesh import daemon
from meshrun.core import keys
from meshrun.core import peers
from meshrun.system import probe
from meshrun.system import transport
from meshrun.system import wg
from meshrun.errors import CoordinatorError, MeshrunError, StateError, UsageError
from meshrun.core.model import Member, Network, check_mtu, check_name, default_node_name, parse_endpoint
from meshrun.system.store import StateDir
from meshrun.core.token import JoinToken, parse_token
from meshrun.core.wgconf import render_quick

log = logging.getLogger("meshrun.mesh.agent")

SYNC_WAIT = 20.0
FAST_WAIT = 2.0          # long-poll while a path is unproven
PROBE_WINDOW_S = 10.0    # = paths.ATTEMPT_S: how long a new path gets to handshake
READY_TIMEOUT = 45.0


@dataclass(frozen=True)
class JoinResult:
    name: str
    overlay_ip: str
    network: Network
    backend: str
    resumed: bool
    daemon_pid: int | None
    mtu: int


def enrol(tok: JoinToken, name: str, public_key: str, candidates: list[str], timeout: float = 15) -> dict:
    """POST /v1/join to each endpoint in the token until one answers; TLS pinned by fingerprint."""
    body = {"token_id": tok.token_id, "secret": base64.urlsafe_b64encode(tok.secret).decode().rstrip("="),
            "name": name, "public_key": public_key, "candidates": candidates, "network": tok.network}
    tried = []
    for ep in tok.endpoints:
        host, _, port = ep.rpartition(":")
        host = host.strip("[]")
        try:
            return transport.call(host, int(port), "POST", "/v1/join", body, fingerprint=tok.fingerprint,
                                  timeout=timeout)
        except CoordinatorError as exc:
            if getattr(exc, "status", None):  # the coordinator answered: its verdict is final
                raise
            tried.append(exc)
    if len(tried) == 1:
        raise tried[0]
    raise CoordinatorError("cannot reach the coordinator at any of " + ", ".join(tok.endpoints),
                           "check the addresses and that TCP port is open on the coordinator")


def join(token: str, state: StateDir, name: str | None = None, endpoint: str | None = None,
         start: bool = True, mtu: int | None = None) -> JoinResult:
    """Enrol this machine and bring up its interface; start the agent unless start=False.

    Run again on an enrolled node, it resumes with the same key and address. On failure
    nothing is left: no interface, no daemon, no state files (the coordinator keeps a
    reservation it frees for the same name on the next try).
    """
    tok = parse_token(token)
    if state.exists:
        return resume(state, tok, start)
    name = check_name(name) if name else default_node_name(socket.gethostname())
    if mtu is not None:
        check_mtu(mtu)
    advertised = []
    if endpoint:
        try:
            advertised = [parse_endpoint(endpoint, default_port=int(tok.endpoints[0].rpartition(":")[2]))]
        except ValueError as exc:
            raise UsageError(f"--endpoint {endpoint!r} is not HOST or HOST:PORT ({exc})",
                             "give this node's public address, e.g. --endpoint 198.51.100.7") from None
    wg.require_admin()
    wg.require_tools("ip", "wg")
    private_key = keys.generate_private_key()
    answer = enrol(tok, name, keys.public_key(private_key), advertised)
    try:
        network = Network.from_dict(answer["network"])
        me = Member.from_dict(answer["member"])
        members = [Member.from_dict(m) for m in answer["members"]]
    except (KeyError, ValueError, TypeError) as exc:
        raise CoordinatorError(f"the coordinator's join answer is malformed ({exc})",
                               "use the same meshrun version on the node and the coordinator") from None
    if wg.interface_exists(network.interface):
        raise MeshrunError(f"network interface {network.interface} already exists on this machine",
                           "run `meshrun leave` if it is a leftover of meshrun, or remove it with `ip link del`")

    underlay = None
    if mtu is None:
        host, _, port = network.endpoints[0].rpartition(":")
        underlay = probe.path_mtu(host.strip("[]"), int(port))
        mtu = probe.overlay_mtu(network.mtu, underlay)

    created_dir = state.create()
    pid = None
    try:
        state.write("private.key", private_key + "\n", secret=True)
        record = {"role": "node", "name": me.name, "network": network.to_dict(), "overlay_ip": me.overlay_ip,
                  "public_key": me.public_key, "advertised": advertised, "mtu": mtu, "underlay_mtu": underlay}
        backend, pid = bring_up(state, network, me.overlay_ip, mtu)
        record.update(backend=backend, wg_pid=pid)
        state.write_json("member.json", record)
        save_members(state, 0, members)
        apply_members(state, network, me.public_key, members)
        daemon_pid = daemon.spawn(state, timeout=READY_TIMEOUT) if start else None
    except BaseException:
        with contextlib.suppress(Exception):
            daemon.stop(state)
        with contextlib.suppress(Exception):
            wg.delete_interface(network.interface, pid)
        if created_dir:
            shutil.rmtree(state.path, ignore_errors=True)
        else:
            state.remove("private.key", "member.json", "peers.json", f"{network.interface}.conf", "daemon.log",
                         "daemon.error", "daemon.lock", "wireguard-go.log")
        raise
    return JoinResult(me.name, me.overlay_ip, network, backend, False, daemon_pid, mtu)


def resume(state: StateDir, tok: JoinToken | None, start: bool = True) -> JoinResult:
    """Bring an enrolled node back (same key, same address): interface and agent."""
    rec = state.read_json("member.json")
    network = _network(state, rec)
    if rec.get("role") != "node":
        raise StateError(f"{state.path} holds a coordinator, not a node",
                         "use another --state-dir to join from this machine")
    if tok is not None and (tok.network != network.name or tok.fingerprint != network.fingerprint):
        raise StateError(f"this node is already a member of network {network.name!r} (another network's token given)",
                         "run `meshrun leave --purge` first to switch networks")
    wg.require_admin()
    pid = state.read_pid()
    if pid is None and start:
        pid = daemon.spawn(state, timeout=READY_TIMEOUT)
    return JoinResult(rec["name"], rec["overlay_ip"], network, wg.backend_of(network.interface), True, pid,
                      int(rec.get("mtu") or network.mtu))


def _network(state: StateDir, rec: dict) -> Network:
    try:
        return Network.from_dict(rec["network"])
    except (KeyError, ValueError, TypeError) as exc:
        raise StateError(f"{state / 'member.json'} is corrupt ({exc})",
                         "restore it, or `meshrun leave --purge` and join again") from None


def bring_up(state: StateDir, network: Network, address: str, mtu: int | None = None) -> tuple[str, int | None]:
    from meshrun.mesh.coordinator import bring_up as _bring_up
    return _bring_up(state, network, address, mtu)


def save_members(state: StateDir, version: int, members: list[Member]) -> None:
    state.write_json("peers.json", {"version": version, "members": [m.to_dict() for m in members]})


def load_members(state: StateDir) -> tuple[int, list[Member]]:
    try:
        data = state.read_json("peers.json")
        return int(data.get("version", 0)), [Member.from_dict(m) for m in data.get("members", [])]
    except (ValueError, TypeError) as exc:
        raise StateError(f"{state / 'peers.json'} is corrupt ({exc})", "remove it; the agent fetches it again") from None


def apply_members(state: StateDir, network: Network, my_key: str, members: list[Member],
                  recreate: frozenset[str] = frozenset(),
                  hold_windows: dict[tuple[str, str, str], float] | None = None) -> frozenset[str]:
    """Make the interface's peers match `members` (minimal diff) and rewrite the wg-quick file.

    Peers in `recreate` changed path: they are re-created so a fresh handshake proves the path.
    With `hold_windows` (see `peers.handshake_holds`), peers whose handshake this node must leave
    to the other end for now get no keepalive; returns their keys: apply again when HOLD_S is up.
    """
    _, current = wg.show(network.interface)
    hold: frozenset[str] = frozenset()
    if hold_windows is not None:
        hold = peers.handshake_holds(my_key, members, {p.public_key: p.latest_handshake for p in current},
                                     hold_windows, time.monotonic(), recreate)
    desired = peers.desired_for_node(my_key, members, hold)
    d = peers.diff(current, desired, time.time(), recreate)
    if d:
        log.info("peers: +%d ~%d -%d", len(d.add), len(d.update), len(d.remove))
        wg.apply(network.interface, d)
        # WireGuard handshakes only when it has something to send: a datagram to each new
        # direct peer starts the handshake now, so the new path is proven (or not) quickly.
        # Only peers with an endpoint: an attempt without one still counts as "sent" for
        # wireguard-go, which then waits REKEY_TIMEOUT (5 s) before it tries again.
        # Held peers (no keepalive yet) are left alone: the other end starts their handshake.
        probe.nudge([ip.split("/")[0] for spec in (*d.add, *d.update) if spec.endpoint and spec.keepalive
                     for ip in spec.allowed_ips[:1]])
    rec = state.read_json("member.json")
    key = state.read("private.key").decode().strip()
    text = render_quick(key, f"{rec['overlay_ip']}/{network.prefixlen}", network.listen_port,
                        int(rec.get("mtu") or network.mtu),
                        desired, comment=f"meshrun network {network.name}, node {rec['name']}; managed by meshrun")
    state.write(f"{network.interface}.conf", text, secret=True)
    return hold


class AgentService:
    """The node daemon: keeps peers in sync; `run()` blocks until SIGTERM/SIGINT."""

    def __init__(self, state: StateDir) -> None:
        self.state = state
        self.rec = state.read_json("member.json")
        self.network = _network(state, self.rec)
        self.iface = self.network.interface
        self.stop_event = threading.Event()
        self.version, self.members = load_members(state)
        self.ready = False
        self.removed = False
        self.path_changed_at = 0.0
        self.reported: dict[str, int] = {}   # handshakes the coordinator has acknowledged
        self.full_report = True
        self.hold_windows: dict[tuple[str, str, str], float] = {}
        self.apply_lock = threading.Lock()    # the sync loop and the hold-release timer both apply
        self.release_timer: threading.Timer | None = None

    def run(self) -> None:
        lock_fd = daemon.hold_lock(self.state)
        try:
            self._ensure_interface()
        except MeshrunError as exc:
            daemon.record_fatal(self.state, exc)
            raise
        signal.signal(signal.SIGTERM, lambda *_: self.stop_event.set())
        signal.signal(signal.SIGINT, lambda *_: self.stop_event.set())
        self.job_server = None
        try:
            from meshrun.jobs import server as jobs
            self.job_server = jobs.start_job_server(self)
        except MeshrunError as exc:
            log.warning("job API unavailable: %s", exc)
        backoff = 0.5
        try:
            while not self.stop_event.is_set():
                try:
                    self.sync_once(wait=self.wait_time() if self.ready else 0)
                    backoff = 0.5
                except MeshrunError as exc:
                    if getattr(exc, "status", None) == 410:
                        log.warning("this node was removed from the network; taking the interface down")
                        self.removed = True
                        self._cleanup_removed()
                        break
                    if not isinstance(exc, CoordinatorError):
                        log.error("sync could not be applied: %s", exc)
                        self.stop_event.wait(2)
                        continue
                    log.warning("sync failed: %s (tunnels stay up; retrying in %.1f s)", exc, backoff)
                    self.stop_event.wait(backoff)
                    backoff = min(backoff * 2, 10.0)
        finally:
            if self.job_server is not None:
                self.job_server.close()
            self.state.remove("daemon.pid", "daemon.ready")
            os.close(lock_fd)
        log.info("agent stopped")

    def _ensure_interface(self) -> None:
        if wg.interface_exists(self.iface):
            return
        log.info("interface %s is missing (reboot?); recreating it from state", self.iface)
        backend, pid = bring_up(self.state, self.network, self.rec["overlay_ip"], self.rec.get("mtu"))
        self.rec.update(backend=backend, wg_pid=pid)
        self.state.write_json("member.json", self.rec)
        if self.members:
            apply_members(self.state, self.network, self.rec["public_key"], self.members)

    def heartbeat(self) -> dict:
        """Candidates plus {peer key: latest handshake} for peers whose handshake changed since the
        last report the coordinator acknowledged (all of them when it asked for a full report)."""
        port = self.network.listen_port
        cands = list(self.rec.get("advertised", [])) + [f"{a}:{port}" for a in wg.local_addresses(exclude=self.iface)]
        _, current = wg.show(self.iface)
        now = {p.public_key: p.latest_handshake for p in current}
        if self.full_report:
            delta = now
        else:
            delta = {k: hs for k, hs in now.items() if self.reported.get(k) != hs}
        return {"candidates": cands[:16], "peers": delta, "full": self.full_report}

    def wait_time(self) -> float:
        """Long-poll briefly while a path is being probed, so the coordinator hears of the
        handshake (or its absence) quickly; otherwise wait long and cost nothing."""
        if time.time() - self.path_changed_at < 2 * PROBE_WINDOW_S:
            return FAST_WAIT
        try:
            _, current = wg.show(self.iface)
        except MeshrunError:
            return FAST_WAIT
        relayed = {m.public_key for m in self.members if m.path == "relayed"}
        if any(not p.latest_handshake for p in current if p.public_key not in relayed):
            return FAST_WAIT
        return SYNC_WAIT

    def sync_once(self, wait: float) -> None:
        body = dict(self.heartbeat(), version=self.version, wait=wait)
        answer = transport.call(self.network.coordinator_ip, self.network.api_port, "POST", "/v1/sync", body,
                                timeout=wait + 15)
        self.reported.update(body["peers"])
        self.full_report = answer.get("report") == "full"
        try:
            version = int(answer["version"])
            # "unchanged": our member list is current (a long-poll that timed out).
            members = self.members if answer.get("unchanged") else [Member.from_dict(m) for m in answer["members"]]
        except (KeyError, ValueError, TypeError) as exc:
            raise CoordinatorError(f"malformed sync answer ({exc})", "run the same meshrun version everywhere") from None
        if not any(m.public_key == self.rec["public_key"] for m in members):
            err = StateError("this node is no longer a member of the network", "ask the operator for a new token")
            err.status = 410  # type: ignore[attr-defined]
            raise err
        before = {m.public_key: m.path for m in self.members}
        # Re-create a peer only when its path really changed; a first assignment ("" -> mode)
        # keeps a tunnel that already works (the coordinator counts its handshake as proof).
        recreate = frozenset(m.public_key for m in members
                             if before.get(m.public_key) and before[m.public_key] != m.path
                             or before.get(m.public_key) == "" and m.path == "private")
        if recreate:
            self.path_changed_at = time.time()
            log.info("path changed for %s", ", ".join(f"{m.name}->{m.path}" for m in members
                                                       if m.public_key in recreate))
        if version != self.version or members != self.members:
            save_members(self.state, version, members)
        self.version, self.members = version, members
        self._apply(members, recreate)
        if not self.ready:
            self.ready = True
            daemon.mark_ready(self.state)
            log.info("agent of %s up: %s on %s, %d members", self.rec["name"], self.rec["overlay_ip"], self.iface,
                     len(members))

    def _apply(self, members: list[Member], recreate: frozenset[str] = frozenset()) -> None:
        """apply_members with handshake holds; a timer applies again when the holds are up."""
        with self.apply_lock:
            held = apply_members(self.state, self.network, self.rec["public_key"], members, recreate,
                                 self.hold_windows)
            if held and (self.release_timer is None or not self.release_timer.is_alive()):
                self.release_timer = threading.Timer(peers.HOLD_S + 0.05, self._release_holds)
                self.release_timer.daemon = True
                self.release_timer.start()

    def _release_holds(self) -> None:
        with self.apply_lock:
            self.release_timer = None     # this thread: _apply may need to start the next one
        if self.stop_event.is_set():
            return
        try:
            self._apply(self.members)
        except MeshrunError as exc:   # the next sync applies again
            log.warning("could not release handshake holds: %s", exc)

    def _cleanup_removed(self) -> None:
        with contextlib.suppress(MeshrunError):
            wg.delete_interface(self.iface, self.rec.get("wg_pid"))
        self.rec["removed"] = True
        self.state.write_json("member.json", self.rec)
        self.state.remove("peers.json", f"{self.iface}.conf")


def leave(state: StateDir, purge: bool = False) -> str:
    """Stop the daemon and remove the interface (node or coordinator); state stays unless purge."""
    if not state.exists:
        raise StateError(f"no meshrun state in {state.path}", "nothing to do; pass --state-dir if it lives elsewhere")
    rec = state.read_json("member.json")
    network = _network(state, rec)
    wg.require_admin()
    daemon.stop(state)
    wg.delete_interface(network.interface, rec.get("wg_pid"))
    if purge:
        shutil.rmtree(state.path)
    return network.interface


def load_node(state: StateDir) -> tuple[dict, Network]:
    if not state.exists:
        raise StateError(f"no meshrun state in {state.path}", "run `meshrun init` or `meshrun join` first")
    rec = state.read_json("member.json")
    return rec, _network(state, rec)
