"""Property-based fuzzing of the parsers that see untrusted input (bounded budget).

The coordinator's HTTP handlers are fuzzed at the HTTP level elsewhere.
"""

from __future__ import annotations

import base64
import hashlib
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import json_strategy

from meshrun.core.model import Member, Network, parse_endpoint
from meshrun.core.token import PREFIX, JoinToken, parse_duration, parse_token
from meshrun.errors import TokenError, UsageError

BUDGET = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SECRET = bytes(range(32))
VALID = JoinToken("lab", ("203.0.113.1:51820", "[2001:db8::1]:51820"), "ab" * 32, "abcde12345", SECRET).encode()
SECRET_B64 = base64.urlsafe_b64encode(SECRET).decode().rstrip("=")
KEY = "j0DFrbaPJWJK5bIU6nZ6bslNgp09e14a0bpvPiE4KF8="

json_values = json_strategy()


def _check_token_error(value: str) -> None:
    try:
        tok = parse_token(value)
    except TokenError as exc:
        msg = str(exc)
        assert "\n" not in msg and SECRET_B64 not in msg
        return
    # Anything accepted must be fully valid and round-trip.
    assert parse_token(tok.encode()) == tok
    assert len(tok.secret) == 32 and tok.endpoints


@BUDGET
@given(st.text(max_size=300))
def test_parse_token_arbitrary_text(value):
    _check_token_error(value)


@BUDGET
@given(st.text(max_size=200))
def test_parse_token_prefixed_text(value):
    _check_token_error(PREFIX + value)


@BUDGET
@given(st.data())
def test_parse_token_mutated_valid_token(data):
    s = VALID
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "drop", "insert", "truncate", "swap"]))
        i = data.draw(st.integers(0, max(len(s) - 1, 0)))
        c = data.draw(st.characters())
        if op == "flip":
            s = s[:i] + c + s[i + 1 :]
        elif op == "drop":
            s = s[:i] + s[i + 1 :]
        elif op == "insert":
            s = s[:i] + c + s[i:]
        elif op == "truncate":
            s = s[:i]
        elif len(s) > i + 1:
            s = s[:i] + s[i + 1] + s[i] + s[i + 2 :]
    _check_token_error(s)


@BUDGET
@given(json_values)
def test_parse_token_arbitrary_payload_with_valid_checksum(obj):
    payload = json.dumps(obj).encode()
    blob = payload + hashlib.sha256(payload).digest()[:4]
    _check_token_error(PREFIX + base64.urlsafe_b64encode(blob).decode().rstrip("="))


good_payload = st.fixed_dictionaries(
    {
        "n": st.sampled_from(["lab", "x", "a" * 32]) | st.text(max_size=10) | st.integers(),
        "e": st.lists(st.sampled_from(["203.0.113.1:51820", "h:1", "[::1]:2"]) | st.text(max_size=10), max_size=3)
        | st.text(max_size=5),
        "f": st.sampled_from(["ab" * 32]) | st.text(max_size=70),
        "i": st.sampled_from(["abcde12345"]) | st.text(max_size=12),
        "s": st.sampled_from([SECRET_B64]) | st.text(max_size=50),
    }
)


@BUDGET
@given(good_payload)
def test_parse_token_near_valid_payloads(obj):
    payload = json.dumps(obj).encode()
    blob = payload + hashlib.sha256(payload).digest()[:4]
    _check_token_error(PREFIX + base64.urlsafe_b64encode(blob).decode().rstrip("="))


@BUDGET
@given(json_values)
def test_member_from_dict_arbitrary(obj):
    try:
        Member.from_dict(obj)
    except ValueError:
        pass


member_like = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["gpu-a"]) | json_values,
        "public_key": st.sampled_from([KEY]) | json_values,
        "overlay_ip": st.sampled_from(["10.213.0.2"]) | json_values,
    },
    optional={
        "endpoint": st.sampled_from(["1.2.3.4:5", "[::1]:9", None]) | json_values,
        "candidates": st.lists(st.text(max_size=30), max_size=3) | json_values,
        "is_coordinator": json_values,
        "last_handshake": st.integers() | json_values,
    },
)


@BUDGET
@given(member_like)
def test_member_from_dict_near_valid(obj):
    try:
        m = Member.from_dict(obj)
    except ValueError:
        return
    assert Member.from_dict(m.to_dict()) == m


network_like = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["lab"]) | json_values,
        "cidr": st.sampled_from(["10.213.0.0/16", "fd00::/64"]) | json_values,
        "interface": st.sampled_from(["meshrun0"]) | json_values,
        "listen_port": st.sampled_from([51820]) | json_values,
        "mtu": st.sampled_from([1420]) | st.integers() | json_values,
        "coordinator_ip": st.sampled_from(["10.213.0.1"]) | json_values,
        "coordinator_public_key": st.sampled_from([KEY]) | json_values,
        "endpoints": st.lists(st.text(max_size=20), max_size=3) | json_values,
        "fingerprint": st.sampled_from(["ab" * 32]) | json_values,
        "api_port": st.sampled_from([51821]) | json_values,
        "rdzv_port": st.sampled_from([29400]) | json_values,
    }
)


@BUDGET
@given(json_values)
def test_network_from_dict_arbitrary(obj):
    try:
        Network.from_dict(obj)
    except ValueError:
        pass


@BUDGET
@given(network_like)
def test_network_from_dict_near_valid(obj):
    try:
        n = Network.from_dict(obj)
    except ValueError:
        return
    assert Network.from_dict(n.to_dict()) == n


@BUDGET
@given(st.text(max_size=80), st.none() | st.integers(1, 65535))
def test_parse_endpoint_only_value_error(value, default):
    try:
        out = parse_endpoint(value, default)
    except ValueError:
        return
    assert parse_endpoint(out) == out


@BUDGET
@given(st.text(max_size=30) | st.from_regex(r"\A[0-9]{1,6000}[smhd]\Z", fullmatch=True))
def test_parse_duration_only_usage_error(value):
    try:
        seconds = parse_duration(value)
    except UsageError as exc:
        assert "\n" not in str(exc).replace(repr(value), "")
        return
    assert 1 <= seconds <= 30 * 86400
