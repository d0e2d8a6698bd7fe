"""Key material: WireGuard X25519 keys and the coordinator's self-signed TLS identity.

Keys are made here, on the machine that uses them; only public keys ever leave it.
WireGuard keys use WireGuard's own format: standard base64 of the 32 raw bytes.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.x509.oid import NameOID

from meshrun.errors import UsageError

_RAW = serialization.Encoding.Raw


def generate_private_key() -> str:
    """Return a fresh WireGuard private key (base64 of 32 bytes, clamped by X25519)."""
    key = X25519PrivateKey.generate()
    raw = key.private_bytes(_RAW, serialization.PrivateFormat.Raw, serialization.NoEncryption())
    return base64.b64encode(raw).decode()


def public_key(private_key_b64: str) -> str:
    """Return the WireGuard public key for a base64 private key."""
    raw = decode_key(private_key_b64, "private key")
    pub = X25519PrivateKey.from_private_bytes(raw).public_key()
    return base64.b64encode(pub.public_bytes(_RAW, serialization.PublicFormat.Raw)).decode()


def shared_secret(private_key_b64: str, peer_public_b64: str) -> bytes:
    """X25519 between our private key and a peer's public key: the same 32 bytes on both sides, and
    nothing of it ever on the wire (both halves are WireGuard keys the two members already hold).

    UsageError for a public key that gives no secret (a low-order point: the all-zero result).
    """
    priv = X25519PrivateKey.from_private_bytes(decode_key(private_key_b64, "private key"))
    try:
        return priv.exchange(X25519PublicKey.from_public_bytes(decode_key(peer_public_b64, "public key")))
    except ValueError:
        raise UsageError(
            "the public key gives no shared secret (a low-order point)",
            "use a key made by meshrun or `wg genkey`/`wg pubkey`",
        ) from None


def decode_key(value: str, what: str = "key") -> bytes:
    """Decode a WireGuard base64 key to its 32 raw bytes, or raise UsageError naming `what`.

    The message never repeats the value: it may be a private key.
    """
    try:
        raw = base64.b64decode(value.strip(), validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    # Canonical spelling only: b64decode ignores the last character's spare bits, so one key
    # would otherwise have several spellings (and slip past per-key checks on the coordinator).
    if len(raw) != 32 or base64.b64encode(raw).decode() != value.strip():
        raise UsageError(
            f"the {what} is not a WireGuard key (44 base64 characters for 32 bytes)",
            "pass a key made by meshrun or `wg genkey`/`wg pubkey`",
        )
    return raw


def is_public_key(value: object) -> bool:
    """True when `value` is a well-formed WireGuard public key string."""
    if not isinstance(value, str) or len(value) != 44:
        return False
    try:
        decode_key(value)
    except UsageError:
        return False
    return True


def generate_tls_identity(common_name: str, days: int = 3650) -> tuple[bytes, bytes]:
    """Return (certificate PEM, private key PEM) for a self-signed ECDSA P-256 certificate.

    Nodes never check a CA chain: they pin the SHA-256 fingerprint carried in the join
    token (kubeadm's discovery-token pattern), so a long validity costs nothing.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def cert_fingerprint(cert: bytes) -> str:
    """SHA-256 fingerprint (lower-case hex) of a certificate given as PEM or DER bytes."""
    if cert.lstrip().startswith(b"-----BEGIN"):
        cert = x509.load_pem_x509_certificate(cert).public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(cert).hexdigest()
