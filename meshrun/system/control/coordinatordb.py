"""The coordinator's database (SQLite, coordinator.db in its state directory, 0600): members, tokens, removals,
the member-list version and every node pair's path.

Each public method of `CoordinatorDB` is one transaction. The admission rules of an enrolment are
meshrun.core.admission's pure decision; the database gathers its facts and carries it out.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import wraps
from pathlib import Path

from meshrun.core import admission, ipam
from meshrun.core.model import Member
from meshrun.core.pairpaths import PairState
from meshrun.core.token import hash_secret, secret_matches
from meshrun.errors import StateError

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS members(
  id INTEGER PRIMARY KEY,
  name TEXT NOT NULL,
  public_key TEXT NOT NULL UNIQUE,
  overlay_ip TEXT NOT NULL UNIQUE,          -- a removed member's row keeps it for ADDRESS_QUARANTINE_S
  candidates TEXT NOT NULL DEFAULT '[]',
  endpoint TEXT,
  last_handshake INTEGER NOT NULL DEFAULT 0,
  is_coordinator INTEGER NOT NULL DEFAULT 0,
  token_id TEXT,
  joined_at REAL NOT NULL,
  last_seen REAL,
  removed_at REAL,
  mtu INTEGER NOT NULL DEFAULT 0,            -- the member's overlay MTU as its agent reports it
  site TEXT NOT NULL DEFAULT '',            -- the site its agent reports (`meshrun join --site`)
  relay INTEGER NOT NULL DEFAULT 1,         -- may relay others' pairs (`meshrun join --no-relay`: 0)
  tunnels INTEGER NOT NULL DEFAULT 1);      -- tunnels per same-site pair it runs (`meshrun join --tunnels`)
CREATE UNIQUE INDEX IF NOT EXISTS members_active_name ON members(name) WHERE removed_at IS NULL;
CREATE TABLE IF NOT EXISTS tokens(
  id TEXT PRIMARY KEY,
  secret_hash TEXT NOT NULL,
  created_at REAL NOT NULL,
  expires_at REAL NOT NULL,
  max_uses INTEGER,                         -- NULL: unlimited until expiry
  uses INTEGER NOT NULL DEFAULT 0,
  revoked_at REAL);
CREATE TABLE IF NOT EXISTS pairs(           -- the coordinator's path for each node pair (core/pairpaths)
  a TEXT NOT NULL,                          -- node names, a < b
  b TEXT NOT NULL,
  mode TEXT NOT NULL,
  since REAL NOT NULL,
  verified INTEGER NOT NULL,
  relay TEXT NOT NULL DEFAULT '',           -- a relayed pair's relay (a member's name; '' = the coordinator)
  port INTEGER NOT NULL DEFAULT 0,          -- the UDP port its relay forwards it on (core/relays.RELAY_PORTS)
  tries INTEGER NOT NULL DEFAULT 0,         -- failed direct attempts since its last direct tunnel
  PRIMARY KEY(a, b)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS pairs_b ON pairs(b);
CREATE TABLE IF NOT EXISTS removals(        -- every key ever removed, and when: removal is final
  public_key TEXT PRIMARY KEY,
  name TEXT NOT NULL,
  removed_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS removals_name ON removals(name);
"""
# A removed member's row (and so its address) is kept this long, then its address may be handed out
# again: every peer dropped it within seconds of the removal (REMOVED_GRACE_S in the service).
ADDRESS_QUARANTINE_S = 3600.0


@dataclass(frozen=True)
class TokenInfo:
    """A token as `token list` shows it: never the secret, never its hash."""

    id: str
    created_at: float
    expires_at: float
    max_uses: int | None
    uses: int
    revoked: bool

    def status(self, now: float) -> str:
        if self.revoked:
            return "revoked"
        if now >= self.expires_at:
            return "expired"
        if self.max_uses is not None and self.uses >= self.max_uses:
            return "used up"
        return "valid"

    def to_dict(self, now: float) -> dict:
        left = None if self.max_uses is None else max(self.max_uses - self.uses, 0)
        return {
            "id": self.id,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "max_uses": self.max_uses,
            "uses": self.uses,
            "uses_left": left,
            "status": self.status(now),
        }


@dataclass(frozen=True)
class CoordinatorInfo:
    """A coordinator's public face, as join tokens carry it, and its etcd URLs (none for a lone coordinator)."""

    name: str
    public_key: str  # its WireGuard key (a joining node proves its own key with it)
    overlay_ip: str
    endpoint: str  # public host:port: enrolment over TLS (TCP) and WireGuard (UDP)
    fingerprint: str  # SHA-256 of its TLS certificate
    etcd_client: str = ""  # https://overlay_ip:port of its etcd member
    etcd_peer: str = ""

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict) -> CoordinatorInfo:
        return cls(**{k: str(d.get(k) or "") for k in cls.__dataclass_fields__})


def _locked(fn):
    @wraps(fn)
    def inner(self, *a, **kw):
        with self._lock:
            return fn(self, *a, **kw)

    return inner


class CoordinatorDB:
    """The coordinator's SQLite state. Each public method is one transaction.

    WAL mode plus BEGIN IMMEDIATE serialise writers across threads and processes (the
    daemon and `meshrun token ...` on the same machine), so concurrent joins can never
    receive the same address.
    """

    def __init__(self, path: Path | str, readonly: bool = False) -> None:
        self.path = Path(path)
        self.readonly = readonly
        # One connection shared by the daemon's threads: the lock keeps their
        # transactions from interleaving on it.
        self._lock = threading.RLock()
        self.removals = 0  # members removed through this object (in-memory views check it)
        self._commits = 0  # write transactions committed through this object
        # The live member list as last read, and the _stamp() it was read at: the coordinator's loop, its
        # interface sync and its roster all ask for it after a change (1000 rows parsed three times a join).
        self._members: tuple[tuple[int, int], list[Member]] | None = None
        self._member_rows: dict[tuple, Member] = {}  # row -> Member as last built (a join changes one row)
        if not self.path.exists():
            raise StateError(f"{self.path} is missing", "run `meshrun init` on the coordinator first")
        self._open()

    @classmethod
    def create(cls, path: Path | str) -> CoordinatorDB:
        path = Path(path)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.close(fd)
        return cls(path)

    def _open(self) -> None:
        # Check read-only first: a read-write open would let SQLite "repair" a truncated or
        # garbled file (CREATE TABLE IF NOT EXISTS writes page 1), silently resetting the network.
        try:
            ro = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=30)
            try:
                verdict = ro.execute("PRAGMA quick_check").fetchone()
                if self.path.stat().st_size and (verdict is None or verdict[0] != "ok"):
                    raise sqlite3.DatabaseError(f"quick_check says {verdict[0] if verdict else 'nothing'}")
            finally:
                ro.close()
        except sqlite3.DatabaseError as exc:
            raise StateError(
                f"{self.path} is not a readable meshrun database ({exc})",
                "restore it from a backup; meshrun will not reset it",
            ) from None
        if self.readonly:  # readers (status, listings) never write, not even the schema
            self.conn = sqlite3.connect(
                f"file:{self.path}?mode=ro", uri=True, timeout=30, isolation_level=None, check_same_thread=False
            )
            return
        try:
            self.conn = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=False)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=FULL")
            self.conn.executescript(SCHEMA)
            self._migrate()
            self.conn.execute("PRAGMA quick_check").fetchone()
        except sqlite3.DatabaseError as exc:
            raise StateError(
                f"{self.path} is not a readable meshrun database ({exc})",
                "restore it from a backup; meshrun will not reset it",
            ) from None

    def _migrate(self) -> None:
        """Columns added since a database was made (CREATE TABLE IF NOT EXISTS keeps the old table)."""
        cols = {r[1] for r in self.conn.execute("PRAGMA table_info(members)")}
        if "mtu" not in cols:
            self.conn.execute("ALTER TABLE members ADD COLUMN mtu INTEGER NOT NULL DEFAULT 0")
        if "site" not in cols:
            self.conn.execute("ALTER TABLE members ADD COLUMN site TEXT NOT NULL DEFAULT ''")
        if "relay" not in cols:
            self.conn.execute("ALTER TABLE members ADD COLUMN relay INTEGER NOT NULL DEFAULT 1")
        if "tunnels" not in cols:
            self.conn.execute("ALTER TABLE members ADD COLUMN tunnels INTEGER NOT NULL DEFAULT 1")
        pair_cols = {r[1] for r in self.conn.execute("PRAGMA table_info(pairs)")}
        if "relay" not in pair_cols:
            self.conn.execute("ALTER TABLE pairs ADD COLUMN relay TEXT NOT NULL DEFAULT ''")
        if "port" not in pair_cols:
            self.conn.execute("ALTER TABLE pairs ADD COLUMN port INTEGER NOT NULL DEFAULT 0")
        if "tries" not in pair_cols:
            self.conn.execute("ALTER TABLE pairs ADD COLUMN tries INTEGER NOT NULL DEFAULT 0")
        self.conn.execute(
            "INSERT OR IGNORE INTO removals(public_key, name, removed_at) "
            "SELECT public_key, name, removed_at FROM members WHERE removed_at IS NOT NULL"
        )

    def close(self) -> None:
        self.conn.close()

    @contextlib.contextmanager
    def tx(self, durable: bool = True):
        """A write transaction (BEGIN IMMEDIATE); rolled back on any exception.

        Not `durable`: committed without an fsync of its own (WAL, synchronous=NORMAL): a crash of the process
        loses nothing, a power cut may take it back, and the next durable commit makes it durable too. For what
        the coordinator can learn again from its members (pair paths, last seen times, handshakes): a join storm
        wrote a thousand pair rows a tick, each commit an fsync that every enrolment queued behind."""
        with self._lock:
            if not durable:
                self.conn.execute("PRAGMA synchronous=NORMAL")
            try:
                self.conn.execute("BEGIN IMMEDIATE")
                try:
                    yield self.conn
                except BaseException:
                    self.conn.execute("ROLLBACK")
                    raise
                self.conn.execute("COMMIT")
                self._commits += 1
            except sqlite3.OperationalError as exc:  # disk full, read-only, locked too long
                with contextlib.suppress(sqlite3.Error):
                    self.conn.execute("ROLLBACK")
                raise StateError(
                    f"cannot write {self.path}: {exc}; the previous version is unchanged",
                    "free disk space or fix permissions, then run the command again",
                ) from None
            finally:
                if not durable:
                    self.conn.execute("PRAGMA synchronous=FULL")

    # meta ------------------------------------------------------------------
    def set_meta(self, **values: str) -> None:
        with self.tx() as c:
            for k, v in values.items():
                c.execute("INSERT OR REPLACE INTO meta(key, value) VALUES(?, ?)", (k, str(v)))

    @_locked
    def meta(self, key: str) -> str | None:
        row = self.conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    def version(self) -> int:
        return int(self.meta("version") or 0)

    def bump_version(self) -> int:
        """A new member-list version for a change the database does not see (a pair's path); persisted,
        so versions never repeat across coordinator restarts. Returns it."""
        with self.tx() as c:
            self._bump(c)
            return int(c.execute("SELECT value FROM meta WHERE key='version'").fetchone()[0])

    @staticmethod
    def _bump(c: sqlite3.Connection) -> None:
        c.execute(
            "INSERT INTO meta(key, value) VALUES('version', '1') ON CONFLICT(key) "
            "DO UPDATE SET value = CAST(value AS INTEGER) + 1"
        )

    # tokens ----------------------------------------------------------------
    def add_token(
        self, token_id: str, secret: bytes, ttl_s: int, max_uses: int | None, now: float | None = None
    ) -> None:
        now = time.time() if now is None else now
        with self.tx() as c:
            c.execute(
                "INSERT INTO tokens(id, secret_hash, created_at, expires_at, max_uses) VALUES(?,?,?,?,?)",
                (token_id, hash_secret(secret), now, now + ttl_s, max_uses),
            )

    @_locked
    def tokens(self) -> list[TokenInfo]:
        rows = self.conn.execute(
            "SELECT id, created_at, expires_at, max_uses, uses, revoked_at FROM tokens ORDER BY created_at"
        ).fetchall()
        return [TokenInfo(r[0], r[1], r[2], r[3], r[4], r[5] is not None) for r in rows]

    def revoke_token(self, token_id: str, now: float | None = None) -> bool:
        """Revoke a token; False if no such token."""
        with self.tx() as c:
            cur = c.execute(
                "UPDATE tokens SET revoked_at=? WHERE id=? AND revoked_at IS NULL",
                (time.time() if now is None else now, token_id),
            )
            if cur.rowcount:
                return True
            return c.execute("SELECT 1 FROM tokens WHERE id=?", (token_id,)).fetchone() is not None

    # members ---------------------------------------------------------------
    def add_coordinator(self, name: str, public_key: str, overlay_ip: str) -> None:
        with self.tx() as c:
            c.execute(
                "INSERT INTO members(name, public_key, overlay_ip, is_coordinator, joined_at) VALUES(?,?,?,1,?)",
                (name, public_key, overlay_ip, time.time()),
            )
            self._bump(c)

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
        """Check the token and add (or find) the member; returns (member, created).

        Gathers the facts in one transaction and applies meshrun.core.admission.admit's decision
        (the rules live there); TokenError or StateError with the reason, and nothing written then.
        The caller has checked that the node holds the key's private half.
        """
        now = time.time() if now is None else now
        net = ipam.parse_cidr(cidr)
        with self.tx() as c:
            # Enrolments whose node never synced within the grace are over (their join failed there): their
            # names are free, their addresses return after the quarantine.
            c.execute(
                "UPDATE members SET removed_at=? WHERE removed_at IS NULL AND last_seen IS NULL "
                "AND is_coordinator=0 AND joined_at < ?",
                (now, now - admission.PENDING_GRACE_S),
            )
            row = c.execute(
                "SELECT secret_hash, created_at, expires_at, max_uses, uses, revoked_at FROM tokens WHERE id=?",
                (token_id,),
            ).fetchone()
            token = (
                None
                if row is None
                else admission.TokenFacts(
                    secret_matches(secret, row[0]), row[1], row[2], row[3], row[4], row[5] is not None
                )
            )
            related = [
                admission.MemberFacts(r[0], r[1], r[2], r[3], r[4] is not None, bool(r[5]))
                for r in c.execute(
                    "SELECT name, public_key, joined_at, removed_at, last_seen, is_coordinator FROM members "
                    "WHERE (name=? AND removed_at IS NULL) OR public_key=?",
                    (name, public_key),
                )
            ]
            related += [
                admission.MemberFacts(r[0], r[1], r[2], r[2])
                for r in c.execute(
                    "SELECT name, public_key, removed_at FROM removals WHERE public_key=?", (public_key,)
                )
            ]
            removed_at = c.execute("SELECT MAX(removed_at) FROM removals WHERE name=?", (name,)).fetchone()[0]
            pending, held = c.execute(
                "SELECT COALESCE(SUM(last_seen IS NULL), 0), COUNT(*) FROM members WHERE token_id=? "
                "AND removed_at IS NULL",
                (token_id,),
            ).fetchone()
            decision = admission.admit(
                now,
                token,
                name,
                public_key,
                related,
                removed_at,
                int(pending),
                int(held),
                max(net.num_addresses - 3, 1),
            )
            if decision.existing is not None:
                m = self._member_where(c, "public_key=? AND removed_at IS NULL", (public_key,))
                assert m is not None
                return m, False
            for key in decision.release:
                # An enrolment whose node never synced (its join failed there): the name is free again,
                # its address returns after the quarantine.
                c.execute("UPDATE members SET removed_at=? WHERE public_key=?", (now, key))
            c.execute(
                "DELETE FROM members WHERE removed_at IS NOT NULL AND removed_at < ? AND is_coordinator=0",
                (now - ADDRESS_QUARANTINE_S,),
            )
            taken = [r[0] for r in c.execute("SELECT overlay_ip FROM members")]
            ip = str(ipam.allocate(net, taken))
            c.execute(
                "INSERT INTO members(name, public_key, overlay_ip, candidates, token_id, joined_at) "
                "VALUES(?,?,?,?,?,?)",
                (name, public_key, ip, json.dumps(candidates), token_id, now),
            )
            c.execute("UPDATE tokens SET uses = uses + 1 WHERE id=?", (token_id,))
            self._bump(c)
            return Member(name, public_key, ip, None, tuple(candidates)), True

    _COLS = (
        "name, public_key, overlay_ip, endpoint, candidates, is_coordinator, last_handshake, mtu, site, relay, tunnels"
    )

    @staticmethod
    def _row_member(r) -> Member:
        return Member(
            r[0],
            r[1],
            r[2],
            r[3],
            tuple(json.loads(r[4])),
            bool(r[5]),
            r[6],
            mtu=int(r[7] or 0),
            site=r[8] or "",
            relay=bool(r[9]),
            tunnels=int(r[10] or 1),
        )

    def _member_where(self, c, where: str, args: tuple) -> Member | None:
        r = c.execute(f"SELECT {self._COLS} FROM members WHERE {where}", args).fetchone()
        return self._row_member(r) if r else None

    def _stamp(self) -> tuple[int, int]:
        """Changes whenever the database may have: a commit through this object, or through any other
        connection (SQLite's data_version: `meshrun remove` runs in another process)."""
        return self._commits, self.conn.execute("PRAGMA data_version").fetchone()[0]

    @_locked
    def members(self) -> list[Member]:
        """The live members in the order they joined (a new list each call; the members are shared)."""
        stamp = self._stamp()
        if self._members is None or self._members[0] != stamp:
            rows = self.conn.execute(
                f"SELECT {self._COLS} FROM members WHERE removed_at IS NULL ORDER BY id"
            ).fetchall()
            prev = self._member_rows
            built = {r: prev.get(r) or self._row_member(r) for r in rows}
            self._member_rows = built
            self._members = (stamp, list(built.values()))
        return list(self._members[1])

    @_locked
    def member_by_ip(self, ip: str) -> Member | None:
        return self._member_where(self.conn, "overlay_ip=? AND removed_at IS NULL", (ip,))

    @_locked
    def member_by_name(self, name: str) -> Member | None:
        return self._member_where(self.conn, "name=? AND removed_at IS NULL", (name,))

    @_locked
    @_locked
    def recently_removed(self, grace_s: float, now: float | None = None) -> list[Member]:
        """Members removed less than `grace_s` ago (kept reachable so they can learn of it)."""
        now = time.time() if now is None else now
        rows = self.conn.execute(
            f"SELECT {self._COLS} FROM members WHERE removed_at > ? AND is_coordinator=0", (now - grace_s,)
        ).fetchall()
        return [self._row_member(r) for r in rows]

    def is_removed_ip(self, ip: str) -> bool:
        return (
            self.conn.execute("SELECT 1 FROM members WHERE overlay_ip=? AND removed_at IS NOT NULL", (ip,)).fetchone()
            is not None
        )

    @_locked
    def is_removed_key(self, public_key: str) -> bool:
        """Whether `public_key` belonged to a member removed for good (it can never join again)."""
        row = self.conn.execute("SELECT 1 FROM members WHERE public_key=? AND removed_at IS NOT NULL", (public_key,))
        return row.fetchone() is not None

    def abandon(self, name: str, public_key: str, now: float | None = None) -> bool:
        """Release the enrolment of `name` with `public_key` if it never completed (its node never synced);
        True if one was released. Its address waits out the quarantine like any other."""
        with self.tx() as c:
            cur = c.execute(
                "UPDATE members SET removed_at=? WHERE name=? AND public_key=? AND removed_at IS NULL "
                "AND last_seen IS NULL AND is_coordinator=0",
                (time.time() if now is None else now, name, public_key),
            )
            if cur.rowcount:
                self._bump(c)
            return cur.rowcount > 0

    def remove_member(self, name: str, now: float | None = None) -> Member | None:
        """Mark a member removed (its address stays reserved forever)."""
        with self.tx() as c:
            m = self._member_where(c, "name=? AND removed_at IS NULL AND is_coordinator=0", (name,))
            if m is not None:
                when = time.time() if now is None else now
                c.execute("UPDATE members SET removed_at=? WHERE public_key=?", (when, m.public_key))
                c.execute(
                    "INSERT OR REPLACE INTO removals(public_key, name, removed_at) VALUES(?,?,?)",
                    (m.public_key, m.name, when),
                )
                self._bump(c)
                self.removals += 1
            return m

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
        """Record a member's self-reported candidates (overlay MTU, site, whether it may relay, its tunnels per
        same-site pair); bump the version if they changed.

        Writes only when the candidates or MTU changed, on the member's first sync ever, or with
        `touch` (the coordinator passes it on a member's first sync since the daemon started,
        so last_seen says when it last reconnected): an idle network's heartbeats cost no
        disk write (and no fsync). `mtu`, `site`, `relay` or `tunnels` None (an agent that does not report it)
        keeps the stored one.
        """
        new = json.dumps(candidates)
        with self._lock:
            old = self.conn.execute(
                "SELECT candidates, last_seen, mtu, site, relay, tunnels FROM members "
                "WHERE overlay_ip=? AND removed_at IS NULL",
                (ip,),
            ).fetchone()
        if old is None:
            return
        mtu = old[2] if mtu is None else mtu
        site = old[3] if site is None else site
        relay_int = old[4] if relay is None else int(relay)
        tunnels = old[5] if tunnels is None else tunnels
        changed = old[0] != new or old[2] != mtu or old[3] != site or old[4] != relay_int or old[5] != tunnels
        if not changed and old[1] is not None and not touch:
            return
        with self.tx(durable=changed) as c:
            c.execute(
                "UPDATE members SET candidates=?, mtu=?, site=?, relay=?, tunnels=?, last_seen=? "
                "WHERE overlay_ip=? AND removed_at IS NULL",
                (new, mtu, site, relay_int, tunnels, time.time() if now is None else now, ip),
            )
            if changed:
                self._bump(c)

    def observe(self, observations: dict[str, tuple[str | None, int]]) -> bool:
        """Store WireGuard's view {public_key: (endpoint, last_handshake)}; True if an endpoint changed.

        Runs every second over every member: one read, and a write transaction only for the rows
        that changed (only the coordinator daemon writes these columns, so reading first is safe).
        """
        with self._lock:
            rows = {
                r[0]: (r[1], r[2])
                for r in self.conn.execute(
                    "SELECT public_key, endpoint, last_handshake FROM members WHERE removed_at IS NULL"
                )
            }
        changed = False
        updates = []
        for key, (endpoint, hs) in observations.items():
            row = rows.get(key)
            if row is None or (endpoint is None or row[0] == endpoint) and row[1] == hs:
                continue
            if endpoint is not None and row[0] != endpoint:
                changed = True
            updates.append((endpoint, hs, key))
        if not updates:
            return False
        with self.tx(durable=changed) as c:  # a new version must never be lost (versions never repeat)
            c.executemany(
                "UPDATE members SET endpoint=COALESCE(?, endpoint), last_handshake=? WHERE public_key=?", updates
            )
            if changed:
                self._bump(c)
        return changed

    # node pairs --------------------------------------------------------------
    @_locked
    def pairs(self) -> dict[tuple[str, str], PairState]:
        """Every stored pair path {(a, b): state}, a < b (none in a database from before the table)."""
        try:
            rows = self.conn.execute("SELECT a, b, mode, since, verified, relay, port, tries FROM pairs").fetchall()
        except sqlite3.OperationalError:  # read-only open of a database made by an older meshrun
            return {}
        return {
            (r[0], r[1]): PairState(r[2], float(r[3]), bool(r[4]), r[5] or "", int(r[6] or 0), int(r[7] or 0))
            for r in rows
        }

    def save_pairs(self, states: Mapping[tuple[str, str], PairState], drop: Iterable[str] = ()) -> None:
        """Write the pairs whose state changed and delete every pair of the nodes in `drop` (removed
        members), in one transaction: one row per pair, so a change costs its own rows only. Not durable (see
        tx): after a power cut the members' next reports decide the paths again."""
        with self.tx(durable=bool(drop)) as c:
            for name in drop:
                c.execute("DELETE FROM pairs WHERE a=? OR b=?", (name, name))
            c.executemany(
                "INSERT INTO pairs(a, b, mode, since, verified, relay, port, tries) VALUES(?,?,?,?,?,?,?,?) "
                "ON CONFLICT(a, b) DO UPDATE SET mode=excluded.mode, since=excluded.since, "
                "verified=excluded.verified, relay=excluded.relay, port=excluded.port, tries=excluded.tries",
                [
                    (a, b, st.mode, st.since, int(st.verified), st.relay, st.port, st.tries)
                    for (a, b), st in states.items()
                ],
            )

    # moving between SQLite and etcd ------------------------------------------
    def coordinators(self) -> list[CoordinatorInfo]:
        """The one coordinator of a network kept in SQLite (its description is the network's)."""
        from meshrun.core.model import Network

        net = Network.from_dict(json.loads(self.meta("network") or "null"))
        me = next((m for m in self.members() if m.is_coordinator), None)
        return [
            CoordinatorInfo(
                me.name if me else "coordinator",
                net.coordinator_public_key,
                net.coordinator_ip,
                net.endpoints[0],
                net.fingerprint,
            )
        ]

    @_locked
    def dump(self) -> dict:
        """Every record (members removed or not, tokens, removals, pairs, meta): what a move to etcd writes
        (meshrun.system.control.etcdstate.EtcdCoordinatorDB.load) and `load` reads back."""
        cols = [
            "id", "name", "public_key", "overlay_ip", "candidates", "endpoint", "last_handshake", "is_coordinator",
            "token_id", "joined_at", "last_seen", "removed_at", "mtu", "site", "relay", "tunnels",
        ]  # fmt: skip
        members = []
        for r in self.conn.execute(f"SELECT {', '.join(cols)} FROM members ORDER BY id"):
            row = dict(zip(cols, r))
            row["candidates"] = json.loads(row["candidates"])
            row["is_coordinator"], row["relay"] = bool(row["is_coordinator"]), bool(row["relay"])
            members.append(row)
        tcols = ["id", "secret_hash", "created_at", "expires_at", "max_uses", "uses", "revoked_at"]
        tokens = [dict(zip(tcols, r)) for r in self.conn.execute(f"SELECT {', '.join(tcols)} FROM tokens")]
        removals = [
            {"public_key": r[0], "name": r[1], "removed_at": r[2]}
            for r in self.conn.execute("SELECT public_key, name, removed_at FROM removals")
        ]
        meta = {r[0]: r[1] for r in self.conn.execute("SELECT key, value FROM meta") if r[0] != "version"}
        pairs = [{"a": a, "b": b, **st.record()} for (a, b), st in sorted(self.pairs().items())]
        return {
            "meta": meta,
            "version": self.version(),
            "members": members,
            "tokens": tokens,
            "removals": removals,
            "pairs": pairs,
            "coordinators": [],
        }

    def load(self, dump: dict) -> None:
        """Write a dump (from `dump`, or from etcd's EtcdCoordinatorDB.dump) into this new, empty database."""
        with self.tx() as c:
            if c.execute("SELECT COUNT(*) FROM members").fetchone()[0]:
                raise StateError(f"{self.path} already holds members", "load into a new database only")
            for k, v in dump["meta"].items():
                c.execute("INSERT OR REPLACE INTO meta(key, value) VALUES(?, ?)", (k, str(v)))
            c.execute("INSERT OR REPLACE INTO meta(key, value) VALUES('version', ?)", (str(int(dump["version"]) + 1),))
            for r in dump["members"]:
                c.execute(
                    "INSERT INTO members(id, name, public_key, overlay_ip, candidates, endpoint, last_handshake, "
                    "is_coordinator, token_id, joined_at, last_seen, removed_at, mtu, site, relay, tunnels) "
                    "VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        *(r[k] for k in ("id", "name", "public_key", "overlay_ip")),
                        json.dumps(r["candidates"]),
                        *(r[k] for k in ("endpoint", "last_handshake")),
                        int(r["is_coordinator"]),
                        *(r[k] for k in ("token_id", "joined_at", "last_seen", "removed_at", "mtu", "site")),
                        int(r["relay"]),
                        int(r.get("tunnels") or 1),  # a dump from before the column: one tunnel
                    ),
                )
            for r in dump["tokens"]:
                c.execute(
                    "INSERT INTO tokens(id, secret_hash, created_at, expires_at, max_uses, uses, revoked_at) "
                    "VALUES(?,?,?,?,?,?,?)",
                    (
                        r["id"],
                        r["secret_hash"],
                        r["created_at"],
                        r["expires_at"],
                        r["max_uses"],
                        r["uses"],
                        r["revoked_at"],
                    ),
                )
            for r in dump["removals"]:
                c.execute(
                    "INSERT OR REPLACE INTO removals(public_key, name, removed_at) VALUES(?,?,?)",
                    (r["public_key"], r["name"], r["removed_at"]),
                )
            for r in dump["pairs"]:
                st = PairState.from_record(r)
                c.execute(
                    "INSERT INTO pairs(a, b, mode, since, verified, relay, port, tries) VALUES(?,?,?,?,?,?,?,?)",
                    (r["a"], r["b"], st.mode, st.since, int(st.verified), st.relay, st.port, st.tries),
                )


def retire(path: Path | str) -> Path:
    """Move a database aside once its state lives elsewhere (etcd): renamed with the time, never read again
    (a backup of the moment it moved); its WAL files go. Returns the new name."""
    path = Path(path)
    aside = path.with_name(f"{path.name}.moved-to-etcd-{int(time.time())}")
    path.rename(aside)
    for extra in ("-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            path.with_name(path.name + extra).unlink()
    return aside


def build(path: Path | str, dump: dict) -> None:
    """A new database at `path` holding `dump` (CoordinatorDB.dump or EtcdCoordinatorDB.dump): written beside
    it and renamed into place, so `path` is either absent or complete."""
    path = Path(path)
    fresh = path.with_name(path.name + ".new")
    for p in (fresh, fresh.with_name(fresh.name + "-wal"), fresh.with_name(fresh.name + "-shm")):
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    db = CoordinatorDB.create(fresh)
    try:
        db.load(dump)
    finally:
        db.close()
    fresh.rename(path)
