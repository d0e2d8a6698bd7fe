"""The overlay API: members talk to the coordinator here, inside WireGuard.

It listens on the coordinator's overlay IP with the socket bound to the WireGuard device, so
every caller's source address was authenticated by WireGuard (AllowedIPs = that member's /32):
the caller is identified by it, as in innernet. An address names a machine, not a process: every user
and container on a member sends with it. So the requests that change something (SIGNED: the agents'
syncs and relay reports, the coordinators' forwards and demotions, the jobs' rendezvous) also carry a MAC
under the key the caller's and this coordinator's WireGuard keys give (meshrun.core.auth.overlay_key),
which only root can compute; without one they get 403 before their body is read. POST /v1/sync is the agents' long-poll
(heartbeat in, member list out); GET /v1/members lists the members. For `meshrun doctor`:
GET /v1/time answers the coordinator's clock, POST /v1/probe-udp sends a few datagrams from an
ephemeral port to the caller's observed endpoint (the caller counts what arrives: is its WireGuard
port reachable from outside?). The probe only ever targets the caller's own endpoint, at most
once per PROBE_INTERVAL_S per member, so it cannot be turned on anyone else.

With several coordinators (meshrun.mesh.coordinator.ha) three more, each for its own callers:
POST /v1/forward takes another coordinator's batch of agents' reports (the leader's pair driver decides
paths: meshrun.mesh.coordinator.forward), POST /v1/coordinators/demote tells this coordinator that another
took it out of the cluster (`meshrun coordinator remove`), both from coordinators only; POST /v1/rdzv/JOB is
a job's torchrun rendezvous, kept in the replicated store (meshrun.mesh.coordinator.rendezvous), from the
job's nodes only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from meshrun.core import auth
from meshrun.core.model import MAX_TUNNELS, SITE_RE, Member, Network, parse_endpoint, split_endpoint
from meshrun.core.ratelimit import RateLimiter
from meshrun.errors import AuthError, CoordinatorError, StateError, UsageError
from meshrun.mesh.coordinator.pairs import PairDriver
from meshrun.mesh.coordinator.roster import Roster
from meshrun.system.control.state import ControlState
from meshrun.system.sockets import probe
from meshrun.system.sockets.transport import Request, Response, Wait

log = logging.getLogger("meshrun.mesh.coordinator.overlay")

SYNC_WAIT_MAX = 25.0
SYNC_BURST = 20
SYNC_PER_S = 5.0
RDZV_BURST = 100
RDZV_PER_S = 50.0
PROBE_COUNT = 3
PROBE_INTERVAL_S = 2.0
PROBE_PAYLOAD = b"meshrun doctor: is this port reachable from outside?"


SIGNED = ("/v1/sync", "/v1/relay-down", "/v1/forward", "/v1/coordinators/demote")  # POSTs that need a MAC


def signed(req: Request) -> bool:
    """Whether `req` must carry a MAC under the caller's overlay key (module docstring)."""
    return req.method == "POST" and (req.path in SIGNED or req.path.startswith("/v1/rdzv/"))


def _gone() -> Response:
    return Response.error(
        410, StateError("this node was removed from the network", "ask the operator for a new token and join again")
    )


class OverlayAPI:
    """Handler of the overlay port (member-facing)."""

    def __init__(
        self,
        db: ControlState,
        network: Network,
        roster: Roster,
        pairs: PairDriver,
        stop: threading.Event,
        on_news: Callable[[], None] = lambda: None,
        forward: Callable[[dict], dict] | None = None,
        demote: Callable[[], None] | None = None,
        rendezvous: Callable[[Request], Response] | None = None,
        keys: Callable[[str], bytes] | None = None,
    ) -> None:
        # A caller's overlay key by its public key (meshrun.mesh.member.OverlayKeys); None: the signed requests
        # are refused, all of them (nothing can prove itself).
        self.keys = keys
        self.verifiers: dict[str, auth.Verifier] = {}  # public key -> its verifier (it remembers nonces)
        self.verifiers_lock = threading.Lock()
        self.forward = forward  # the leader takes a follower's reports (Reports.take); None: one coordinator
        self.demote = demote  # another coordinator took this one out of the cluster
        self.rendezvous = rendezvous  # a job's rendezvous (RendezvousService.serve), with several coordinators
        self.db = db
        self.on_news = on_news  # a report the loop should act on now (a relay that failed)
        self.network = network
        self.roster = roster
        self.pairs = pairs
        self.stop = stop
        self.max_wait = SYNC_WAIT_MAX
        self.probed: dict[str, float] = {}  # member name -> monotonic time of its last UDP probe
        # (overlay IP, public key) -> (candidates, mtu) as last handed to db.heartbeat: an unchanged
        # heartbeat needs no database access (and no wait for its lock) at all.
        self.heard: dict[tuple[str, str], tuple[list[str], int | None, str | None, bool | None]] = {}
        self.limiter = RateLimiter(SYNC_BURST, SYNC_PER_S)
        # A job's rendezvous has its own budget: torchrun's agent polls its store during a round (31 requests
        # for two agents to form a world) and must not eat into its agent's syncs, nor be starved by them.
        self.rdzv_limiter = RateLimiter(RDZV_BURST, RDZV_PER_S)
        self.relayed_once: set[str] = set()  # members that were relays since start (told when they stop)

    def gate(self, req: Request) -> Response | None:
        """Before the body is read: members only (by WireGuard source address), at most SYNC_BURST
        requests at once and SYNC_PER_S a second each (an agent long-polls: one every few seconds)."""
        caller = self.roster.member_by_ip(req.client_ip)
        if caller is None:
            if self.db.is_removed_ip(req.client_ip):
                return _gone()
            log.warning("refused %s %s from %s: not a member", req.method, req.path, req.client_ip)
            return Response.error(403, f"{req.client_ip} is not a member of this network")
        limiter = self.rdzv_limiter if req.path.startswith("/v1/rdzv/") else self.limiter
        if not limiter.allow(req.client_ip):
            return Response.error(
                429,
                UsageError(
                    f"too many requests from {caller.name}",
                    f"at most {SYNC_PER_S:g} a second; the agent backs off by itself",
                ),
            )
        if signed(req):
            try:
                req.expect_sha256 = self._verifier(caller.public_key).head(
                    req.headers.get("Authorization"), req.method, req.path, time.time()
                )
            except AuthError as exc:
                log.warning("refused %s %s from %s: %s", req.method, req.path, caller.name, exc.message)
                return Response.error(403, exc)
        return None

    def _verifier(self, public_key: str) -> auth.Verifier:
        if self.keys is None:
            raise AuthError("this coordinator checks no overlay keys", "run it as meshrun's daemon")
        with self.verifiers_lock:
            if public_key not in self.verifiers:
                self.verifiers[public_key] = auth.Verifier(self.keys(public_key), sender=auth.OVERLAY_SENDER)
            return self.verifiers[public_key]

    def handle(self, req: Request) -> Response:
        if not req.gated:  # called directly (tests, in-process agents), not through the server's gate
            refused = self.gate(req)
            if refused is not None:
                return refused
        caller = self.roster.member_by_ip(req.client_ip)
        if caller is None:  # removed between the gate and now
            return _gone()
        if signed(req):
            try:
                auth.Verifier.body(req.expect_sha256, req.sha256())
            except AuthError as exc:
                return Response.error(403, exc)
        if req.method == "POST" and req.path == "/v1/sync":
            resp = self.sync(caller, req.body if isinstance(req.body, dict) else {})
            return resp if isinstance(resp, Response) or req.deferrable else self._block(resp)
        if req.method == "GET" and req.path == "/v1/members":
            return Response(200, {"network": self.network.to_dict(), "members": self.roster.payload(caller)})
        if req.method == "GET" and req.path == "/v1/time":
            return Response(200, {"time": time.time()})
        if req.method == "POST" and req.path == "/v1/relay-down":
            return self.relay_down(caller, req.body if isinstance(req.body, dict) else {})
        if req.method == "POST" and req.path == "/v1/probe-udp":
            return self.probe_udp(caller)
        body = req.body if isinstance(req.body, dict) else {}
        if req.path.startswith("/v1/rdzv/") and self.rendezvous is not None:
            return self.rendezvous(req)
        if req.method == "POST" and req.path in ("/v1/forward", "/v1/coordinators/demote"):
            if not caller.is_coordinator:
                log.warning("refused %s from %s: not a coordinator", req.path, caller.name)
                return Response.error(403, f"{caller.name} is not a coordinator")
            if req.path == "/v1/forward":
                if self.forward is None:
                    return Response.error(
                        409, CoordinatorError("this coordinator does not lead", "send it to the leader")
                    )
                try:
                    return Response(200, self.forward(body))
                except (ValueError, TypeError, KeyError) as exc:
                    return Response.error(400, UsageError(f"malformed forwarded reports ({exc})", "use meshrun"))
            if self.demote is None:
                return Response.error(409, UsageError("this is the only coordinator", "nothing to do"))
            log.warning("%s took this coordinator out of the cluster: becoming a node again", caller.name)
            self.demote()
            return Response(200, {"demoted": True})
        return Response.error(404, f"no such endpoint {req.method} {req.path}")

    def sync(self, caller: Member, body: dict) -> Response | Wait:
        """Heartbeat in, member list out; a Wait (long-poll) while nothing changed.

        The heartbeat's `peers` is {peer public key: latest handshake} for the peers whose liveness
        the coordinator does not know yet, `stale` the keys among them whose tunnel is not fresh
        (meshrun.core.peers.handshake_report; the first report after either side restarted is
        complete: the answer asks for it with "report": "full"). An answer to a
        long-poll that timed out without a change is just {"version", "unchanged": true}.

        An agent that sends "delta": true with the version it holds gets {"version", "since",
        "changed": [members], "removed": [public keys]}: only what changed for it since then
        (meshrun.core.memberlist); the full {"version", "network", "members"} when it is too far
        behind, after a coordinator restart, or when it did not ask for deltas.
        """
        try:
            known = int(body.get("version", 0))
            wait = min(max(float(body.get("wait", 0)), 0.0), self.max_wait)
            candidates = [parse_endpoint(str(c)) for c in body.get("candidates", [])][:16]
            report = body.get("peers", {})
            if not isinstance(report, dict) or len(report) > 100_000:
                raise ValueError("peers must be an object")
            delta = {str(k): int(v["handshake"] if isinstance(v, dict) else v) for k, v in report.items()}
            if any(v < 0 for v in delta.values()):
                raise ValueError("a handshake time is negative")
            stale = body.get("stale")  # absent: an older agent, whose reports are judged by time
            if stale is not None:
                if not isinstance(stale, list):
                    raise ValueError("stale must be a list")
                stale = {str(k) for k in stale} & delta.keys()
            mtu = body.get("mtu")
            if mtu is not None and (isinstance(mtu, bool) or not isinstance(mtu, int) or not 576 <= mtu <= 9000):
                raise ValueError("mtu must be an integer in 576..9000")
            site = body.get("site")
            if site is not None and not (isinstance(site, str) and (site == "" or SITE_RE.match(site))):
                raise ValueError("site must be a name")
            relay = body.get("relay")
            if relay is not None and not isinstance(relay, bool):
                raise ValueError("relay must be true or false")
            tunnels = body.get("tunnels")
            if tunnels is not None and (
                isinstance(tunnels, bool) or not isinstance(tunnels, int) or not 1 <= tunnels <= MAX_TUNNELS
            ):
                raise ValueError(f"tunnels must be an integer in 1..{MAX_TUNNELS}")
            rtt = body.get("rtt", {})
            if not isinstance(rtt, dict) or len(rtt) > 64:
                raise ValueError("rtt must be an object of at most 64 round trips")
            rtt_ms = {str(k): float(v) for k, v in rtt.items()}
            if not all(0.0 <= v < 60_000.0 for v in rtt_ms.values()):
                raise ValueError("a round trip is out of range")
        except (ValueError, TypeError, KeyError, OverflowError):
            return Response.error(400, UsageError("malformed sync request", "use the meshrun agent"))
        owed = self.pairs.report(caller.name, delta, full=bool(body.get("full")), stale=stale)
        if rtt_ms:
            self.pairs.report_rtt(caller.name, rtt_ms)
        heard = (caller.overlay_ip, caller.public_key)
        said = (candidates, mtu, site, relay, tunnels)
        if owed or self.heard.get(heard) != said:
            self.db.heartbeat(
                caller.overlay_ip, candidates, touch=owed, mtu=mtu, site=site, relay=relay, tunnels=tunnels
            )
            self.heard[heard] = said
        deltas = bool(body.get("delta")) and known > 0  # the agent applies deltas (meshrun >= this one)
        extra = {"report": "full"} if owed else {}
        # A node that owes a full report is answered at once, so its pairs are judged again soon.
        deadline = time.monotonic() + (0 if owed else wait)
        seen = [known]  # the newest version this caller need not hear of

        def poll(expired: bool) -> Response | None:
            version = self.roster.version
            if version == seen[0] and not expired:
                return None
            # The caller as the list now has it, not as it was when this long-poll began: its own heartbeat (above)
            # may have changed it since (its site: which of its pairs take a trusted site's LAN path).
            now = self.roster.member_by_ip(caller.overlay_ip) or caller
            news = self.roster.delta(now, known) if deltas and version != known else None
            if news is not None and not (news["changed"] or news["removed"]) and not expired:
                # The new version changes nothing this caller sees (another pair's path): a thousand
                # agents need not all come back for it; keep waiting.
                seen[0] = version
                return None
            return self._answer(now, known, version, deltas, news, extra)

        first = poll(time.monotonic() >= deadline)
        return first if first is not None else Wait(deadline, poll)

    def _answer(
        self, caller: Member, known: int, version: int, deltas: bool, news: dict | None, extra: dict
    ) -> Response:
        """A sync's answer once the wait is over: `version` as unchanged, a delta or the full list."""
        if self.roster.member_by_ip(caller.overlay_ip) is None:  # removed while it waited
            return _gone()
        if version == known:
            return Response(200, {"version": version, "unchanged": True, **extra})
        if deltas:
            if news is not None and not (news["changed"] or news["removed"]):
                return Response(200, {"version": version, "unchanged": True, **extra})
            if news is not None:
                return Response(200, {"version": version, **news, **self._relaying(caller, bool(extra)), **extra})
        # The list as published with `version` (not re-read from the database: a thousand agents
        # fetching it at once queued on the database lock ahead of the loop).
        return Response(
            200,
            {
                "version": version,
                "network": self.network.to_dict(),
                "members": self.roster.payload(caller, fresh=False),
                **self._relaying(caller, bool(extra)),
                **extra,
            },
        )

    def _relaying(self, caller: Member, first: bool) -> dict:
        """{"relaying": [[ip, ip], ...]}: the pairs the caller relays (its forwarding allow-list), with every
        answer that is not "unchanged"; {} for a member that relays nothing and never did since this
        coordinator started (most of them), except in its `first` answer since then."""
        pairs = self.roster.relaying(caller)
        if pairs or first or caller.name in self.relayed_once:
            self.relayed_once.add(caller.name)
            return {"relaying": pairs}
        return {}

    def _block(self, wait: Wait) -> Response:
        """Answer a Wait in this thread (a caller that cannot take one: tests, in-process agents)."""
        while True:
            seen = self.roster.version
            resp = wait.poll(time.monotonic() >= wait.deadline or self.stop.is_set())
            if resp is not None:
                return resp
            self.roster.wait(seen, max(0.0, wait.deadline - time.monotonic()), self.stop)

    def relay_down(self, caller: Member, body: dict) -> Response:
        """The caller cannot reach these relayed peers through their relay: each pair gets another one
        at once (the loop is woken), and both ends hear of it with their next answer."""
        peers, via = body.get("peers"), body.get("via", {})
        if (
            not isinstance(peers, list)
            or not all(isinstance(k, str) for k in peers)
            or len(peers) > 256
            or not isinstance(via, dict)
            or not all(isinstance(v, str) for v in via.values())
        ):
            return Response.error(400, UsageError("malformed relay-down report", "use the meshrun agent"))
        rerouted = self.pairs.relay_failed(caller.name, peers, via=via)
        if rerouted:
            self.on_news()
        return Response(200, {"rerouted": rerouted})

    def probe_udp(self, caller: Member) -> Response:
        """Send PROBE_COUNT datagrams from an ephemeral port to the caller's observed endpoint."""
        if not caller.endpoint:
            return Response.error(
                409,
                UsageError(
                    "the coordinator has not seen this node's endpoint yet",
                    "wait for a handshake (meshrun status) and try again",
                ),
            )
        now = time.monotonic()
        if now - self.probed.get(caller.name, -PROBE_INTERVAL_S) < PROBE_INTERVAL_S:
            return Response.error(
                429, UsageError("a UDP probe was sent to this node a moment ago", f"wait {PROBE_INTERVAL_S:g} s")
            )
        self.probed[caller.name] = now
        host, port = split_endpoint(caller.endpoint)
        sent = probe.send_udp(host, port, PROBE_PAYLOAD, PROBE_COUNT)
        return Response(200, {"endpoint": caller.endpoint, "sent": sent})
