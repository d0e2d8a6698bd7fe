"""The coordinator: creates the network, enrols nodes, tells every member about the others.

Two listeners:
- enrolment API, TLS on 0.0.0.0:PORT/tcp (the only public TCP surface), pinned by the
  fingerprint in the join token: POST /v1/join.
- overlay API on COORD_OVERLAY_IP:API_PORT, bound to the WireGuard device, plain HTTP:
  WireGuard already authenticated the source address, so the caller is identified by it
  (innernet's model): POST /v1/sync (long-poll peer list + heartbeat).

A loop reads `wg show dump` every second: the endpoint WireGuard observes for a node is its
public (server-reflexive) address, which is what other nodes need.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import ipaddress
import json
import logging
import os
import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from meshrun.mesh import daemon
from meshrun.core import ipam
from meshrun.core import keys
from meshrun.core import paths
from meshrun.core import peers
from meshrun.system import wg
from meshrun.errors import CoordinatorError, MeshrunError, StateError, TokenError, UsageError
from meshrun.core.model import (DEFAULT_IFACE, DEFAULT_MTU, DEFAULT_PORT, Member, Network, check_interface, check_mtu,
                           check_name, check_port, parse_endpoint)
from meshrun.system.store import CoordinatorDB, StateDir
from meshrun.core.token import looks_like_token, new_token, parse_duration, parse_token
from meshrun.system.transport import JSONServer, Request, Response, server_tls_context
from meshrun.core.wgconf import render_quick

log = logging.getLogger("meshrun.mesh.coordinator")

DEFAULT_TTL = "12h"
SYNC_WAIT_MAX = 25.0
REMOVED_GRACE_S = 5.0   # a removed node's pending long-poll is answered 410 within this
OBSERVE_INTERVAL = 1.0


@dataclass(frozen=True)
class InitOptions:
    endpoint: str | None = None
    cidr: str = ipam.DEFAULT_CIDR
    port: int = DEFAULT_PORT
    interface: str = DEFAULT_IFACE
    mtu: int = DEFAULT_MTU
    name: str = "meshrun"
    token_ttl: str = DEFAULT_TTL
    token_uses: int | None = None


@dataclass(frozen=True)
class InitResult:
    network: Network
    token: str
    backend: str
    state_dir: Path
    daemon_pid: int | None


def check_init_options(opts: InitOptions) -> None:
    """Raise UsageError for any init option that is wrong on its own (no system needed)."""
    check_name(opts.name, "--network")
    check_interface(opts.interface)
    check_port(opts.port)
    check_mtu(opts.mtu)
    parse_duration(opts.token_ttl)
    if opts.token_uses is not None and opts.token_uses < 1:
        raise UsageError(f"--uses {opts.token_uses} must be at least 1", "leave it out for unlimited uses until expiry")
    ipam.parse_cidr(opts.cidr)
    if opts.endpoint:
        _endpoint(opts.endpoint, opts.port)


def _endpoint(host: str, port: int) -> str:
    try:
        return parse_endpoint(host, default_port=port)
    except ValueError as exc:
        raise UsageError(f"--endpoint {host!r} is not HOST or HOST:PORT ({exc})",
                         "e.g. --endpoint 203.0.113.1 or --endpoint vpn.example.com:51820") from None


def plan_network(opts: InitOptions, routes: list[tuple[str, str]], fallback_host: str | None,
                 public_key: str, fingerprint: str) -> Network:
    """Validate init options against the machine's routes and return the Network (pure)."""
    check_init_options(opts)
    net = ipam.parse_cidr(opts.cidr)
    ipam.check_overlap(net, [(d, dev) for d, dev in routes if dev != opts.interface])
    host = opts.endpoint or fallback_host
    if not host:
        raise UsageError("no --endpoint given and this machine has no default route to guess one from",
                         "pass the address nodes reach this machine at, e.g. --endpoint 203.0.113.1")
    endpoint = _endpoint(host, opts.port)
    return Network(name=opts.name, cidr=str(net), interface=opts.interface, listen_port=opts.port, mtu=opts.mtu,
                   coordinator_ip=str(ipam.coordinator_address(net)), coordinator_public_key=public_key,
                   endpoints=(endpoint,), fingerprint=fingerprint, api_port=opts.port + 1)


def init(opts: InitOptions, state: StateDir, start: bool = True) -> InitResult:
    """Create the network: state, keys, certificate, interface, daemon, first token.

    Computes everything first, then applies; if any step fails, what was applied is undone
    (interface removed, state files deleted) before the error propagates.
    """
    if state.exists:
        role = state.read_json("member.json").get("role")
        raise StateError(f"{state.path} already holds a meshrun {role}",
                         "start it with `meshrun up`, or remove it with `meshrun down --purge` first")
    # Bad options are reported before missing privileges: the user fixes one thing at a time.
    check_init_options(opts)
    wg.require_admin()
    wg.require_tools("ip", "wg")
    private_key = keys.generate_private_key()
    cert_pem, tls_key_pem = keys.generate_tls_identity(f"meshrun-{opts.name}")
    fallback = None if opts.endpoint else wg.default_route_address()
    network = plan_network(opts, wg.local_routes(), fallback, keys.public_key(private_key),
                           keys.cert_fingerprint(cert_pem))
    if wg.interface_exists(network.interface):
        raise MeshrunError(f"network interface {network.interface} already exists",
                           "run `meshrun down` if it is a leftover of meshrun, or pick another --interface")
    ttl = parse_duration(opts.token_ttl)

    created_dir = state.create()
    undo: list = []
    try:
        state.write("private.key", private_key + "\n", secret=True)
        undo.append(lambda: state.remove("private.key"))
        state.write("tls.key", tls_key_pem, secret=True)
        state.write("tls.crt", cert_pem)
        undo.append(lambda: state.remove("tls.key", "tls.crt"))
        db = CoordinatorDB.create(state / "coordinator.db")
        undo.append(lambda: state.remove("coordinator.db", "coordinator.db-wal", "coordinator.db-shm"))
        db.set_meta(network=json.dumps(network.to_dict()))
        db.add_coordinator("coordinator", network.coordinator_public_key, network.coordinator_ip)
        tok = new_token(network.name, network.endpoints, network.fingerprint)
        db.add_token(tok.token_id, tok.secret, ttl, opts.token_uses)
        db.close()
        backend, pid = bring_up(state, network, network.coordinator_ip)
        undo.append(lambda: wg.delete_interface(network.interface, pid))
        state.write_json("member.json", {"role": "coordinator", "name": "coordinator", "network": network.to_dict(),
                                         "overlay_ip": network.coordinator_ip, "backend": backend, "wg_pid": pid})
        undo.append(lambda: state.remove("member.json"))
        daemon_pid = daemon.spawn(state) if start else None
    except BaseException:
        for step in reversed(undo):
            with contextlib.suppress(Exception):
                step()
        state.remove(f"{network.interface}.conf", "daemon.log", "daemon.error", "daemon.pid", "daemon.lock")
        if created_dir:
            shutil.rmtree(state.path, ignore_errors=True)
        raise
    return InitResult(network, tok.encode(), backend, state.path, daemon_pid)


def bring_up(state: StateDir, network: Network, address: str, mtu: int | None = None) -> tuple[str, int | None]:
    """Create and configure the interface from state; returns (backend, wireguard-go pid)."""
    backend, pid = wg.create_interface(network.interface, state / "wireguard-go.log")
    try:
        wg.configure(network.interface, state / "private.key", network.listen_port,
                     f"{address}/{network.prefixlen}", mtu or network.mtu)
        if pid:
            try:
                log.debug("wireguard-go socket buffers (rcv, snd): %s", wg.widen_socket_buffers(pid))
            except OSError as exc:
                log.warning("could not widen wireguard-go's UDP socket buffers (%s): at high rates it may "
                            "drop datagrams (inner TCP retransmits); kernel WireGuard and wireguard-go after "
                            "0.0.20230223 do not need this", exc)
    except BaseException:
        with contextlib.suppress(Exception):
            wg.delete_interface(network.interface, pid)
        raise
    return backend, pid


# --------------------------------------------------------------------------- tokens & members

def _open_db(state: StateDir) -> tuple[CoordinatorDB, Network]:
    if not state.exists:
        raise StateError(f"no meshrun state in {state.path}", "run `meshrun init` first, or pass --state-dir")
    if state.read_json("member.json").get("role") != "coordinator":
        raise StateError(f"{state.path} belongs to a node, not the coordinator",
                         "run this command on the coordinator")
    db = CoordinatorDB(state / "coordinator.db")
    try:
        network = Network.from_dict(json.loads(db.meta("network") or "null"))
    except (ValueError, TypeError) as exc:
        raise StateError(f"{state / 'coordinator.db'} holds a corrupt network description ({exc})",
                         "restore the state directory from a backup") from None
    return db, network


def create_token(state: StateDir, ttl: str = DEFAULT_TTL, uses: int | None = None) -> str:
    """Make a new join token and return its string (the only time the secret is shown)."""
    seconds = parse_duration(ttl)
    if uses is not None and uses < 1:
        raise UsageError(f"--uses {uses} must be at least 1", "leave it out for unlimited uses until expiry")
    db, network = _open_db(state)
    tok = new_token(network.name, network.endpoints, network.fingerprint)
    db.add_token(tok.token_id, tok.secret, seconds, uses)
    return tok.encode()


def list_tokens(state: StateDir) -> list[dict]:
    db, _ = _open_db(state)
    now = time.time()
    return [t.to_dict(now) for t in db.tokens()]


def revoke_token(state: StateDir, token_or_id: str) -> str:
    """Revoke by token string or id; returns the id. Joins already made stay members."""
    token_id = parse_token(token_or_id).token_id if looks_like_token(token_or_id) else token_or_id.strip()
    db, _ = _open_db(state)
    if not db.revoke_token(token_id):
        raise UsageError(f"there is no token with id {token_id!r}", "see the ids with `meshrun token list`")
    return token_id


def remove_member(state: StateDir, name: str) -> Member:
    """Revoke a node: every peer drops its key on the next sync; its address is never reused."""
    db, _ = _open_db(state)
    m = db.remove_member(name)
    if m is None:
        names = ", ".join(x.name for x in db.members() if not x.is_coordinator) or "none"
        raise UsageError(f"there is no node named {name!r}", f"members are: {names}")
    return m


def members(state: StateDir) -> tuple[Network, list[Member]]:
    db, network = _open_db(state)
    return network, db.members()


# --------------------------------------------------------------------------- the service

class RateLimiter:
    """Token bucket per source address: `burst` attempts, refilled at `per_s` per second."""

    def __init__(self, burst: int = 10, per_s: float = 0.5) -> None:
        self.burst, self.per_s = burst, per_s
        self._b: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def allow(self, key: str, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        with self._lock:
            level, last = self._b.get(key, (float(self.burst), now))
            level = min(self.burst, level + (now - last) * self.per_s)
            ok = level >= 1
            self._b[key] = (level - 1 if ok else level, now)
            if len(self._b) > 10000:  # bound memory under a spray of source addresses
                self._b = {k: v for k, v in self._b.items() if now - v[1] < 60}
            return ok


class CoordinatorService:
    """The coordinator daemon. `run()` blocks until SIGTERM/SIGINT."""

    def __init__(self, state: StateDir) -> None:
        self.state = state
        self.db, self.network = _open_db(state)
        self.member = state.read_json("member.json")
        self.iface = self.network.interface
        self.cond = threading.Condition()
        self.path_changes = 0
        self.version = self.db.version()
        self.reports: dict[str, dict[str, int]] = {}   # node name -> {peer key: latest handshake}
        self.pairs: dict[tuple[str, str], paths.PairState] = self._load_pairs()
        self._payload_cache: tuple[int, list] | None = None
        self.limiter = RateLimiter()
        self.stop_event = threading.Event()
        self.apply_lock = threading.Lock()
        self.servers: list[JSONServer] = []
        self.rdzv_store = None

    # lifecycle -------------------------------------------------------------
    def run(self) -> None:
        lock_fd = daemon.hold_lock(self.state)
        try:
            self._ensure_interface()
            wg.enable_forwarding(self.iface)   # relayed pairs are forwarded wg -> wg here
            self.apply_peers()
            tls = server_tls_context(str(self.state / "tls.crt"), str(self.state / "tls.key"))
            self.servers.append(JSONServer(("0.0.0.0", self.network.listen_port), self.handle_public, tls))
            self.servers.append(JSONServer((self.network.coordinator_ip, self.network.api_port),
                                           self.handle_overlay, device=self.iface))
        except MeshrunError as exc:
            daemon.record_fatal(self.state, exc)
            raise
        except OSError as exc:
            err = MeshrunError(f"cannot listen on TCP port {self.network.listen_port} or {self.network.api_port}: "
                               f"{exc.strerror}", "stop whatever uses that port, or init with another --port")
            daemon.record_fatal(self.state, err)
            raise err from None
        for s in self.servers:
            s.start(f"http-{s.server_address}")
        signal.signal(signal.SIGTERM, lambda *_: self.stop_event.set())
        signal.signal(signal.SIGINT, lambda *_: self.stop_event.set())
        threading.Thread(target=self._host_rendezvous, name="rdzv", daemon=True).start()
        daemon.mark_ready(self.state)
        log.info("coordinator of %s up: enrolment on :%d/tcp, overlay API on %s:%d", self.network.name,
                 self.network.listen_port, self.network.coordinator_ip, self.network.api_port)
        try:
            while not self.stop_event.wait(OBSERVE_INTERVAL):
                self.tick()
        finally:
            for s in self.servers:
                s.shutdown()
                s.server_close()
            with self.cond:
                self.cond.notify_all()
            self.state.remove("daemon.pid", "daemon.ready")
            os.close(lock_fd)
        log.info("coordinator stopped (the interface stays up; `meshrun down` removes it)")

    def _ensure_interface(self) -> None:
        if wg.interface_exists(self.iface):
            return
        log.info("interface %s is missing (reboot?); recreating it from state", self.iface)
        backend, pid = bring_up(self.state, self.network, self.network.coordinator_ip)
        self.state.write_json("member.json", dict(self.member, backend=backend, wg_pid=pid))

    def _host_rendezvous(self) -> None:
        # The job's c10d store lives here, on the overlay IP, so it outlives any worker and
        # the coordinator need not train. Imported lazily: torch is slow to import.
        try:
            from torch.distributed import TCPStore
            self.rdzv_store = TCPStore(self.network.coordinator_ip, self.network.rdzv_port, is_master=True,
                                       wait_for_workers=False, multi_tenant=True)
            log.info("rendezvous store on %s:%d", self.network.coordinator_ip, self.network.rdzv_port)
        except Exception as exc:  # training is unavailable, the mesh still works
            log.warning("cannot host the rendezvous store on %s:%d: %s", self.network.coordinator_ip,
                        self.network.rdzv_port, exc)

    def tick(self) -> None:
        """One observation round: WireGuard's endpoints into the DB, pair paths, peers onto the interface."""
        try:
            _, current = wg.show(self.iface)
        except MeshrunError as exc:
            log.warning("cannot read %s: %s", self.iface, exc)
            return
        changed = self.db.observe({p.public_key: (p.endpoint, p.latest_handshake) for p in current})
        if self.update_pairs(time.time()):
            self.path_changes += 1
        v = self.db.version() + self.path_changes
        if changed or v != self.version or self.db.recently_removed(REMOVED_GRACE_S + 5):
            self.apply_peers(current)
            with self.cond:
                self.version = v
                self.cond.notify_all()

    # pair paths -------------------------------------------------------------
    def _load_pairs(self) -> dict[tuple[str, str], paths.PairState]:
        """Pair states survive a coordinator restart (paths.json), so working pairs are not re-probed."""
        if not (self.state / "paths.json").exists():
            return {}
        try:
            data = self.state.read_json("paths.json")
            return {tuple(k.split("|", 1)): paths.PairState(v["mode"], float(v["since"]), bool(v["verified"]))
                    for k, v in data.get("pairs", {}).items()}
        except (StateError, KeyError, ValueError, TypeError) as exc:
            log.warning("ignoring unreadable paths.json (%s); pairs are probed again", exc)
            return {}

    def pair_handshake(self, a: Member, b: Member) -> int:
        """The newest handshake between a and b that either of them reported."""
        return max(self.reports.get(a.name, {}).get(b.public_key, 0),
                   self.reports.get(b.name, {}).get(a.public_key, 0))

    def update_pairs(self, now: float) -> bool:
        """Advance every pair's path state; True if any mode changed (nodes must be told)."""
        # A pair is judged once both nodes have an observed endpoint and have reported their
        # candidates (first sync): only then can "same site" be told apart from "elsewhere".
        nodes = [m for m in self.db.members() if not m.is_coordinator and m.endpoint and m.candidates]
        changed = False
        new: dict[tuple[str, str], paths.PairState] = {}
        for i, a in enumerate(nodes):
            for b in nodes[i + 1:]:
                key = paths.pair_key(a.name, b.name)
                old = self.pairs.get(key)
                hs = self.pair_handshake(a, b)
                if old is None:
                    st = paths.initial(a, b, hs, now)
                    changed = True
                else:
                    st = paths.step(old, a, b, hs, now)
                    if st.mode != old.mode:
                        log.info("path %s <-> %s: %s -> %s", a.name, b.name, old.mode, st.mode)
                        changed = True
                new[key] = st
        if new != self.pairs:
            self.pairs = new
            self.state.write_json("paths.json", {"pairs": {
                f"{a}|{b}": {"mode": st.mode, "since": st.since, "verified": st.verified}
                for (a, b), st in sorted(new.items())}})
        return changed

    def apply_peers(self, current=None) -> None:
        with self.apply_lock:
            if current is None:
                _, current = wg.show(self.iface)
            d = peers.diff(current, self.desired_peers(), time.time())
            if d:
                log.info("peers: +%d ~%d -%d", len(d.add), len(d.update), len(d.remove))
                wg.apply(self.iface, d)
                self._write_conf()

    def desired_peers(self) -> list[peers.PeerSpec]:
        """Every member, plus members removed in the last REMOVED_GRACE_S: the coordinator stays
        reachable for a moment so the removed node's pending long-poll gets its 410 and its agent
        takes the interface down. Other nodes drop a removed member at once."""
        return peers.desired_for_coordinator(self.db.members() + self.db.recently_removed(REMOVED_GRACE_S))

    def _write_conf(self) -> None:
        specs = self.desired_peers()
        key = self.state.read("private.key").decode().strip()
        text = render_quick(key, f"{self.network.coordinator_ip}/{self.network.prefixlen}",
                            self.network.listen_port, self.network.mtu, specs,
                            comment=f"meshrun network {self.network.name} (coordinator); managed by meshrun")
        self.state.write(f"{self.iface}.conf", text, secret=True)

    def members_payload(self, caller: Member | None = None) -> list[dict]:
        """The member list as `caller` should see it: per peer the endpoint to dial and the path.

        The base list is built once per database version (with 1000 members, building it per
        request was most of the coordinator's CPU); per caller only pair overrides are copied.
        """
        v = self.db.version()
        if self._payload_cache is None or self._payload_cache[0] != v:
            base = []
            for m in self.db.members():
                d = m.to_dict()
                if m.is_coordinator:
                    d["endpoint"] = self.network.endpoints[0]
                base.append((m, d))
            self._payload_cache = (v, base)
        out = []
        for m, d in self._payload_cache[1]:
            st = None
            if caller is not None and not m.is_coordinator and m.name != caller.name and not caller.is_coordinator:
                st = self.pairs.get(paths.pair_key(caller.name, m.name))
            out.append(dict(d, path=st.mode, endpoint=paths.endpoint_for(st.mode, m)) if st is not None else d)
        return out

    # enrolment API (public, TLS) ---------------------------------------------
    def handle_public(self, req: Request) -> Response:
        if req.method == "POST" and req.path == "/v1/join":
            if not self.limiter.allow(req.client_ip):
                return Response.error(429, CoordinatorError(
                    f"too many join attempts from {req.client_ip}", "wait a minute and try again"))
            return self.join(req)
        if req.method == "GET" and req.path == "/v1/hello":
            return Response(200, {"network": self.network.name})
        return Response.error(404, f"no such endpoint {req.method} {req.path}")

    def join(self, req: Request) -> Response:
        b = req.body if isinstance(req.body, dict) else {}
        try:
            token_id, secret_b64 = str(b["token_id"]), str(b["secret"])
            secret = base64.urlsafe_b64decode(secret_b64 + "=" * (-len(secret_b64) % 4))
            name = check_name(str(b["name"]))
            public_key = b["public_key"]
            if not keys.is_public_key(public_key):
                raise ValueError("public_key is not a canonical WireGuard key")
            network_name = str(b.get("network", ""))
            candidates = [parse_endpoint(str(c)) for c in b.get("candidates", [])][:16]
        except (KeyError, ValueError, TypeError, binascii.Error):
            return Response.error(400, UsageError("malformed join request", "use the meshrun client to join"))
        if network_name != self.network.name:
            return Response.error(403, TokenError(
                f"this token is for network {network_name!r} but this coordinator runs {self.network.name!r}",
                "use a token created on this coordinator"))
        if public_key == self.network.coordinator_public_key:
            return Response.error(400, UsageError("the node presented the coordinator's own key", "join from a node"))
        member, created = self.db.enrol(token_id, secret, name, public_key, candidates, self.network.cidr)
        log.info("%s %s at %s (from %s)", "enrolled" if created else "re-enrolled", name, member.overlay_ip,
                 req.client_ip)
        self.apply_peers()   # so the node's first handshake is answered
        self.tick()
        return Response(200, {"member": member.to_dict(), "network": self.network.to_dict(),
                              "members": self.members_payload(member)})

    # overlay API (WireGuard-authenticated) ------------------------------------
    def handle_overlay(self, req: Request) -> Response:
        caller = self.db.member_by_ip(req.client_ip)
        if caller is None:
            if self.db.is_removed_ip(req.client_ip):
                return Response.error(410, StateError("this node was removed from the network",
                                                      "ask the operator for a new token and join again"))
            return Response.error(403, f"{req.client_ip} is not a member of this network")
        if req.method == "POST" and req.path == "/v1/sync":
            return self.sync(caller, req.body if isinstance(req.body, dict) else {})
        if req.method == "GET" and req.path == "/v1/members":
            return Response(200, {"network": self.network.to_dict(), "members": self.members_payload(caller)})
        return Response.error(404, f"no such endpoint {req.method} {req.path}")

    def sync(self, caller: Member, body: dict) -> Response:
        """Heartbeat in, member list out; waits (long-poll) while nothing changed.

        The heartbeat's `peers` is {peer public key: latest handshake} for the peers whose
        handshake changed since the agent's last report (the first report after either side
        restarted is complete: the answer asks for it with "report": "full"). An answer to a
        long-poll that timed out without a change is just {"version", "unchanged": true}.
        """
        try:
            known = int(body.get("version", 0))
            wait = min(max(float(body.get("wait", 0)), 0.0), SYNC_WAIT_MAX)
            candidates = [parse_endpoint(str(c)) for c in body.get("candidates", [])][:16]
            report = body.get("peers", {})
            if not isinstance(report, dict) or len(report) > 100_000:
                raise ValueError("peers must be an object")
            delta = {str(k): int(v["handshake"] if isinstance(v, dict) else v) for k, v in report.items()}
        except (ValueError, TypeError, KeyError, OverflowError):
            return Response.error(400, UsageError("malformed sync request", "use the meshrun agent"))
        first = caller.name not in self.reports
        self.db.heartbeat(caller.overlay_ip, candidates, touch=first)
        self.reports.setdefault(caller.name, {}).update(delta)
        deadline = time.monotonic() + wait
        with self.cond:
            while self.version == known and not self.stop_event.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cond.wait(left)
            version = self.version
        if self.db.member_by_ip(caller.overlay_ip) is None:   # removed while it waited
            return Response.error(410, StateError("this node was removed from the network",
                                                  "ask the operator for a new token and join again"))
        extra = {"report": "full"} if first and not body.get("full") else {}
        if version == known:
            return Response(200, {"version": version, "unchanged": True, **extra})
        return Response(200, {"version": version, "network": self.network.to_dict(),
                              "members": self.members_payload(caller), **extra})


def is_overlay_ip(network: Network, ip: str) -> bool:
    return ipaddress.ip_address(ip) in ipaddress.ip_network(network.cidr)
