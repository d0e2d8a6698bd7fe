"""meshrun.core.auth: job keys only the key holders can compute, request MACs checked before the body,
enrolment proofs of possession (pure)."""

from __future__ import annotations

import pytest

from meshrun.core import auth, keys
from meshrun.core.auth import Verifier
from meshrun.errors import AuthError

COORD_PRIV = keys.generate_private_key()
COORD = keys.public_key(COORD_PRIV)
A_PRIV, B_PRIV = keys.generate_private_key(), keys.generate_private_key()
K_A, K_B = keys.public_key(A_PRIV), keys.public_key(B_PRIV)
T = 1_700_000_000.0


def coord_side(node_pub: str) -> bytes:
    return auth.job_key(keys.shared_secret(COORD_PRIV, node_pub), COORD, node_pub)


def node_side(node_priv: str) -> bytes:
    return auth.job_key(keys.shared_secret(node_priv, COORD), COORD, keys.public_key(node_priv))


def test_both_sides_derive_the_same_job_key_and_no_one_else_can():
    assert coord_side(K_A) == node_side(A_PRIV) and len(node_side(A_PRIV)) == 32
    assert coord_side(K_A) != coord_side(K_B)
    # a member knows every public key, its own private key: it derives its own key, never another's
    mallory = keys.generate_private_key()
    assert auth.job_key(keys.shared_secret(mallory, COORD), COORD, K_A) != coord_side(K_A)
    assert auth.job_key(keys.shared_secret(mallory, K_A), COORD, K_A) != coord_side(K_A)


def test_a_signed_request_verifies_once():
    key = coord_side(K_A)
    v = Verifier(key)
    h = auth.sign(key, "POST", "/v1/jobs/j1/start", b'{"argv": ["x"]}', T)
    v.verify(h, "POST", "/v1/jobs/j1/start", b'{"argv": ["x"]}', T + 1)
    with pytest.raises(AuthError, match="already used once"):
        v.verify(h, "POST", "/v1/jobs/j1/start", b'{"argv": ["x"]}', T + 2)


def test_the_head_is_checked_before_the_body_and_the_body_after():
    key = coord_side(K_A)
    h = auth.sign(key, "POST", "/v1/jobs/j1/code", b"tarball", T)
    digest = Verifier(key).head(h, "POST", "/v1/jobs/j1/code", T)
    Verifier.body(digest, auth.body_hash(b"tarball"))
    with pytest.raises(AuthError, match="not the one it was signed with"):
        Verifier.body(digest, auth.body_hash(b"another tarball"))
    with pytest.raises(AuthError, match="does not match"):  # no body needed to refuse a stranger
        Verifier(coord_side(K_B)).head(h, "POST", "/v1/jobs/j1/code", T)


@pytest.mark.parametrize(
    "method, path, body",
    [
        ("POST", "/v1/jobs/j1/start", b'{"argv": ["rm"]}'),  # body changed
        ("POST", "/v1/jobs/j2/start", b'{"argv": ["x"]}'),  # another job
        ("GET", "/v1/jobs/j1/start", b'{"argv": ["x"]}'),  # another method
    ],
)
def test_any_change_breaks_the_mac(method, path, body):
    key = coord_side(K_A)
    h = auth.sign(key, "POST", "/v1/jobs/j1/start", b'{"argv": ["x"]}', T)
    with pytest.raises(AuthError, match="does not match|not the one it was signed with"):
        Verifier(key).verify(h, method, path, body, T)


def test_each_node_has_its_own_key():
    a, b = coord_side(K_A), coord_side(K_B)
    h = auth.sign(b, "GET", "/v1/health", b"", T)
    with pytest.raises(AuthError, match="does not match the key it must be signed with"):
        Verifier(a).verify(h, "GET", "/v1/health", b"", T)


def test_two_members_share_one_overlay_key_whichever_computes_it_and_no_third_can():
    """An agent and a coordinator (or two coordinators) derive the same overlay key, each from its own private key
    and the other's public key; it is not their job key, and no other member's private key gives it."""
    pa, pb, pc = (keys.generate_private_key() for _ in range(3))
    a, b = keys.public_key(pa), keys.public_key(pb)
    from_a = auth.overlay_key(keys.shared_secret(pa, b), a, b)
    assert from_a == auth.overlay_key(keys.shared_secret(pb, a), b, a)
    assert from_a != auth.job_key(keys.shared_secret(pa, b), a, b)
    assert from_a != auth.overlay_key(keys.shared_secret(pc, b), keys.public_key(pc), b)
    v = Verifier(from_a, sender=auth.OVERLAY_SENDER)
    with pytest.raises(AuthError, match="come only from meshrun's agent"):
        v.verify(None, "POST", "/v1/sync", b"{}", T)
    v.verify(auth.sign(from_a, "POST", "/v1/sync", b"{}", T), "POST", "/v1/sync", b"{}", T)


def test_stale_or_future_time_is_refused_naming_the_skew():
    key = coord_side(K_A)
    with pytest.raises(AuthError, match=r"signed \+301 s from this node's clock"):
        Verifier(key).verify(auth.sign(key, "GET", "/x", b"", T), "GET", "/x", b"", T + 301)
    with pytest.raises(AuthError, match=r"signed -400 s"):
        Verifier(key).verify(auth.sign(key, "GET", "/x", b"", T + 400), "GET", "/x", b"", T)
    Verifier(key).verify(auth.sign(key, "GET", "/x", b"", T), "GET", "/x", b"", T + 299)


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer abc",
        "MeshrunMAC v2 1 n " + "0" * 64 + " m",
        "MeshrunMAC v1 1 abcdefgh " + "0" * 64 + " m",
        "MeshrunMAC v2 -5 abcdefgh " + "0" * 64 + " m",
        "MeshrunMAC v2 5 abcdefgh nothex m",
        "MeshrunMAC v2 5 ab/cdefgh " + "0" * 64 + " m",
    ],
)
def test_unsigned_or_malformed_headers_are_refused(header):
    with pytest.raises(AuthError):
        Verifier(coord_side(K_A)).head(header, "GET", "/x", T)


def test_nonce_memory_is_bounded_and_forgets_only_what_the_clock_refuses_anyway():
    key = coord_side(K_A)
    v = Verifier(key, window=10, max_nonces=3)
    for i in range(5):
        v.verify(auth.sign(key, "GET", "/x", b"", T + i), "GET", "/x", b"", T + i)
    assert len(v._seen) <= 3
    old = auth.sign(key, "GET", "/x", b"", T)
    with pytest.raises(AuthError, match="signed"):  # too old to replay by then
        v.verify(old, "GET", "/x", b"", T + 30)


def test_an_enrolment_proof_needs_the_private_key():
    proof = auth.enrol_proof(keys.shared_secret(A_PRIV, COORD), "lab", "gpu-a", K_A, "tok0000001", T)
    auth.check_enrol_proof(keys.shared_secret(COORD_PRIV, K_A), "lab", "gpu-a", K_A, "tok0000001", proof, T + 5)
    # someone who knows K_A (every member does) but not its private key
    forged = auth.enrol_proof(
        keys.shared_secret(keys.generate_private_key(), COORD), "lab", "gpu-a", K_A, "tok0000001", T
    )
    for bad, needle in ((forged, "did not prove"), (None, "carries no proof"), ({"time": "x", "proof": 1}, "no proof")):
        with pytest.raises(AuthError, match=needle):
            auth.check_enrol_proof(keys.shared_secret(COORD_PRIV, K_A), "lab", "gpu-a", K_A, "tok0000001", bad, T)
    with pytest.raises(AuthError, match="did not prove"):  # bound to the name it was made for
        auth.check_enrol_proof(keys.shared_secret(COORD_PRIV, K_A), "lab", "gpu-b", K_A, "tok0000001", proof, T)
    with pytest.raises(AuthError, match="coordinator's clock"):
        auth.check_enrol_proof(keys.shared_secret(COORD_PRIV, K_A), "lab", "gpu-a", K_A, "tok0000001", proof, T + 400)


def test_a_low_order_public_key_gives_no_secret():
    from meshrun.errors import UsageError

    with pytest.raises(UsageError, match="low-order"):
        keys.shared_secret(COORD_PRIV, "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=")
