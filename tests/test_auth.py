"""meshrun.core.auth: request MACs for job control (pure)."""

from __future__ import annotations

import pytest

from meshrun.core import auth
from meshrun.core.auth import AuthError, Verifier

NET = bytes(range(32))
K_A = "omjXDyOxNCkYbimc/y3YipnkEnnasAyCC8uW60+7wVU="
K_B = "xTIBA5rboUvnH4htodjb6e697QjLERt1NAB4mZqp8Dg="
T = 1_700_000_000.0


def test_a_signed_request_verifies_once():
    key = auth.node_key(NET, K_A)
    v = Verifier(key)
    h = auth.sign(key, "POST", "/v1/jobs/j1/start", b'{"argv": ["x"]}', T)
    v.verify(h, "POST", "/v1/jobs/j1/start", b'{"argv": ["x"]}', T + 1)
    with pytest.raises(AuthError, match="already used once"):
        v.verify(h, "POST", "/v1/jobs/j1/start", b'{"argv": ["x"]}', T + 2)


@pytest.mark.parametrize("method, path, body, needle", [
    ("POST", "/v1/jobs/j1/start", b'{"argv": ["rm"]}', "does not match"),    # body changed
    ("POST", "/v1/jobs/j2/start", b'{"argv": ["x"]}', "does not match"),     # another job
    ("GET", "/v1/jobs/j1/start", b'{"argv": ["x"]}', "does not match"),      # another method
])
def test_any_change_breaks_the_mac(method, path, body, needle):
    key = auth.node_key(NET, K_A)
    h = auth.sign(key, "POST", "/v1/jobs/j1/start", b'{"argv": ["x"]}', T)
    with pytest.raises(AuthError, match=needle):
        Verifier(key).verify(h, method, path, body, T)


def test_each_node_has_its_own_key_and_the_network_key_opens_nothing_directly():
    a, b = auth.node_key(NET, K_A), auth.node_key(NET, K_B)
    assert a != b and len(a) == 32
    for key in (b, NET):
        h = auth.sign(key, "GET", "/v1/health", b"", T)
        with pytest.raises(AuthError, match="does not match this node's job key"):
            Verifier(a).verify(h, "GET", "/v1/health", b"", T)


def test_stale_or_future_time_is_refused_naming_the_skew():
    key = auth.node_key(NET, K_A)
    with pytest.raises(AuthError, match=r"signed \+301 s from this node's clock"):
        Verifier(key).verify(auth.sign(key, "GET", "/x", b"", T), "GET", "/x", b"", T + 301)
    with pytest.raises(AuthError, match=r"signed -400 s"):
        Verifier(key).verify(auth.sign(key, "GET", "/x", b"", T + 400), "GET", "/x", b"", T)
    Verifier(key).verify(auth.sign(key, "GET", "/x", b"", T), "GET", "/x", b"", T + 299)


@pytest.mark.parametrize("header", [None, "", "Bearer abc", "MeshrunMAC v1 1 n m", "MeshrunMAC v2 1 abcdefgh m",
                                    "MeshrunMAC v1 -5 abcdefgh m", "MeshrunMAC v1 5 ab/cdefgh m x"])
def test_unsigned_or_malformed_headers_are_refused(header):
    with pytest.raises(AuthError):
        Verifier(NET).verify(header, "GET", "/x", b"", T)


def test_nonce_memory_is_bounded_and_forgets_only_what_the_clock_refuses_anyway():
    key = auth.node_key(NET, K_A)
    v = Verifier(key, window=10, max_nonces=3)
    for i in range(5):
        v.verify(auth.sign(key, "GET", "/x", b"", T + i), "GET", "/x", b"", T + i)
    assert len(v._seen) <= 3
    old = auth.sign(key, "GET", "/x", b"", T)
    with pytest.raises(AuthError, match="signed"):         # too old to replay by then
        v.verify(old, "GET", "/x", b"", T + 30)


def test_key_text_round_trip_and_bad_keys():
    assert auth.decode_key(auth.encode_key(NET)) == NET
    for bad in ("", "abc", auth.encode_key(NET[:31])):
        with pytest.raises(AuthError) as exc:
            auth.decode_key(bad)
        assert bad not in str(exc.value) or bad == ""
