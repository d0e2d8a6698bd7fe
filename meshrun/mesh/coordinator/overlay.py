"""The overlay API: members talk to the coordinator here, inside WireGuard.

It listens on the coordinator's overlay IP with the socket bound to the WireGuard device, so
every caller's source address was authenticated by WireGuard (AllowedIPs = that member's /32):
the caller is identified by it, as in innernet. POST /v1/sync is the agents' long-poll
(heartbeat in, member list out); GET /v1/members lists the members.
"""

from __future__ import annotations

import logging
import threading

from meshrun.core.model import Member, Network, parse_endpoint
from meshrun.errors import StateError, UsageError
from meshrun.mesh.coordinator.pairs import PairDriver
from meshrun.mesh.coordinator.roster import Roster
from meshrun.system.store import CoordinatorDB
from meshrun.system.transport import Request, Response

log = logging.getLogger("meshrun.mesh.coordinator.overlay")

SYNC_WAIT_MAX = 25.0


def _gone() -> Response:
    return Response.error(410, StateError("this node was removed from the network",
                                          "ask the operator for a new token and join again"))


class OverlayAPI:
    """Handler of the overlay port (member-facing)."""

    def __init__(self, db: CoordinatorDB, network: Network, roster: Roster, pairs: PairDriver,
                 stop: threading.Event) -> None:
        self.db = db
        self.network = network
        self.roster = roster
        self.pairs = pairs
        self.stop = stop
        self.max_wait = SYNC_WAIT_MAX

    def handle(self, req: Request) -> Response:
        caller = self.db.member_by_ip(req.client_ip)
        if caller is None:
            if self.db.is_removed_ip(req.client_ip):
                return _gone()
            log.warning("refused %s %s from %s: not a member", req.method, req.path, req.client_ip)
            return Response.error(403, f"{req.client_ip} is not a member of this network")
        if req.method == "POST" and req.path == "/v1/sync":
            return self.sync(caller, req.body if isinstance(req.body, dict) else {})
        if req.method == "GET" and req.path == "/v1/members":
            return Response(200, {"network": self.network.to_dict(), "members": self.roster.payload(caller)})
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
            wait = min(max(float(body.get("wait", 0)), 0.0), self.max_wait)
            candidates = [parse_endpoint(str(c)) for c in body.get("candidates", [])][:16]
            report = body.get("peers", {})
            if not isinstance(report, dict) or len(report) > 100_000:
                raise ValueError("peers must be an object")
            delta = {str(k): int(v["handshake"] if isinstance(v, dict) else v) for k, v in report.items()}
        except (ValueError, TypeError, KeyError, OverflowError):
            return Response.error(400, UsageError("malformed sync request", "use the meshrun agent"))
        owed = self.pairs.report(caller.name, delta, full=bool(body.get("full")))
        self.db.heartbeat(caller.overlay_ip, candidates, touch=owed)
        # A node that owes a full report is answered at once, so its pairs are judged again soon.
        version = self.roster.wait(known, 0 if owed else wait, self.stop)
        if self.db.member_by_ip(caller.overlay_ip) is None:   # removed while it waited
            return _gone()
        extra = {"report": "full"} if owed else {}
        if version == known:
            return Response(200, {"version": version, "unchanged": True, **extra})
        return Response(200, {"version": version, "network": self.network.to_dict(),
                              "members": self.roster.payload(caller), **extra})
