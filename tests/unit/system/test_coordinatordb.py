"""meshrun.system.control.coordinatordb: what only the SQLite backend has (its file, concurrent processes on one
file, schema migrations); what every backend does is tests/control_state_contract.py's."""

from __future__ import annotations

import multiprocessing
import os
import stat
import threading
import time

import pytest
from control_state_contract import CIDR, NOW, SECRET, enrol, key

from meshrun.errors import StateError, TokenError
from meshrun.system.control.coordinatordb import CoordinatorDB


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# --------------------------------------------------------------------------- CoordinatorDB


@pytest.fixture
def sqlite_db(tmp_path):
    d = CoordinatorDB.create(tmp_path / "coordinator.db")
    d.add_coordinator("coord", key(0), "10.213.0.1")
    d.add_token("tok0000001", SECRET, 3600, None, now=NOW)
    yield d
    d.close()


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

    from meshrun.system.control.coordinatordb import CoordinatorDB

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
    from meshrun.system.control.etcdstate import EtcdCoordinatorDB
    from meshrun.system.control.fakeetcd import FakeEtcd

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


def test_one_token_holds_at_most_half_the_range(tmp_path):
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
