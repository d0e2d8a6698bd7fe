"""meshrun.system.statedir: state directory files (atomic, private) and the coordinator's SQLite DB."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
import threading
import time

import pytest

from meshrun.core import admission
from meshrun.core.model import Member
from meshrun.errors import StateError, TokenError
from meshrun.system.coordinatordb import CoordinatorDB, TokenInfo

CIDR = "10.213.0.0/16"
SECRET = b"s" * 32
NOW = 1_700_000_000.0
FIX_NEW = "ask the coordinator's operator for a new token (`meshrun token create`)"
UNKNOWN = "the coordinator does not know this join token (wrong network, or deleted); " + FIX_NEW


def key(i: int) -> str:
    """A distinct, well-formed public key per i (these tests never need the private half)."""
    import base64

    return base64.b64encode(i.to_bytes(4, "big") * 8).decode()


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# --------------------------------------------------------------------------- StateDir


# --------------------------------------------------------------------------- CoordinatorDB


@pytest.fixture(params=["sqlite", "etcd"])
def db(request, tmp_path):
    """The coordinator's state in SQLite (one coordinator) and in etcd (several: a FakeEtcd, the same contract
    as the real one, tests/etcd_contract.py), held to the same tests."""
    if request.param == "sqlite":
        d = CoordinatorDB.create(tmp_path / "coordinator.db")
    else:
        from meshrun.system.etcdstate import EtcdCoordinatorDB
        from meshrun.system.fakeetcd import FakeEtcd

        d = EtcdCoordinatorDB(FakeEtcd())
    d.add_coordinator("coord", key(0), "10.213.0.1")
    d.add_token("tok0000001", SECRET, 3600, None, now=NOW)
    yield d
    d.close()


@pytest.fixture
def sqlite_db(tmp_path):
    d = CoordinatorDB.create(tmp_path / "coordinator.db")
    d.add_coordinator("coord", key(0), "10.213.0.1")
    d.add_token("tok0000001", SECRET, 3600, None, now=NOW)
    yield d
    d.close()


def enrol(db, name, i, token_id="tok0000001", secret=SECRET, now=NOW + 1, cidr=CIDR):
    return db.enrol(token_id, secret, name, key(i), [f"172.31.40.{i % 250}:51820"], cidr, now=now)


class TestDBFile:
    def test_missing(self, tmp_path):
        with pytest.raises(StateError) as info:
            CoordinatorDB(tmp_path / "coordinator.db")
        assert str(info.value) == (f"{tmp_path}/coordinator.db is missing; run `meshrun init` on the coordinator first")

    def test_create_mode_0600(self, tmp_path):
        CoordinatorDB.create(tmp_path / "c.db").close()
        assert mode(tmp_path / "c.db") == 0o600

    def test_corrupt_random_bytes(self, tmp_path):
        path = tmp_path / "coordinator.db"
        junk = os.urandom(8192)
        path.write_bytes(junk)
        with pytest.raises(StateError) as info:
            CoordinatorDB(path)
        assert str(info.value) == (
            f"{path} is not a readable meshrun database (file is not a database); "
            "restore it from a backup; meshrun will not reset it"
        )
        assert path.read_bytes() == junk

    def test_reopen_keeps_everything(self, tmp_path, sqlite_db):
        db = sqlite_db
        enrol(db, "gpu-a", 1)
        db.set_meta(network='{"x": 1}')
        again = CoordinatorDB(tmp_path / "coordinator.db")
        try:
            assert [m.name for m in again.members()] == ["coord", "gpu-a"]
            assert again.meta("network") == '{"x": 1}'
            assert again.meta("nope") is None
        finally:
            again.close()


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
        from meshrun.system.coordinatordb import ADDRESS_QUARANTINE_S

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

    def test_one_token_holds_at_most_half_the_range(self, tmp_path):
        small = CoordinatorDB.create(tmp_path / "small.db")  # (the etcd twin runs the same admission code)
        small.add_coordinator("coord", key(0), "10.9.0.1")
        small.add_token("tok000000s", SECRET, 3600, None, now=NOW)
        small.add_token("tok000000t", SECRET, 3600, None, now=NOW)
        for i in range(1, 3):
            enrol(small, f"s{i}", i, token_id="tok000000s", cidr="10.9.0.0/29")
        with pytest.raises(TokenError, match="already holds 2 of the overlay's 5 addresses"):
            enrol(small, "s3", 3, token_id="tok000000s", cidr="10.9.0.0/29")
        enrol(small, "t1", 4, token_id="tok000000t", cidr="10.9.0.0/29")  # another token still can
        small.close()

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


# ---- concurrency: distinct names through separate connections on one file


def _enrol_many(path: str, names: list[str], first_key: int, out) -> None:
    try:
        d = CoordinatorDB(path)
        try:
            for j, name in enumerate(names):
                m, _ = d.enrol("tok0000001", SECRET, name, key(first_key + j), [], CIDR, now=NOW + 1)
                out.put((name, m.overlay_ip))
        finally:
            d.close()
    except Exception as exc:  # reported to the test instead of a hang on the queue
        out.put(("error", f"{type(exc).__name__}: {exc}"))


class _ListQueue(list):
    put = list.append


class TestConcurrency:
    def test_threads(self, tmp_path, sqlite_db):
        db = sqlite_db
        path = str(tmp_path / "coordinator.db")
        results: list = []
        lock = threading.Lock()
        errors: list = []

        def run(i):
            try:
                q = _ListQueue()
                _enrol_many(path, [f"t{i}"], 1000 + i, q)
                with lock:
                    results.extend(q)
            except Exception as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == [] and [r for r in results if r[0] == "error"] == []
        ips = [ip for _, ip in results]
        assert len(ips) == 16 and len(set(ips)) == 16
        assert "10.213.0.1" not in ips
        assert sorted(ips, key=lambda s: int(s.rsplit(".", 1)[1])) == [f"10.213.0.{i}" for i in range(2, 18)]
        assert db.tokens()[0].uses == 16

    def test_processes(self, tmp_path, sqlite_db):
        db = sqlite_db
        path = str(tmp_path / "coordinator.db")
        ctx = multiprocessing.get_context("spawn")
        q = ctx.Queue()
        procs = [
            ctx.Process(target=_enrol_many, args=(path, [f"p{i}-{j}" for j in range(4)], 2000 + 10 * i, q))
            for i in range(4)
        ]
        for p in procs:
            p.start()
        results = [q.get(timeout=60) for _ in range(16)]
        assert [r for r in results if r[0] == "error"] == []
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        ips = [ip for _, ip in results]
        assert len(set(ips)) == 16 and "10.213.0.1" not in ips
        assert {m.overlay_ip for m in db.members()} == set(ips) | {"10.213.0.1"}


def test_a_reported_mtu_and_site_are_stored_and_move_the_version_once(tmp_path):
    import sqlite3

    from meshrun.system.coordinatordb import CoordinatorDB

    # A database made before the column existed gains it on open.
    old = sqlite3.connect(tmp_path / "coordinator.db")
    old.executescript(
        "CREATE TABLE members(id INTEGER PRIMARY KEY, name TEXT NOT NULL, public_key TEXT NOT NULL "
        "UNIQUE, overlay_ip TEXT NOT NULL UNIQUE, candidates TEXT NOT NULL DEFAULT '[]', endpoint TEXT, "
        "last_handshake INTEGER NOT NULL DEFAULT 0, is_coordinator INTEGER NOT NULL DEFAULT 0, "
        "token_id TEXT, joined_at REAL NOT NULL, last_seen REAL, removed_at REAL);"
        "INSERT INTO members(name, public_key, overlay_ip, joined_at) "
        f"VALUES('gpu-a', '{'A' * 43}=', '10.213.0.2', 1.0);"
    )
    old.close()
    db = CoordinatorDB(tmp_path / "coordinator.db")
    assert db.members()[0].mtu == 0
    v = db.version()
    db.heartbeat("10.213.0.2", [], mtu=1220)
    assert db.members()[0].mtu == 1220 and db.version() == v + 1
    db.heartbeat("10.213.0.2", [], mtu=1220)
    db.heartbeat("10.213.0.2", [])  # an agent that does not report it keeps the stored one
    assert db.members()[0].mtu == 1220 and db.version() == v + 1
    assert db.members()[0].site == ""  # the site column came with the same migration
    db.heartbeat("10.213.0.2", [], site="fra")
    db.heartbeat("10.213.0.2", [], site="fra")
    db.heartbeat("10.213.0.2", [])  # not reported: kept
    assert db.members()[0].site == "fra" and db.version() == v + 2
    db.heartbeat("10.213.0.2", [], site="")  # reported empty: cleared
    assert db.members()[0].site == "" and db.version() == v + 3
    db.close()


# ---- several coordinators: each its own EtcdCoordinatorDB (its own mirror) over one etcd


def test_coordinators_enrolling_at_once_never_hand_out_one_address(tmp_path):
    """16 joins through 4 coordinators at once, each coordinator's state a separate mirror of one store: every
    join gets its own address and the token counts each once (the compares on version, token and sequence)."""
    from meshrun.system.etcdstate import EtcdCoordinatorDB
    from meshrun.system.fakeetcd import FakeEtcd

    store = FakeEtcd()
    first = EtcdCoordinatorDB(store)
    first.add_coordinator("coord", key(0), "10.213.0.1")
    first.add_token("tok0000001", SECRET, 3600, None, now=NOW)
    views = [EtcdCoordinatorDB(store, follow=True) for _ in range(4)]
    results, errors = [], []

    def run(v, i):
        try:
            for j in range(4):
                m, _ = v.enrol("tok0000001", SECRET, f"c{i}-{j}", key(100 + 10 * i + j), [], CIDR, now=NOW + 1)
                results.append(m.overlay_ip)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(v, i)) for i, v in enumerate(views)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and len(results) == 16 and len(set(results)) == 16
    fresh = EtcdCoordinatorDB(store)
    assert fresh.tokens()[0].uses == 16 and len(fresh.members()) == 17
    versions = {v.version() for v in views} | {fresh.version()}
    for v in views:  # every mirror caught up with the same state
        deadline = time.monotonic() + 5
        while v.version() != fresh.version() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert v.version() == fresh.version() and len(v.members()) == 17
        v.close()
    assert fresh.version() == max(versions)


def test_the_state_moves_from_sqlite_to_etcd_and_back_unchanged(tmp_path, sqlite_db):
    from meshrun.core.pairpaths import PairState
    from meshrun.system.etcdstate import EtcdCoordinatorDB
    from meshrun.system.fakeetcd import FakeEtcd

    db = sqlite_db
    for i in range(1, 4):
        enrol(db, f"gpu-{i}", i)
    db.heartbeat("10.213.0.2", ["172.31.40.1:51820"], now=NOW + 5, mtu=1380, site="fra")
    db.remove_member("gpu-3", now=NOW + 6)
    db.save_pairs({("gpu-1", "gpu-2"): PairState("relayed", NOW, True, "coord")})
    db.set_meta(network='{"x": 1}')
    etcd = EtcdCoordinatorDB(FakeEtcd())
    etcd.load(db.dump())
    assert etcd.members() == db.members()
    assert etcd.tokens() == db.tokens()
    assert etcd.pairs() == db.pairs()
    assert etcd.is_removed_ip("10.213.0.4") and etcd.version() > db.version()
    assert etcd.meta("network") == '{"x": 1}'
    with pytest.raises(TokenError, match="was removed"):  # removal stays final in etcd too
        enrol(etcd, "gpu-3", 9, now=NOW + 7)
    back = CoordinatorDB.create(tmp_path / "back.db")
    back.load(etcd.dump())
    assert back.members() == db.members() and back.tokens() == db.tokens() and back.pairs() == db.pairs()
    assert back.version() > etcd.version()
    assert enrol(back, "gpu-4", 4, now=NOW + 8)[0].overlay_ip == "10.213.0.5"  # addresses never reused
    back.close()
