"""The coordinator daemon: its listeners, its once-a-second loop, and the interface it keeps in step.

Two listeners:
- the enrolment API (meshrun.mesh.coordinator.enrolment), TLS on 0.0.0.0:PORT/tcp, pinned by the
  fingerprint in the join token;
- the overlay API (meshrun.mesh.coordinator.overlay) on COORD_OVERLAY_IP:API_PORT, bound to the
  WireGuard device.

The loop (`tick`) reads the device's peers every second: the endpoint WireGuard observes for a
node is its public (server-reflexive) address, which other nodes need; it advances the pair paths
whose inputs changed or whose time came (mesh/coordinator/pairs), publishes a new member-list
version when anything changed (agents receive the delta: mesh/coordinator/roster) and applies the peers.

With several coordinators (meshrun.mesh.coordinator.ha) every one runs this service on the replicated state
in etcd, answers enrolment and sync, and keeps its own interface in step; the one that leads
(meshrun.mesh.coordinator.leader) also observes endpoints, advances the pair paths and bumps versions, while
the others follow its decisions from the store (PairDriver.follow) and forward their agents' reports to it
(meshrun.mesh.coordinator.forward). A change in the store wakes the loop at once.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Sequence

from meshrun.core import keys, peers, relays
from meshrun.core.model import Member, Network
from meshrun.errors import ControlStateError, MeshrunError, NetworkError
from meshrun.mesh import iface, member, process
from meshrun.mesh.coordinator import ha
from meshrun.mesh.coordinator.admin import open_db
from meshrun.mesh.coordinator.enrolment import EnrolmentAPI
from meshrun.mesh.coordinator.forward import Reports
from meshrun.mesh.coordinator.leader import Leadership
from meshrun.mesh.coordinator.overlay import OverlayAPI
from meshrun.mesh.coordinator.pairs import PairDriver
from meshrun.mesh.coordinator.rendezvous import RendezvousService
from meshrun.mesh.coordinator.roster import Roster
from meshrun.mesh.process import ExtensionFactory
from meshrun.system.control import etcdjobs
from meshrun.system.control.etcdjobs import EtcdKV
from meshrun.system.files.statedir import StateDir
from meshrun.system.kernel.device import Device
from meshrun.system.sockets import transport, udprelay
from meshrun.system.sockets.frontdoor import FrontDoor
from meshrun.system.sockets.longpoll import LongPollServer
from meshrun.system.sockets.transport import server_tls_context

log = logging.getLogger("meshrun.mesh.coordinator.daemon")

REMOVED_GRACE_S = 5.0  # a removed node's pending long-poll is answered 410 within this
OBSERVE_INTERVAL = 1.0
BACKLOG_PAUSE = 0.05  # between two slices of a pair backlog: the API threads get the GIL
OVERLAY_MAX_CONNS = 4096  # connections to the overlay API at most (1000 members long-polling fit)
OVERLAY_PER_SOURCE = 8
# A new version wakes every member's long-poll and each comes back at once: at most this often, so a
# join storm costs members a few syncs a second (under the overlay's per-member rate limit), not one per join.
PUBLISH_GAP = 0.25
# The wg-quick file (for an operator; the interface itself is set by `wg set`) is rewritten at most this
# often: rendering a thousand peers costs 25 ms, once per join in a join storm.
QUICK_FILE_GAP = 2.0
ALLOWED_TTL_S = 1.0  # a job's rendezvous members, as read from etcd, are trusted this long
ETCD_CHECK_S = 10.0  # the etcd member's process is looked for this often (several coordinators)


class CoordinatorService:
    """The coordinator daemon. `run()` blocks until SIGTERM/SIGINT; `tick()` is one loop round."""

    def __init__(
        self,
        state: StateDir,
        device: Device | None = None,
        extensions: Sequence[ExtensionFactory] = (),
        db=None,
        forward_with=None,
        guard_etcd=ha.guard_etcd,
        etcd_member: bool = True,
        make_relay=None,
    ) -> None:
        """`db`, `forward_with` (leader's IP, batch -> answer), `guard_etcd` (name, network, IPs), `etcd_member`
        False and `make_relay` are for tests: a replicated state on a fake etcd, the leader's handler in-process,
        no nftables, no etcd process of its own to keep running, a relay that binds no port (udprelay.FakeRelay)."""
        self.etcd_member = etcd_member
        self.guard_etcd = guard_etcd
        self.state = state
        self.member = state.read_json("member.json")
        self.ha = ha.replicated(self.member)
        self.device: Device | None = device
        if db is None:
            if self.ha:
                # Its etcd member runs before the state is read (after a reboot it is started here), on the
                # overlay address: the interface comes first (the network as member.json describes it).
                net = _network_of(self.member)
                # Taken out for good while away (a reboot that outlasted `coordinator remove --force`): no etcd
                # member of a cluster that removed it, no interface, no daemon; the others say so on their
                # public ports, since nothing of the overlay reaches a removed member any more.
                by = ha.removed_by(state, self.member, net) if etcd_member else None
                if by is not None:
                    raise ha.refuse_removed(state, self.member, by)
                self.device = self.device or iface.device_for(state, net, self.member)
                fresh = not self.device.exists()
                self.member = _interface_up(self.device, state, net, str(self.member["overlay_ip"]), self.member)
                if fresh:
                    # An interface without peers reaches no other coordinator, and the state that names them
                    # is in etcd, which needs them: the peers it last knew come back first (a reboot used to
                    # wait here for an etcd that could not be reached, for ever).
                    n = iface.restore_peers(self.device, state, net)
                    log.info("%d peer(s) it last knew back on %s, so etcd can reach the others", n, net.interface)
                ha.ensure_member(state, self.member, net, ha.control_ips(self.member))
            db, _ = open_db(state, follow=self.ha)
        self.db = db
        self.network = _network_from_db(db)
        self.name = str(self.member.get("name") or "coordinator")
        self.ip = str(self.member.get("overlay_ip") or self.network.coordinator_ip)
        self.public_key = str(self.member.get("public_key") or self.network.coordinator_public_key)
        if self.device is None:
            self.device = iface.device_for(state, self.network, self.member)
        self.stop_event = threading.Event()
        self.apply_lock = threading.Lock()
        self.pairs = PairDriver(self.db, state, me=self.name if self.ha else None)
        # One coordinator leads by itself; several elect one (an etcd key with a lease).
        self.leadership = Leadership(self.db.client, self.name) if self.ha else None
        self.leading = not self.ha
        self.restart_as: str | None = None  # the daemon comes back in this role (another coordinator demoted it)
        self.role_changed = False  # run() returned after member.json got another role (meshrun.mesh.run)
        self.registry: tuple = ()  # the coordinators as last applied (guard, etcd endpoints)
        self.etcd_checked = time.monotonic()  # when the etcd member was last looked for (_keep_etcd)
        self.etcd_restart: threading.Thread | None = None
        self.tls = ha.TlsKeeper(state, self.member, self.network) if self.ha and etcd_member else None
        self.forward_with = forward_with
        # The pairs this coordinator relays, and their relay.
        self.relaying = udprelay.Relaying(make_relay, self.network.interface)
        self.reports = Reports(
            self.pairs, lambda: self.leading, self._leader_ip, self._send_forward if self.ha else None
        )
        self.roster = Roster(self.db, self.network, self.pairs)
        self.wake = threading.Event()  # a join asks the loop for a tick now
        self.ticks = threading.Condition()
        self.tick_count = 0
        self.looping = False
        self.interval = OBSERVE_INTERVAL
        self.known = {m.name for m in self.db.members()}
        self.members_version = -1  # the member-list version the pair driver last saw
        self.paths_moved = False  # pair paths changed, not yet published (see tick)
        self.published_at = 0.0  # monotonic time of the last roster.publish
        self.publish_held = False  # a version applied to the interface, held back by PUBLISH_GAP
        self.quick_written_at = 0.0  # monotonic time the wg-quick file was last written
        self.quick_stale = False  # peers changed since; written by a later tick (QUICK_FILE_GAP)
        private = state.read("private.key").decode().strip()
        self.overlay_keys = member.OverlayKeys(state)  # what the overlay API's signed requests are checked with
        self.enrolment = EnrolmentAPI(
            self.db, self.network, self.roster, lambda pub: keys.shared_secret(private, pub), self._enrolled, self.ip
        )
        self.overlay = OverlayAPI(
            self.db,
            self.network,
            self.roster,
            self.reports,
            self.stop_event,
            self.wake.set,
            forward=self._take_forward if self.ha else None,
            demote=self._demote if self.ha else None,
            rendezvous=self._rendezvous().serve if self.ha else None,
            keys=self.overlay_keys,
        )
        self.extensions = list(extensions)
        if self.ha:
            self.db.listeners.append(self.wake.set)  # another coordinator changed the state: look now

    # lifecycle -------------------------------------------------------------
    def run(self) -> None:
        with process.running(self.state):
            try:
                self._ensure_interface()
                self._allow_relayed()  # the pairs the coordinator relays: their datagrams, on their ports
                self.apply_peers()
                tls = server_tls_context(str(self.state / "tls.crt"), str(self.state / "tls.key"))
                self.front = FrontDoor(("0.0.0.0", self.network.listen_port), self.enrolment.handle, tls)
                # Bounded: a long-poll per member and a few more (doctor, status); beyond, closed at once.
                # One event loop holds them all (each agent long-polls over one kept-alive connection,
                # transport.Session); a publish polls the waiting ones.
                self.overlay_server = LongPollServer(
                    (self.ip, self.network.api_port),
                    self.overlay.handle,
                    device=self.network.interface,
                    gate=self.overlay.gate,
                    max_conns=OVERLAY_MAX_CONNS,
                    max_per_source=OVERLAY_PER_SOURCE,
                    inline=True,  # the sync handler holds a lock only briefly (the database's: rarely)
                    # ... but a rendezvous or a forwarded batch may wait on etcd: not on the loop.
                    offload=lambda req: req.path != "/v1/sync",
                )
                self.roster.listeners.append(self.overlay_server.kick)
            except OSError as exc:
                raise NetworkError(
                    f"cannot listen on TCP port {self.network.listen_port} or {self.network.api_port}: {exc.strerror}",
                    "stop whatever uses that port, or init with another --port",
                ) from None
            self.front.start("enrolment")
            self.overlay_server.start("overlay-api")
            self.reports.start()
            signal.signal(signal.SIGTERM, lambda *_: self.stop_event.set())
            signal.signal(signal.SIGINT, lambda *_: self.stop_event.set())
            running = [start(self.state, self.network, self.member) for start in self.extensions]
            process.ready()
            log.info(
                "coordinator %s of %s up: enrolment on :%d/tcp, overlay API on %s:%d%s",
                self.name,
                self.network.name,
                self.network.listen_port,
                self.ip,
                self.network.api_port,
                ", state in etcd" if self.ha else "",
            )
            try:
                self._loop()
            finally:
                for ext in running:
                    ext.close()
                self.front.shutdown()
                self.overlay_server.shutdown()
                self.roster.wake_all()
                self.reports.close()
                self.relaying.close()
                if self.leadership is not None:
                    self.leadership.resign()  # another coordinator leads at once, not after the lease
                if self.ha:
                    self.db.close()
                if self.restart_as == "node":
                    ha.demote(self.state)
                    self.role_changed = True
        log.info("coordinator stopped (the interface stays up; `meshrun down` removes it)")

    def _ensure_interface(self) -> None:
        self.member = _interface_up(self.device, self.state, self.network, self.ip, self.member)

    def _loop(self) -> None:
        """The one thread that ticks: once a second, or at once when a join asks for it. An error in
        one tick is logged and the loop goes on (the daemon also serves enrolment and rendezvous)."""
        self.looping = True
        while not self.stop_event.is_set():
            # Pairs still waiting for their first look (a mass start): the next slice at once.
            pause = BACKLOG_PAUSE if self.pairs.behind else self.interval
            if self.publish_held:
                pause = min(pause, max(0.0, PUBLISH_GAP - (time.monotonic() - self.published_at)))
            self.wake.wait(pause)
            self.wake.clear()
            if self.stop_event.is_set():
                return
            try:
                self.tick()
            except ControlStateError as exc:  # etcd without a majority: the tunnels stay, agents keep theirs
                log.warning("tick failed: %s", exc)
            except Exception:
                log.exception("tick failed; the next one runs in %.0f s", self.interval)
            with self.ticks:
                self.tick_count += 1
                self.ticks.notify_all()

    def _enrolled(self, member: Member) -> None:
        """A join was recorded: its peer goes on the interface now (one `wg set`, in the enrolment's own
        thread), so the node's first handshake is answered; the loop, woken, announces it to the members.
        (Waiting here for a tick held an enrolment worker for up to a tick under load: a storm of joins
        queued behind four workers until some were cut off.)"""
        if not self.looping:  # no loop thread (tests drive the service by hand): tick here
            self.tick()
            return
        with self.apply_lock:
            self.device.apply(peers.PeerDiff(add=tuple(peers.desired_for_coordinator([member], self.public_key))))
        self.wake.set()

    # the loop ----------------------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        """One observation round: WireGuard's endpoints into the DB, pair paths, peers onto the interface.

        `now` (unix seconds) is the clock the pair paths are advanced with (tests move it on)."""
        if self.ha:
            if self.etcd_member:
                self._keep_etcd()
                self.tls.tick(self.db)  # certificate renewal, CA rotation (meshrun.mesh.coordinator.ha)
            self._lead()
            self._follow_registry()
        try:
            current = self.device.peers()
        except MeshrunError as exc:
            log.warning("cannot read %s: %s", self.network.interface, exc)
            return
        changed = False
        if self.leading:  # endpoints as the leader's WireGuard sees them (one view, not three that differ)
            changed = self.db.observe({p.public_key: (p.endpoint, p.latest_handshake) for p in current})
        # Members are read again only when the version moved (a join, a removal, a new endpoint or
        # candidates): a quiet tick costs the device read and one comparison per peer, nothing per pair.
        members = None
        v = self.db.version()
        if v != self.members_version:
            members = self.db.members()
            self.members_version = v
            names = {m.name for m in members}
            for gone in sorted(self.known - names):
                log.info("%s was removed from the network; every member drops it", gone)
            self.known = names
        if not self.leading:
            self.pairs.follow(members)  # the leader's decisions, from the store
        elif self.pairs.update(members, time.time() if now is None else now):
            self.paths_moved = True
        if self.leading and self.roster.trust_moved():  # `meshrun site trust` ran: the pairs' `lan` flags move
            self.paths_moved = True
        # Paths are part of what agents receive: a new version wakes every long-poll. While a backlog is
        # sliced (ticks every BACKLOG_PAUSE) that is at most once per interval, not after every slice.
        if self.paths_moved and (not self.pairs.behind or time.monotonic() - self.published_at >= self.interval):
            v = self.db.bump_version()
            self.paths_moved = False
        if self.quick_stale and time.monotonic() - self.quick_written_at >= QUICK_FILE_GAP:
            self.apply_peers(current)  # nothing left to change on the interface: this writes the file
        if changed or v != self.roster.version or self.db.recently_removed(REMOVED_GRACE_S + 5):
            self.apply_peers(current)
            # In a burst of joins the peers are on the interface now (each joiner's handshake works) and
            # the members hear of them together, in one version, at most PUBLISH_GAP after the last one. Only
            # with the loop running: it comes back for the held version (tests tick by hand).
            self.publish_held = (
                self.looping and v != self.roster.version and time.monotonic() - self.published_at < PUBLISH_GAP
            )
            if self.publish_held:
                return
            # Pair changes go out with the version that announces them (held back ones stay queued).
            if self.paths_moved:
                self.roster.publish(v)
            else:
                moved = self.pairs.take_relay_changes()
                # Also on a member-list change alone: an end's address (what its datagrams may come from) moved.
                self._allow_relayed()
                self.roster.publish(v, self.pairs.take_changes(), moved)
            self.published_at = time.monotonic()

    def _allow_relayed(self) -> None:
        """Forward exactly the pairs this coordinator relays, each on its port (meshrun.system.sockets.udprelay): those
        relayed by "the coordinator" on the first one, and those relayed by its name on any. The datagrams pass
        as they are: its own tunnels never carry another member's address."""
        members = self.db.members()
        names = [self.name] if self.ha else []
        if self.public_key == self.network.coordinator_public_key:
            names.append(relays.COORDINATOR)
        listed = self.pairs.relay_list(names, {m.name: m.overlay_ip for m in members})
        if self.relaying.apply(listed, members, self.device, self.public_key):
            mode = self.relaying.relay.mode if self.relaying.relay is not None else "-"
            ports = [p for _, _, p in listed][:16]
            log.info("relaying %d pairs on ports %s, forwarded by %s", len(listed), ports, mode)

    # several coordinators -----------------------------------------------------
    def _lead(self) -> None:
        """Take or keep the lead (once a tick); a coordinator that starts or stops leading starts its pair
        driver over (the new leader hears every agent's full report; a follower follows the store)."""
        assert self.leadership is not None
        was = self.leading
        self.leading = self.leadership.step()
        self.db.fence = self.leadership.fence if self.leading else None
        if self.leading != was:
            self.pairs.restart(self.db)
            self.paths_moved = False
            self.members_version = -1  # the driver starts with no member list: hand it the current one
            if self.leading:
                self.pairs.relays_changed.update(self.pairs.by_relay)  # every relay hears its pairs again

    def _rendezvous(self) -> RendezvousService:
        """Jobs' torchrun rendezvous, in etcd: any coordinator answers the job's nodes (and only them). Who may
        is read from the job's record at most once a second per job (two reads a request otherwise)."""
        client = self.db.client
        seen: dict[str, tuple[float, list[str] | None]] = {}

        def read(job_id: str) -> list[str] | None:
            allowed = etcdjobs.job_allowed(client, job_id)
            if len(seen) > 1024:
                seen.clear()
            seen[job_id] = (time.monotonic(), allowed)
            return allowed

        def members_of(job_id: str):
            at, allowed = seen.get(job_id, (0.0, None))
            if time.monotonic() - at >= ALLOWED_TTL_S:
                allowed = read(job_id)
            if allowed is None:
                return None

            class Fresh(list):  # a node admitted a moment ago (an elastic job grew) is looked up again
                def __contains__(self, ip) -> bool:
                    return list.__contains__(self, ip) or ip in (read(job_id) or ())

            return Fresh(allowed)

        return RendezvousService(EtcdKV(client), members_of)

    def _leader_ip(self) -> str | None:
        name = self.leadership.leader if self.leadership is not None else None
        m = self.db.member_by_name(name) if name else None
        return m.overlay_ip if m is not None else None

    def _send_forward(self, leader_ip: str, batch: dict) -> dict:
        if self.forward_with is not None:
            return self.forward_with(leader_ip, batch)
        leader = self.roster.member_by_ip(leader_ip)
        key = self.overlay_keys(leader.public_key) if leader is not None else None
        return transport.call(leader_ip, self.network.api_port, "POST", "/v1/forward", batch, timeout=5, key=key)

    def _take_forward(self, batch: dict) -> dict:
        if not self.leading:
            raise ValueError("this coordinator does not lead now")
        out = self.reports.take(batch)
        if out["rerouted"]:
            self.wake.set()
        return out

    def _demote(self) -> None:
        """Another coordinator took this one out of the cluster: stop, and come back as a node."""
        self.restart_as = "node"
        self.stop_event.set()
        self.wake.set()

    def _keep_etcd(self) -> None:
        """This coordinator's etcd member runs: checked every ETCD_CHECK_S, started again (from its data, in a
        thread: it may wait for the others) when it died."""
        if time.monotonic() - self.etcd_checked < ETCD_CHECK_S:
            return
        self.etcd_checked = time.monotonic()
        if ha.etcd_pid(self.state) is not None or (self.etcd_restart is not None and self.etcd_restart.is_alive()):
            return
        log.warning("this coordinator's etcd member is not running: starting it again")

        def restart() -> None:
            try:
                ha.ensure_member(
                    self.state, self.member, self.network, sorted({c[1] for c in self.registry} | {self.ip})
                )
            except MeshrunError as exc:
                log.warning("could not start the etcd member: %s", exc)

        self.etcd_restart = threading.Thread(target=restart, name="etcd-restart", daemon=True)
        self.etcd_restart.start()

    def _follow_registry(self) -> None:
        """The coordinators as the store lists them: this etcd member's guard admits exactly their overlay
        addresses, and the etcd client knows every member's URL (it fails over between them)."""
        coords = self.db.coordinators()
        now = tuple(sorted((c.name, c.overlay_ip, c.etcd_client, c.endpoint, c.fingerprint) for c in coords))
        if now == self.registry:
            return
        ips = sorted({c.overlay_ip for c in coords} | {self.ip})
        try:
            self.guard_etcd(self.name, self.network, ips)
        except MeshrunError as exc:
            log.warning("could not update the etcd member's guard: %s", exc)
            return
        own = ha.own_urls(self.member)[0]
        urls = sorted((c.etcd_client for c in coords if c.etcd_client), key=lambda u: u != own)  # own member first
        if urls:
            self.db.client.set_endpoints(urls)
            ha.save_endpoints(self.state, urls, [c for c in coords if c.name != self.name])
        self.registry = now
        log.info("coordinators: %s", ", ".join(f"{c.name} ({c.overlay_ip})" for c in coords))

    def apply_peers(self, current=None) -> None:
        with self.apply_lock:
            members = self.db.members()
            desired = self.desired_peers(members)
            comment = f"meshrun network {self.network.name} (coordinator {self.name}); managed by meshrun"
            # Relayed packets leave here too: they must fit the small-MTU nodes' hops as well.
            d = iface.sync_peers(
                self.device,
                self.state,
                self.network,
                desired,
                address=self.ip,
                mtu=self.network.mtu,
                route_mtus=peers.route_mtus(self.public_key, self.network.mtu, members),
                comment=comment,
                current=current,
                quick_file=False,
            )
            quick = self.state / f"{self.network.interface}.conf"
            self.quick_stale = self.quick_stale or bool(d) or not quick.exists()
            if self.quick_stale and (time.monotonic() - self.quick_written_at >= QUICK_FILE_GAP or not quick.exists()):
                iface.write_quick_file(
                    self.state,
                    self.network,
                    desired,
                    address=self.ip,
                    mtu=self.network.mtu,
                    comment=comment,
                )
                self.quick_written_at, self.quick_stale = time.monotonic(), False

    def desired_peers(self, members: list[Member] | None = None) -> list[peers.PeerSpec]:
        """Every member, plus members removed in the last REMOVED_GRACE_S: the coordinator stays
        reachable for a moment so the removed node's pending long-poll gets its 410 and its agent
        takes the interface down. Other nodes drop a removed member at once."""
        members = self.db.members() if members is None else members
        everyone = members + self.db.recently_removed(REMOVED_GRACE_S)
        desired = peers.desired_for_coordinator(everyone, self.public_key)
        peers.check_own_addresses(desired, everyone)  # a bug, not an input: raised as it is
        return desired


def _interface_up(device: Device, state: StateDir, network: Network, ip: str, rec: dict) -> dict:
    """The interface, recreated from state if it is missing (a reboot, `meshrun down`); the member record."""
    if device.exists():
        return rec
    log.info("interface %s is missing (reboot?); recreating it from state", network.interface)
    backend = iface.bring_up(device, state, network, ip)
    rec = dict(rec, backend=backend, wg_pid=device.pid)
    state.write_json("member.json", rec)
    return rec


def _network_of(rec: dict) -> Network:
    return Network.from_dict(rec["network"])


def _network_from_db(db) -> Network:
    try:
        return Network.from_dict(json.loads(db.meta("network") or "null"))
    except (ValueError, TypeError) as exc:
        raise NetworkError(
            f"the state holds a corrupt network description ({exc})", "restore it from a backup"
        ) from None
