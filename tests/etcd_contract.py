"""The etcd contract: what meshrun.system.control.etcd.EtcdClient does against a real etcd, and so what
meshrun.system.control.fakeetcd.FakeEtcd must do too, written once.

`CASES` each take a `Harness`; `run_all(make_harness, kind)` runs the cases for `kind` ("real" or "fake") and
returns {case: "ok" or what went wrong}. tests/unit/system/test_etcd.py runs them on FakeEtcd and on a real
single-member etcd (TLS, 127.0.0.1). The real server is shared by every case, so a case keeps to the keys
under its `prefix` and never assumes the store's revision is its own, only that nobody else writes meanwhile.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from meshrun.errors import ControlStateError
from meshrun.system.control.etcd import Compacted, Compare, Delete, Get, Put


@dataclass
class Harness:
    """One case's view of an etcd: `client` (EtcdClient or FakeEtcd), the key prefix it may use, how to let a
    lease of `ttl` seconds run out, and (real only) a client whose first endpoint never answers."""

    client: object
    kind: str
    prefix: bytes
    let_lease_expire: Callable[[int], None]
    member_name: str
    failover_client: Callable[[], tuple[object, str]] | None = None


def only(kind: str):
    """Mark a case that holds for one kind only (real: about the network client; fake: what a 1-member real
    cluster refuses)."""

    def mark(fn):
        fn.only = kind
        return fn

    return mark


def _collect(client, prefix: bytes, start: int, want: int, timeout: float = 10.0) -> list:
    """The first `want` events a watch from `start` sees (fewer if `timeout` runs out), the watch stopped."""
    stop = threading.Event()
    got: list = []
    errors: list = []

    def run() -> None:
        try:
            for batch in client.watch(prefix, start, stop):
                got.extend(batch)
                if len(got) >= want:
                    stop.set()
        except Exception as exc:  # noqa: BLE001 -- handed to the case
            errors.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    stop.set()
    t.join(3)
    assert not t.is_alive(), "the watch did not return within 3 s of stop"
    if errors:
        raise errors[0]
    return got


# --------------------------------------------------------------------------- keys


def case_get_put_delete(h):
    c, k = h.client, h.prefix + b"k"
    assert c.get(k) is None
    r1 = c.put(k, b"v1")
    kv = c.get(k)
    assert (kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease) == (k, b"v1", r1, r1, 1, 0), kv
    r2 = c.put(k, b"v2")
    assert r2 == r1 + 1
    kv = c.get(k)
    assert (kv.value, kv.create_revision, kv.mod_revision, kv.version) == (b"v2", r1, r2, 2), kv
    assert c.revision() == r2
    assert c.delete(k) == 1
    assert c.get(k) is None
    assert c.revision() == r2 + 1, "a delete is a write"
    assert c.delete(k) == 0
    assert c.revision() == r2 + 1, "deleting nothing makes no revision"
    r3 = c.put(k, b"again")
    kv = c.get(k)
    assert (kv.create_revision, kv.version) == (r3, 1), "a key made again starts over"


def case_binary_keys_and_values(h):
    c = h.client
    k = h.prefix + bytes(range(256))
    c.put(k, b'\x00\xff\n"{}')
    assert c.get(k).value == b'\x00\xff\n"{}'
    c.put(h.prefix + b"empty", b"")
    assert c.get(h.prefix + b"empty").value == b""


def case_delete_prefix(h):
    c, p = h.client, h.prefix
    for k in (b"d/a", b"d/b", b"d/c/d", b"d0", b"e"):
        c.put(p + k, b"x")
    assert c.delete(p + b"d/", prefix=True) == 3
    kvs, _ = c.get_prefix(p)
    assert [kv.key for kv in kvs] == [p + b"d0", p + b"e"]


def case_get_prefix_sorted_and_bounded(h):
    c, p = h.client, h.prefix
    for k in (b"a/2", b"a/1", b"a/\xff", b"a0", b"b", b"a"):
        c.put(p + k, k)
    kvs, rev = c.get_prefix(p + b"a/")
    assert [kv.key for kv in kvs] == [p + b"a/1", p + b"a/2", p + b"a/\xff"]
    assert rev == c.revision()
    assert c.get_prefix(p + b"nothing/") == ([], rev)


def case_get_prefix_pages_at_one_revision(h):
    """More keys than a page, read while a writer adds more: the pages are one snapshot, at one revision."""
    c, p = h.client, h.prefix + b"pg/"
    for i in range(25):
        c.put(p + b"%03d" % i, b"x")
    kvs, rev = c.get_prefix(p, page=10)
    assert [kv.key for kv in kvs] == [p + b"%03d" % i for i in range(25)]
    assert rev == c.revision()

    stop = threading.Event()
    written: list[int] = []

    def writer() -> None:
        i = 25
        while not stop.is_set() and i < 400:
            written.append(c.put(p + b"%03d" % i, b"x"))
            i += 1

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        time.sleep(0.05)
        kvs, rev = c.get_prefix(p, page=3)
    finally:
        stop.set()
        t.join(10)
    # The snapshot at `rev` holds exactly the keys written up to `rev`: no gap, nothing newer.
    assert all(kv.mod_revision <= rev for kv in kvs)
    n = len(kvs)
    assert [kv.key for kv in kvs] == [p + b"%03d" % i for i in range(n)], "a gap: pages read at different revisions"
    assert n == 25 + sum(1 for r in written if r <= rev)


def case_concurrent_writes_from_threads(h):
    c, p = h.client, h.prefix + b"t/"
    start = c.revision()
    revs: list[int] = []
    lock = threading.Lock()

    def work(n: int) -> None:
        for i in range(15):
            r = c.put(p + b"%d-%d" % (n, i), b"x")
            with lock:
                revs.append(r)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(revs) == list(range(start + 1, start + 61)), "one revision per write, none lost or shared"
    assert len(c.get_prefix(p)[0]) == 60


# --------------------------------------------------------------------------- transactions


def case_txn_compare_mod(h):
    c, k = h.client, h.prefix + b"m"
    r = c.put(k, b"v1")
    res = c.txn([Compare(k, "MOD", "EQUAL", r)], [Put(k, b"v2")], [Get(k)])
    assert (res.succeeded, res.revision, res.responses) == (True, r + 1, [None]), res
    stale = c.txn([Compare(k, "MOD", "EQUAL", r)], [Put(k, b"v3")], [Get(k)])
    assert (stale.succeeded, stale.revision) == (False, r + 1), stale
    [kvs] = stale.responses
    assert [(kv.value, kv.mod_revision) for kv in kvs] == [(b"v2", r + 1)]
    assert c.txn([Compare(k, "MOD", "LESS", r + 2)], [], []).succeeded
    assert not c.txn([Compare(k, "MOD", "GREATER", r + 1)], [], []).succeeded


def case_txn_compare_version_creates_once(h):
    c, k = h.client, h.prefix + b"once"
    first = c.txn([Compare(k, "VERSION", "EQUAL", 0)], [Put(k, b"mine")], [Get(k)])
    second = c.txn([Compare(k, "VERSION", "EQUAL", 0)], [Put(k, b"theirs")], [Get(k)])
    assert first.succeeded and not second.succeeded
    assert [kv.value for kv in second.responses[0]] == [b"mine"]
    assert c.txn([Compare(k, "VERSION", "GREATER", 0)], [], []).succeeded
    assert c.txn([Compare(k, "VERSION", "NOT_EQUAL", 2)], [], []).succeeded


def case_txn_compare_create(h):
    c, k = h.client, h.prefix + b"cr"
    r = c.put(k, b"a")
    c.put(k, b"b")
    assert c.txn([Compare(k, "CREATE", "EQUAL", r)], [], []).succeeded, "create_revision stays at the creation"
    assert not c.txn([Compare(k, "CREATE", "EQUAL", r + 1)], [], []).succeeded
    assert c.txn([Compare(h.prefix + b"missing", "CREATE", "EQUAL", 0)], [], []).succeeded


def case_txn_compare_value(h):
    c, k = h.client, h.prefix + b"val"
    c.put(k, b"b")
    assert c.txn([Compare(k, "VALUE", "EQUAL", b"b")], [], []).succeeded
    assert not c.txn([Compare(k, "VALUE", "EQUAL", b"c")], [], []).succeeded
    assert c.txn([Compare(k, "VALUE", "NOT_EQUAL", b"c")], [], []).succeeded
    assert c.txn([Compare(k, "VALUE", "GREATER", b"a")], [], []).succeeded
    assert c.txn([Compare(k, "VALUE", "LESS", b"c")], [], []).succeeded
    missing = h.prefix + b"nope"
    assert not c.txn([Compare(missing, "VALUE", "NOT_EQUAL", b"x")], [], []).succeeded, "a missing key has no value"


def case_txn_every_compare_must_hold(h):
    c, a, b = h.client, h.prefix + b"a", h.prefix + b"b"
    ra, rb = c.put(a, b"1"), c.put(b, b"1")
    both = [Compare(a, "MOD", "EQUAL", ra), Compare(b, "MOD", "EQUAL", rb)]
    assert c.txn(both, [], []).succeeded
    assert not c.txn([*both, Compare(a, "VALUE", "EQUAL", b"2")], [], []).succeeded


def case_txn_ops_share_one_revision_and_gets_see_earlier_ops(h):
    c, p = h.client, h.prefix
    c.put(p + b"old/1", b"x")
    c.put(p + b"old/2", b"x")
    before = c.revision()
    res = c.txn(
        [],
        [Put(p + b"n/1", b"a"), Put(p + b"n/2", b"b"), Get(p + b"n/", prefix=True), Delete(p + b"old/", prefix=True)],
    )
    assert res.succeeded and res.revision == before + 1, res
    assert res.responses[0] is None and res.responses[1] is None and res.responses[3] == 2, res
    assert [(kv.key, kv.mod_revision) for kv in res.responses[2]] == [
        (p + b"n/1", before + 1),
        (p + b"n/2", before + 1),
    ]
    reads = c.txn([], [Get(p + b"n/1"), Get(p + b"absent")])
    assert reads.revision == before + 1, "a read-only txn makes no revision"
    assert [kv.value for kv in reads.responses[0]] == [b"a"] and reads.responses[1] == []
    assert c.txn([], [Delete(p + b"absent")]).revision == before + 1, "deleting nothing makes no revision"


def case_txn_writing_one_key_twice_is_refused(h):
    c, k = h.client, h.prefix + b"dup"
    try:
        c.txn([], [Put(k, b"1"), Put(k, b"2")])
    except ControlStateError:
        return
    raise AssertionError("a txn putting one key twice was not refused")


def case_txn_compare_lease(h):
    c, k = h.client, h.prefix + b"leased"
    lease = c.lease_grant(30)
    try:
        c.put(k, b"x", lease=lease)
        assert c.txn([Compare(k, "LEASE", "EQUAL", lease)], [], []).succeeded
        c.put(k, b"y")
        assert c.txn([Compare(k, "LEASE", "EQUAL", 0)], [], []).succeeded, "a put without a lease detaches it"
    finally:
        c.lease_revoke(lease)


# --------------------------------------------------------------------------- leases


def case_lease_grant_keepalive_revoke(h):
    c, p = h.client, h.prefix
    lease = c.lease_grant(30)
    assert lease > 0
    c.put(p + b"l1", b"x", lease=lease)
    c.put(p + b"l2", b"x", lease=lease)
    c.put(p + b"kept", b"x")
    assert c.get(p + b"l1").lease == lease
    assert 0 < c.lease_keepalive(lease) <= 30
    before = c.revision()
    c.lease_revoke(lease)
    assert c.get(p + b"l1") is None and c.get(p + b"l2") is None and c.get(p + b"kept") is not None
    assert c.revision() == before + 1, "a revoke deletes its keys in one revision"
    assert c.lease_keepalive(lease) == 0
    c.lease_revoke(lease)  # gone already: no error


def case_put_with_an_unknown_lease_is_refused(h):
    try:
        h.client.put(h.prefix + b"x", b"x", lease=0x7EADBEEF)
    except ControlStateError:
        return
    raise AssertionError("a put with an unknown lease was not refused")


def case_key_vanishes_with_its_expired_lease(h):
    c, k = h.client, h.prefix + b"ttl"
    start = c.revision() + 1
    lease = c.lease_grant(2)
    c.put(k, b"x", lease=lease)
    assert c.get(k) is not None
    h.let_lease_expire(2)
    assert c.get(k) is None
    assert c.lease_keepalive(lease) == 0
    events = _collect(c, h.prefix, start, 2)
    assert [(e.type, e.kv.key) for e in events] == [("PUT", k), ("DELETE", k)], events


# --------------------------------------------------------------------------- watch


def case_watch_sees_puts_and_deletes_in_order(h):
    c, p = h.client, h.prefix + b"w/"
    c.put(h.prefix + b"outside", b"x")
    start = c.revision() + 1
    ra = c.put(p + b"a", b"1")
    c.put(p + b"b", b"2")
    c.delete(p + b"a")
    rd = c.revision()
    rt = c.txn([], [Put(p + b"c", b"3"), Delete(p + b"b")]).revision
    events = _collect(c, p, start, 5)
    assert [(e.type, e.kv.key, e.kv.value, e.kv.mod_revision) for e in events] == [
        ("PUT", p + b"a", b"1", ra),
        ("PUT", p + b"b", b"2", ra + 1),
        ("DELETE", p + b"a", b"", rd),
        ("PUT", p + b"c", b"3", rt),
        ("DELETE", p + b"b", b"", rt),
    ], events
    put = events[0].kv
    assert (put.create_revision, put.version) == (ra, 1)


def case_watch_sees_live_changes_and_stops(h):
    c, p = h.client, h.prefix + b"live/"
    stop = threading.Event()
    got: list = []

    def run() -> None:
        for batch in c.watch(p, 0, stop):
            got.extend(batch)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(0.5)  # the watch is created before the writes (start revision 0: from now on)
    c.put(p + b"x", b"1")
    c.put(h.prefix + b"elsewhere", b"1")
    c.delete(p + b"x")
    deadline = time.monotonic() + 10
    while len(got) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [(e.type, e.kv.key) for e in got] == [("PUT", p + b"x"), ("DELETE", p + b"x")], got
    began = time.monotonic()
    stop.set()
    t.join(5)
    assert not t.is_alive() and time.monotonic() - began < 2.5, "the watch did not notice stop within a second or so"


def case_watch_from_a_compacted_revision_raises_compacted(h):
    c, k = h.client, h.prefix + b"cmp"
    old = c.put(k, b"1")
    c.put(k, b"2")
    now = c.put(k, b"3")
    c.compact(now)
    try:
        _collect(c, h.prefix, old, 1, timeout=5)
    except Compacted as exc:
        assert exc.revision == now, exc.revision
    else:
        raise AssertionError("a watch from a compacted revision did not raise Compacted")
    try:
        c.compact(now)
    except ControlStateError:
        pass
    else:
        raise AssertionError("compacting a compacted revision again did not fail")
    c.put(k, b"4")
    events = _collect(c, h.prefix, now, 1, timeout=5)  # the compaction's own revision is still there
    assert events and events[-1].kv.value == b"4", events


# --------------------------------------------------------------------------- cluster


def case_status_of_a_single_member(h):
    c = h.client
    st = c.status()
    assert set(st) >= {"member_id", "leader", "raft_term", "version", "db_size"}, st
    assert st["member_id"] > 0 and st["leader"] == st["member_id"], st
    assert st["raft_term"] >= 1 and st["db_size"] > 0 and st["version"].startswith("3."), st
    assert st["member_id"] in {m.id for m in c.members()}


def case_members_lists_this_member(h):
    members = h.client.members()
    assert [m.name for m in members] == [h.member_name], members
    m = members[0]
    assert m.id > 0 and m.peer_urls and all(u.startswith("https://") for u in m.peer_urls), m
    assert h.client.endpoint in m.client_urls and h.client.endpoint in h.client.endpoints, (h.client.endpoint, m)


def case_learner_add_promote_and_remove(h):
    """A learner (no vote) can be added to a 1-member cluster without costing it its majority; it cannot get a
    vote before it runs and catches up; promoting a member that votes already is no error."""
    c = h.client
    me = c.members()[0]
    m = c.member_add(["https://127.0.0.1:1"], learner=True)
    try:
        assert m.id > 0 and m.peer_urls == ("https://127.0.0.1:1",) and m.is_learner, m
        listed = {x.id: x for x in c.members()}
        assert m.id in listed and listed[m.id].name == "" and listed[m.id].client_urls == (), listed
        try:
            c.member_promote(m.id)
        except ControlStateError as exc:
            assert "in sync" in exc.message, exc
        else:
            raise AssertionError("a learner that never started was promoted")
        c.member_promote(me.id)
    finally:
        c.member_remove(m.id)
    assert m.id not in {x.id for x in c.members()}
    for again in (c.member_remove, c.member_promote):
        try:
            again(m.id)
        except ControlStateError:
            continue
        raise AssertionError(f"{again.__name__} of a removed member did not fail")


@only("fake")
def case_a_started_learner_is_promoted(h):
    c = h.client
    m = c.member_add(["https://10.7.0.3:2380"], learner=True)
    c.start_member(m.id, "coord-b", "https://10.7.0.3:2379")
    c.member_promote(m.id)
    assert not {x.id: x for x in c.members()}[m.id].is_learner


@only("fake")
def case_voting_member_add_and_remove(h):
    c = h.client
    m = c.member_add(["https://10.7.0.3:2380"])
    assert not m.is_learner and m.id in {x.id for x in c.members()}
    try:
        c.member_add(["https://10.7.0.3:2380"])
    except ControlStateError:
        pass
    else:
        raise AssertionError("a peer URL added twice was not refused")
    c.member_remove(m.id)
    assert len(c.members()) == 1


@only("fake")
def case_an_unreachable_cluster_raises(h):
    c = h.client
    c.down = True
    for call in (lambda: c.get(b"k"), lambda: c.put(b"k", b"v"), c.members, c.status, c.revision):
        try:
            call()
        except ControlStateError as exc:
            assert exc.fix, exc
            continue
        raise AssertionError(f"{call} worked while the cluster was down")
    c.down = False
    assert c.get(b"k") is None


@only("real")
def case_failover_to_the_live_endpoint_and_stay(h):
    client, live = h.failover_client()
    try:
        began = time.monotonic()
        r = client.put(h.prefix + b"fo", b"1")
        first = time.monotonic() - began
        assert client.endpoint == live and client.get(h.prefix + b"fo").mod_revision == r
        began = time.monotonic()
        for _ in range(5):
            client.get(h.prefix + b"fo")
        again = time.monotonic() - began
        assert client.endpoint == live
        assert again < first, f"later calls tried the dead endpoint again ({first:.2f} s, then {again:.2f} s for 5)"
    finally:
        client.close()


CASES: dict[str, Callable] = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def cases_for(kind: str) -> dict[str, Callable]:
    return {n: fn for n, fn in CASES.items() if getattr(fn, "only", kind) == kind}


def run_all(make_harness: Callable[[str], Harness], kind: str) -> dict[str, str]:
    """Every case for `kind` on a harness from `make_harness(case name)`; {case: "ok" or the failure}."""
    out = {}
    for name, case in cases_for(kind).items():
        h = make_harness(name)
        try:
            case(h)
            out[name] = "ok"
        except Exception as exc:  # noqa: BLE001 -- reported per case
            out[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"
    return out
