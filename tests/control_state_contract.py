"""The control-state contract: what every backend of meshrun.system.control.state.ControlState does, written once.

tests/unit/system/test_control_state.py runs these classes against each backend through one fixture, `db`:
SQLite (CoordinatorDB), etcd in memory (EtcdCoordinatorDB over FakeEtcd) and a real etcd (EtcdCoordinatorDB over
a single-member etcd with TLS). Each test gets a store holding one coordinator ("coord", 10.213.0.1) and one
token ("tok0000001", SECRET, an hour from NOW, unlimited uses); a new backend is one more fixture parameter.
"""

from __future__ import annotations

import base64
import json

import pytest

from meshrun.core import admission
from meshrun.core.model import Member
from meshrun.core.pairpaths import PairState
from meshrun.errors import StateError, TokenError
from meshrun.system.control.coordinatordb import TokenInfo

CIDR = "10.213.0.0/16"
SECRET = b"s" * 32
NOW = 1_700_000_000.0
FIX_NEW = "ask the coordinator's operator for a new token (`meshrun token create`)"
UNKNOWN = "the coordinator does not know this join token (wrong network, or deleted); " + FIX_NEW
NETWORK = {
    "name": "lab",
    "cidr": CIDR,
    "interface": "meshrun0",
    "listen_port": 51820,
    "mtu": 1420,
    "coordinator_ip": "10.213.0.1",
    "coordinator_public_key": "",  # set to key(0) below
    "endpoints": ["203.0.113.1:51820"],
    "fingerprint": "ab" * 32,
    "api_port": 51821,
    "rdzv_port": 29400,
}


def key(i: int) -> str:
    """A distinct, well-formed public key per i (these tests never need the private half)."""
    return base64.b64encode(i.to_bytes(4, "big") * 8).decode()


def seed(db) -> None:
    """What every contract test starts from (see the module docstring)."""
    db.add_coordinator("coord", key(0), "10.213.0.1")
    db.add_token("tok0000001", SECRET, 3600, None, now=NOW)


def enrol(db, name, i, token_id="tok0000001", secret=SECRET, now=NOW + 1, cidr=CIDR):
    return db.enrol(token_id, secret, name, key(i), [f"172.31.40.{i % 250}:51820"], cidr, now=now)


class TestTokens:
    def test_list_and_status(self, db):
        db.add_token("tok0000002", b"t" * 32, 60, 2, now=NOW + 10)
        infos = db.tokens()
        assert infos == [
            TokenInfo("tok0000001", NOW, NOW + 3600, None, 0, False),
            TokenInfo("tok0000002", NOW + 10, NOW + 70, 2, 0, False),
        ]
        assert infos[1].to_dict(NOW + 20) == {
            "id": "tok0000002",
            "created_at": NOW + 10,
            "expires_at": NOW + 70,
            "max_uses": 2,
            "uses": 0,
            "uses_left": 2,
            "status": "valid",
        }
        assert infos[0].to_dict(NOW)["uses_left"] is None

    def test_status_transitions(self):
        t = TokenInfo("x", NOW, NOW + 60, 1, 0, False)
        assert t.status(NOW) == "valid"
        assert t.status(NOW + 60) == "expired"
        assert TokenInfo("x", NOW, NOW + 60, 1, 1, False).status(NOW) == "used up"
        assert TokenInfo("x", NOW, NOW + 60, 1, 1, True).status(NOW + 999) == "revoked"
        assert TokenInfo("x", NOW, NOW + 60, 1, 5, False).to_dict(NOW)["uses_left"] == 0

    def test_never_exposes_secret_or_hash(self, db):
        from meshrun.core.token import hash_secret

        h = hash_secret(SECRET)
        for t in db.tokens():
            text = repr(t) + json.dumps(t.to_dict(NOW))
            assert h not in text and SECRET.decode() not in text
            assert not any("secret" in k or "hash" in k for k in t.to_dict(NOW))

    def test_revoke(self, db):
        assert db.revoke_token("tok0000001", now=NOW + 5) is True
        assert db.tokens()[0].revoked
        assert db.revoke_token("tok0000001") is True  # already revoked: still "exists"
        assert db.revoke_token("nosuchtok1") is False


class TestEnrol:
    def test_first_member_gets_second_address(self, db):
        m, created = enrol(db, "gpu-a", 1)
        assert created is True
        assert m == Member("gpu-a", key(1), "10.213.0.2", None, ("172.31.40.1:51820",))
        assert db.tokens()[0].uses == 1
        assert db.member_by_name("gpu-a") == m
        assert db.member_by_ip("10.213.0.2") == m

    def test_version_bumps(self, db):
        v = db.version()
        enrol(db, "gpu-a", 1)
        assert db.version() == v + 1

    def test_unknown_token_and_wrong_secret_same_message(self, db):
        with pytest.raises(TokenError) as a:
            enrol(db, "gpu-a", 1, token_id="nosuchtok1")
        with pytest.raises(TokenError) as b:
            enrol(db, "gpu-a", 1, secret=b"x" * 32)
        assert str(a.value) == str(b.value) == UNKNOWN
        assert db.members()[-1].name == "coord" and db.tokens()[0].uses == 0

    def test_revoked(self, db):
        db.revoke_token("tok0000001")
        with pytest.raises(TokenError) as info:
            enrol(db, "gpu-a", 1)
        assert str(info.value) == "this join token has been revoked; " + FIX_NEW

    def test_expired(self, db):
        enrol(db, "gpu-a", 1, now=NOW + 3599)
        with pytest.raises(TokenError) as info:
            enrol(db, "gpu-b", 2, now=NOW + 3600)
        assert str(info.value) == "this join token has expired; " + FIX_NEW

    def test_used_up(self, db):
        db.add_token("tok0000002", SECRET, 3600, 2, now=NOW)
        enrol(db, "gpu-a", 1, token_id="tok0000002")
        enrol(db, "gpu-b", 2, token_id="tok0000002")
        with pytest.raises(TokenError) as info:
            enrol(db, "gpu-c", 3, token_id="tok0000002")
        assert str(info.value) == "this join token is used up (2 of 2 uses); " + FIX_NEW
        assert [m.name for m in db.members()] == ["coord", "gpu-a", "gpu-b"]

    def test_re_enrol_same_name_and_key_returns_existing(self, db):
        m, created = enrol(db, "gpu-a", 1)
        again, created2 = db.enrol("tok0000001", SECRET, "gpu-a", key(1), ["10.0.0.9:1"], CIDR, now=NOW + 2)
        assert created and not created2
        assert again == m  # a retry after a lost answer
        assert db.tokens()[0].uses == 1

    def test_a_used_up_token_is_refused_even_for_an_existing_member(self, db):
        """A used-up token plus a member's name and public key gets nothing back (security finding 1)."""
        db.add_token("tok0000002", SECRET, 3600, 1, now=NOW)
        enrol(db, "gpu-a", 1, token_id="tok0000002")
        with pytest.raises(TokenError, match="used up"):
            db.enrol("tok0000002", SECRET, "gpu-a", key(1), [], CIDR, now=NOW + 2)

    def test_name_taken(self, db):
        enrol(db, "gpu-a", 1)
        db.heartbeat("10.213.0.2", [], now=NOW + 5)  # it completed its join
        with pytest.raises(StateError) as info:
            enrol(db, "gpu-a", 2)
        assert str(info.value) == (
            "the name 'gpu-a' is already taken by another member; "
            "pick another --name, or `meshrun remove` the old member first"
        )

    def test_coordinator_name_never_reclaimed(self, db):
        with pytest.raises(StateError, match="^the name 'coord' is already taken by another member"):
            enrol(db, "coord", 1)

    def test_a_joining_nodes_name_cannot_be_squatted_and_a_failed_join_frees_it_later(self, db):
        first, _ = enrol(db, "gpu-a", 1)  # never synced yet: it is joining, or its join failed
        with pytest.raises(StateError, match="being taken by a node that is joining right now"):
            enrol(db, "gpu-a", 2, now=NOW + 60)
        second, created = enrol(db, "gpu-a", 2, now=NOW + 1 + admission.PENDING_GRACE_S)
        assert created and second.overlay_ip == "10.213.0.3" and first.overlay_ip == "10.213.0.2"
        assert [m.public_key for m in db.members()] == [key(0), key(2)]
        assert db.is_removed_ip("10.213.0.2")  # its address waits out the quarantine
        third, _ = enrol(db, "gpu-b", 3, now=NOW + 200)
        assert third.overlay_ip == "10.213.0.4"

    def test_removed_key_cannot_rejoin(self, db):
        enrol(db, "gpu-a", 1)
        assert db.remove_member("gpu-a").name == "gpu-a"
        for name in ("gpu-a", "other"):
            with pytest.raises(StateError) as info:
                enrol(db, name, 1)
            assert str(info.value) == (
                "this node's key belonged to a removed member and cannot join again; "
                "run `meshrun leave --purge` on the node to make a new identity, then join"
            )

    def test_active_key_under_another_name(self, db):
        enrol(db, "gpu-a", 1)
        db.heartbeat("10.213.0.2", [], now=NOW + 5)
        with pytest.raises(StateError) as info:
            enrol(db, "gpu-b", 1)
        assert str(info.value) == (
            "this node's key is already enrolled as member 'gpu-a'; join again with "
            "--name gpu-a, or `meshrun leave --purge` for a new identity"
        )

    def test_removal_is_final_for_tokens_made_before_it(self, db):
        enrol(db, "gpu-a", 1)
        enrol(db, "gpu-b", 2)
        removed = db.remove_member("gpu-a", now=NOW + 10)
        assert removed.overlay_ip == "10.213.0.2"
        assert db.member_by_ip("10.213.0.2") is None and db.is_removed_ip("10.213.0.2")
        with pytest.raises(TokenError, match="'gpu-a' was removed from the network after this token was made"):
            enrol(db, "gpu-a", 3, now=NOW + 20)  # same name, new key, the old (unlimited) token
        db.add_token("tok0000009", SECRET, 3600, None, now=NOW + 30)
        m, _ = enrol(db, "gpu-a", 3, token_id="tok0000009", now=NOW + 31)  # the operator's new token
        assert m.overlay_ip == "10.213.0.4"
        assert db.remove_member("gpu-a") is not None
        assert db.remove_member("gpu-a") is None
        assert db.remove_member("coord") is None  # the coordinator cannot be removed

    def test_a_removed_address_returns_after_the_quarantine(self, db):
        from meshrun.system.control.coordinatordb import ADDRESS_QUARANTINE_S

        enrol(db, "gpu-a", 1)
        db.remove_member("gpu-a", now=NOW + 10)
        assert enrol(db, "gpu-b", 2, now=NOW + 20)[0].overlay_ip == "10.213.0.3"
        later = NOW + 11 + ADDRESS_QUARANTINE_S
        db.add_token("tok000000l", SECRET, 3600, None, now=later - 1)
        assert enrol(db, "gpu-c", 3, token_id="tok000000l", now=later)[0].overlay_ip == "10.213.0.2"
        with pytest.raises(StateError, match="belonged to a removed member"):
            enrol(db, "gpu-x", 1, token_id="tok000000l", now=later)  # the key stays refused for ever

    def test_one_token_cannot_pile_up_pending_enrolments(self, db, monkeypatch):
        monkeypatch.setattr(admission, "PENDING_PER_TOKEN", 4)
        for i in range(1, 5):
            enrol(db, f"n{i}", i)
        with pytest.raises(TokenError, match="4 enrolments that never completed"):
            enrol(db, "n99", 99)
        db.heartbeat("10.213.0.2", [], now=NOW + 5)  # one synced: not pending any more
        enrol(db, "n99", 99, now=NOW + 6)
        # the rest never sync: past the grace they are over, and their names are free
        enrol(db, "n2", 200, now=NOW + 2 + admission.PENDING_GRACE_S)
        assert {m.name for m in db.members()} == {"coord", "n1", "n99", "n2"}

    def test_exhausted_range(self, db):
        for t in range(5):
            db.add_token(f"tok00000e{t}", SECRET, 3600, None, now=NOW)
        for i in range(1, 6):
            enrol(db, f"n{i}", i, token_id=f"tok00000e{i % 5}", cidr="10.9.0.0/29")
        from meshrun.errors import NetworkError

        with pytest.raises(NetworkError, match=r"^overlay range 10\.9\.0\.0/29 has no free address left"):
            enrol(db, "n6", 6, token_id="tok00000e1", cidr="10.9.0.0/29")
        assert sum(t.uses for t in db.tokens()) == 5  # the failed one was rolled back

    def test_heartbeat_and_observe(self, db):
        enrol(db, "gpu-a", 1)
        v = db.version()
        db.heartbeat("10.213.0.2", ["172.31.40.1:51820"], now=NOW + 5)
        assert db.version() == v  # same candidates: no change
        db.heartbeat("10.213.0.2", ["172.31.40.9:51820"], now=NOW + 6)
        assert db.version() == v + 1
        assert db.observe({key(1): ("198.51.100.2:40000", 123)}) is True
        assert db.observe({key(1): ("198.51.100.2:40000", 124)}) is False
        assert db.observe({key(1): (None, 125)}) is False
        m = db.member_by_name("gpu-a")
        assert (m.endpoint, m.last_handshake, m.candidates) == ("198.51.100.2:40000", 125, ("172.31.40.9:51820",))
        assert db.observe({key(99): ("1.2.3.4:5", 1)}) is False

    def test_a_members_reported_tunnels_are_stored_and_move_the_version_once(self, db):
        enrol(db, "gpu-a", 1)
        db.heartbeat("10.213.0.2", [], now=NOW + 5)
        assert db.member_by_name("gpu-a").tunnels == 1  # not reported yet: one
        v = db.version()
        db.heartbeat("10.213.0.2", [], now=NOW + 6, tunnels=4)
        db.heartbeat("10.213.0.2", [], now=NOW + 7, tunnels=4)
        db.heartbeat("10.213.0.2", [], now=NOW + 8)  # an agent that does not report it keeps the stored one
        assert db.member_by_name("gpu-a").tunnels == 4 and db.version() == v + 1
        db.heartbeat("10.213.0.2", [], now=NOW + 9, tunnels=1)
        assert db.member_by_name("gpu-a").tunnels == 1 and db.version() == v + 2


class TestState:
    def test_meta_is_kept_and_the_version_only_moves_forward(self, db):
        assert db.meta("network") is None
        db.set_meta(network='{"x": 1}', other="2")
        assert db.meta("network") == '{"x": 1}' and db.meta("other") == "2"
        v = db.version()
        assert db.bump_version() == v + 1 == db.version()

    def test_a_removed_member_is_gone_for_good_and_its_address_is_known_removed(self, db):
        enrol(db, "gpu-a", 1)
        db.heartbeat("10.213.0.2", [], now=NOW + 5)
        removals, v = db.removals, db.version()
        assert db.remove_member("gpu-a", now=NOW + 6).name == "gpu-a"
        assert db.member_by_name("gpu-a") is None and db.member_by_ip("10.213.0.2") is None
        assert db.is_removed_ip("10.213.0.2") and db.removals > removals and db.version() > v
        assert db.is_removed_key(key(1)) and not db.is_removed_key(key(0)) and not db.is_removed_key(key(7))
        assert [m.name for m in db.recently_removed(60, now=NOW + 10)] == ["gpu-a"]
        assert db.recently_removed(60, now=NOW + 100) == []
        assert db.remove_member("gpu-a") is None
        with pytest.raises(TokenError, match="was removed"):  # its name, with another key
            enrol(db, "gpu-a", 9, now=NOW + 7)
        with pytest.raises(StateError, match="belonged to a removed member"):  # its key, under another name
            enrol(db, "gpu-z", 1, now=NOW + 7)

    def test_an_abandoned_enrolment_gives_its_name_back_at_once(self, db):
        enrol(db, "gpu-a", 1)
        assert db.abandon("gpu-a", key(2)) is False  # not the holder of the enrolment's key
        assert db.abandon("gpu-a", key(1)) is True
        assert db.member_by_name("gpu-a") is None
        assert enrol(db, "gpu-a", 3, now=NOW + 2)[1] is True

    def test_pairs_are_saved_changed_and_dropped_with_a_member(self, db):
        for i in (1, 2, 3):
            enrol(db, f"gpu-{i}", i)
        one = PairState("relayed", NOW, True, "gpu-3", 51821)
        db.save_pairs({("gpu-1", "gpu-2"): one, ("gpu-1", "gpu-3"): PairState("public", NOW, False)})
        assert db.pairs() == {("gpu-1", "gpu-2"): one, ("gpu-1", "gpu-3"): PairState("public", NOW, False)}
        db.save_pairs({("gpu-1", "gpu-3"): PairState("public", NOW + 1, True)})
        assert db.pairs()[("gpu-1", "gpu-3")] == PairState("public", NOW + 1, True)
        db.save_pairs({}, drop=["gpu-3"])
        assert db.pairs() == {("gpu-1", "gpu-2"): one}

    def test_a_dump_loads_into_an_empty_store_of_any_backend_unchanged(self, db, empty_store):
        for i in (1, 2, 3):
            enrol(db, f"gpu-{i}", i)
        db.heartbeat("10.213.0.2", ["172.31.40.1:51820"], now=NOW + 5, mtu=1380, site="fra", tunnels=4)
        db.remove_member("gpu-3", now=NOW + 6)
        db.save_pairs({("gpu-1", "gpu-2"): PairState("relayed", NOW, True, "coord")})
        db.set_meta(network='{"x": 1}')
        for kind, other in empty_store():
            other.load(db.dump())
            assert other.members() == db.members(), kind
            assert other.tokens() == db.tokens() and other.pairs() == db.pairs(), kind
            assert other.meta("network") == '{"x": 1}' and other.is_removed_ip("10.213.0.4"), kind
            assert other.version() > db.version(), kind  # agents that knew the old store re-read everything
            with pytest.raises(TokenError, match="was removed"):  # removal stays final
                enrol(other, "gpu-3", 9, now=NOW + 7)
            assert enrol(other, "gpu-4", 4, now=NOW + 8)[0].overlay_ip == "10.213.0.5", kind  # never reused
            other.close()

    def test_the_lone_coordinator_or_every_coordinator_is_listed(self, db):
        net = dict(NETWORK, coordinator_public_key=key(0))
        db.set_meta(network=json.dumps(net))
        if hasattr(db, "put_coordinator"):  # several coordinators: each one's record is written by `add`
            from meshrun.system.control.coordinatordb import CoordinatorInfo

            db.put_coordinator(CoordinatorInfo("coord", key(0), "10.213.0.1", "203.0.113.1:51820", "ab" * 32))
        rows = db.coordinators()
        assert [(c.name, c.public_key, c.overlay_ip, c.endpoint) for c in rows] == [
            ("coord", key(0), "10.213.0.1", "203.0.113.1:51820")
        ]
