"""Job-control request MACs: only root on the coordinator can start, cancel or read jobs on nodes.

The coordinator holds a 32-byte network job key (job.key, 0600, root only). Each node receives at
enrolment, inside the pinned TLS, only *its own* key, derived from the network key and its public
key, so a node's key opens no other node. A request carries

    Authorization: MeshrunMAC v1 <unix time> <nonce> <mac>

where mac = HMAC-SHA256(key, method, path, time, nonce, SHA-256 of the body). The receiver accepts
a time within WINDOW_S of its own clock and each nonce once within that window, so a captured
request cannot be replayed. Pure: the caller passes the clock, and a `Verifier` keeps the nonces.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import threading
from collections import OrderedDict

from meshrun.errors import MeshrunError

SCHEME = "MeshrunMAC"
VERSION = "v1"
WINDOW_S = 300                  # clocks of coordinator and node may differ this much
MAX_NONCES = 100_000            # bounds the replay memory; past it the oldest are dropped early


class AuthError(MeshrunError):
    """A request without a valid MAC: unsigned, malformed, wrong key, stale, or replayed."""

    exit_code = 1


def new_key() -> bytes:
    return secrets.token_bytes(32)


def derive(network_key: bytes, purpose: str) -> bytes:
    """A key for one purpose (e.g. one node) from the network job key; one-way."""
    return hmac.new(network_key, f"meshrun/{VERSION}/{purpose}".encode(), hashlib.sha256).digest()


def node_key(network_key: bytes, node_public_key: str) -> bytes:
    """The job key of the node with WireGuard public key `node_public_key`."""
    return derive(network_key, f"job/{node_public_key}")


def encode_key(key: bytes) -> str:
    return base64.b64encode(key).decode()


def decode_key(text: str) -> bytes:
    """A job key from its base64 text; AuthError (never echoing it) when it is not 32 bytes."""
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise AuthError("the job key is not 32 bytes of base64", "restore job.key, or join again")
    return key


def _mac(key: bytes, method: str, path: str, ts: int, nonce: str, body: bytes) -> str:
    msg = "\n".join((VERSION, method, path, str(ts), nonce, hashlib.sha256(body).hexdigest())).encode()
    return base64.urlsafe_b64encode(hmac.new(key, msg, hashlib.sha256).digest()).decode().rstrip("=")


def sign(key: bytes, method: str, path: str, body: bytes, now: float, nonce: str | None = None) -> str:
    """The Authorization header value for one request."""
    nonce = nonce or secrets.token_hex(12)
    ts = int(now)
    return f"{SCHEME} {VERSION} {ts} {nonce} {_mac(key, method, path, ts, nonce, body)}"


class Verifier:
    """Checks Authorization headers against one key and remembers the nonces it accepted."""

    def __init__(self, key: bytes, window: float = WINDOW_S, max_nonces: int = MAX_NONCES) -> None:
        self.key = key
        self.window = window
        self.max_nonces = max_nonces
        self._seen: OrderedDict[str, float] = OrderedDict()     # nonce -> time accepted, oldest first
        self._lock = threading.Lock()

    def verify(self, header: str | None, method: str, path: str, body: bytes, now: float) -> None:
        """Return if the request is authentic and fresh; raise AuthError saying why not."""
        parts = (header or "").split()
        if len(parts) != 5 or parts[0] != SCHEME:
            raise AuthError("the request is not signed", "job control comes only from `meshrun` run as root "
                                                          "on the coordinator")
        _, version, ts_text, nonce, mac = parts
        if version != VERSION or not ts_text.isdigit() or not 8 <= len(nonce) <= 64 or not nonce.isalnum():
            raise AuthError("the request's signature is malformed", "use the same meshrun version everywhere")
        ts = int(ts_text)
        if not hmac.compare_digest(mac, _mac(self.key, method, path, ts, nonce, body)):
            raise AuthError("the request's signature does not match this node's job key",
                            "only root on the coordinator can control jobs; re-join the node if its key was lost")
        if abs(now - ts) > self.window:
            raise AuthError(f"the request was signed {now - ts:+.0f} s from this node's clock (more than "
                            f"{self.window:.0f} s)", "synchronise the clocks (NTP) of the coordinator and nodes")
        with self._lock:
            while self._seen and (now - next(iter(self._seen.values())) > 2 * self.window
                                  or len(self._seen) >= self.max_nonces):
                self._seen.popitem(last=False)
            if nonce in self._seen:
                raise AuthError("the request was already used once (a replay)", "send a freshly signed request")
            self._seen[nonce] = now
