"""Key material: WireGuard X25519 keys, the coordinator's self-signed TLS identity, and the small X.509 CA
the coordinators' etcd members trust.

Keys are made here, on the machine that uses them; only public keys (and certificate requests) ever leave it.
WireGuard keys use WireGuard's own format: standard base64 of the 32 raw bytes.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib
import ipaddress

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

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


def _self_signed(key: ec.EllipticCurvePrivateKey, name: x509.Name, days: int) -> x509.CertificateBuilder:
    """A certificate builder for `key`, issued by itself, valid from five minutes ago (a clock a little
    behind) for `days` days."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def generate_tls_identity(common_name: str, days: int = 3650) -> tuple[bytes, bytes]:
    """Return (certificate PEM, private key PEM) for a self-signed ECDSA P-256 certificate.

    Nodes never check a CA chain: they pin the SHA-256 fingerprint carried in the join
    token (kubeadm's discovery-token pattern), so a long validity costs nothing.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = _self_signed(key, name, days).sign(key, hashes.SHA256())
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def cert_fingerprint(cert: bytes) -> str:
    """SHA-256 fingerprint (lower-case hex) of a certificate given as PEM or DER bytes."""
    if cert.lstrip().startswith(b"-----BEGIN"):
        cert = x509.load_pem_x509_certificate(cert).public_bytes(serialization.Encoding.DER)
    return hashlib.sha256(cert).hexdigest()


# --------------------------------------------------------------------------- the etcd members' CA
#
# etcd checks chains, not fingerprints: every member and every client presents a certificate signed by one
# CA, and a member's certificate carries its overlay address as an IP SAN (etcd matches a peer's address
# against it). Each machine makes its own key and sends only a CSR; the CA's key signs it.

_PEM = serialization.Encoding.PEM
_SKEW = datetime.timedelta(minutes=5)  # not-before in the past: a signer's clock a little ahead of a member's
# A member's certificate lives 90 days and is renewed by its own coordinator when 30 are left (`renew_due`):
# a copy that leaks (a backup, a disk) opens etcd for weeks, not years, while a coordinator may be down for up
# to a month and still come back on its own. One that is down longer finds its certificate expired: take it
# out (`meshrun coordinator remove`) and add it again.
LEAF_DAYS = 90
RENEW_DAYS = 30
# The CA outlives its leaves by far; it is replaced whenever a coordinator is taken out (a new key that one
# never saw), which is what actually ends a removed coordinator's access.
CA_DAYS = 3650
_CSR_FIX = (
    "make the request on the member itself, for its own overlay address {ip} and nothing else "
    "(`meshrun coordinator add` does): run the same meshrun version on both machines"
)


class CertificateRequestError(UsageError):
    """A certificate request that the etcd CA refuses to sign (it names the request's value and the fix)."""


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(_PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()


def _cn(common_name: str) -> x509.Name:
    if not common_name or len(common_name) > 64:  # X.509's upper bound for a common name
        raise UsageError(f"the common name {common_name!r} must be 1 to 64 characters", "pass a member's name")
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def new_ca(common_name: str, days: int = CA_DAYS) -> tuple[str, str]:
    """Return (certificate PEM, private key PEM) of a new self-signed CA (EC P-256) valid for `days` days.

    It may sign leaf certificates only (path length 0). Its key signs every member's CSR (`sign_csr`); keep
    it where only the coordinators can read it.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    name = _cn(common_name)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        _self_signed(key, name, days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(_PEM).decode(), _key_pem(key)


def new_csr(common_name: str, ip: str) -> tuple[str, str]:
    """Return (private key PEM, CSR PEM): a fresh EC P-256 key and its request for a certificate whose only
    subject alternative name is the IP address `ip` (no loopback is added: etcd listens on `ip` alone).

    UsageError for an `ip` that is not an IP address.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    return _key_pem(key), csr_for_key(_key_pem(key), common_name, ip)


def csr_for_key(key_pem: str, common_name: str, ip: str) -> str:
    """The CSR (PEM) of an existing private key for a certificate whose only subject alternative name is `ip`:
    a renewal keeps the member's key, so only the certificate file changes (etcd reads both files on each new
    handshake; two files replaced one after the other could be read as a mismatched pair).

    UsageError for an `ip` that is not an IP address.
    """
    addr = _ip_address(ip)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(_cn(common_name))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(addr)]), critical=False)
        .sign(_load_key(key_pem), hashes.SHA256())
    )
    return csr.public_bytes(_PEM).decode()


def _ip_address(ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        return ipaddress.ip_address(ip)
    except ValueError:
        raise UsageError(f"{ip!r} is not an IP address", "pass the member's overlay address, e.g. 10.7.0.2") from None


def _load_cert(pem: str | bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem.encode() if isinstance(pem, str) else pem)


def _load_key(pem: str | bytes):
    return serialization.load_pem_private_key(pem.encode() if isinstance(pem, str) else pem, password=None)


def _public_der(public_key) -> bytes:
    return public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def check_csr(csr_pem: str, ip: str) -> x509.CertificateSigningRequest:
    """The certificate request `csr_pem`, checked before anything signs it: its signature verifies and its
    subject alternative names are exactly the one IP address `ip` (the overlay address the network gave the
    member it comes from). A certificate for another address would let its holder pose as another member.

    CertificateRequestError (one line, naming the value and the fix) for anything else.
    """
    try:
        csr = x509.load_pem_x509_csr(csr_pem.encode() if isinstance(csr_pem, str) else csr_pem)
    except ValueError:
        raise CertificateRequestError(
            "the certificate request is not a PEM certificate request", _CSR_FIX.format(ip=ip)
        ) from None
    if not csr.is_signature_valid:
        raise CertificateRequestError("the certificate request's signature does not verify", _CSR_FIX.format(ip=ip))
    want = _ip_address(ip)
    try:
        names = list(csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        names = []
    asked = [str(n.value) if isinstance(n, x509.IPAddress) else f"{type(n).__name__}:{n.value}" for n in names]
    if len(names) != 1 or not isinstance(names[0], x509.IPAddress) or names[0].value != want:
        raise CertificateRequestError(
            f"the certificate request names {asked or 'no IP address'} (subject alternative names), "
            f"not exactly {want}, the overlay address of the member it is for",
            _CSR_FIX.format(ip=want),
        )
    return csr


def sign_csr(ca_cert_pem: str, ca_key_pem: str, csr_pem: str, ip: str, days: int = LEAF_DAYS) -> str:
    """Return the PEM certificate the CA issues for `csr_pem`, a request for the overlay address `ip` alone
    (`check_csr`): its subject and that one IP SAN, good for both TLS ends (serverAuth and clientAuth: an
    etcd member is a server to its clients and a client to its peers), not a CA, valid for `days` days but
    never past the CA itself.

    CertificateRequestError for a request that `check_csr` refuses; ValueError for a CA key that is not the
    CA certificate's or a CA certificate that is not a CA.
    """
    ca_cert, ca_key = _load_cert(ca_cert_pem), _load_key(ca_key_pem)
    if _public_der(ca_cert.public_key()) != _public_der(ca_key.public_key()):
        raise ValueError("the CA key does not belong to the CA certificate")
    try:
        if not ca_cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            raise ValueError("the CA certificate is not a CA (basicConstraints CA:FALSE)")
    except x509.ExtensionNotFound:
        raise ValueError("the CA certificate is not a CA (no basicConstraints)") from None
    csr = check_csr(csr_pem, ip)
    san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    now = datetime.datetime.now(datetime.timezone.utc)
    not_after = min(now + datetime.timedelta(days=days), ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(csr.subject)
        .issuer_name(ca_cert.subject)
        .public_key(csr.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=True,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(san, critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(csr.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(_PEM).decode()


def cert_ips(cert_pem: str) -> list[str]:
    """The IP addresses among the certificate's subject alternative names, in its order ([] for none)."""
    try:
        san = _load_cert(cert_pem).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(a) for a in san.get_values_for_type(x509.IPAddress)]


def cert_matches_key(cert_pem: str, key_pem: str) -> bool:
    """True when the private key `key_pem` is the one for the certificate's public key.

    ValueError when either PEM cannot be read (the message names which, never its content).
    """
    try:
        cert = _load_cert(cert_pem)
    except ValueError:
        raise ValueError("the certificate is not a PEM X.509 certificate") from None
    try:
        key = _load_key(key_pem)
    except (ValueError, TypeError):
        raise ValueError("the private key is not an unencrypted PEM private key") from None
    return _public_der(cert.public_key()) == _public_der(key.public_key())


def cert_issued_by(cert_pem: str, ca_cert_pem: str) -> bool:
    """True when the CA certificate `ca_cert_pem` signed the certificate `cert_pem` (False for unreadable PEM)."""
    try:
        _load_cert(cert_pem).verify_directly_issued_by(_load_cert(ca_cert_pem))
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def renew_due(cert_pem: str, now: datetime.datetime | None = None, renew_days: int = RENEW_DAYS) -> bool:
    """Whether a member's certificate is due for renewal at `now`: fewer than `renew_days` days left, or a
    third of its lifetime if that is shorter (a certificate cut short by its CA), or expired, or unreadable."""
    try:
        cert = _load_cert(cert_pem)
    except ValueError:
        return True
    now = now or datetime.datetime.now(datetime.timezone.utc)
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    window = min(datetime.timedelta(days=renew_days), lifetime / 3)
    return now >= cert.not_valid_after_utc - window
