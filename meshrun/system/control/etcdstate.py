"""The coordinators' replicated state in etcd: what CoordinatorDB keeps in SQLite, for several coordinators.

`EtcdCoordinatorDB` has CoordinatorDB's methods and meaning (members, tokens, removals, the member-list
version, every node pair's path), so the coordinator daemon, its APIs and the operator's commands run on
either (meshrun.mesh.coordinator.admin.open_db picks by the member record's "control"). Reads are answered
from an in-memory mirror of the keys under STATE: read once, then kept current by a watch (`follow=True`,
the daemons) or read again for each command (`follow=False`). Writes are etcd transactions that compare
what they were decided on:

- everything that changes the member list (an enrolment, a removal, a new version) compares the version
  key's revision and bumps it in the same transaction, so two coordinators enrolling at once never hand out
  one address, and versions never repeat;
- a member's row is written with a compare on its own revision (a heartbeat on one coordinator and the
  leader's endpoint observation do not overwrite each other);
- what only the leading coordinator decides (observed endpoints, pair paths, a bare version bump) also
  compares the leader key (`fence`): a coordinator that lost the lead cannot write a stale decision.

A failed compare is retried on a mirror that has caught up with the store. etcd unreachable or without
quorum: ControlStateError, nothing written; reads keep answering from the last mirror (agents keep their
tunnels; see meshrun.mesh.coordinator.daemon).

Keys (one etcd cluster per network): STATE/version, seq (the last member id), meta/<key>,
members/<id, zero-padded: join order>, tokens/<id>, removals/<public key>, pairs/<a>|<b>,
coordinators/<name> (each coordinator's endpoint, TLS fingerprint and etcd URLs: what tokens carry).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from meshrun.core import admission, ipam
from meshrun.core.model import Member
from meshrun.core.pairpaths import PairState
from meshrun.core.token import hash_secret, secret_matches
from meshrun.errors import ControlStateError, StateError
from meshrun.system.control.coordinatordb import ADDRESS_QUARANTINE_S, CoordinatorInfo, TokenInfo
from meshrun.system.control.etcd import Compacted, Compare, Delete, OutcomeUnknown, Put

log = logging.getLogger("meshrun.system.control.etcdstate")

PREFIX = b"/meshrun/"
STATE = PREFIX + b"state/"
K_VERSION = STATE + b"version"
K_SEQ = STATE + b"seq"
K_META = STATE + b"meta/"
K_MEMBERS = STATE + b"members/"
K_TOKENS = STATE + b"tokens/"
K_REMOVALS = STATE + b"removals/"
K_PAIRS = STATE + b"pairs/"
K_COORDINATORS = STATE + b"coordinators/"
K_LEADER = PREFIX + b"leader"  # the leading coordinator's fence (meshrun.mesh.coordinator.leader), with its lease
OPS_PER_TXN = 1000  # etcd takes up to --max-txn-ops (10000) and 1.5 MiB a request: pair writes go in slices
RETRIES = 30
# etcd (meshrun's flags) sends watch progress every 5 s: a stream silent this long runs to a member that is gone
# (its machine vanished: nothing resets the connection), and the watch moves to another member.
WATCH_IDLE_S = 12.0
CATCH_UP_S = 2.0


def _end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


def member_key(member_id: int) -> bytes:
    return K_MEMBERS + b"%010d" % member_id


def pair_key(a: str, b: str) -> bytes:
    return K_PAIRS + f"{a}|{b}".encode()


class _Conflict(Exception):
    """A transaction's compare failed: the mirror was behind (another coordinator wrote first)."""

    def __init__(self, revision: int) -> None:
        super().__init__(revision)
        self.revision = revision


@dataclass
class _Row:
    """A member's record as stored (the SQLite table's columns)."""

    id: int
    name: str
    public_key: str
    overlay_ip: str
    candidates: list
    endpoint: str | None
    last_handshake: int
    is_coordinator: bool
    token_id: str | None
    joined_at: float
    last_seen: float | None
    removed_at: float | None
    mtu: int
    site: str
    relay: bool
    tunnels: int = 1

    @classmethod
    def parse(cls, raw: bytes) -> _Row:
        d = json.loads(raw)
        return cls(
            int(d["id"]),
            str(d["name"]),
            str(d["public_key"]),
            str(d["overlay_ip"]),
            list(d.get("candidates") or []),
            d.get("endpoint"),
            int(d.get("last_handshake") or 0),
            bool(d.get("is_coordinator")),
            d.get("token_id"),
            float(d["joined_at"]),
            d.get("last_seen"),
            d.get("removed_at"),
            int(d.get("mtu") or 0),
            str(d.get("site") or ""),
            bool(d.get("relay", True)),
            int(d.get("tunnels") or 1),
        )

    def dump(self) -> bytes:
        return json.dumps(self.__dict__, separators=(",", ":"), sort_keys=True).encode()

    def member(self) -> Member:
        return Member(
            self.name,
            self.public_key,
            self.overlay_ip,
            self.endpoint,
            tuple(self.candidates),
            self.is_coordinator,
            self.last_handshake,
            mtu=self.mtu,
            site=self.site,
            relay=self.relay,
            tunnels=self.tunnels,
        )


class EtcdCoordinatorDB:
    """CoordinatorDB's interface over etcd (see the module docstring). `client` is a
    meshrun.system.control.etcd.EtcdClient (or FakeEtcd); `follow` keeps the mirror current with a watch thread
    (daemons), else each public read loads what changed first (commands that run once)."""

    def __init__(self, client, follow: bool = False, readonly: bool = False, what: str = "etcd") -> None:
        self.client = client
        self.path = what  # named in errors, like CoordinatorDB's file
        self.readonly = readonly
        self.removals = 0  # members seen removed (in-memory views check it, as with CoordinatorDB)
        self.fence: bytes | None = None  # set while this coordinator leads: leader-only writes compare it
        self._lock = threading.RLock()
        self._caught_up = threading.Condition(self._lock)
        self._kv: dict[bytes, tuple[int, bytes]] = {}  # key -> (mod revision, value) under STATE
        self._tomb: dict[bytes, int] = {}  # keys deleted here, by revision, until the watch passes it
        self._rev = 0  # the mirror's revision
        self._mgen = 0  # bumped by every change of a member key
        self._built = -1  # _mgen when the member list below was built
        self._rows: dict[bytes, tuple[int, _Row]] = {}  # key -> (mod revision, parsed row)
        self._live: list[Member] = []
        self._member_objs: dict[tuple[bytes, int], Member] = {}
        self._by_ip: dict[str, Member] = {}
        self._by_name: dict[str, Member] = {}
        self._removed_ips: set[str] = set()
        self._pairs: dict[tuple[str, str], PairState] = {}
        self._pairs_changed: set[tuple[str, str]] = set()  # since take_pair_changes (followers publish them)
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self.listeners: list[Callable[[], None]] = []  # called (watch thread) after each batch of changes
        self._load()
        if follow:
            self._watcher = threading.Thread(target=self._watch, name="etcd-watch", daemon=True)
            self._watcher.start()

    # mirror ----------------------------------------------------------------
    def _load(self) -> None:
        kvs, rev = self.client.get_prefix(STATE)
        with self._lock:
            self._kv = {kv.key: (kv.mod_revision, kv.value) for kv in kvs}
            self._tomb.clear()
            self._rev = rev
            self._pairs_changed |= set(self._pairs)  # deleted since: followers hear of them too
            self._pairs = {}
            for kv in kvs:
                if kv.key.startswith(K_PAIRS):
                    self._pair_event(kv.key, kv.value)
            self._mgen += 1
            self.removals += 1  # whatever was cached from before this load may name removed members
            self._caught_up.notify_all()

    def _pair_event(self, key: bytes, value: bytes | None) -> None:
        a, _, b = key[len(K_PAIRS) :].decode().partition("|")
        self._pairs_changed.add((a, b))
        if value is None:
            self._pairs.pop((a, b), None)
            return
        d = json.loads(value)
        self._pairs[(a, b)] = PairState.from_record(d)

    def _set(self, key: bytes, rev: int, value: bytes | None) -> None:
        """One change into the mirror (lock held): a put or (value None) a delete at `rev`, unless the mirror
        already holds something newer for that key."""
        cur = self._kv.get(key)
        if cur is not None and cur[0] >= rev or self._tomb.get(key, 0) >= rev:
            return
        if key.startswith(K_MEMBERS):
            self._mgen += 1
            old = self._kv.get(key)
            if value is not None and old is not None and json.loads(old[1]).get("removed_at") is None:
                if json.loads(value).get("removed_at") is not None:
                    self.removals += 1  # a member removed: cached views of the member list are stale
        if value is None:
            self._kv.pop(key, None)
            self._tomb[key] = rev
        else:
            self._kv[key] = (rev, value)
            self._tomb.pop(key, None)
        if key.startswith(K_PAIRS):
            self._pair_event(key, value)

    def _apply_events(self, events, rev: int) -> None:
        with self._lock:
            for ev in events:
                self._set(ev.kv.key, ev.kv.mod_revision, None if ev.type == "DELETE" else ev.kv.value)
            self._rev = max(self._rev, rev)
            self._tomb = {k: r for k, r in self._tomb.items() if r > self._rev}
            self._caught_up.notify_all()
        for listener in self.listeners:
            listener()

    def _applied(self, rev: int, puts: Mapping[bytes, bytes], deletes: Iterable[bytes] = ()) -> None:
        """What this object just wrote at `rev`, into the mirror at once (reads after a write see it)."""
        with self._lock:
            for key, value in puts.items():
                self._set(key, rev, value)
            for key in deletes:
                self._set(key, rev, None)
        for listener in self.listeners:
            listener()

    def _watch(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                for batch in self.client.watch(STATE, self._rev + 1, self._stop, idle_timeout=WATCH_IDLE_S):
                    if batch:
                        self._apply_events(batch, max(ev.kv.mod_revision for ev in batch))
                    backoff = 0.5
            except Compacted:
                log.info("the watch fell behind etcd's compaction: reading the state again")
                with contextlib.suppress(ControlStateError):
                    self._load()
            except ControlStateError as exc:
                if self._stop.is_set():
                    return
                log.warning("lost the watch on the control state (%s); retrying in %.1f s", exc, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            except Exception:  # a bug must not freeze the mirror silently
                log.exception("the control state watch failed; retrying")
                self._stop.wait(backoff)

    def _fresh(self) -> None:
        """Commands that run once read what changed since their last read (no watch runs for them)."""
        if self._watcher is None:
            self._load()

    def _catch_up(self, revision: int) -> None:
        """After a failed compare: wait for the watch to reach `revision` (or load the state again)."""
        if self._watcher is not None:
            deadline = time.monotonic() + CATCH_UP_S
            with self._lock:
                while self._rev < revision and time.monotonic() < deadline:
                    self._caught_up.wait(max(0.0, deadline - time.monotonic()))
                if self._rev >= revision:
                    return
        self._load()

    def _txn(self, compare: list, puts: Mapping[bytes, bytes], deletes: Iterable[bytes] = ()) -> int:
        """One write transaction; its revision (the mirror holds the writes). _Conflict when a compare failed."""
        if self.readonly:
            raise StateError(f"{self.path} was opened read-only", "this is a bug in meshrun; please report it")
        deletes = list(deletes)
        ops = [Put(k, v) for k, v in puts.items()] + [Delete(k) for k in deletes]
        res = self.client.txn(compare, ops)
        if not res.succeeded:
            raise _Conflict(res.revision)
        self._applied(res.revision, puts, deletes)
        return res.revision

    def _retry(self, attempt: Callable[[], object]) -> object:
        """Run `attempt` (which reads the mirror and writes with compares) until its compares hold."""
        for _ in range(RETRIES):
            try:
                return attempt()
            except _Conflict as c:
                self._catch_up(c.revision)
            except OutcomeUnknown:
                # Sent, not answered: it may have been applied. Decide again on the store as it is now (an
                # enrolment that went through is then found as the member it made).
                self._load()
        raise ControlStateError(
            f"{self.path}: another coordinator kept changing the same records ({RETRIES} tries)",
            "try again; if it persists, check `meshrun status` on the coordinators",
        )

    def _fenced(self) -> list:
        if self.fence is None:
            return []
        return [Compare(K_LEADER, "VALUE", "EQUAL", self.fence)]

    def _version_cmp(self) -> tuple[list, int]:
        cur = self._kv.get(K_VERSION)
        mod = cur[0] if cur else 0
        value = int(cur[1]) if cur else 0
        return [Compare(K_VERSION, "MOD", "EQUAL", mod)], value

    def _row_cmp(self, key: bytes) -> Compare:
        cur = self._kv.get(key)
        return Compare(key, "MOD", "EQUAL", cur[0] if cur else 0)

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(5)

    # meta ------------------------------------------------------------------
    def set_meta(self, **values: str) -> None:
        self._txn([], {K_META + k.encode(): str(v).encode() for k, v in values.items()})

    def meta(self, key: str) -> str | None:
        self._fresh()
        with self._lock:
            cur = self._kv.get(K_META + key.encode())
        return cur[1].decode() if cur else None

    def version(self) -> int:
        with self._lock:
            cur = self._kv.get(K_VERSION)
        return int(cur[1]) if cur else 0

    def bump_version(self) -> int:
        """A new member-list version (leader only: fenced); returns it."""

        def attempt() -> int:
            with self._lock:
                cmp, v = self._version_cmp()
            self._txn(cmp + self._fenced(), {K_VERSION: str(v + 1).encode()})
            return v + 1

        return int(self._retry(attempt))

    # coordinators ------------------------------------------------------------
    def coordinators(self) -> list[CoordinatorInfo]:
        """Every coordinator's public face (endpoint, TLS fingerprint, WireGuard key) and etcd URLs, by name."""
        self._fresh()
        with self._lock:
            raws = [v for k, (_, v) in sorted(self._kv.items()) if k.startswith(K_COORDINATORS)]
        return [CoordinatorInfo.from_dict(json.loads(v)) for v in raws]

    def put_coordinator(self, info: CoordinatorInfo) -> None:
        self._txn([], {K_COORDINATORS + info.name.encode(): json.dumps(info.to_dict(), sort_keys=True).encode()})

    def delete_coordinator(self, name: str) -> None:
        self._txn([], {}, [K_COORDINATORS + name.encode()])

    # tokens ----------------------------------------------------------------
    def add_token(
        self, token_id: str, secret: bytes, ttl_s: int, max_uses: int | None, now: float | None = None
    ) -> None:
        now = time.time() if now is None else now
        key = K_TOKENS + token_id.encode()
        row = {
            "id": token_id,
            "secret_hash": hash_secret(secret),
            "created_at": now,
            "expires_at": now + ttl_s,
            "max_uses": max_uses,
            "uses": 0,
            "revoked_at": None,
        }
        try:  # CREATE == 0: a token id is never reused
            self._txn([Compare(key, "CREATE", "EQUAL", 0)], {key: json.dumps(row).encode()})
        except (_Conflict, OutcomeUnknown):
            kv = self.client.get(key)
            if kv is not None and json.loads(kv.value).get("secret_hash") == row["secret_hash"]:
                self._load()  # our own write, whose answer was lost
                return
            raise StateError(f"token id {token_id} exists already", "create another token") from None

    def _token_rows(self) -> list[dict]:
        with self._lock:
            return [json.loads(v) for k, (_, v) in self._kv.items() if k.startswith(K_TOKENS)]

    def tokens(self) -> list[TokenInfo]:
        self._fresh()
        rows = sorted(self._token_rows(), key=lambda r: r["created_at"])
        return [
            TokenInfo(r["id"], r["created_at"], r["expires_at"], r["max_uses"], r["uses"], r["revoked_at"] is not None)
            for r in rows
        ]

    def revoke_token(self, token_id: str, now: float | None = None) -> bool:
        key = K_TOKENS + token_id.encode()
        self._fresh()

        def attempt() -> bool:
            with self._lock:
                cur = self._kv.get(key)
            if cur is None:
                return False
            row = json.loads(cur[1])
            if row["revoked_at"] is None:
                row["revoked_at"] = time.time() if now is None else now
                self._txn([self._row_cmp(key)], {key: json.dumps(row).encode()})
            return True

        return bool(self._retry(attempt))

    # members ---------------------------------------------------------------
    def _all_rows(self) -> list[tuple[bytes, _Row]]:
        """Every member row, in join order (lock held by the caller)."""
        out = []
        for key, (rev, raw) in sorted((k, v) for k, v in self._kv.items() if k.startswith(K_MEMBERS)):
            cached = self._rows.get(key)
            if cached is None or cached[0] != rev:
                cached = (rev, _Row.parse(raw))
                self._rows[key] = cached
            out.append((key, cached[1]))
        return out

    def _build(self) -> None:
        """The live member list and its indexes, built again when a member key changed (lock held)."""
        if self._built == self._mgen:
            return
        live: list[Member] = []
        objs: dict[tuple[bytes, int], Member] = {}
        removed_ips: set[str] = set()
        for key, row in self._all_rows():
            if row.removed_at is not None:
                removed_ips.add(row.overlay_ip)
                continue
            rev = self._kv[key][0]
            m = self._member_objs.get((key, rev)) or row.member()  # an unchanged row keeps its Member
            objs[(key, rev)] = m
            live.append(m)
        self._member_objs = objs
        self._live = live
        self._by_ip = {m.overlay_ip: m for m in live}
        self._by_name = {m.name: m for m in live}
        self._removed_ips = removed_ips - set(self._by_ip)
        self._built = self._mgen

    def members(self) -> list[Member]:
        """The live members in the order they joined (a new list each call; the members are shared)."""
        self._fresh()
        with self._lock:
            self._build()
            return list(self._live)

    def member_by_ip(self, ip: str) -> Member | None:
        with self._lock:
            self._build()
            return self._by_ip.get(ip)

    def member_by_name(self, name: str) -> Member | None:
        with self._lock:
            self._build()
            return self._by_name.get(name)

    def is_removed_ip(self, ip: str) -> bool:
        with self._lock:
            self._build()
            return ip in self._removed_ips

    def is_removed_key(self, public_key: str) -> bool:
        with self._lock:
            return any(r.public_key == public_key and r.removed_at is not None for _, r in self._all_rows())

    def recently_removed(self, grace_s: float, now: float | None = None) -> list[Member]:
        now = time.time() if now is None else now
        with self._lock:
            return [
                row.member()
                for _, row in self._all_rows()
                if row.removed_at is not None and row.removed_at > now - grace_s and not row.is_coordinator
            ]

    def add_coordinator(
        self, name: str, public_key: str, overlay_ip: str, endpoint: str | None = None, now: float | None = None
    ) -> None:
        """A coordinator's member row (a new one, or an existing member's row turned coordinator), version bumped."""

        def attempt() -> None:
            with self._lock:
                cmp, v = self._version_cmp()
                rows = self._all_rows()
                seq = self._kv.get(K_SEQ)
            existing = next(((k, r) for k, r in rows if r.public_key == public_key and r.removed_at is None), None)
            if existing is not None:
                key, row = existing
                row = _Row(**{**row.__dict__, "is_coordinator": True, "endpoint": endpoint or row.endpoint})
                puts = {key: row.dump()}
                cmp = cmp + [self._row_cmp(key)]
            else:
                mid = (int(seq[1]) if seq else 0) + 1
                row = _Row(
                    mid, name, public_key, overlay_ip, [], endpoint, 0, True, None,
                    time.time() if now is None else now, None, None, 0, "", True,
                )  # fmt: skip
                puts = {member_key(mid): row.dump(), K_SEQ: str(mid).encode()}
                cmp = cmp + [Compare(K_SEQ, "MOD", "EQUAL", seq[0] if seq else 0)]
            puts[K_VERSION] = str(v + 1).encode()
            self._txn(cmp, puts)

        self._retry(attempt)

    def demote_coordinator(self, public_key: str) -> None:
        """A coordinator's row becomes a node's again (`meshrun coordinator remove` of a live member)."""

        def attempt() -> None:
            with self._lock:
                cmp, v = self._version_cmp()
                rows = self._all_rows()
            for key, row in rows:
                if row.public_key == public_key and row.removed_at is None:
                    row = _Row(**{**row.__dict__, "is_coordinator": False, "endpoint": None})
                    self._txn(cmp + [self._row_cmp(key)], {key: row.dump(), K_VERSION: str(v + 1).encode()})
                    return

        self._retry(attempt)

    def enrol(
        self,
        token_id: str,
        secret: bytes,
        name: str,
        public_key: str,
        candidates: list[str],
        cidr: str,
        now: float | None = None,
    ) -> tuple[Member, bool]:
        """Check the token and add (or find) the member; returns (member, created). The same admission
        rules as CoordinatorDB.enrol (meshrun.core.admission), decided on the mirror and written with compares
        on the version, the token and the id sequence: a concurrent enrolment elsewhere makes this one decide
        again on the caught-up mirror."""
        now = time.time() if now is None else now
        net = ipam.parse_cidr(cidr)
        tkey = K_TOKENS + token_id.encode()
        self._fresh()
        if tkey not in self._kv:  # made a moment ago on another coordinator? (one read; the front door rate-limits)
            kv = self.client.get(tkey)
            if kv is not None:
                self._catch_up(kv.mod_revision)

        def attempt() -> tuple[Member, bool]:
            with self._lock:
                cmp, v = self._version_cmp()
                rows = self._all_rows()
                tok = self._kv.get(tkey)
                seq = self._kv.get(K_SEQ)
                removal_rows = [json.loads(val) for k, (_, val) in self._kv.items() if k.startswith(K_REMOVALS)]
            puts: dict[bytes, bytes] = {}
            deletes: list[bytes] = []
            changed: dict[bytes, _Row] = {}
            for key, row in rows:  # enrolments whose node never synced within the grace are over
                if (
                    row.removed_at is None
                    and row.last_seen is None
                    and not row.is_coordinator
                    and row.joined_at < now - admission.PENDING_GRACE_S
                ):
                    changed[key] = _Row(**{**row.__dict__, "removed_at": now})
            current = [(k, changed.get(k, r)) for k, r in rows]
            trow = json.loads(tok[1]) if tok else None
            token = (
                None
                if trow is None
                else admission.TokenFacts(
                    secret_matches(secret, trow["secret_hash"]),
                    trow["created_at"],
                    trow["expires_at"],
                    trow["max_uses"],
                    trow["uses"],
                    trow["revoked_at"] is not None,
                )
            )
            related = [
                admission.MemberFacts(
                    r.name, r.public_key, r.joined_at, r.removed_at, r.last_seen is not None, r.is_coordinator
                )
                for _, r in current
                if (r.name == name and r.removed_at is None) or r.public_key == public_key
            ]  # fmt: skip
            related += [
                admission.MemberFacts(r["name"], r["public_key"], r["removed_at"], r["removed_at"])
                for r in removal_rows
                if r["public_key"] == public_key
            ]
            removed_at = max((r["removed_at"] for r in removal_rows if r["name"] == name), default=None)
            mine = [r for _, r in current if r.token_id == token_id and r.removed_at is None]
            decision = admission.admit(
                now,
                token,
                name,
                public_key,
                related,
                removed_at,
                sum(r.last_seen is None for r in mine),
                len(mine),
                max(net.num_addresses - 3, 1),
            )
            if decision.existing is not None:
                m = next(r for _, r in current if r.public_key == public_key and r.removed_at is None)
                return m.member(), False
            for key, row in current:
                if row.public_key in decision.release and row.removed_at is None:
                    changed[key] = _Row(**{**row.__dict__, "removed_at": now})
            for key, row in changed.items():
                puts[key] = row.dump()
            current = [(k, changed.get(k, r)) for k, r in rows]
            for key, row in current:  # past the quarantine, a removed node's address may be handed out again
                if (
                    row.removed_at is not None
                    and row.removed_at < now - ADDRESS_QUARANTINE_S
                    and not row.is_coordinator
                ):
                    deletes.append(key)
                    puts.pop(key, None)
            taken = [r.overlay_ip for k, r in current if k not in deletes]
            ip = str(ipam.allocate(net, taken))
            mid = (int(seq[1]) if seq else 0) + 1
            row = _Row(
                mid, name, public_key, ip, list(candidates), None, 0, False, token_id, now, None, None, 0, "", True
            )
            puts[member_key(mid)] = row.dump()
            puts[K_SEQ] = str(mid).encode()
            trow = dict(trow, uses=trow["uses"] + 1)
            puts[tkey] = json.dumps(trow).encode()
            puts[K_VERSION] = str(v + 1).encode()
            compare = cmp + [self._row_cmp(tkey), Compare(K_SEQ, "MOD", "EQUAL", seq[0] if seq else 0)]
            self._txn(compare, puts, deletes)
            return row.member(), True

        return self._retry(attempt)  # type: ignore[return-value]

    def abandon(self, name: str, public_key: str, now: float | None = None) -> bool:
        """Release `name`'s enrolment with `public_key` if it never completed; True if one was released."""
        self._fresh()

        def attempt() -> bool:
            with self._lock:
                cmp, v = self._version_cmp()
                rows = self._all_rows()
            for key, row in rows:
                if (
                    row.name == name
                    and row.public_key == public_key
                    and row.removed_at is None
                    and row.last_seen is None
                    and not row.is_coordinator
                ):
                    new = _Row(**{**row.__dict__, "removed_at": time.time() if now is None else now})
                    self._txn(cmp + [self._row_cmp(key)], {key: new.dump(), K_VERSION: str(v + 1).encode()})
                    return True
            return False

        return bool(self._retry(attempt))

    def remove_member(self, name: str, now: float | None = None) -> Member | None:
        """Mark a node removed (its address stays reserved), its key in the removals for ever."""
        self._fresh()

        def attempt() -> Member | None:
            with self._lock:
                cmp, v = self._version_cmp()
                rows = self._all_rows()
            for key, row in rows:
                if row.name == name and row.removed_at is None and not row.is_coordinator:
                    when = time.time() if now is None else now
                    new = _Row(**{**row.__dict__, "removed_at": when})
                    removal = {"public_key": row.public_key, "name": row.name, "removed_at": when}
                    self._txn(
                        cmp + [self._row_cmp(key)],
                        {
                            key: new.dump(),
                            K_REMOVALS + row.public_key.encode(): json.dumps(removal).encode(),
                            K_VERSION: str(v + 1).encode(),
                        },
                    )
                    return row.member()
            return None

        return self._retry(attempt)  # type: ignore[return-value]

    def _live_row(self, ip: str) -> tuple[bytes, _Row] | None:
        with self._lock:
            return next(((k, r) for k, r in self._all_rows() if r.overlay_ip == ip and r.removed_at is None), None)

    def heartbeat(
        self,
        ip: str,
        candidates: list[str],
        now: float | None = None,
        touch: bool = False,
        mtu: int | None = None,
        site: str | None = None,
        relay: bool | None = None,
        tunnels: int | None = None,
    ) -> None:
        """A member's self-reported candidates, MTU, site, relay setting and tunnels (CoordinatorDB.heartbeat): written
        on a change, on its first sync ever or with `touch`, the version bumped when something changed."""

        def attempt() -> None:
            found = self._live_row(ip)
            if found is None:
                return
            key, old = found
            new_mtu = old.mtu if mtu is None else mtu
            new_site = old.site if site is None else site
            new_relay = old.relay if relay is None else relay
            new_tunnels = old.tunnels if tunnels is None else tunnels
            changed = (
                old.candidates != list(candidates)
                or old.mtu != new_mtu
                or old.site != new_site
                or old.relay != new_relay
                or old.tunnels != new_tunnels
            )
            if not changed and old.last_seen is not None and not touch:
                return
            row = _Row(
                **{
                    **old.__dict__,
                    "candidates": list(candidates),
                    "mtu": new_mtu,
                    "site": new_site,
                    "relay": new_relay,
                    "tunnels": new_tunnels,
                    "last_seen": time.time() if now is None else now,
                }
            )
            compare = [self._row_cmp(key)]
            puts = {key: row.dump()}
            if changed:
                with self._lock:
                    cmp, v = self._version_cmp()
                compare += cmp
                puts[K_VERSION] = str(v + 1).encode()
            self._txn(compare, puts)

        self._retry(attempt)

    def observe(self, observations: dict[str, tuple[str | None, int]]) -> bool:
        """WireGuard's view {public_key: (endpoint, last_handshake)} into the rows (the leader's, fenced);
        True if an endpoint changed. Coordinators' rows keep the endpoint they advertise."""

        def attempt() -> bool:
            with self._lock:
                rows = {r.public_key: (k, r) for k, r in self._all_rows() if r.removed_at is None}
                cmp, v = self._version_cmp()
            puts: dict[bytes, bytes] = {}
            compare = []
            moved = False
            for pub, (endpoint, hs) in observations.items():
                found = rows.get(pub)
                if found is None:
                    continue
                key, row = found
                if row.is_coordinator:
                    endpoint = None
                if (endpoint is None or row.endpoint == endpoint) and row.last_handshake == hs:
                    continue
                if endpoint is not None and row.endpoint != endpoint:
                    moved = True
                new = _Row(**{**row.__dict__, "endpoint": endpoint or row.endpoint, "last_handshake": hs})
                puts[key] = new.dump()
                compare.append(self._row_cmp(key))
            if not puts:
                return False
            if moved:
                compare += cmp
                puts[K_VERSION] = str(v + 1).encode()
            self._txn(compare + self._fenced(), puts)
            return moved

        return bool(self._retry(attempt))

    # node pairs --------------------------------------------------------------
    def pairs(self) -> dict[tuple[str, str], PairState]:
        """Every stored pair path {(a, b): state}, a < b."""
        self._fresh()
        with self._lock:
            return dict(self._pairs)

    def take_pair_changes(self) -> dict[tuple[str, str], PairState | None]:
        """The pairs changed in the store since the last call: {pair: its state now, None if deleted}."""
        with self._lock:
            keys, self._pairs_changed = self._pairs_changed, set()
            return {k: self._pairs.get(k) for k in keys}

    def save_pairs(self, states: Mapping[tuple[str, str], PairState], drop: Iterable[str] = ()) -> None:
        """Write the pairs whose state changed and delete every pair of the nodes in `drop` (the leader's,
        fenced), in slices of OPS_PER_TXN."""
        gone = set(drop)
        with self._lock:
            deletes = [pair_key(a, b) for (a, b) in self._pairs if a in gone or b in gone]
        puts = {
            pair_key(a, b): json.dumps(st.record(), separators=(",", ":")).encode() for (a, b), st in states.items()
        }
        items = list(puts.items())
        for i in range(0, max(len(items), len(deletes), 1), OPS_PER_TXN):
            chunk_puts = dict(items[i : i + OPS_PER_TXN])
            chunk_del = deletes[i : i + OPS_PER_TXN]
            if chunk_puts or chunk_del:
                try:
                    self._txn(self._fenced(), chunk_puts, chunk_del)
                except _Conflict:
                    raise ControlStateError(
                        "this coordinator no longer leads: its pair paths were not written",
                        "nothing to do: the leading coordinator decides them",
                    ) from None

    # dump and load (moving between SQLite and etcd) --------------------------
    def dump(self) -> dict:
        """Every record, as CoordinatorDB.load takes it."""
        self._fresh()
        with self._lock:
            rows = [r.__dict__.copy() for _, r in self._all_rows()]
            kv = dict(self._kv)
        pick = lambda p: [json.loads(v) for k, (_, v) in sorted(kv.items()) if k.startswith(p)]  # noqa: E731
        return {
            "meta": {k[len(K_META) :].decode(): v.decode() for k, (_, v) in kv.items() if k.startswith(K_META)},
            "version": self.version(),
            "members": rows,
            "tokens": pick(K_TOKENS),
            "removals": pick(K_REMOVALS),
            "pairs": [{"a": a, "b": b, **st.record()} for (a, b), st in sorted(self.pairs().items())],
            "coordinators": pick(K_COORDINATORS),
        }

    def load(self, dump: dict) -> None:
        """Write a dump (CoordinatorDB.dump) into an empty store; ControlStateError if the store holds state."""
        if self._kv:
            raise ControlStateError(
                f"{self.path} already holds a network's state", "this is a bug in meshrun; please report it"
            )
        puts: dict[bytes, bytes] = {K_META + k.encode(): str(v).encode() for k, v in dump["meta"].items()}
        seq = 0
        for r in dump["members"]:
            row = _Row.parse(json.dumps(r).encode())
            puts[member_key(row.id)] = row.dump()
            seq = max(seq, row.id)
        for r in dump["tokens"]:
            puts[K_TOKENS + str(r["id"]).encode()] = json.dumps(r).encode()
        for r in dump["removals"]:
            puts[K_REMOVALS + str(r["public_key"]).encode()] = json.dumps(r).encode()
        for r in dump.get("coordinators", []):
            puts[K_COORDINATORS + str(r["name"]).encode()] = json.dumps(r, sort_keys=True).encode()
        for r in dump["pairs"]:
            puts[pair_key(r["a"], r["b"])] = json.dumps(
                PairState.from_record(r).record(), separators=(",", ":")
            ).encode()
        puts[K_SEQ] = str(seq).encode()
        # The version goes last, in its own transaction: a store with a version is a complete one.
        items = list(puts.items())
        for i in range(0, len(items), OPS_PER_TXN):
            self._txn([], dict(items[i : i + OPS_PER_TXN]))
        self._txn([Compare(K_VERSION, "CREATE", "EQUAL", 0)], {K_VERSION: str(int(dump["version"]) + 1).encode()})


def complete(client) -> bool:
    """Whether the store holds a whole network's state (a load finishes by writing the version)."""
    return client.get(K_VERSION) is not None
