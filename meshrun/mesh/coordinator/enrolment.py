"""The enrolment API: the coordinator's only public TCP surface (TLS, pinned by the join token).

POST /v1/join takes a token id and secret, the node's name, public key and candidates, and a proof
that the node holds that key's private half (meshrun.core.auth.enrol_proof, made with the X25519
secret of the node's and the coordinator's keys); it answers with the member record, the network and
the member list. No key travels: the node's job key is the one it derives itself. The admission
rules are meshrun.core.admission's. POST /v1/join/abandon gives a failed join's name back, and POST
/v1/membership tells the holder of a key whether it was removed (both with the same proof). Everything else is
404 (nothing tells a scanner the network's name). Requests are rate-limited per source address.
"""

from __future__ import annotations

import base64
import binascii
import logging
import time
from collections.abc import Callable

from meshrun.core import auth, keys
from meshrun.core.model import Member, Network, check_name, parse_endpoint
from meshrun.core.ratelimit import RateLimiter
from meshrun.errors import AuthError, CoordinatorError, MeshrunError, TokenError, UsageError
from meshrun.mesh.coordinator.roster import Roster
from meshrun.system.control.state import ControlState
from meshrun.system.sockets.transport import Request, Response

log = logging.getLogger("meshrun.mesh.coordinator.enrolment")
MEMBERSHIP_PATH = "/v1/membership"
MEMBERSHIP_PURPOSE = "membership"  # what the proof of a membership question is bound to (a join's: its token id)


class EnrolmentAPI:
    """Handler of the public TLS port. `on_enrolled(member)` runs after a join is recorded (the
    service puts the new peer on the interface at once, so the node's first handshake is answered)."""

    def __init__(
        self,
        db: ControlState,
        network: Network,
        roster: Roster,
        shared_with: Callable[[str], bytes],
        on_enrolled: Callable[[Member], None],
        own_ip: str = "",
    ) -> None:
        self.own_ip = own_ip  # this coordinator's overlay address (several coordinators: not the network's)
        self.db = db
        self.shared_with = shared_with  # public key -> the X25519 secret the coordinator shares with it
        self.network = network
        self.roster = roster
        self.on_enrolled = on_enrolled
        self.limiter = RateLimiter()

    def handle(self, req: Request) -> Response:
        if req.method == "POST" and req.path == "/v1/join":
            if not self.limiter.allow(req.client_ip):
                log.warning("refused join from %s: rate limit", req.client_ip)
                return Response.error(
                    429, CoordinatorError(f"too many join attempts from {req.client_ip}", "wait a minute and try again")
                )
            return self.join(req)
        if req.method == "POST" and req.path in ("/v1/join/abandon", MEMBERSHIP_PATH):
            if not self.limiter.allow(req.client_ip):
                return Response.error(
                    429, CoordinatorError(f"too many join attempts from {req.client_ip}", "wait a minute and try again")
                )
            return self.abandon(req) if req.path == "/v1/join/abandon" else self.membership(req)
        return Response.error(404, f"no such endpoint {req.method} {req.path}")

    def _proven(self, req: Request, purpose) -> tuple[str, str] | Response:
        """(name, public key) of a request that proves it holds that key (the enrolment proof, bound to
        `purpose(body)`), or the error answer: 400 malformed, 401 not proven."""
        b = req.body if isinstance(req.body, dict) else {}
        try:
            name = check_name(str(b["name"]))
            public_key = b["public_key"]
            if not keys.is_public_key(public_key):
                raise ValueError("public_key is not a canonical WireGuard key")
            auth.check_enrol_proof(
                self.shared_with(public_key),
                self.network.name,
                name,
                public_key,
                purpose(b),
                b.get("possession"),
                time.time(),
            )
        except (KeyError, ValueError, TypeError):
            return Response.error(400, UsageError("malformed request", "use the meshrun client"))
        except (AuthError, UsageError) as exc:
            return Response.error(401, exc)
        return name, public_key

    def abandon(self, req: Request) -> Response:
        """A node whose join failed after it was enrolled (and rolled back there) gives its name back at once.

        Only the holder of the enrolment's private key can (the same proof as a join), and only for an
        enrolment that never completed; otherwise its name would be held for PENDING_GRACE_S."""
        proven = self._proven(req, lambda b: f"abandon:{str(b['token_id'])}")
        if isinstance(proven, Response):
            return proven
        name, public_key = proven
        released = self.db.abandon(name, public_key)
        if released:
            log.info("%s gave back its enrolment (its join failed on the node)", name)
        return Response(200, {"released": released})

    def membership(self, req: Request) -> Response:
        """Whether the caller's key was removed from the network for good: {"removed": bool}.

        A coordinator taken out with `coordinator remove --force` while it was away asks this of the others'
        public ports before it starts its etcd member again (nothing of the overlay reaches it any more). Only
        the holder of the key can ask (the enrolment proof, over MEMBERSHIP_PURPOSE), so the answer says
        nothing to anyone else."""
        proven = self._proven(req, lambda b: MEMBERSHIP_PURPOSE)
        if isinstance(proven, Response):
            return proven
        name, public_key = proven
        removed = self.db.is_removed_key(public_key)
        if removed:
            log.warning("%s (%s) asked whether it is a member: it was removed", name, req.client_ip)
        return Response(200, {"removed": removed})

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
            log.warning("refused join from %s: malformed request", req.client_ip)
            return Response.error(400, UsageError("malformed join request", "use the meshrun client to join"))
        if network_name != self.network.name:
            log.warning("refused join of %s from %s: token for network %r", name, req.client_ip, network_name)
            # Only what the caller sent is named: the network's own name is for its members, not for
            # whoever holds no token of it.
            return Response.error(
                403,
                TokenError(
                    f"this token is for network {network_name!r}, which this coordinator does not run",
                    "use a token created on this coordinator (`meshrun token create` there)",
                ),
            )
        if public_key == self.network.coordinator_public_key or any(
            m.is_coordinator and m.public_key == public_key for m in self.db.members()
        ):
            return Response.error(400, UsageError("the node presented a coordinator's own key", "join from a node"))
        try:
            auth.check_enrol_proof(
                self.shared_with(public_key),
                self.network.name,
                name,
                public_key,
                token_id,
                b.get("possession"),
                time.time(),
            )
        except (AuthError, UsageError) as exc:
            log.warning("refused join of %s from %s: %s", name, req.client_ip, exc.message)
            return Response.error(401, exc)
        try:
            member, created = self.db.enrol(token_id, secret, name, public_key, candidates, self.network.cidr)
        except MeshrunError as exc:
            log.warning("refused join of %s from %s: %s", name, req.client_ip, exc.message)
            raise
        log.info(
            "%s %s at %s (from %s)", "enrolled" if created else "re-enrolled", name, member.overlay_ip, req.client_ip
        )
        self.on_enrolled(member)
        return Response(
            200,
            {
                "member": member.to_dict(),
                "network": self.network.to_dict(),
                "members": self.roster.payload(member),
                # Where the new agent syncs first: this coordinator answers (with several, the first may be gone).
                "coordinator_ip": self.own_ip or self.network.coordinator_ip,
            },
        )
