"""Job-control MACs and enrolment proofs, from keys that only a key's holder can compute. Pure.

A node's job key is derived from X25519 between the coordinator's and the node's static WireGuard
keys (`job_key`): the coordinator computes it with its private key and the node's public key, the
node with its private key and the coordinator's public key. No job key crosses the wire and none
is stored; nobody without one of the two private keys can compute it (not a token holder who knows
every public key, not a member for another member). A job request carries

    Authorization: MeshrunMAC v2 <unix time> <nonce> <sha256 of the body> <mac>

where mac = HMAC-SHA256(key, method, path, time, nonce, body hash). The receiver checks the MAC,
the time (within WINDOW_S of its clock) and the nonce (once per window) *before it reads the body*,
then reads the body and compares its hash (`Verifier.head`, `Verifier.body`): a sender without the
key cannot make it read a byte. `enrol_proof` lets a joining node show the coordinator it holds the
private key of the public key it presents, over the pinned TLS.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import threading
from collections import OrderedDict

from meshrun.errors import AuthError

__all__ = [
    "AuthError",
    "SCHEME",
    "VERSION",
    "WINDOW_S",
    "job_key",
    "overlay_key",
    "sign",
    "Verifier",
    "enrol_proof",
    "check_enrol_proof",
    "body_hash",
]

SCHEME = "MeshrunMAC"
VERSION = "v2"
WINDOW_S = 300  # clocks of coordinator and node may differ this much
MAX_NONCES = 100_000  # bounds the replay memory; past it the oldest are dropped early
_HEX64 = re.compile(r"^[0-9a-f]{64}\Z")


def _kdf(shared: bytes, purpose: str) -> bytes:
    return hmac.new(shared, f"meshrun/{VERSION}/{purpose}".encode(), hashlib.sha256).digest()


def job_key(shared: bytes, coordinator_public_key: str, node_public_key: str) -> bytes:
    """The job key of a node, from the X25519 secret it shares with the coordinator (keys.shared_secret)."""
    return _kdf(shared, f"job/{coordinator_public_key}/{node_public_key}")


def overlay_key(shared: bytes, a_public_key: str, b_public_key: str) -> bytes:
    """The key of overlay API requests between two members (an agent to a coordinator, a coordinator to another),
    from the X25519 secret they share: the same on both sides, whichever asks. Only root on either end can
    compute it (it reads the private key), so a request that carries its MAC came from meshrun, not from another
    user of that machine, who sends with the same overlay address."""
    lo, hi = sorted((a_public_key, b_public_key))
    return _kdf(shared, f"overlay/{lo}/{hi}")


def body_hash(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def _mac(key: bytes, method: str, path: str, ts: int, nonce: str, digest: str) -> str:
    msg = "\n".join((VERSION, method, path, str(ts), nonce, digest)).encode()
    return base64.urlsafe_b64encode(hmac.new(key, msg, hashlib.sha256).digest()).decode().rstrip("=")


def sign(key: bytes, method: str, path: str, body: bytes, now: float, nonce: str | None = None) -> str:
    """The Authorization header value for one request."""
    nonce = nonce or secrets.token_hex(12)
    ts = int(now)
    digest = body_hash(body)
    return f"{SCHEME} {VERSION} {ts} {nonce} {digest} {_mac(key, method, path, ts, nonce, digest)}"


JOB_SENDER = "job control comes only from `meshrun` run as root on the coordinator"
OVERLAY_SENDER = "these requests come only from meshrun's agent, run as root on a member"


class Verifier:
    """Checks Authorization headers against one key and remembers the nonces it accepted. `sender` says, in an
    unsigned request's error, who sends these requests (JOB_SENDER, OVERLAY_SENDER)."""

    def __init__(
        self, key: bytes, window: float = WINDOW_S, max_nonces: int = MAX_NONCES, sender: str = JOB_SENDER
    ) -> None:
        self.key = key
        self.window = window
        self.max_nonces = max_nonces
        self.sender = sender
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> time accepted, oldest first
        self._lock = threading.Lock()

    def head(self, header: str | None, method: str, path: str, now: float) -> str:
        """Check a request before its body is read; returns the body hash the MAC covers (compare it with
        `body` once the body is in). AuthError saying why not: unsigned, malformed, wrong key, stale, replayed."""
        parts = (header or "").split()
        if len(parts) != 6 or parts[0] != SCHEME:
            raise AuthError("the request is not signed", self.sender)
        _, version, ts_text, nonce, digest, mac = parts
        if (
            version != VERSION
            or not ts_text.isdigit()
            or len(ts_text) > 12
            or not 8 <= len(nonce) <= 64
            or not nonce.isalnum()
            or not _HEX64.match(digest)
        ):
            raise AuthError("the request's signature is malformed", "use the same meshrun version everywhere")
        ts = int(ts_text)
        if not hmac.compare_digest(mac, _mac(self.key, method, path, ts, nonce, digest)):
            raise AuthError(
                "the request's signature does not match the key it must be signed with",
                f"{self.sender}; if a member was re-created, join it again",
            )
        if abs(now - ts) > self.window:
            raise AuthError(
                f"the request was signed {now - ts:+.0f} s from this node's clock (more than {self.window:.0f} s)",
                "synchronise the clocks (NTP) of the coordinator and nodes",
            )
        with self._lock:
            while self._seen and (
                now - next(iter(self._seen.values())) > 2 * self.window or len(self._seen) >= self.max_nonces
            ):
                self._seen.popitem(last=False)
            if nonce in self._seen:
                raise AuthError("the request was already used once (a replay)", "send a freshly signed request")
            self._seen[nonce] = now
        return digest

    @staticmethod
    def body(expected: str, actual: str) -> None:
        """AuthError when the body that arrived is not the one the MAC covers."""
        if not hmac.compare_digest(expected, actual):
            raise AuthError("the request's body is not the one it was signed with", "send it again")

    def verify(self, header: str | None, method: str, path: str, body: bytes, now: float) -> None:
        """`head` and `body` together, for a body already in memory."""
        self.body(self.head(header, method, path, now), body_hash(body))


def _enrol_message(network: str, name: str, public_key: str, token_id: str, ts: int) -> bytes:
    return "\n".join(("enrol", network, name, public_key, token_id, str(ts))).encode()


def enrol_proof(shared: bytes, network: str, name: str, public_key: str, token_id: str, now: float) -> dict:
    """What a joining node sends to prove it holds `public_key`'s private key: {"time", "proof"}."""
    ts = int(now)
    mac = hmac.new(_kdf(shared, "enrol"), _enrol_message(network, name, public_key, token_id, ts), hashlib.sha256)
    return {"time": ts, "proof": mac.hexdigest()}


def check_enrol_proof(
    shared: bytes, network: str, name: str, public_key: str, token_id: str, proof: object, now: float
) -> None:
    """AuthError unless `proof` (from `enrol_proof`) is fresh and made with `public_key`'s private key."""
    if not isinstance(proof, dict) or not isinstance(proof.get("time"), int) or not isinstance(proof.get("proof"), str):
        raise AuthError(
            "the join request carries no proof that the node holds its private key",
            "use a meshrun of the same version as the coordinator to join",
        )
    ts = int(proof["time"])
    want = hmac.new(
        _kdf(shared, "enrol"), _enrol_message(network, name, public_key, token_id, ts), hashlib.sha256
    ).hexdigest()
    if not hmac.compare_digest(want, str(proof["proof"])):
        raise AuthError(
            "the node did not prove that it holds the private key of the public key it presents",
            "join from the machine that made the key (a public key alone enrols nothing)",
        )
    if abs(now - ts) > WINDOW_S:
        raise AuthError(
            f"the join request was made {now - ts:+.0f} s from the coordinator's clock",
            "synchronise the clocks (NTP) of the coordinator and this node",
        )
