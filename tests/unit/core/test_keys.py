"""meshrun.core.keys: WireGuard keys and the coordinator's TLS identity."""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from meshrun.core.keys import (
    cert_fingerprint,
    decode_key,
    generate_private_key,
    generate_tls_identity,
    is_public_key,
    public_key,
)
from meshrun.errors import UsageError

# Computed with `echo PRIVATE | wg pubkey` (wireguard-tools); the first private key is
# bytes 0..31, not clamped: WireGuard and X25519 clamp it the same way.
VECTORS = [
    ("AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=", "j0DFrbaPJWJK5bIU6nZ6bslNgp09e14a0bpvPiE4KF8="),
    ("UGPrxkGtf7NS043XEah/Axhqr7YTXB4MzFvrfrAZyUs=", "omjXDyOxNCkYbimc/y3YipnkEnnasAyCC8uW60+7wVU="),
]
needs_wg = pytest.mark.skipif(shutil.which("wg") is None, reason="wireguard-tools not installed")
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")


def wg_pubkey(private: str) -> str:
    return subprocess.run(
        ["wg", "pubkey"], input=private + "\n", capture_output=True, text=True, check=True
    ).stdout.strip()


class TestWireGuardKeys:
    @pytest.mark.parametrize("private,public", VECTORS)
    def test_known_vectors(self, private, public):
        assert public_key(private) == public

    @needs_wg
    def test_matches_wg_pubkey_for_fresh_keys(self):
        for _ in range(3):
            k = generate_private_key()
            assert public_key(k) == wg_pubkey(k)

    def test_generated_key_format(self):
        k = generate_private_key()
        assert len(k) == 44 and k.endswith("=")
        raw = base64.b64decode(k)
        assert len(raw) == 32
        assert generate_private_key() != k

    def test_public_key_strips_whitespace(self):
        private, public = VECTORS[0]
        assert public_key(f" {private}\n") == public

    @pytest.mark.parametrize(
        "value",
        [
            "",
            "abc",
            "A" * 44,
            "AAAA" * 11,
            "!" * 43 + "=",
            base64.b64encode(bytes(31)).decode(),
            base64.b64encode(bytes(33)).decode(),
            "é" * 44,
        ],
    )
    def test_decode_key_errors(self, value):
        with pytest.raises(UsageError) as info:
            decode_key(value, "private key")
        assert str(info.value) == (
            "the private key is not a WireGuard key (44 base64 characters for 32 bytes); "
            "pass a key made by meshrun or `wg genkey`/`wg pubkey`"
        )

    def test_decode_key_never_repeats_value(self):
        secret = VECTORS[1][0][:-2] + "!="
        with pytest.raises(UsageError) as info:
            public_key(secret)
        assert secret not in str(info.value) and secret[:20] not in str(info.value)
        assert "the private key is not a WireGuard key" in str(info.value)

    def test_decode_key_round_trip(self):
        assert decode_key(VECTORS[0][0]) == bytes(range(32))

    def test_non_canonical_spelling_is_refused(self):
        # b64decode ignores the 2 spare low bits of the last character: '8' and '9' decode alike.
        pub = VECTORS[0][1]
        assert pub[42] == "8"
        alt = pub[:42] + "9="
        assert base64.b64decode(alt) == base64.b64decode(pub)
        assert not is_public_key(alt)
        with pytest.raises(UsageError):
            decode_key(alt)

    def test_is_public_key(self):
        assert is_public_key(VECTORS[0][1])
        assert not is_public_key(VECTORS[0][1] + " ")
        assert not is_public_key(" " + VECTORS[0][1][:-1])
        assert not is_public_key(None)
        assert not is_public_key(42)
        assert not is_public_key(b"x" * 44)
        assert not is_public_key("A" * 44)


class TestTLS:
    def test_identity_shape(self):
        cert_pem, key_pem = generate_tls_identity("meshrun-lab")
        cert = x509.load_pem_x509_certificate(cert_pem)
        key = serialization.load_pem_private_key(key_pem, None)
        assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
        assert cert.subject == cert.issuer
        assert cert.subject.rfc4514_string() == "CN=meshrun-lab"
        assert cert.public_key().public_numbers() == key.public_key().public_numbers()
        assert (cert.not_valid_after_utc - cert.not_valid_before_utc).days == 3650
        assert key_pem.startswith(b"-----BEGIN PRIVATE KEY-----")

    def test_fingerprint_is_sha256_of_der(self):
        cert_pem, _ = generate_tls_identity("x", days=1)
        der = x509.load_pem_x509_certificate(cert_pem).public_bytes(serialization.Encoding.DER)
        fp = hashlib.sha256(der).hexdigest()
        assert cert_fingerprint(cert_pem) == fp
        assert cert_fingerprint(der) == fp
        assert cert_fingerprint(b"\n" + cert_pem) == fp
        assert len(fp) == 64 and fp == fp.lower()

    def test_fresh_identities_differ(self):
        assert cert_fingerprint(generate_tls_identity("x")[0]) != cert_fingerprint(generate_tls_identity("x")[0])

    @needs_openssl
    def test_fingerprint_matches_openssl(self, tmp_path):
        cert_pem, _ = generate_tls_identity("meshrun-lab")
        path = tmp_path / "tls.crt"
        path.write_bytes(cert_pem)
        out = subprocess.run(
            ["openssl", "x509", "-in", str(path), "-noout", "-fingerprint", "-sha256"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        # e.g. "sha256 Fingerprint=E5:F7:..." (the label's case varies between OpenSSL versions)
        assert out.split("=", 1)[1].replace(":", "").lower() == cert_fingerprint(cert_pem)
