"""Join tokens: one string a node needs to enrol, modelled on kubeadm's discovery tokens.

Format: ``mr1.`` + base64url(JSON payload + 4-byte SHA-256 checksum). The payload holds the
network name, the coordinator's endpoint(s), the SHA-256 fingerprint of its TLS
certificate, the coordinator's WireGuard public key (a joining node proves with it that it holds
its own private key), a token id and a 32-byte secret; with several coordinators also every other
coordinator's endpoint, fingerprint and key ("c"), tried in turn when the first does not answer (a
meshrun that predates them reads the first coordinator only). The coordinator stores only
``hash_secret(secret)``; nodes prove possession of the secret over TLS pinned by the
fingerprint. The checksum lets a garbled or truncated token fail with a precise message
instead of a confusing network error.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import secrets
from dataclasses import dataclass

from meshrun.core.model import parse_endpoint
from meshrun.errors import TokenError, UsageError

PREFIX = "mr1."
_VERSION_RE = re.compile(r"^mr(\d+)\.")
_ID_RE = re.compile(r"^[a-z0-9]{10}\Z")
_FP_RE = re.compile(r"^[0-9a-f]{64}\Z")
_KEY_RE = re.compile(r"^[A-Za-z0-9+/]{42}[AEIMQUYcgkosw048]=\Z")  # a WireGuard key: base64 of 32 bytes
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}\Z")
_FIX_COPY = "copy the whole token again from the output of `meshrun token create` on the coordinator"


@dataclass(frozen=True)
class JoinToken:
    """A decoded join token. `secret` is raw bytes and must never be logged."""

    network: str
    endpoints: tuple[str, ...]
    fingerprint: str
    token_id: str
    secret: bytes
    coordinator_key: str = ""  # the coordinator's WireGuard public key ("" in tokens of older meshruns)
    others: tuple[tuple[str, str, str], ...] = ()  # every other coordinator: (endpoint, fingerprint, key)

    def coordinators(self) -> list[tuple[str, str, str]]:
        """(endpoint, TLS fingerprint, WireGuard key) of each coordinator to try, in order."""
        return [(ep, self.fingerprint, self.coordinator_key) for ep in self.endpoints] + list(self.others)

    def encode(self) -> str:
        """Return the token string (``mr1.…``)."""
        fields = {
            "n": self.network,
            "e": list(self.endpoints),
            "f": self.fingerprint,
            "i": self.token_id,
            "s": base64.urlsafe_b64encode(self.secret).decode().rstrip("="),
        }
        if self.coordinator_key:
            fields["k"] = self.coordinator_key
        if self.others:
            fields["c"] = [list(o) for o in self.others]
        payload = json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()
        blob = payload + hashlib.sha256(payload).digest()[:4]
        return PREFIX + base64.urlsafe_b64encode(blob).decode().rstrip("=")

    def __repr__(self) -> str:  # never show the secret, even in tracebacks
        return f"JoinToken(network={self.network!r}, endpoints={self.endpoints!r}, token_id={self.token_id!r})"


def new_token(
    network: str,
    endpoints: list[str] | tuple[str, ...],
    fingerprint: str,
    coordinator_key: str = "",
    others: tuple[tuple[str, str, str], ...] = (),
) -> JoinToken:
    """Make a token with a fresh random id and 32-byte secret."""
    token_id = "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(10))
    return JoinToken(
        network, tuple(endpoints), fingerprint, token_id, secrets.token_bytes(32), coordinator_key, tuple(others)
    )


def hash_secret(secret: bytes) -> str:
    """What the coordinator stores instead of the secret (hex SHA-256)."""
    return hashlib.sha256(b"meshrun-token-v1:" + secret).hexdigest()


def secret_matches(secret: bytes, stored_hash: str) -> bool:
    """Constant-time check of a presented secret against a stored hash."""
    return hmac.compare_digest(hash_secret(secret), stored_hash)


def looks_like_token(value: str) -> bool:
    """True when `value` has a token's shape (for `token revoke TOKEN_OR_ID`)."""
    return value.startswith("mr") and "." in value[:6]


def parse_token(value: str) -> JoinToken:
    """Decode and validate a token string, or raise TokenError saying precisely what is wrong.

    Never includes the token text in the message: it carries a secret.
    """
    value = value.strip()
    m = _VERSION_RE.match(value)
    if not m:
        raise TokenError("this is not a meshrun join token (it must start with 'mr1.')", _FIX_COPY)
    if m.group(0) != PREFIX:
        raise TokenError(
            f"join token version mr{m.group(1)} is not supported by this meshrun (it reads mr1)",
            "use the same meshrun version on the node as on the coordinator",
        )
    body = value[len(PREFIX) :]
    try:
        blob = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except (binascii.Error, ValueError):
        raise TokenError("the join token is garbled (it is not valid base64url)", _FIX_COPY) from None
    payload, check = blob[:-4], blob[-4:]
    if len(blob) < 8 or not hmac.compare_digest(hashlib.sha256(payload).digest()[:4], check):
        raise TokenError("the join token is truncated or garbled (its checksum does not match)", _FIX_COPY)
    try:
        data = json.loads(payload)
        # Exact shapes: str() of a number, or iterating a string as endpoints, would let a
        # malformed payload through to fail later with a confusing error.
        if not (
            isinstance(data, dict)
            and all(isinstance(data.get(k), str) for k in "nfis")
            and isinstance(data.get("e"), list)
            and all(isinstance(e, str) for e in data["e"])
        ):
            raise ValueError("wrong field types")
        secret_b64 = data["s"]
        secret = base64.urlsafe_b64decode(secret_b64 + "=" * (-len(secret_b64) % 4))
        ckey = data.get("k", "")
        others = data.get("c", [])
        if (
            not isinstance(ckey, str)
            or not isinstance(others, list)
            or len(others) > 16
            or not all(isinstance(o, list) and len(o) == 3 and all(isinstance(x, str) for x in o) for o in others)
        ):
            raise ValueError("wrong field types")
        if any(not _FP_RE.match(f) or not _KEY_RE.match(k) for _, f, k in others):
            raise ValueError("a coordinator's fingerprint or key is malformed")
        tok = JoinToken(
            data["n"],
            tuple(parse_endpoint(e) for e in data["e"]),
            data["f"],
            data["i"],
            secret,
            ckey,
            tuple((parse_endpoint(e), f, k) for e, f, k in others),
        )
    except (ValueError, KeyError, TypeError, binascii.Error):
        raise TokenError("the join token's contents are malformed", _FIX_COPY) from None
    if (
        not _NAME_RE.match(tok.network)
        or not tok.endpoints
        or not _FP_RE.match(tok.fingerprint)
        or not _ID_RE.match(tok.token_id)
        or len(tok.secret) != 32
        or tok.coordinator_key
        and not _KEY_RE.match(tok.coordinator_key)
    ):
        raise TokenError("the join token's contents are malformed", _FIX_COPY)
    return tok


_DURATION_RE = re.compile(r"^([0-9]{1,12})([smhd])\Z")  # bounded: int() refuses >4300 digits
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_TTL = 30 * 86400


def parse_duration(value: str, option: str = "--ttl") -> int:
    """Parse '90s', '30m', '12h', '7d' into seconds (1 s .. 30 d), or raise UsageError."""
    m = _DURATION_RE.match(value.strip().lower())
    seconds = int(m.group(1)) * _UNIT[m.group(2)] if m else 0
    if not m or not 0 < seconds <= MAX_TTL:
        raise UsageError(
            f"{option} {value!r} is not a duration between 1s and 30d",
            f"write it as a number and a unit, e.g. {option} 12h, 30m or 2d",
        )
    return seconds
