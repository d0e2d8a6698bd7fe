"""FakeEtcd: meshrun.system.control.etcd.EtcdClient's interface over an etcd kept in memory, for tests.

It keeps etcd's rules where callers can see them (tests/etcd_contract.py holds it and the real client to the
same cases): one revision per write (a transaction's writes share one, a delete of nothing makes none), create
and mod revisions and versions as etcd keeps them, compares on a missing key, leases whose expiry deletes their
keys in one revision (watch events like any delete), watches from an event log that `compact` trims, members.

What tests drive: the clock leases expire by (`FakeEtcd(clock=...)`, then `expire()`), `compact(rev)`, and
`down`: while True every call raises ControlStateError, as an unreachable cluster does.

With `quota` (bytes, as etcd's --quota-backend-bytes; 0: none) the fake also keeps etcd's space accounting:
every version of every key until a compaction drops it (the latest version at or before the compacted revision
stays, tombstones go), a database that never shrinks by itself (only `defragment` gives space back, as bbolt's
file keeps its high-water mark), and etcd's NOSPACE alarm: a request that writes (a put, a transaction with a
put in either branch, a lease grant) is refused once the database plus its cost would reach the quota, and
from then on until `disarm`, while reads and deletes still work.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from meshrun.errors import ControlStateError
from meshrun.system.control.etcd import (
    FIX,
    KV,
    Compacted,
    Compare,
    Delete,
    EtcdMember,
    Event,
    Get,
    Put,
    TxnResult,
    prefix_end,
)

VERSION = "3.4.23"
NOSPACE = "etcdserver: mvcc: database space exceeded"  # etcd's refusal while its NOSPACE alarm is raised
VERSION_OVERHEAD = 64  # bytes the fake counts per stored version besides the key and value
MIN_TTL = 2  # etcd raises shorter leases to 1.5 election timeouts (1.5 s with meshrun's settings), rounded up


def _in_range(key: bytes, start: bytes, prefix: bool) -> bool:
    if not prefix:
        return key == start
    end = prefix_end(start)
    return key >= start and (end == b"\0" or key < end)


def _holds(c: Compare, kv: KV | None) -> bool:
    if c.target == "VALUE":
        if kv is None:
            return False  # etcd: a value compare on a missing key is false, whatever the op
        have: int | bytes = kv.value
    else:
        field = {"VERSION": "version", "CREATE": "create_revision", "MOD": "mod_revision", "LEASE": "lease"}
        have = 0 if kv is None else getattr(kv, field[c.target])
    return {
        "EQUAL": have == c.value,
        "NOT_EQUAL": have != c.value,
        "GREATER": have > c.value,
        "LESS": have < c.value,
    }[c.op]


class FakeEtcd:
    """An etcd cluster in memory with EtcdClient's methods. Thread-safe (one lock; watches wait on it)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        name: str = "default",
        peer_url: str = "https://127.0.0.1:2380",
        client_url: str = "https://127.0.0.1:2379",
        quota: int = 0,
    ) -> None:
        self.clock = clock
        self.quota = quota
        self.nospace = False  # etcd's NOSPACE alarm
        self._versions: dict[bytes, list[tuple[int, int, bool]]] = {}  # key -> [(revision, bytes, tombstone)]
        self._used = 0  # bytes of every version kept
        self._high = 0  # the database's size: the high-water mark of _used since the last defragment
        self.down = False
        self.endpoint = client_url
        self.endpoints = [client_url]
        self._cond = threading.Condition(threading.RLock())
        self._kv: dict[bytes, KV] = {}
        self._rev = 1  # a new etcd's store is at revision 1
        self._compacted = 0
        self._events: list[tuple[int, Event]] = []
        self._leases: dict[int, tuple[int, float]] = {}  # id -> (ttl, expires at)
        self._ids = itertools.count(0x1000)
        self._members = [EtcdMember(next(self._ids), name, (peer_url,), (client_url,))]
        self._term = 2

    def set_endpoints(self, endpoints) -> None:
        """As EtcdClient.set_endpoints (the fake answers on any of them)."""
        self.endpoints = list(endpoints)
        if self.endpoint not in self.endpoints:
            self.endpoint = self.endpoints[0]

    # ----------------------------------------------------------------- plumbing

    def _up(self, what: str) -> None:
        if self.down:
            raise ControlStateError(f"no etcd member could serve the {what}: tried {self.endpoint} (down)", FIX)

    def _refuse(self, what: str, message: str) -> ControlStateError:
        return ControlStateError(f"etcd at {self.endpoint} refused the {what}: {message}", FIX)

    def _matching(self, key: bytes, prefix: bool) -> list[KV]:
        if not prefix and not key:
            raise ValueError("an etcd key is non-empty bytes")
        return sorted((kv for k, kv in self._kv.items() if _in_range(k, key, prefix)), key=lambda kv: kv.key)

    def _space(self, ops: Sequence[Put | Delete | Get], what: str, lease: bool = False) -> None:
        """etcd's quota check before a request that may write: refuse (raising the alarm) when it cannot fit."""
        if not self.quota:
            return
        cost = sum(len(op.key) + len(op.value) + VERSION_OVERHEAD for op in ops if isinstance(op, Put))
        if not cost and not lease:
            return
        if self.nospace or self._high + cost >= self.quota:
            self.nospace = True
            raise self._refuse(what, NOSPACE)

    def _keep(self, key: bytes, rev: int, size: int, tombstone: bool) -> None:
        self._versions.setdefault(key, []).append((rev, size, tombstone))
        self._used += size
        self._high = max(self._high, self._used)

    def db_size(self) -> int:
        """The database's size as etcd counts it against the quota (the fake's estimate)."""
        with self._cond:
            return self._high

    def defragment(self) -> None:
        """Give the space of dropped versions back (etcdctl defrag)."""
        with self._cond:
            self._high = self._used

    def disarm(self) -> None:
        """Clear the NOSPACE alarm (etcdctl alarm disarm): it comes back at the next write that does not fit."""
        with self._cond:
            self.nospace = False

    def _write(self, ops: list[Put | Delete], what: str) -> tuple[int, list]:
        """Apply `ops` as one etcd write: one new revision if anything changed. Returns (revision, responses)."""
        rev = self._rev + 1
        changed = False
        out: list = []
        events: list[Event] = []
        for op in ops:
            if isinstance(op, Put):
                if not op.key:
                    raise ValueError("an etcd key is non-empty bytes")
                if op.lease and op.lease not in self._leases:
                    raise self._refuse(what, "etcdserver: requested lease not found")
                old = self._kv.get(op.key)
                kv = KV(
                    op.key,
                    op.value,
                    create_revision=old.create_revision if old else rev,
                    mod_revision=rev,
                    version=old.version + 1 if old else 1,
                    lease=op.lease,
                )
                self._kv[op.key] = kv
                self._keep(op.key, rev, len(op.key) + len(op.value) + VERSION_OVERHEAD, False)
                events.append(Event("PUT", kv))
                changed = True
                out.append(None)
            elif isinstance(op, Delete):
                gone = self._matching(op.key, op.prefix)
                for kv in gone:
                    del self._kv[kv.key]
                    self._keep(kv.key, rev, len(kv.key) + VERSION_OVERHEAD, True)
                    events.append(Event("DELETE", KV(kv.key, b"", 0, rev, 0)))
                changed = changed or bool(gone)
                out.append(len(gone))
            else:  # a Get inside a transaction sees the writes before it
                out.append(self._matching(op.key, op.prefix))
        if changed:
            self._rev = rev
            self._events.extend((rev, e) for e in events)
            self._cond.notify_all()
        return self._rev, out

    @staticmethod
    def _check_txn(ops: Sequence[Put | Delete | Get]) -> None:
        """etcd refuses a transaction that writes one key twice (two puts, or a put inside a delete's range)."""
        puts = [op.key for op in ops if isinstance(op, Put)]
        deletes = [op for op in ops if isinstance(op, Delete)]
        if len(set(puts)) != len(puts) or any(_in_range(k, d.key, d.prefix) for k in puts for d in deletes):
            raise ValueError("etcdserver: duplicate key given in txn request")

    # ----------------------------------------------------------------- keys

    def get(self, key: bytes) -> KV | None:
        with self._cond:
            self._up("read")
            found = self._matching(key, False)
            return found[0] if found else None

    def get_prefix(self, prefix: bytes, page: int = 1000) -> tuple[list[KV], int]:
        if page < 1:
            raise ValueError("a page holds at least one key")
        with self._cond:
            self._up("read")
            return self._matching(prefix, True), self._rev

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        with self._cond:
            self._up("write")
            self._space([Put(key, value, lease)], "write")
            return self._write([Put(key, value, lease)], "write")[0]

    def delete(self, key: bytes, prefix: bool = False) -> int:
        with self._cond:
            self._up("delete")
            return self._write([Delete(key, prefix)], "delete")[1][0]

    def txn(self, compare: Sequence[Compare], success: Sequence[Put | Delete | Get], failure=()) -> TxnResult:
        ops_ok, ops_ko = list(success), list(failure)
        for op in ops_ok + ops_ko:
            if not isinstance(op, (Put, Delete, Get)):
                raise ValueError(f"a transaction op is a Put, Delete or Get, not {type(op).__name__}")
        with self._cond:
            self._up("transaction")
            for ops in (ops_ok, ops_ko):
                try:
                    self._check_txn(ops)
                except ValueError as exc:
                    raise self._refuse("transaction", str(exc)) from None
            for c in compare:
                if not c.key:
                    raise ValueError("an etcd key is non-empty bytes")
            self._space(ops_ok + ops_ko, "transaction")
            ok = all(_holds(c, self._kv.get(c.key)) for c in compare)
            rev, responses = self._write(ops_ok if ok else ops_ko, "transaction")
            return TxnResult(succeeded=ok, revision=rev, responses=responses)

    def revision(self) -> int:
        with self._cond:
            self._up("read")
            return self._rev

    def compact(self, revision: int) -> None:
        with self._cond:
            self._up("compaction")
            if revision <= self._compacted:
                raise Compacted(self._compacted, f"etcd at {self.endpoint}")
            if revision > self._rev:
                raise self._refuse("compaction", "mvcc: required revision is a future revision")
            self._compacted = revision
            self._events = [(r, e) for r, e in self._events if r > revision]
            for key, versions in list(self._versions.items()):
                # etcd keeps every version after `revision` and the one current at it, unless that is a delete.
                older = [i for i, v in enumerate(versions) if v[0] <= revision]
                drop = older[:-1] + (older[-1:] if older and versions[older[-1]][2] else [])
                if drop:
                    self._used -= sum(versions[i][1] for i in drop)
                    kept = [v for i, v in enumerate(versions) if i not in set(drop)]
                    if kept:
                        self._versions[key] = kept
                    else:
                        del self._versions[key]

    # ----------------------------------------------------------------- leases

    def lease_grant(self, ttl: int) -> int:
        with self._cond:
            self._up("lease grant")
            self._space((), "lease grant", lease=True)
            lease = next(self._ids)
            ttl = max(ttl, MIN_TTL)
            self._leases[lease] = (ttl, self.clock() + ttl)
            return lease

    def lease_keepalive(self, lease: int) -> int:
        with self._cond:
            self._up("lease keep-alive")
            self.expire()
            if lease not in self._leases:
                return 0
            ttl, _ = self._leases[lease]
            self._leases[lease] = (ttl, self.clock() + ttl)
            return ttl

    def lease_revoke(self, lease: int) -> None:
        with self._cond:
            self._up("lease revoke")
            self._revoke(lease)

    def _revoke(self, lease: int) -> None:
        if self._leases.pop(lease, None) is None:
            return
        keys = sorted(k for k, kv in self._kv.items() if kv.lease == lease)
        self._write([Delete(k) for k in keys], "lease revoke")  # one revision for all of them, as etcd does

    def expire(self) -> list[int]:
        """Revoke every lease whose time ran out by the clock (its keys deleted); returns their IDs."""
        with self._cond:
            now = self.clock()
            gone = sorted(lease for lease, (_, until) in self._leases.items() if until <= now)
            for lease in gone:
                self._revoke(lease)
            return gone

    # ----------------------------------------------------------------- watch

    def watch(
        self, prefix: bytes, start_revision: int, stop: threading.Event, idle_timeout: float | None = None
    ) -> Iterator[list[Event]]:
        with self._cond:
            self._up("watch")
            if start_revision and start_revision < self._compacted:
                raise Compacted(self._compacted, f"etcd at {self.endpoint}")
            nxt = start_revision or self._rev + 1
        while not stop.is_set():
            with self._cond:
                if self.down:
                    raise ControlStateError(f"the watch stream from etcd at {self.endpoint} broke (down)", FIX)
                if nxt < self._compacted:
                    raise Compacted(self._compacted, f"etcd at {self.endpoint}")
                batch = [e for r, e in self._events if r >= nxt and _in_range(e.kv.key, prefix, True)]
                nxt = self._rev + 1
                if not batch:
                    self._cond.wait(0.1)  # short: `stop` and `down` are not under the lock
                    continue
            yield batch

    # ----------------------------------------------------------------- cluster

    def status(self, endpoint: str | None = None) -> dict:
        with self._cond:
            self._up("status")
            if endpoint is not None and endpoint.rstrip("/") != self.endpoint:
                raise ControlStateError(f"no etcd member could serve the status: tried {endpoint} (unknown)", FIX)
            size = sum(len(kv.key) + len(kv.value) for kv in self._kv.values())
            me = self._members[0].id
            return {
                "member_id": me,
                "leader": me,
                "raft_term": self._term,
                "version": VERSION,
                "db_size": 20480 + size,
                "errors": [],
            }

    def members(self) -> list[EtcdMember]:
        with self._cond:
            self._up("member list")
            return list(self._members)

    def member_add(self, peer_urls: Sequence[str], learner: bool = False) -> EtcdMember:
        with self._cond:
            self._up("member add")
            taken = {u for m in self._members for u in m.peer_urls}
            if not peer_urls or taken.intersection(peer_urls):
                raise self._refuse("member add", "etcdserver: Peer URLs already exists")
            member = EtcdMember(next(self._ids), "", tuple(peer_urls), (), is_learner=learner)
            self._members.append(member)
            return member

    def member_promote(self, member_id: int) -> None:
        with self._cond:
            self._up("member promote")
            member = next((m for m in self._members if m.id == member_id), None)
            if member is None:
                raise self._refuse("member promote", "etcdserver: member not found")
            if not member.is_learner:
                return  # votes already: etcd refuses, the client takes that as done
            if not member.client_urls:  # never started, so it cannot have caught up
                raise self._refuse(
                    "member promote", "etcdserver: can only promote a learner member which is in sync with leader"
                )
            self._members = [replace(m, is_learner=False) if m.id == member_id else m for m in self._members]

    def member_remove(self, member_id: int) -> None:
        with self._cond:
            self._up("member remove")
            if member_id not in {m.id for m in self._members}:
                raise self._refuse("member remove", "etcdserver: member not found")
            self._members = [m for m in self._members if m.id != member_id]

    def close(self) -> None:
        """Nothing to close; here so the fake has every method the client has."""

    # ----------------------------------------------------------------- for tests

    def start_member(self, member_id: int, name: str, client_url: str) -> None:
        """What starting an added member does: it gets its name and client URL (and, a learner, can be promoted)."""
        with self._cond:
            self._members = [
                replace(m, name=name, client_urls=(client_url,)) if m.id == member_id else m for m in self._members
            ]
