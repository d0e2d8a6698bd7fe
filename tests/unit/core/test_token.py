"""meshrun.core.token: join token format, validation messages, secret hashing, durations."""

from __future__ import annotations

import base64
import hashlib
import json
import re

import pytest

from meshrun.core.token import (
    PREFIX,
    JoinToken,
    hash_secret,
    looks_like_token,
    new_token,
    parse_duration,
    parse_token,
    secret_matches,
)
from meshrun.errors import TokenError, UsageError

FP = "ab" * 32
SECRET = bytes(range(32))
SECRET_B64 = base64.urlsafe_b64encode(SECRET).decode().rstrip("=")
FIX = "copy the whole token again from the output of `meshrun token create` on the coordinator"
GARBLED = "the join token is truncated or garbled (its checksum does not match); " + FIX
NOT_B64 = "the join token is garbled (it is not valid base64url); " + FIX
MALFORMED = "the join token's contents are malformed; " + FIX


def make(**over) -> JoinToken:
    fields = dict(network="lab", endpoints=("203.0.113.1:51820",), fingerprint=FP, token_id="abcde12345", secret=SECRET)
    fields.update(over)
    return JoinToken(**fields)


def raw_token(payload: bytes) -> str:
    """A token around an arbitrary payload with a correct checksum."""
    blob = payload + hashlib.sha256(payload).digest()[:4]
    return PREFIX + base64.urlsafe_b64encode(blob).decode().rstrip("=")


def good_payload(**over) -> dict:
    d = {"n": "lab", "e": ["203.0.113.1:51820"], "f": FP, "i": "abcde12345", "s": SECRET_B64}
    d.update(over)
    return d


def token_error(value: str) -> str:
    with pytest.raises(TokenError) as info:
        parse_token(value)
    msg = str(info.value)
    assert "\n" not in msg
    assert SECRET_B64 not in msg and (not value.strip() or value.strip() not in msg)
    return msg


class TestRoundTrip:
    def test_encode_parse(self):
        tok = make(endpoints=("203.0.113.1:51820", "[2001:db8::1]:51820", "vpn.example.com:443"))
        assert parse_token(tok.encode()) == tok

    def test_prefix_and_alphabet(self):
        s = make().encode()
        assert s.startswith("mr1.")
        assert "=" not in s and "+" not in s and "/" not in s

    def test_surrounding_whitespace_is_ignored(self):
        tok = make()
        assert parse_token(f"  {tok.encode()}\n") == tok

    def test_new_token_fresh_id_and_secret(self):
        a = new_token("lab", ["203.0.113.1:51820"], FP)
        b = new_token("lab", ["203.0.113.1:51820"], FP)
        assert len(a.secret) == 32 and a.secret != b.secret and a.token_id != b.token_id
        assert re.fullmatch(r"[a-z0-9]{10}", a.token_id)
        assert parse_token(a.encode()) == a
        assert a.endpoints == ("203.0.113.1:51820",)

    def test_repr_hides_secret(self):
        tok = make()
        r = repr(tok)
        assert r == "JoinToken(network='lab', endpoints=('203.0.113.1:51820',), token_id='abcde12345')"
        assert str(SECRET) not in r and SECRET_B64 not in r and "secret" not in r

    def test_looks_like_token(self):
        assert looks_like_token(make().encode())
        assert looks_like_token("mr2.xyz")
        assert not looks_like_token("abcde12345")


class TestErrors:
    def test_garbage(self):
        assert token_error("hello") == ("this is not a meshrun join token (it must start with 'mr1.'); " + FIX)

    def test_empty(self):
        assert token_error("").startswith("this is not a meshrun join token")

    def test_wrong_version(self):
        assert token_error("mr2.xxx") == (
            "join token version mr2 is not supported by this meshrun (it reads mr1); "
            "use the same meshrun version on the node as on the coordinator"
        )

    @pytest.mark.parametrize("drop", [1, 2, 3, 4, 5, 10, 40])
    def test_truncated(self, drop):
        s = make().encode()
        cut = s[:-drop]
        body_len = len(cut) - len(PREFIX)
        # A base64 body one longer than a multiple of 4 cannot be decoded at all.
        assert token_error(cut) == (NOT_B64 if body_len % 4 == 1 else GARBLED)

    def test_every_single_flipped_character_is_caught(self):
        s = make().encode()
        for i in range(len(PREFIX), len(s)):
            c = "A" if s[i] != "A" else "B"
            flipped = s[:i] + c + s[i + 1 :]
            try:
                tok = parse_token(flipped)
            except TokenError as exc:
                assert str(exc) in (GARBLED, MALFORMED), (i, str(exc))
                assert SECRET_B64 not in str(exc)
            else:  # only the spare bits of the last character may change without changing the bytes
                assert i == len(s) - 1 and tok == make()

    def test_one_flip_in_the_middle(self):
        s = make().encode()
        i = len(s) // 2
        assert token_error(s[:i] + ("x" if s[i] != "x" else "y") + s[i + 1 :]) == GARBLED

    def test_bad_base64(self):
        assert token_error("mr1.a") == NOT_B64
        assert token_error("mr1.é") == NOT_B64  # non-ASCII

    def test_too_short_for_checksum(self):
        assert token_error("mr1.AAAA") == GARBLED
        assert token_error("mr1.") == GARBLED

    def test_malformed_json_with_valid_checksum(self):
        assert token_error(raw_token(b"{not json")) == MALFORMED
        assert token_error(raw_token(b"\xff\xfe\xfd\xfc")) == MALFORMED

    @pytest.mark.parametrize(
        "payload",
        [
            [1, 2],
            "str",
            12345,
            None,
            {"n": "lab"},
            good_payload(e="203.0.113.1:51820"),  # a string, not a list
            good_payload(e=[]),
            good_payload(e=[5]),
            good_payload(e=["no-port"]),
            good_payload(e=["203.0.113.1:99999"]),
            good_payload(n=123),
            good_payload(n="Bad_Name"),
            good_payload(n="lab\n"),
            good_payload(f="AB" * 32),
            good_payload(f=FP[:-1]),
            good_payload(f=FP + "\n"),
            good_payload(i=1234567890),
            good_payload(i="short"),
            good_payload(i="abcde12345\n"),
            good_payload(s=5),
            good_payload(s=SECRET_B64[:-4]),  # 29 bytes
            good_payload(s="!!!!"),
        ],
        ids=lambda p: json.dumps(p)[:40],
    )
    def test_bad_field_shapes(self, payload):
        assert token_error(raw_token(json.dumps(payload).encode())) == MALFORMED

    def test_hand_built_good_payload_parses(self):
        tok = parse_token(raw_token(json.dumps(good_payload()).encode()))
        assert tok == make()

    def test_error_never_contains_secret_or_token(self):
        s = make().encode()
        for bad in (s[:-3], s[:20] + "Z" + s[21:], s + "A", "mr1." + s[4:].upper(), s.replace("mr1.", "mr9.")):
            try:
                parse_token(bad)
            except TokenError as exc:
                text = f"{exc} {exc.message} {exc.fix} {exc!r}"
                assert SECRET_B64 not in text and s[4:] not in text and bad[4:] not in text
                assert "\n" not in str(exc)


class TestSecret:
    def test_hash_secret_exact(self):
        assert hash_secret(SECRET) == hashlib.sha256(b"meshrun-token-v1:" + SECRET).hexdigest()
        assert len(hash_secret(b"x")) == 64

    def test_hash_differs_from_plain_sha256(self):
        assert hash_secret(SECRET) != hashlib.sha256(SECRET).hexdigest()

    def test_secret_matches(self):
        h = hash_secret(SECRET)
        assert secret_matches(SECRET, h)
        assert not secret_matches(SECRET[:-1] + b"\x00", h)
        assert not secret_matches(b"", h)


class TestDuration:
    @pytest.mark.parametrize(
        "value,seconds",
        [
            ("90s", 90),
            ("30m", 1800),
            ("12h", 43200),
            ("7d", 604800),
            ("30d", 2592000),
            ("1s", 1),
            (" 2H ", 7200),
            ("720h", 2592000),
        ],
    )
    def test_good(self, value, seconds):
        assert parse_duration(value) == seconds

    @pytest.mark.parametrize(
        "value", ["0s", "31d", "721h", "5y", "12", "h", "", "1.5h", "-1h", "1h30m", "12h\n1", "1" * 5000 + "s", "١٢h"]
    )
    def test_bad(self, value):
        with pytest.raises(UsageError) as info:
            parse_duration(value)
        assert str(info.value) == (
            f"--ttl {value!r} is not a duration between 1s and 30d; "
            "write it as a number and a unit, e.g. --ttl 12h, 30m or 2d"
        )
        assert info.value.exit_code == 2

    def test_option_name_in_message(self):
        with pytest.raises(
            UsageError,
            match=r"^--expire '5y' is not a duration between 1s and 30d; "
            r"write it as a number and a unit, e.g. --expire 12h",
        ):
            parse_duration("5y", "--expire")


class TestSeveralCoordinators:
    KEY_B = base64.b64encode(b"b" * 32).decode()
    KEY_C = base64.b64encode(b"c" * 32).decode()

    def test_every_coordinator_travels_and_is_tried_in_order(self):
        others = (("198.51.100.7:51820", "cd" * 32, self.KEY_B), ("198.51.100.9:51820", "ef" * 32, self.KEY_C))
        tok = make(coordinator_key=base64.b64encode(b"a" * 32).decode(), others=others)
        back = parse_token(tok.encode())
        assert back == tok
        assert [c[0] for c in back.coordinators()] == ["203.0.113.1:51820", "198.51.100.7:51820", "198.51.100.9:51820"]
        assert back.coordinators()[1] == others[0]

    def test_a_token_of_one_coordinator_has_no_others(self):
        tok = make()
        assert "c" not in json.loads(base64.urlsafe_b64decode(tok.encode()[4:] + "==")[:-4])
        assert parse_token(tok.encode()).others == ()

    @pytest.mark.parametrize(
        "others",
        [
            "198.51.100.7:51820",  # not a list
            [["198.51.100.7:51820", "cd" * 32]],  # two fields
            [["198.51.100.7:51820", "xx", KEY_B]],  # fingerprint
            [["198.51.100.7:51820", "cd" * 32, "nokey"]],  # key
            [["not an endpoint", "cd" * 32, KEY_B]],
            [["198.51.100.7:51820", "cd" * 32, KEY_B]] * 17,  # too many
        ],
    )
    def test_a_malformed_coordinator_list_is_refused(self, others):
        assert token_error(raw_token(json.dumps(good_payload(c=others)).encode())) == MALFORMED
