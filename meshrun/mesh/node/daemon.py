"""The node agent: keeps this node's peers in sync with the coordinator, and serves the job API.

The agent long-polls POST /v1/sync on a coordinator's overlay IP (with several coordinators, the one
that last answered; one that does not answer is left for the next at once): the coordinator answers
at once when the member list changed since the version the agent holds, else after up to
25 s; the answer is the full list or only what changed since that version (a delta). Each
request carries the node's heartbeat (its candidate addresses and its view of
its peers). When the coordinator is unreachable the agent keeps the tunnels it has and
retries with backoff; the data path never depends on the coordinator being up.
"""

from __future__ import annotations

import concurrent.futures
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence

from meshrun.core import lanpath, memberlist, peers, relays, tunnels
from meshrun.core.model import Member, Network
from meshrun.errors import CoordinatorError, MeshrunError, StateError
from meshrun.mesh import iface, member, process
from meshrun.mesh.node.jumbo import CHECK_S as JUMBO_CHECK_S
from meshrun.mesh.node.jumbo import JumboPairs
from meshrun.mesh.node.lan import LanPaths
from meshrun.mesh.node.tunnels import Tunnels
from meshrun.mesh.process import Extension, ExtensionFactory
from meshrun.system.files.statedir import StateDir
from meshrun.system.kernel import net
from meshrun.system.kernel.device import Device
from meshrun.system.sockets import probe as probe_mod
from meshrun.system.sockets import transport, udprelay

log = logging.getLogger("meshrun.mesh.node.daemon")

SYNC_WAIT = 20.0
FAST_WAIT = 2.0  # long-poll while a path is unproven
SYNC_GRACE_S = 15.0  # a sync call's timeout beyond its long-poll wait: a coordinator gone is noticed after both
PROBE_WINDOW_S = 10.0  # = paths.ATTEMPT_S: how long a new path gets to handshake
RELAY_CHECK_S = 1.0  # every relayed peer is tried through its relay this often (one TCP SYN)
RELAY_FAILS = 3  # consecutive misses before the relay is reported down (a new one within 10 s)
# A relay just assigned gets this long before its misses count: a pair with no session yet needs a handshake
# through it, and WireGuard tries one again only 5 s (REKEY_TIMEOUT) after an attempt that got no answer. A
# pair with a session (a relay's failover) passes its probes at once, so this does not slow a failover.
RELAY_GRACE_S = 6.0
RTT_EVERY_S = 30.0  # round trips to the possible relays measured this often
# With several coordinators the one this agent syncs with is tried this often (a TCP handshake to its API
# port), and left for the next after COORDINATOR_FAILS misses in a row: a machine that is gone answers
# nothing, and a long-poll to it would only end at its timeout (35 s).
COORDINATOR_CHECK_S = 2.0
COORDINATOR_FAILS = 3

# (method, path, body, timeout) -> the coordinator's JSON answer
CoordinatorCall = Callable[[str, str, dict, float], dict]


def apply_members(
    device: Device,
    state: StateDir,
    rec: dict,
    network: Network,
    members: list[Member],
    recreate: frozenset[str] = frozenset(),
    hold_windows: dict[tuple[str, str, str], float] | None = None,
    jumbo: tuple[int, dict[str, int]] = (0, {}),
) -> tuple[frozenset[str], dict[tuple[str, str, str], float]]:
    """Make the interface's peers match `members` (minimal diff) and rewrite the wg-quick file.

    Peers in `recreate` changed path: they are re-created so a fresh handshake proves the path.
    `jumbo` (JumboPairs.plan): the interface MTU to raise to (0: none) and the proven jumbo pairs.
    With `hold_windows` (see `peers.handshake_holds`), peers whose handshake this node must leave
    to the other end for now get no keepalive. Returns (held peer keys, the new hold windows):
    apply again when HOLD_S is up.
    """
    current = device.peers()
    hold: frozenset[str] = frozenset()
    windows: dict[tuple[str, str, str], float] = {}
    if hold_windows is not None:
        hold, windows = peers.handshake_holds(
            rec["public_key"],
            members,
            {p.public_key: p.latest_handshake for p in current},
            hold_windows,
            time.monotonic(),
            recreate,
        )
    desired = peers.desired_for_node(rec["public_key"], members, hold)
    try:
        peers.check_own_addresses(desired, members)
    except ValueError as exc:
        raise StateError(
            f"refusing a peer set that breaks the overlay's address invariant: {exc}",
            "this is a bug in meshrun; please report it",
        ) from None
    mtu = int(rec.get("mtu") or network.mtu)
    iface_mtu, routes = peers.pair_mtus(rec["public_key"], mtu, members, jumbo[1], jumbo[0])
    d = iface.sync_peers(
        device,
        state,
        network,
        desired,
        address=rec["overlay_ip"],
        mtu=mtu,
        recreate=recreate,
        current=current,
        route_mtus=routes,
        iface_mtu=iface_mtu,
        comment=f"meshrun network {network.name}, node {rec['name']}; managed by meshrun",
    )
    # WireGuard handshakes only when it has something to send: a datagram to each new
    # direct peer starts the handshake now, so the new path is proven (or not) quickly.
    # Only peers with an endpoint: an attempt without one still counts as "sent" for
    # wireguard-go, which then waits REKEY_TIMEOUT (5 s) before it tries again.
    # Held peers (no keepalive yet) are left alone: the other end starts their handshake.
    device.nudge(
        [
            ip.split("/")[0]
            for spec in (*d.add, *d.update)
            if spec.endpoint and spec.keepalive
            for ip in spec.allowed_ips[:1]
        ]
    )
    return hold, windows


class AgentService:
    """The node daemon: keeps peers in sync; `run()` blocks until SIGTERM/SIGINT.

    `device` is the WireGuard interface (a FakeDevice in tests), `call` reaches the coordinator's
    overlay API (in tests: its handler, in-process), `addresses` lists this machine's addresses,
    `extensions` start what runs beside the mesh once the interface is up (the job API), `probe(overlay
    IP)` is one round trip to a member over the overlay in seconds, None when it did not answer (a TCP
    handshake to its API port: relay health and the round trips the relay choice uses), `make_relay` makes
    the forwarder of the pairs this node relays (a FakeRelay in tests), `lan` is the site LAN path (one on a
    FakeLanLink in tests), `extra_tunnels` the tunnels beside the interface (one on a FakeTunnelLink in tests).
    """

    def __init__(
        self,
        state: StateDir,
        device: Device | None = None,
        call: CoordinatorCall | None = None,
        addresses: Callable[[str], list[str]] = net.local_addresses,
        extensions: Sequence[ExtensionFactory] = (),
        probe: Callable[[str], float | None] | None = None,
        make_relay: Callable[[], udprelay.UdpRelay | udprelay.FakeRelay] | None = None,
        lan: LanPaths | None = None,
        jumbo: JumboPairs | None = None,
        extra_tunnels: Tunnels | None = None,
    ) -> None:
        self.state = state
        self.rec, self.network = member.load(state)
        self.device = device or iface.device_for(state, self.network, self.rec)
        self.session: transport.Session | None = None
        self.overlay_keys = member.OverlayKeys(state)  # the coordinators check what this agent sends with them
        self.call = call or self._call_coordinator
        # A call beside the long-poll (which holds the session): a relay found down is reported at once.
        self.call_now = call or self._call_once
        self.probe = probe or (lambda ip: probe_mod.tcp_rtt(ip, self.network.api_port, timeout=1.0))
        # The pairs this node relays, and their relay.
        self.relaying = udprelay.Relaying(make_relay, self.network.interface)
        self.lan = lan or LanPaths(state, self.network, self.rec)  # the site LAN path (trusted sites)
        self.jumbo = jumbo or JumboPairs(state, self.network, self.rec)  # same-site tunnels with the LAN's MTU
        # Several tunnels per same-site pair (`meshrun join --tunnels K`; one: none of this).
        self.tunnels = extra_tunnels or Tunnels(state, self.network, self.rec)
        self.rtt: dict[str, float] = {}  # {peer key: rtt bucket} measured, not yet acknowledged
        self.rtt_told: dict[str, float] = {}  # {peer key: rtt bucket} the coordinator acknowledged
        self.misses: dict[str, int] = {}  # relayed peer key -> consecutive failed tries through its relay
        self.relay_since: dict[str, tuple[tuple[str, int], float]] = {}  # peer key -> ((relay, port), since)
        self._synced_state: dict | None = None  # sync.json as last written
        self.addresses = addresses
        self.stop_event = threading.Event()
        self.version, self.members = member.load_members(state)
        self.ready = False
        self.removed = False
        self.path_changed_at = 0.0
        self.told: dict[str, bool] = {}  # {peer key: fresh} as the coordinator acknowledged it
        self.full_report = True
        self.hold_windows: dict[tuple[str, str, str], float] = {}
        self.apply_lock = threading.Lock()  # the sync loop and the hold-release timer both apply
        self.release_timer: threading.Timer | None = None
        self.extensions = list(extensions)
        self.running: list[Extension] = []
        # The coordinator this agent syncs with now: the one it last synced with (sync.json), else the one that
        # enrolled it, else the network's first.
        last = state.read_json("sync.json").get("coordinator") if (state / "sync.json").exists() else None
        self.coordinator_ip = str(last or self.rec.get("sync_with") or self.network.coordinator_ip)
        self.coordinator_misses = 0  # consecutive probes it did not answer
        self.role_changed = False  # run() returned because this node became a coordinator (meshrun.mesh.run)

    def coordinator_ips(self) -> list[str]:
        """Every coordinator's overlay address, the one this agent syncs with first."""
        ips = [m.overlay_ip for m in self.members if m.is_coordinator] or [self.network.coordinator_ip]
        return sorted(ips, key=lambda ip: (ip != self.coordinator_ip, ips.index(ip)))

    def _failover(self, exc: CoordinatorError) -> None:
        """The coordinator did not answer (no status: nothing came back): the next one, at once."""
        ips = self.coordinator_ips()
        if exc.status or len(ips) < 2:
            return
        nxt = ips[1]
        log.warning("coordinator %s does not answer (%s); syncing with %s", self.coordinator_ip, exc.message, nxt)
        self.coordinator_ip = nxt
        if self.session is not None:
            self.session.close()
            self.session = None

    def _key_for(self, coordinator_ip: str) -> bytes | None:
        """The overlay key this agent shares with the coordinator at `coordinator_ip` (None: one it knows not)."""
        return self.overlay_keys.at(coordinator_ip, self.members, self.network)

    def _call_once(self, method: str, path: str, body: dict, timeout: float) -> dict:
        ips = self.coordinator_ips()
        for ip in ips:
            try:
                key = self._key_for(ip)
                return transport.call(ip, self.network.api_port, method, path, body, timeout=timeout, key=key)
            except CoordinatorError as exc:
                if exc.status or ip == ips[-1]:
                    raise
        raise AssertionError("unreachable")

    def _call_coordinator(self, method: str, path: str, body: dict, timeout: float) -> dict:
        # One kept-alive connection for every long-poll (the overlay API keeps it open between syncs).
        if self.session is None or self.session.host != self.coordinator_ip:
            if self.session is not None:
                self.session.close()
            self.session = transport.Session(self.coordinator_ip, self.network.api_port)
        session = self.session
        try:
            return session.call(method, path, body, timeout=timeout, key=self._key_for(session.host))
        except CoordinatorError as exc:
            if session.host == self.coordinator_ip:  # else the probe thread moved on already (and ended this call)
                self._failover(exc)
            raise

    def run(self) -> None:
        with process.running(self.state):
            self._ensure_interface()
            self.tunnels.start()  # before the listeners: they bind to the address alone beside tunnels
            signal.signal(signal.SIGTERM, lambda *_: self.stop_event.set())
            signal.signal(signal.SIGINT, lambda *_: self.stop_event.set())
            for start in self.extensions:
                try:
                    self.running.append(start(self.state, self.network, self.rec))
                except MeshrunError as exc:
                    log.warning("%s", exc)
            # Beside the sync loop: relayed peers tried every second (a dead relay is reported within
            # seconds), round trips to possible relays measured every half minute (slow: one at a time).
            for step, every in (
                (self.check_relays, RELAY_CHECK_S),
                (self.measure_rtt, RTT_EVERY_S),
                (self.check_coordinator, COORDINATOR_CHECK_S),
                (self.lan.check, lanpath.PROBE_EVERY_S),
                (self.check_jumbo, JUMBO_CHECK_S),
                *([(self.tunnels.check, tunnels.PROBE_EVERY_S)] if self.tunnels.enabled else []),
            ):
                threading.Thread(target=self._probe_loop, args=(step, every), name=step.__name__, daemon=True).start()
            try:
                self._loop()
            finally:
                for ext in self.running:
                    ext.close()
                self.relaying.close()
                self.lan.close()
                self.tunnels.close()
                if self.session is not None:
                    self.session.close()
        # `meshrun coordinator add` made this node a coordinator (its job API rewrote member.json and stopped us).
        self.role_changed = self.state.read_json("member.json").get("role") != "node"
        log.info("agent stopped%s", " (this node is a coordinator now)" if self.role_changed else "")

    def _sync_state(self, failing_since: float | None, error: str = "", retry_s: float = 0.0) -> None:
        """What `meshrun status` and `doctor` say of the coordinator (sync.json): written on a change only."""
        state = {"failing_since": failing_since, "error": error, "retry_s": retry_s} if failing_since else {}
        state["coordinator"] = self.coordinator_ip  # the one it syncs with (several: `meshrun status` names it)
        if state != self._synced_state:
            self._synced_state = state
            try:
                self.state.write_json("sync.json", state)
            except MeshrunError as exc:
                log.warning("could not record the sync state: %s", exc)

    def _loop(self) -> None:
        backoff = 0.5
        failing_since: float | None = None
        while not self.stop_event.is_set():
            try:
                self.sync_once(wait=self.wait_time() if self.ready else 0)
                backoff = 0.5
                if failing_since is not None:
                    log.info("the coordinator answers again after %.0f s", time.time() - failing_since)
                failing_since = None
                self._sync_state(None)
            except MeshrunError as exc:
                if exc.status == 410:
                    log.warning("this node was removed from the network; taking the interface down")
                    self.removed = True
                    self._cleanup_removed()
                    return
                if not isinstance(exc, CoordinatorError):
                    log.error("sync could not be applied: %s", exc)
                    self.stop_event.wait(2)
                    continue
                log.warning("sync failed: %s (tunnels stay up; retrying in %.1f s)", exc, backoff)
                failing_since = failing_since or time.time()
                # The wait grows to 10 s: recorded once it stops changing, not at every retry.
                self._sync_state(failing_since, str(exc).split(";")[0][:200], min(backoff * 2, 10.0))
                self.stop_event.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    def _ensure_interface(self) -> None:
        if self.device.exists():
            return
        log.info("interface %s is missing (reboot?); recreating it from state", self.network.interface)
        backend = iface.bring_up(self.device, self.state, self.network, self.rec["overlay_ip"], self.rec.get("mtu"))
        self.rec.update(backend=backend, wg_pid=self.device.pid)
        self.state.write_json("member.json", self.rec)
        if self.members:
            apply_members(self.device, self.state, self.rec, self.network, self.members)

    def heartbeat(self, current: list[peers.PeerState]) -> dict:
        """Candidates plus {peer key: latest handshake} for the peers whose liveness the coordinator
        does not know (`peers.handshake_report`; all of them when it asked for a full report), and
        which of those are stale."""
        port = self.network.listen_port
        cands = list(self.rec.get("advertised", [])) + [f"{a}:{port}" for a in self.addresses(self.network.interface)]
        report = peers.handshake_report(
            {p.public_key: p.latest_handshake for p in current}, self.told, self.full_report, time.time()
        )
        return {
            "candidates": cands[:16],
            "peers": report.peers,
            "stale": list(report.stale),
            "relay": bool(self.rec.get("relay", True)),
            "rtt": {k: v for k, v in list(self.rtt.items()) if self.rtt_told.get(k) != v},
            "full": self.full_report,
            "mtu": int(self.rec.get("mtu") or self.network.mtu),
            "site": str(self.rec.get("site") or ""),
            "tunnels": self.tunnels.count,
        }

    def wait_time(self, current: list[peers.PeerState] | None = None) -> float:
        """Long-poll briefly while a path is being probed, so the coordinator hears of the
        handshake (or its absence) quickly; otherwise wait long and cost nothing."""
        if time.time() - self.path_changed_at < 2 * PROBE_WINDOW_S:
            return FAST_WAIT
        try:
            current = self.device.peers() if current is None else current
        except MeshrunError:
            return FAST_WAIT
        relayed = {m.public_key for m in self.members if m.path == "relayed"}
        if any(not p.latest_handshake for p in current if p.public_key not in relayed):
            return FAST_WAIT
        return SYNC_WAIT

    def sync_once(self, wait: float) -> None:
        """One long-poll: report, receive the member list, apply what changed."""
        body = dict(self.heartbeat(self.device.peers()), version=self.version, wait=wait, delta=True)
        answer = self.call("POST", "/v1/sync", body, wait + SYNC_GRACE_S)
        stale = set(body["stale"])
        self.told.update((k, k not in stale) for k in body["peers"])
        self.rtt_told.update(body["rtt"])
        self.full_report = answer.get("report") == "full"
        try:
            version = int(answer["version"])
            if answer.get("unchanged"):  # our member list is current (a long-poll that timed out)
                members = self.members
            elif "members" in answer:  # the full list
                members = [Member.from_dict(m) for m in answer["members"]]
            elif int(answer["since"]) == self.version:  # what changed since the version we hold
                members = memberlist.apply_delta(
                    self.members, [Member.from_dict(m) for m in answer["changed"]], {str(k) for k in answer["removed"]}
                )
            else:  # a delta from elsewhere: ask for the full list next
                log.warning(
                    "ignored a member-list delta since version %s (this node holds %d)", answer["since"], self.version
                )
                self.version = 0
                return
        except (KeyError, ValueError, TypeError) as exc:
            raise CoordinatorError(
                f"malformed sync answer ({exc})", "run the same meshrun version everywhere"
            ) from None
        if not any(m.public_key == self.rec["public_key"] for m in members):
            err = StateError(
                "this node is no longer a member of the network", "ask the operator for a new token", status=410
            )
            raise err
        recreate = peers.to_recreate(self.members, members)
        if recreate:
            self.path_changed_at = time.time()
            for key in recreate:  # the new path is proven by its next handshake: report it
                self.told.pop(key, None)
            log.info(
                "path changed for %s", ", ".join(f"{m.name}->{m.path}" for m in members if m.public_key in recreate)
            )
        # Saved when the list changed, not for a version alone: a node holding an older version with
        # the same list gets the same delta after a restart, and 1000 nodes do not rewrite 1000 files
        # for a change elsewhere.
        if members != self.members:
            member.save_members(self.state, version, members)
        self.version, self.members = version, members
        self._apply(members, recreate)
        self.lan.apply(members)
        self._apply_tunnels()
        if "relaying" in answer:
            self._relay(answer["relaying"])
        if not self.ready:
            self.ready = True
            process.ready()
            log.info(
                "agent of %s up: %s on %s, %d members",
                self.rec["name"],
                self.rec["overlay_ip"],
                self.network.interface,
                len(members),
            )

    def _relay(self, pairs: list) -> None:
        """Forward exactly these pairs' WireGuard datagrams ([[overlay IP, overlay IP, port], ...]), each on its
        port (meshrun.system.sockets.udprelay); this node's own tunnels never carry them."""
        if pairs and not self.rec.get("relay", True):
            log.warning("the coordinator asked this node to relay, but it joined with --no-relay: not relaying")
            pairs = []
        if not self.relaying.apply(pairs, self.members, self.device, self.rec["public_key"]):
            return
        by_ip = {m.overlay_ip: m.name for m in self.members}
        shown = [[by_ip.get(str(a), a), by_ip.get(str(b), b)] for a, b, *_ in pairs]
        log.info("relaying %d pairs: %s", len(shown), ", ".join(f"{a}<->{b}" for a, b in shown[:8]))
        forwarding = self.relaying.relay.mode if self.relaying.relay is not None else None
        self.state.write_json(
            "relaying.json", {"pairs": shown, "ports": [p.port for p in self.relaying.pairs], "forwarding": forwarding}
        )

    def _probe_loop(self, step, every: float) -> None:
        """Run `step` every `every` seconds (from start to start: a slow step does not stretch the
        cadence) until the agent stops (relay checks; round trips)."""
        due = time.monotonic() + every
        while not self.stop_event.wait(max(0.0, due - time.monotonic())):
            due = max(due + every, time.monotonic())
            try:
                step()
            except Exception:  # the agent's job is the sync loop: a probe failure must not end it
                log.exception("%s failed", step.__name__)

    def check_jumbo(self) -> None:
        """Probe the pairs on trial for the LAN's MTU; apply again when one was proven or failed."""
        if self.jumbo.check():
            self._apply(self.members)
            self._apply_tunnels()  # the extra tunnels follow the interface's MTU

    def _apply_tunnels(self) -> None:
        plan = self.lan.plan
        self.tunnels.apply(self.members, self.lan.link.underlay if plan.local_ip and plan.routed else None)

    def check_relays(self) -> list[str]:
        """Try every relayed peer through its relay once; report the ones that missed RELAY_FAILS times in
        a row (the coordinator gives those pairs another relay). Returns the keys reported."""
        members = self.members
        relayed = {m.public_key: m for m in members if m.path == "relayed"}
        self.misses = {k: v for k, v in self.misses.items() if k in relayed}
        now = time.monotonic()
        since = {}
        for key, m in relayed.items():
            have = self.relay_since.get(key)
            since[key] = have if have is not None and have[0] == (m.via, m.via_port) else ((m.via, m.via_port), now)
        self.relay_since = since
        # All at once: a dead relay makes every try wait its whole timeout.
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, max(1, len(relayed)))) as pool:
            answered = dict(zip(relayed, pool.map(lambda m: self.probe(m.overlay_ip), relayed.values())))
        down = []
        for key in relayed:
            if answered[key] is not None:
                self.misses.pop(key, None)
                continue
            if now - since[key][1] < RELAY_GRACE_S:
                continue  # a new relay: its first handshake may need WireGuard's retry
            self.misses[key] = self.misses.get(key, 0) + 1
            if self.misses[key] >= RELAY_FAILS:
                down.append(key)
        if down:
            names = ", ".join(relayed[k].name for k in down)
            log.warning("relayed peers unreachable through their relay: %s; asking for another relay", names)
            try:
                # With the relay each end tried: a report about a relay the pair already left changes nothing.
                via = {k: relayed[k].via for k in down}
                self.call_now("POST", "/v1/relay-down", {"peers": down, "via": via}, 5)
                for key in down:
                    self.misses[key] = 0
            except MeshrunError as exc:
                log.warning("could not report it: %s", exc)
        return down

    def check_coordinator(self) -> bool:
        """With several coordinators: is the one this agent syncs with there? After COORDINATOR_FAILS misses
        the long-poll in flight is ended and the next sync goes to the next coordinator. True if it answered."""
        ips = self.coordinator_ips()
        if len(ips) < 2:
            return True
        ip = ips[0]
        if self.probe(ip) is not None:
            self.coordinator_misses = 0
            return True
        self.coordinator_misses += 1
        if self.coordinator_misses >= COORDINATOR_FAILS and ip == self.coordinator_ip:
            self.coordinator_misses = 0
            log.warning("coordinator %s does not answer; syncing with %s", ip, ips[1])
            self.coordinator_ip = ips[1]
            session = self.session
            if session is not None:
                session.abort()  # the long-poll in flight ends now; the loop retries with the next one
        return False

    def measure_rtt(self) -> None:
        """Round trips to the members this node could be relayed by (relays.probe_targets), median of 3,
        kept as buckets; the next sync reports those that changed."""
        for m in relays.probe_targets(self.rec["public_key"], self.members):
            tries = [self.probe(m.overlay_ip) for _ in range(3)]
            ok = sorted(t for t in tries if t is not None)
            if ok:
                self.rtt[m.public_key] = relays.rtt_bucket(1e3 * ok[len(ok) // 2])

    def _apply(self, members: list[Member], recreate: frozenset[str] = frozenset()) -> None:
        """apply_members with handshake holds; a timer applies again when the holds are up."""
        with self.apply_lock:
            held, self.hold_windows = apply_members(
                self.device,
                self.state,
                self.rec,
                self.network,
                members,
                recreate,
                self.hold_windows,
                self.jumbo.plan(members),
            )
            if held and (self.release_timer is None or not self.release_timer.is_alive()):
                self.release_timer = threading.Timer(peers.HOLD_S + 0.05, self._release_holds)
                self.release_timer.daemon = True
                self.release_timer.start()

    def _release_holds(self) -> None:
        with self.apply_lock:
            self.release_timer = None  # this thread: _apply may need to start the next one
        if self.stop_event.is_set():
            return
        try:
            self._apply(self.members)
        except MeshrunError as exc:  # the next sync applies again
            log.warning("could not release handshake holds: %s", exc)

    def _cleanup_removed(self) -> None:
        self.lan.close()
        self.tunnels.close()
        try:
            self.device.delete()
        except MeshrunError as exc:
            log.warning("could not remove %s: %s", self.network.interface, exc)
        self.rec["removed"] = True
        self.state.write_json("member.json", self.rec)
        self.state.remove("peers.json", f"{self.network.interface}.conf")
