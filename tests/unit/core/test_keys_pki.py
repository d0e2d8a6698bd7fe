"""meshrun.core.keys' X.509 helpers: the CA the coordinators' etcd members trust, CSRs, signing."""

from __future__ import annotations

import datetime
import shutil
import subprocess

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from meshrun.core.keys import cert_ips, cert_matches_key, new_ca, new_csr, sign_csr
from meshrun.errors import UsageError

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")


@pytest.fixture(scope="module")
def ca():
    return new_ca("meshrun-etcd-ca")


def ext(cert: x509.Certificate, cls):
    return cert.extensions.get_extension_for_class(cls)


def test_the_ca_is_a_self_signed_p256_ca_that_signs_certificates(ca):
    cert_pem, key_pem = ca
    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    key = serialization.load_pem_private_key(key_pem.encode(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
    assert cert.subject == cert.issuer
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "meshrun-etcd-ca"
    cert.verify_directly_issued_by(cert)
    bc = ext(cert, x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    ku = ext(cert, x509.KeyUsage)
    assert ku.critical and ku.value.key_cert_sign and not ku.value.digital_signature
    assert cert_matches_key(cert_pem, key_pem)
    life = cert.not_valid_after_utc - datetime.datetime.now(datetime.timezone.utc)
    assert 3649 <= life.days <= 3650


def test_a_ca_for_fewer_days(ca):
    cert = x509.load_pem_x509_certificate(new_ca("short", days=30)[0].encode())
    assert (cert.not_valid_after_utc - cert.not_valid_before_utc).days in (30, 29)


def test_a_csr_names_its_ip_and_nothing_else():
    key_pem, csr_pem = new_csr("coord-2", "10.7.0.2")
    csr = x509.load_pem_x509_csr(csr_pem.encode())
    assert csr.is_signature_valid
    san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["10.7.0.2"]
    assert san.get_values_for_type(x509.DNSName) == []
    assert csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "coord-2"
    key = serialization.load_pem_private_key(key_pem.encode(), None)
    assert key.public_key().public_numbers() == csr.public_key().public_numbers()
    assert "PRIVATE KEY" not in csr_pem


@pytest.mark.parametrize("bad", ["10.7.0", "coord-1", "", "10.7.0.2/32"])
def test_a_csr_needs_an_ip(bad):
    with pytest.raises(UsageError):
        new_csr("coord-1", bad)


def test_signing_gives_a_leaf_for_both_tls_ends(ca):
    key_pem, csr_pem = new_csr("coord-2", "fd00::2")
    cert_pem = sign_csr(*ca, csr_pem, days=365)
    cert = x509.load_pem_x509_certificate(cert_pem.encode())
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca[0].encode()))
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "coord-2"
    assert cert_ips(cert_pem) == ["fd00::2"]
    bc = ext(cert, x509.BasicConstraints)
    assert bc.critical and not bc.value.ca
    ku = ext(cert, x509.KeyUsage).value
    assert ku.digital_signature and ku.key_encipherment and not ku.key_cert_sign
    assert set(ext(cert, x509.ExtendedKeyUsage).value) == {
        ExtendedKeyUsageOID.SERVER_AUTH,
        ExtendedKeyUsageOID.CLIENT_AUTH,
    }
    assert cert_matches_key(cert_pem, key_pem) and not cert_matches_key(cert_pem, ca[1])
    assert (cert.not_valid_after_utc - cert.not_valid_before_utc).days in (365, 364)


def test_a_leaf_never_outlives_its_ca():
    short = new_ca("short", days=10)
    cert = x509.load_pem_x509_certificate(sign_csr(*short, new_csr("m", "10.0.0.1")[1]).encode())
    ca_cert = x509.load_pem_x509_certificate(short[0].encode())
    assert cert.not_valid_after_utc == ca_cert.not_valid_after_utc


def test_a_csr_whose_signature_does_not_verify_is_refused(ca):
    csr = x509.load_pem_x509_csr(new_csr("m", "10.0.0.1")[1].encode())
    der = bytearray(csr.public_bytes(serialization.Encoding.DER))
    der[-1] ^= 0x01  # the signature's last byte: still DER, no longer the signature
    forged = x509.load_der_x509_csr(bytes(der)).public_bytes(serialization.Encoding.PEM).decode()
    with pytest.raises(ValueError, match="signature"):
        sign_csr(*ca, forged)


def _csr_with(names: list[x509.GeneralName] | None) -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    b = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "m")]))
    if names is not None:
        b = b.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return b.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode()


@pytest.mark.parametrize("names", [None, [x509.DNSName("coord-1.example")]])
def test_a_csr_without_an_ip_is_refused(ca, names):
    with pytest.raises(ValueError, match="IP"):
        sign_csr(*ca, _csr_with(names))


def test_every_san_of_the_csr_is_copied(ca):
    import ipaddress

    csr = _csr_with([x509.IPAddress(ipaddress.ip_address("10.0.0.1")), x509.DNSName("coord-1.example")])
    cert = x509.load_pem_x509_certificate(sign_csr(*ca, csr).encode())
    san = ext(cert, x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["coord-1.example"] and cert_ips(sign_csr(*ca, csr)) == ["10.0.0.1"]


def test_signing_needs_the_cas_own_key_and_a_ca(ca):
    csr = new_csr("m", "10.0.0.1")[1]
    other = new_ca("other")
    with pytest.raises(ValueError, match="CA key"):
        sign_csr(ca[0], other[1], csr)
    leaf_key, leaf_csr = new_csr("leaf", "10.0.0.9")
    leaf = sign_csr(*ca, leaf_csr)
    with pytest.raises(ValueError, match="not a CA"):
        sign_csr(leaf, leaf_key, csr)


def test_cert_ips_of_a_certificate_without_sans(ca):
    assert cert_ips(ca[0]) == []


def test_cert_matches_key_names_what_it_cannot_read(ca):
    with pytest.raises(ValueError, match="certificate"):
        cert_matches_key("not a cert", ca[1])
    with pytest.raises(ValueError, match="private key") as err:
        cert_matches_key(ca[0], ca[1][:60])
    assert ca[1][30:60] not in str(err.value)


@needs_openssl
def test_openssl_verifies_the_chain_for_server_and_client_use(ca, tmp_path):
    (tmp_path / "ca.crt").write_text(ca[0])
    (tmp_path / "leaf.crt").write_text(sign_csr(*ca, new_csr("m", "10.7.0.2")[1]))
    for purpose in ("sslserver", "sslclient"):
        out = subprocess.run(
            ["openssl", "verify", "-purpose", purpose, "-CAfile", tmp_path / "ca.crt", tmp_path / "leaf.crt"],
            capture_output=True,
            text=True,
        )
        assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out
    ip = subprocess.run(
        ["openssl", "verify", "-verify_ip", "10.7.0.3", "-CAfile", tmp_path / "ca.crt", tmp_path / "leaf.crt"],
        capture_output=True,
        text=True,
    )
    assert ip.returncode != 0, "the certificate is for its own address only"
