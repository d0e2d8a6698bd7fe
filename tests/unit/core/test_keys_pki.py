"""meshrun.core.keys' X.509 helpers: the CA the coordinators' etcd members trust, CSRs, signing."""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import subprocess

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from meshrun.core import keys
from meshrun.core.keys import (
    CertificateRequestError,
    cert_ips,
    cert_matches_key,
    check_csr,
    new_ca,
    new_csr,
    sign_csr,
)
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
    cert_pem = sign_csr(*ca, csr_pem, "fd00::2", days=365)
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
    cert = x509.load_pem_x509_certificate(sign_csr(*short, new_csr("m", "10.0.0.1")[1], "10.0.0.1").encode())
    ca_cert = x509.load_pem_x509_certificate(short[0].encode())
    assert cert.not_valid_after_utc == ca_cert.not_valid_after_utc


def test_a_csr_whose_signature_does_not_verify_is_refused(ca):
    csr = x509.load_pem_x509_csr(new_csr("m", "10.0.0.1")[1].encode())
    der = bytearray(csr.public_bytes(serialization.Encoding.DER))
    der[-1] ^= 0x01  # the signature's last byte: still DER, no longer the signature
    forged = x509.load_der_x509_csr(bytes(der)).public_bytes(serialization.Encoding.PEM).decode()
    with pytest.raises(CertificateRequestError, match="signature"):
        sign_csr(*ca, forged, "10.0.0.1")


def _csr_with(names: list[x509.GeneralName] | None) -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    b = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "m")]))
    if names is not None:
        b = b.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return b.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode()


@pytest.mark.parametrize(
    "names, shown",
    [
        (None, "no IP address"),
        ([x509.DNSName("coord-1.example")], "DNSName:coord-1.example"),
        ([x509.IPAddress(ipaddress.ip_address("10.0.0.9"))], "10.0.0.9"),
        ([x509.IPAddress(ipaddress.ip_address("10.0.0.1")), x509.DNSName("coord-1.example")], "coord-1.example"),
        ([x509.IPAddress(ipaddress.ip_address("10.0.0.1"))] * 2, "'10.0.0.1', '10.0.0.1'"),
        ([x509.IPAddress(ipaddress.ip_address("10.0.0.1")), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))], "127"),
    ],
)
def test_a_csr_for_anything_but_exactly_the_members_overlay_address_is_refused(ca, names, shown):
    with pytest.raises(CertificateRequestError) as err:
        sign_csr(*ca, _csr_with(names), "10.0.0.1")
    assert isinstance(err.value, UsageError), "a typed error of meshrun's, with its fix"
    assert shown in err.value.message and "10.0.0.1" in err.value.message
    assert "\n" not in err.value.message and "10.0.0.1" in err.value.fix


def test_a_request_made_for_another_members_address_is_refused_naming_both():
    ca = new_ca("c")
    _, csr = new_csr("gpu-b", "10.7.0.3")
    with pytest.raises(CertificateRequestError) as err:
        sign_csr(*ca, csr, "10.7.0.2")
    assert "['10.7.0.3']" in err.value.message and "not exactly 10.7.0.2" in err.value.message
    assert check_csr(csr, "10.7.0.3").is_signature_valid


def test_a_request_that_is_no_csr_is_refused():
    with pytest.raises(CertificateRequestError, match="not a PEM certificate request"):
        check_csr("-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n", "10.0.0.1")


def test_the_exact_request_is_signed_with_its_one_ip(ca):
    csr = _csr_with([x509.IPAddress(ipaddress.ip_address("10.0.0.1"))])
    cert = x509.load_pem_x509_certificate(sign_csr(*ca, csr, "10.0.0.1").encode())
    san = ext(cert, x509.SubjectAlternativeName).value
    assert [str(a.value) for a in san] == ["10.0.0.1"]


def test_signing_needs_the_cas_own_key_and_a_ca(ca):
    csr = new_csr("m", "10.0.0.1")[1]
    other = new_ca("other")
    with pytest.raises(ValueError, match="CA key"):
        sign_csr(ca[0], other[1], csr, "10.0.0.1")
    leaf_key, leaf_csr = new_csr("leaf", "10.0.0.9")
    leaf = sign_csr(*ca, leaf_csr, "10.0.0.9")
    with pytest.raises(ValueError, match="not a CA"):
        sign_csr(leaf, leaf_key, csr, "10.0.0.1")


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
    (tmp_path / "leaf.crt").write_text(sign_csr(*ca, new_csr("m", "10.7.0.2")[1], "10.7.0.2"))
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


# --------------------------------------------------------------------------- lifetimes and renewal


def test_a_member_certificate_lives_90_days_by_default(ca):
    cert = x509.load_pem_x509_certificate(sign_csr(*ca, new_csr("m", "10.0.0.1")[1], "10.0.0.1").encode())
    assert (cert.not_valid_after_utc - cert.not_valid_before_utc).days == keys.LEAF_DAYS == 90
    assert keys.RENEW_DAYS < keys.LEAF_DAYS / 2, "renewed with weeks to spare: a coordinator may be down a while"


def _at(cert_pem: str, days: float) -> datetime.datetime:
    return x509.load_pem_x509_certificate(cert_pem.encode()).not_valid_before_utc + datetime.timedelta(days=days)


def test_renewal_is_due_30_days_before_the_end(ca):
    leaf = sign_csr(*ca, new_csr("m", "10.0.0.1")[1], "10.0.0.1")
    assert not keys.renew_due(leaf)
    assert not keys.renew_due(leaf, _at(leaf, 59.9))
    assert keys.renew_due(leaf, _at(leaf, 60.1))
    assert keys.renew_due(leaf, _at(leaf, 120)), "expired: certainly due"


def test_a_certificate_cut_short_by_its_ca_is_renewed_at_two_thirds(ca):
    leaf = sign_csr(*ca, new_csr("m", "10.0.0.1")[1], "10.0.0.1", days=9)
    assert not keys.renew_due(leaf, _at(leaf, 5.9)) and keys.renew_due(leaf, _at(leaf, 6.1))


def test_an_unreadable_certificate_is_due(ca):
    assert keys.renew_due("") and keys.renew_due("not a certificate")


def test_cert_issued_by_names_the_signing_ca(ca):
    leaf = sign_csr(*ca, new_csr("m", "10.0.0.1")[1], "10.0.0.1")
    assert keys.cert_issued_by(leaf, ca[0])
    assert not keys.cert_issued_by(leaf, new_ca("meshrun-etcd-ca")[0]), "the same name, another key"
    assert not keys.cert_issued_by("garbage", ca[0])


def test_a_renewal_keeps_the_key(ca):
    key_pem, _ = new_csr("m", "10.0.0.1")
    cert = sign_csr(*ca, keys.csr_for_key(key_pem, "m", "10.0.0.1"), "10.0.0.1")
    assert cert_matches_key(cert, key_pem) and cert_ips(cert) == ["10.0.0.1"]
